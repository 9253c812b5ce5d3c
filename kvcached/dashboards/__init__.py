"""Grafana dashboards shipped as package data (`kvcachectl dashboard` prints one)."""
