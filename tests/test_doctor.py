"""kvcachectl doctor: each check's verdict from a stats snapshot, and the command against a daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from kvcachectl.doctor import doctor_checks
from kvcached.stats import HitRateHistory
from kvcached_client import Client
from tests.service.conftest import LAYOUT


def snap(**over):
    s = {
        "leases_active": 1,
        "pool": {"capacity_bytes": 100 << 20, "free_bytes": 50 << 20, "leased_chunks": 10, "leased_bytes": 10 << 20,
                 "cached_chunks": 40, "reserved_chunks": 0},
        "nvme": {"used_bytes": 10, "capacity_bytes": 100, "chunks": 3, "admitting": True},
        "doctor": {"hit_rate_5m": 0.6, "lookup_tokens_5m": 50_000, "hit_rate_1h": 0.62, "lookup_tokens_1h": 900_000,
                   "lease_ttl": 30.0, "leases_held_over_10x_ttl": 0, "oldest_lease_age_s": 5.0,
                   "lmdb_stale_readers_cleared": 0, "lmdb_readers": 1},
    }
    for k, v in over.items():
        s[k].update(v) if isinstance(v, dict) else s.__setitem__(k, v)
    return s


def verdicts(s, shm_free=1 << 30):
    return {c["check"]: c["verdict"] for c in doctor_checks(s, shm_free)}


def test_all_ok():
    assert set(verdicts(snap()).values()) == {"ok"}


def test_each_problem_is_named():
    assert verdicts(snap(doctor={"hit_rate_5m": 0.1}))["hit rate"] == "warn"
    assert verdicts(snap(doctor={"hit_rate_5m": 0.1, "lookup_tokens_5m": 10}))["hit rate"] == "ok"  # too little traffic
    assert verdicts(snap(doctor={"leases_held_over_10x_ttl": 3, "oldest_lease_age_s": 900}))["leases held past TTL"] == "warn"
    assert verdicts(snap(pool={"leased_bytes": 95 << 20, "free_bytes": 5 << 20, "cached_chunks": 0}))["pool"] == "fail"
    assert verdicts(snap(nvme={"admitting": False}))["NVMe"] == "fail"
    assert verdicts(snap(nvme={"used_bytes": 99}))["NVMe"] == "warn"
    assert verdicts(snap(doctor={"lmdb_stale_readers_cleared": 2}))["LMDB readers"] == "warn"
    assert verdicts(snap(), shm_free=1 << 20)["shared memory"] == "warn"
    gpu = snap(doctor={"gpu_free_bytes": 1 << 30, "gpu_total_bytes": 80 << 30})
    assert verdicts(gpu)["GPU memory"] == "warn" and "shared memory" not in verdicts(gpu)
    warn = [c for c in doctor_checks(snap(doctor={"leases_held_over_10x_ttl": 3, "oldest_lease_age_s": 900}))
            if c["verdict"] != "ok"][0]
    assert "journalctl -u kvcached" in warn["dig"]


def test_prompt_structure_check_judges_the_stats_prompt_shape():
    def shape(new0, shared0, later, after1=0):
        buckets = {b: {"new": 0, "shared_lead": 0, "shared_after": 0, "repeat": 0} for b in ("0", "1", "2-3", "4-7")}
        buckets["0"].update(new=new0, shared_lead=shared0, repeat=500)  # repeats are no evidence
        buckets["1"]["shared_after"] = after1
        buckets["2-3"]["new"] = later
        return {"L": {"model": "org/m@1", "chunk_tokens": 128, "lead_tokens": 4, "whole": 0, "short": 0,
                      "first_uncached_chunk": buckets}}

    def check(prompt_shape=None):
        s = snap()
        if prompt_shape is not None:
            s["prompt_shape"] = prompt_shape
        return next(c for c in doctor_checks(s, 1 << 30) if c["check"] == "prompt structure")

    assert check()["detail"].startswith("not enough lookups yet")  # no prompt_shape at all
    warn = check(shape(10, 290, 0))
    assert warn["verdict"] == "warn" and "prompts diverge at chunk 0–1" in warn["detail"]
    assert "org/m@1 (128-token chunks)" in warn["detail"] and "prompt_shape" in warn["dig"]
    assert check(shape(200, 0, 0, after1=100))["verdict"] == "warn"  # a third go on as other prompts do
    assert check(shape(220, 0, 0, after1=70))["verdict"] == "ok"  # 24 %
    assert check(shape(300, 0, 0))["verdict"] == "ok"  # new prompts
    assert check(shape(1, 0, 299))["verdict"] == "ok"  # after a shared system prompt
    assert check(shape(10, 100, 0))["detail"].startswith("not enough lookups yet: 110")


def test_hit_rate_history_windows():
    h = HitRateHistory(every=10)
    h.sample(0, 0, 0)
    h.sample(5, 10, 10)  # too soon: not kept
    h.sample(3000, 1000, 900)
    h.sample(3400, 2000, 1000)
    assert h.window(3500, 300, 2100, 1010) == (10 / 100, 100)  # last 5 min: from the sample at 3400
    rate, n = h.window(3500, 3600, 2100, 1010)
    assert n == 2100 and abs(rate - 1010 / 2100) < 1e-9


def test_doctor_against_a_daemon(daemon):
    with Client(daemon.socket) as c:
        c.put(LAYOUT, list(range(32)), torch.zeros(2, 2, 2, 32, 8))
        assert "doctor" not in c.stats()  # the probes run only when asked for
        assert c.stats(doctor=True)["doctor"]["leases_held_over_10x_ttl"] == 0
    exe = os.path.join(os.path.dirname(sys.executable), "kvcachectl")
    r = subprocess.run([exe, "--socket", daemon.socket, "doctor", "--json"], capture_output=True, text=True, timeout=60)
    out = json.loads(r.stdout)
    names = {c["check"] for c in out["checks"]}
    assert {"hit rate", "leases held past TTL", "pool", "NVMe", "LMDB readers"} <= names
    assert r.returncode == (0 if out["healthy"] else 1)
    r = subprocess.run([exe, "--socket", daemon.socket, "doctor"], capture_output=True, text=True, timeout=60)
    assert "pool" in r.stdout and ("OK" in r.stdout or "WARN" in r.stdout)
