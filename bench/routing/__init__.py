"""The cache-aware routing bench (issue 18): simulated hosts with real kvcached daemons.

See README.md here. The modules also run as plain scripts (``python bench/routing/simhost.py``).
"""
