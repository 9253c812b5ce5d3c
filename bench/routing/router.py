"""kvcached-router as a process in front of a simulated fleet (:class:`bench.routing.fleet.SimFleet`),
and the few HTTP calls that drive it: what tests/router/test_router_e2e.py and bench/cross_host.py
(the restart storm) share."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.harness.daemon import BIN
from bench.harness.ports import free_ports
from bench.routing.fleet import to_toml


def post(url: str, body: dict, timeout: float = 30) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, dict(r.headers), (json.loads(raw) if not body.get("stream") else {"raw": raw.decode()})
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), {"error": e.read().decode()}


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def chat(system: str, user: str, stream: bool = False) -> dict:
    return {"model": "sim", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 4, "stream": stream}


def words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 30000}" for i in range(n))


def start_router(config: dict, directory: Path) -> tuple[str, subprocess.Popen]:
    """kvcached-router as a process on a free port with ``config``; (its URL, the process)."""
    port = free_ports(1)[0]
    cfg = directory / "router.toml"
    cfg.write_text(to_toml({**config, "listen": f"127.0.0.1:{port}"}))
    proc = subprocess.Popen([os.path.join(BIN, "kvcached-router"), "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if get(url + "/health")["healthy_hosts"]:
                break
        except (OSError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("router did not start:\n" + (proc.stdout.read() if proc.stdout else ""))
        time.sleep(0.1)
    return url, proc


def state(router: str) -> dict[str, dict]:
    return {h["name"]: h for h in get(router + "/router/state")["hosts"]}


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
