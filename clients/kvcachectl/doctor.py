"""kvcachectl doctor's checks and their format: the troubleshooting table as verdicts.

In: the daemon's stats (``Client.stats(doctor=True)``, a dict). Out: checks, each a dict of
``check``, ``verdict`` (ok / warn / fail), ``detail`` and ``dig`` (where to look next), and
:func:`print_checks`, which kvcached-router's semantic doctor uses too. No I/O but printing.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from kvcached.promptshape import judge as judge_prompt_shape
from kvcached.units import human_bytes


def doctor_checks(s: dict, shm_free: int | None = None) -> list[dict]:
    """The troubleshooting table as checks: (check, verdict ok/warn/fail, detail, dig)."""
    d, p, n = s["doctor"], s["pool"], s["nvme"]
    checks = []

    def add(check: str, verdict: str, detail: str, dig: str) -> None:
        checks.append({"check": check, "verdict": verdict, "detail": detail, "dig": dig})

    r5, r60 = d.get("hit_rate_5m"), d.get("hit_rate_1h")
    if r5 is None or r60 is None or d.get("lookup_tokens_5m", 0) < 10_000:
        add("hit rate", "ok", "not enough recent traffic to compare", "kvcachectl stats")
    elif r5 < 0.5 * r60:
        add("hit rate", "warn", f"fell to {r5:.1%} in the last 5 min from {r60:.1%} over the hour: prompts changed, "
            "or the cache was flushed or evicted", "journalctl -u kvcached EVENT=evictions --since -1h")
    else:
        add("hit rate", "ok", f"{r5:.1%} over 5 min, {r60:.1%} over the hour", "kvcachectl stats")
    long_held = d.get("leases_held_over_10x_ttl", 0)
    if long_held:
        add("leases held past TTL", "warn", f"{long_held} leases kept alive more than 10x lease_ttl "
            f"({d['lease_ttl']:.0f} s; oldest {d['oldest_lease_age_s']:.0f} s): a client may be leaking pins",
            "journalctl -u kvcached EVENT=session_lost; kvcachectl stats --json")
    else:
        add("leases held past TTL", "ok", f"{s['leases_active']} live leases, none held > 10x TTL", "kvcachectl stats")
    cap = p["capacity_bytes"] or 1
    leased, free = p["leased_bytes"] / cap, p["free_bytes"] / cap
    if leased > 0.9:
        add("pool", "fail", f"{leased:.0%} of the pool is leased: new puts store only what still fits",
            "kvcachectl stats; journalctl -u kvcached EVENT=tier_full")
    elif free < 0.05 and p["cached_chunks"] == 0:
        add("pool", "warn", "no free space and no evictable chunks", "kvcachectl stats")
    else:
        add("pool", "ok", f"{human_bytes(p['free_bytes'])} free, {p['leased_chunks']} leased and {p['cached_chunks']} "
            f"cached chunks in {human_bytes(p['capacity_bytes'])}", "kvcachectl stats")
    if n is not None:
        used = n["used_bytes"] / n["capacity_bytes"] if n["capacity_bytes"] else 0
        if not n["admitting"]:
            add("NVMe", "fail", "the LMDB map or the disk is full: NVMe stopped admitting",
                "journalctl -u kvcached EVENT=tier_full; df -h")
        elif used > 0.95:
            add("NVMe", "warn", f"{used:.0%} full: it evicts on every write", "kvcachectl stats")
        else:
            add("NVMe", "ok", f"{used:.0%} used, {n['chunks']} chunks", "kvcachectl stats")
        stale = d.get("lmdb_stale_readers_cleared", 0)
        add("LMDB readers", "warn" if stale else "ok",
            f"cleared {stale} stale reader slots (a killed process held them)" if stale
            else f"{d.get('lmdb_readers', 0)} reader slots in use, none stale", "journalctl -u kvcached -p warning")
    shape = judge_prompt_shape(s.get("prompt_shape"))
    add("prompt structure", shape.verdict, shape.detail, "kvcachectl stats --json (prompt_shape); README, "
        "prompt structure")
    if "remote" in d:
        _remote_checks(d["remote"], s.get("remote") or {}, add)
    if "gpu_total_bytes" in d:
        pool_share = p["capacity_bytes"] / d["gpu_total_bytes"]
        gfree = d["gpu_free_bytes"] / d["gpu_total_bytes"]
        add("GPU memory", "warn" if gfree < 0.05 else "ok",
            f"pool is {pool_share:.0%} of GPU memory, {gfree:.0%} of the GPU free", "nvidia-smi")
    elif shm_free is not None:
        add("shared memory", "warn" if shm_free < p["capacity_bytes"] * 0.1 else "ok",
            f"pool {human_bytes(p['capacity_bytes'])} in /dev/shm, {human_bytes(shm_free)} free there", "df -h /dev/shm")
    return checks


#: Redis maxmemory policies under which Redis makes room by itself: every kvcached key has a TTL,
#: so the volatile-* policies work as well as allkeys-*.
_EVICTING_POLICIES = ("volatile-lru", "volatile-lfu", "volatile-ttl", "volatile-random", "allkeys-lru",
                      "allkeys-lfu", "allkeys-random")


def _remote_checks(r: dict, rs: dict, add: Any) -> None:
    """The remote tier's rows of the doctor table: reachability, ACL isolation, memory policy."""
    nodes = ", ".join(r.get("nodes", []))
    dig = "redis-cli -h HOST -p PORT --user USER --askpass PING; journalctl -u kvcached EVENT=remote_error"
    if not r.get("reachable"):
        add("remote tier", "fail", f"Redis at {nodes} is not reachable ({r.get('error', '?')}): every remote "
            "lookup is a miss (requests still succeed, recomputing)", dig)
        return
    refused = sum((rs.get("refused") or {}).values())
    extra = f"; {refused} values refused (MAC/header/checksum)" if refused else ""
    verdict = "warn" if r.get("breaker_state") != "closed" or refused else "ok"
    add("remote tier", verdict, f"Redis{' Cluster' if r.get('cluster') else ''} at {nodes} answers in "
        f"{r.get('rtt_ms', 0):.1f} ms; breaker {r.get('breaker_state')}, {r.get('errors', 0)} failed calls{extra}",
        "journalctl -u kvcached EVENT=remote_error EVENT=remote_refused")
    acl_dig = ("on every node: redis-cli ACL SETUSER kvc-DOMAIN on '>PASSWORD' resetkeys '~kvc:DOMAIN:*' -@all "
               "+get +set +exists +expire +ping +cluster|slots +command +info; see README, remote tier")
    if r.get("own_prefix_writable") is False:
        add("remote ACL", "fail", f"user {r.get('username') or 'default'} cannot write its own prefix "
            f"kvc:DOMAIN:*: nothing is published ({r.get('error', 'NOPERM')})", acl_dig)
    elif r.get("foreign_prefix_writable"):
        who = f"user {r['username']}" if r.get("username") else "the default user (no remote_username)"
        add("remote ACL", "warn", f"{who} can write keys outside this domain's prefix: other domains' "
            "credentials can likely read this one's chunks too (values stay MAC-checked)", acl_dig)
    else:
        add("remote ACL", "ok", f"user {r.get('username')} is kept to this domain's prefix (NOPERM outside it)",
            "README, remote tier")
    policies = r.get("maxmemory_policy")
    if policies is None:
        add("remote memory", "ok", "maxmemory policy not visible to this ACL user (grant +info to check it here); "
            "it should be volatile-* or allkeys-* with maxmemory set", "redis-cli CONFIG GET maxmemory*")
    elif any(p not in _EVICTING_POLICIES for p in policies) or 0 in r.get("maxmemory", []):
        add("remote memory", "warn", f"maxmemory-policy {', '.join(policies)}, maxmemory "
            f"{', '.join(human_bytes(m) if m else 'unlimited' for m in r.get('maxmemory', []))}: Redis will not make room "
            "by itself (with noeviction, publishes fail once it is full; unlimited grows until the host runs out)",
            "redis-cli CONFIG SET maxmemory 32gb; CONFIG SET maxmemory-policy volatile-lru")
    else:
        add("remote memory", "ok", f"maxmemory-policy {', '.join(policies)}, maxmemory "
            f"{', '.join(human_bytes(m) for m in r.get('maxmemory', []))}", "redis-cli INFO memory")


def print_checks(checks: list[dict], as_json: bool, dig: Callable[[str], str] = str) -> int:
    """Print doctor checks (a table, or ``--json``); exit status 1 when any is not ok. ``dig``
    rewrites each check's "where to dig" hint (kvcached-router puts its URL in)."""
    bad = any(x["verdict"] != "ok" for x in checks)
    if as_json:
        print(json.dumps({"checks": checks, "healthy": not bad}, indent=2))
    else:
        width = max(len(x["check"]) for x in checks)
        for x in checks:
            print(f"{x['verdict'].upper():<4}  {x['check']:<{width}}  {x['detail']}")
            if x["verdict"] != "ok":
                print(f"{'':<4}  {'':<{width}}  dig: {dig(x['dig'])}")
    return 1 if bad else 0
