"""Console scripts ``kvcached`` and ``kvcachectl`` (DESIGN.md section 6, the contract).

``kvcached serve`` runs the daemon: embedded defaults < config file < flags.
``kvcached selfcheck`` opens the engine in process and checks a put/acquire
round trip (no daemon needed). ``kvcachectl`` talks to a running daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any, Callable, Sequence

from kvcached import __version__
from kvcached.settings import SettingsError, default_socket, load_settings, parse_size
from kvcached.units import human_bytes


#: sysexits.h's EX_CONFIG: the exit code of a daemon refused by its configuration (systemd shows it)
EX_CONFIG = 78


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except SettingsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# -- kvcached ---------------------------------------------------------------------------


def kvcached_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvcached", description="KV-cache reuse daemon for LLM serving")
    ap.add_argument("--version", action="version", version=f"kvcached {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("serve", "run the daemon"), ("selfcheck", "check the engine in process, then exit")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", help="TOML config file (default /etc/kvcached/kvcached.toml if it exists)")
        p.add_argument("--socket", help="Unix socket path (default $KVCACHED_SOCKET or the runtime dir)")
        p.add_argument("--state-dir", help="state directory: hash key, NVMe tier (default $STATE_DIRECTORY)")
        p.add_argument("--device", help="auto | cpu | cuda (a pool slab on every GPU) | cuda:N[,M...]")
        p.add_argument("--pool-bytes", type=_size, help="pool size (each GPU's slab), e.g. 2G")
        p.add_argument("--nvme-bytes", type=_size, help="NVMe tier size, e.g. 64G; 0 disables it")
        p.add_argument("--metrics-addr", help="HOST:PORT for Prometheus metrics")
        p.add_argument("--check-config", action="store_true",
                       help="validate the configuration (file and flags) and exit: 0 if good, 78 if not")
    args = ap.parse_args(argv)
    overrides = {
        "socket": args.socket, "state_dir": args.state_dir, "device": args.device, "pool_bytes": args.pool_bytes,
        "nvme_bytes": args.nvme_bytes, "metrics_addr": args.metrics_addr,
    }
    try:
        settings = load_settings(args.config, overrides)
    except SettingsError as e:
        print(f"kvcached: {e}", file=sys.stderr)
        return EX_CONFIG
    if args.check_config:
        domains = ", ".join(d.domain for d in (settings, *settings.extra_domains))
        print(f"kvcached: configuration OK ({args.config or 'defaults'}; domains: {domains}; socket {settings.socket})")
        return 0
    if args.cmd == "selfcheck":
        return _selfcheck(settings)
    from kvcached.daemon import run
    from kvcached.errors import KvcacheError

    try:
        return run(settings, config_file=args.config, overrides=overrides)
    except (KvcacheError, SettingsError, OSError) as e:
        print(f"kvcached: {e}", file=sys.stderr)
        return 1


def _selfcheck(settings: Any) -> int:
    from kvcached.errors import KvcacheError
    from kvcached.keys import KVLayout
    from kvcached.store import Store

    t0 = time.monotonic()
    try:
        with Store(settings.store_config()) as store:
            layout = KVLayout("kvcached/selfcheck@0", 2, 2, 16, "float16", chunk_tokens=16)
            lid = store.register_layout(layout)
            tokens = list(range(64))
            payloads = [bytes([i]) * layout.chunk_bytes for i in range(4)]
            store.put(lid, tokens, payloads)
            lease = store.acquire(lid, tokens)
            ok = lease.matched_tokens == 64 and all(bytes(store.read_chunk(lease, i)) == payloads[i] for i in range(4))
            store.release(lease.lease_id)
            store.evict(lid)
            s = store.stats()
    except (KvcacheError, OSError) as e:
        print(f"kvcached selfcheck: {e}", file=sys.stderr)
        return 1
    print(f"kvcached {__version__} selfcheck: {'ok' if ok else 'FAILED'} in {time.monotonic() - t0:.2f} s")
    print(f"  state: {settings.state_dir}; pool: {s.pool.capacity_bytes} bytes; "
          + (f"NVMe: {s.nvme.chunks} chunks" if s.nvme else "NVMe: disabled"))
    return 0 if ok else 1


# -- kvcachectl -------------------------------------------------------------------------------


def kvcachectl_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvcachectl", description="inspect and drive a kvcached daemon")
    ap.add_argument("--socket", default=None, help="daemon socket (default $KVCACHED_SOCKET or the runtime dir)")
    ap.add_argument("--timeout", type=float, default=10.0)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="is the daemon up, and what does it hold").add_argument("--json", action="store_true")
    sub.add_parser("stats", help="every counter").add_argument("--json", action="store_true")
    lk = sub.add_parser("lookup", help="cached prefix length of token ids read from a file or stdin")
    lk.add_argument("file", nargs="?", default="-", help="token ids: JSON list or whitespace/comma separated ('-' = stdin)")
    lk.add_argument("--layout-id", help="layout id (see `kvcachectl stats`); default: every registered layout")
    lk.add_argument("--json", action="store_true")
    ev = sub.add_parser("evict", help="drop unpinned chunks: all, of one layout, or of prompts with a prefix")
    ev.add_argument("--layout-id", default="")
    ev.add_argument("--prefix", metavar="FILE", help="token ids (file or '-' for stdin): evict prompts starting with them")
    ev.add_argument("--json", action="store_true")
    sub.add_parser("flush", help="write pool-only chunks to NVMe").add_argument("--json", action="store_true")
    sub.add_parser("drain", help="refuse new leases and puts, flush to NVMe").add_argument("--json", action="store_true")
    sub.add_parser("doctor", help="troubleshooting checks, each with a verdict and where to dig").add_argument(
        "--json", action="store_true")
    rp = sub.add_parser("report", help="prefill GPU-hours and money the cache saves per month, at the measured rate")
    rp.add_argument("--gpu-hour-price", type=float, metavar="USD",
                    help="price of one GPU-hour (default: report_gpu_hour_price in the config file)")
    rp.add_argument("--prefill-tokens-per-s", type=float, metavar="N",
                    help="prefill throughput of one GPU (default: report_prefill_tokens_per_s in the config file)")
    rp.add_argument("--month-days", type=float, default=30.0, help="days in the month (default 30)")
    rp.add_argument("--config", help="read the report_* keys from this file (default /etc/kvcached/kvcached.toml "
                                     "if it exists)")
    rp.add_argument("--json", action="store_true")
    la = sub.add_parser("layout", help="a registered layout as kvcached-router's [layout] table (TOML)")
    la.add_argument("--layout-id", help="which one (see `kvcachectl stats`); default: the only registered layout")
    sub.add_parser("dashboard", help="print the Grafana dashboard for kvcached's metrics (JSON)")
    kg = sub.add_parser("keygen", help="write a new hash key file (mode 0600) for hosts sharing a remote tier")
    kg.add_argument("path", help="where to write it; an existing file is never replaced")
    args = ap.parse_args(argv)

    from kvcached_client import Client, KvcachedError, UnavailableError

    sock = args.socket or default_socket()
    if args.cmd == "dashboard":  # needs no daemon
        from importlib.resources import files

        print(files("kvcached.dashboards").joinpath("kvcached.json").read_text())
        return 0
    if args.cmd == "keygen":  # needs no daemon either
        return _keygen(args.path)
    if args.cmd == "report":  # stated prices are checked before the daemon is asked anything
        try:
            args.prices = _report_prices(args)
        except (ValueError, SettingsError) as e:
            _fail(args, f"report: {e}")
            return 2
    try:
        with Client(sock, timeout=args.timeout, session=False) as c:
            return _COMMANDS[args.cmd](c, args)
    except BrokenPipeError:  # output piped into `head` and closed early
        return 0
    except UnavailableError as e:
        _fail(args, f"kvcached is not reachable on {sock}: {e.details}")
        return 3
    except KvcachedError as e:
        _fail(args, f"{e.code.name}: {e.details}")
        return 1


def _keygen(path: str) -> int:
    from kvcached.keys import write_new_key

    try:
        write_new_key(path)
    except FileExistsError:
        print(f"kvcachectl keygen: {path} exists; a domain's key is never replaced in place "
              "(a new key orphans every chunk hashed with the old one)", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kvcachectl keygen: {path}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"wrote a new hash key to {path} (mode 0600). Copy the same file to every host of the trust domain, "
          f"owned by the daemon's user, and set hash_key_file = \"{path}\" in each kvcached.toml.")
    return 0


def _fail(args: argparse.Namespace, msg: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"error": msg}))
    else:
        print(f"kvcachectl: {msg}", file=sys.stderr)


def _out(args: argparse.Namespace, data: dict, rows: list[tuple[str, Any]]) -> int:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
    return 0



def _status(c: Any, args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    c.ping()
    rtt = (time.perf_counter() - t0) * 1e3
    s = c.stats()
    p, n = s["pool"], s["nvme"]
    data = {"up": True, "rtt_ms": rtt, "version": s["version"], "listen": s["listen"], "uptime_seconds": s["uptime_seconds"],
            "draining": s["draining"], "indexed_chunks": s["indexed_chunks"], "hit_rate": s["hit_rate"],
            "pool_free_bytes": p["free_bytes"], "pool_capacity_bytes": p["capacity_bytes"],
            "nvme_chunks": n["chunks"] if n else None, "leases_active": s["leases_active"], "sessions": s["sessions_open"]}
    rows = [
        ("daemon", f"up, kvcached {s['version']}, {s['listen']}, uptime {s['uptime_seconds']:.0f} s, rtt {rtt:.2f} ms"
                   + (", DRAINING" if s["draining"] else "")),
        ("chunks", f"{s['indexed_chunks']} indexed in {s['layouts']} layouts, hit rate {s['hit_rate']:.1%}"),
        ("pool", f"{human_bytes(p['payload_bytes'])} of KV in {p['chunks']} chunks ({p['leased_chunks']} leased), "
                 f"{human_bytes(p['reserved_bytes'])} reserved, {human_bytes(p['free_bytes'])} free of "
                 f"{human_bytes(p['capacity_bytes'])}"),
        *[(f"  slab {k}", f"{sl['placement']}: {human_bytes(sl['used_bytes'])} used of {human_bytes(sl['capacity_bytes'])}")
          for k, sl in enumerate(p.get("slabs") or []) if len(p["slabs"]) > 1],
        ("nvme", f"{n['chunks']} chunks, {human_bytes(n['used_bytes'])} of {human_bytes(n['capacity_bytes'])}"
                 if n else "disabled"),
        ("clients", f"{s['sessions_open']} sessions, {s['leases_active']} leases, {s['reservations_active']} reservations"),
    ]
    return _out(args, data, rows)


def _stats(c: Any, args: argparse.Namespace) -> int:
    s = c.stats()
    rows: list[tuple[str, Any]] = [("version", s["version"]), ("listen", s["listen"]),
                                   ("hit_rate", f"{s['hit_rate']:.4f}")]
    for k in ("layouts", "indexed_chunks", "leases_active", "reservations_active", "sessions_open", "draining"):
        rows.append((k, s[k]))
    for k, v in s["pool"].items():
        if k == "slabs":
            for i, slab in enumerate(v):
                rows += [(f"pool.slabs.{i}.{sk}", sv) for sk, sv in slab.items()]
        else:
            rows.append((f"pool.{k}", v))
    for k, v in (s["nvme"] or {}).items():
        rows.append((f"nvme.{k}", v))
    for k, v in s["counters"].items():
        rows.append((f"counters.{k}", v))
    for k, v in (s.get("hash_memo") or {}).items():
        rows.append((f"hash_memo.{k}", v))
    for lid, shape in (s.get("prompt_shape") or {}).items():
        per_bucket = {b: sum(c.values()) for b, c in shape["first_uncached_chunk"].items()}
        where = ", ".join(f"{b}: {n}" for b, n in per_bucket.items() if n)
        rows.append((f"prompt_shape {lid}", f"whole {shape['whole']}, short {shape['short']}, first uncached chunk "
                                            f"{where or 'none yet'}"))
    for lid, lay in s["layouts_detail"].items():
        rows.append((f"layout {lid}", f"{lay['model']} layers={lay['num_layers']} kv_heads={lay['num_kv_heads']} "
                                      f"head_dim={lay['head_dim']} {lay['dtype']} chunk={lay['chunk_tokens']}"))
    return _out(args, s, rows)


def _read_tokens(source: str) -> list[int]:
    """Token ids from a file or stdin ('-'): a JSON list, or whitespace/comma separated integers."""
    text = (sys.stdin.read() if source == "-" else open(source).read()).strip()
    try:
        return json.loads(text) if text.startswith("[") else [int(t) for t in re.split(r"[\s,]+", text) if t]
    except ValueError as e:
        raise SystemExit(f"kvcachectl: token ids must be integers: {e}") from None


def _layout_name(d: dict) -> str:
    """A layout's model, with what tells two layouts of one model apart (TP rank, LoRA, salt...)."""
    extra = dict(d.get("extra") or ())
    bits = [f"{k} {v}" for k, v in extra.items() if k in ("tp", "engine", "salt", "cache_salt")]
    if d.get("lora_name"):
        bits.append(f"lora {d['lora_name']}")
    return d.get("model", "?") + (f", {', '.join(bits)}" if bits else "")


def _lookup(c: Any, args: argparse.Namespace) -> int:
    """The cached prefix of a prompt in one layout (``--layout-id``), or in every registered one."""
    from kvcached.keys import KVLayout

    tokens = _read_tokens(args.file)
    layouts = c.stats()["layouts_detail"]
    if args.layout_id and args.layout_id not in layouts:
        raise SystemExit(f"kvcachectl lookup: unknown layout id {args.layout_id} (see `kvcachectl stats`)")
    if not layouts:
        raise SystemExit("kvcachectl lookup: no layout is registered yet (nothing was stored)")
    found = []
    for lid in [args.layout_id] if args.layout_id else sorted(layouts):
        layout = KVLayout.from_dict(layouts[lid])
        cached, ct = c.lookup(layout, tokens), layout.chunk_tokens
        found.append({"layout_id": lid, "model": layout.model, "tokens": len(tokens), "cached_tokens": cached,
                      "cached_chunks": cached // ct, "full_chunks": len(tokens) // ct})
    rows = [(f"{f['layout_id']} ({_layout_name(layouts[f['layout_id']])})",
             f"{f['cached_tokens']} of {f['tokens']} tokens cached = {f['cached_chunks']} of {f['full_chunks']} "
             "full chunks") for f in found]
    return _out(args, found[0] if len(found) == 1 else {"layouts": found}, rows)


def _layout(c: Any, args: argparse.Namespace) -> int:
    """Print a registered layout as the router's ``[layout]`` table: the engines' connector
    registers it at start, and the router must hash with exactly it (its extras included)."""
    layouts = c.stats()["layouts_detail"]
    lid = args.layout_id
    if not lid:
        if len(layouts) != 1:
            named = "; ".join(f"{k} ({_layout_name(v)})" for k, v in sorted(layouts.items())) or "none yet"
            raise SystemExit(f"kvcachectl layout: {len(layouts)} layouts are registered; pick one with --layout-id: "
                             f"{named}")
        lid = next(iter(layouts))
    if lid not in layouts:
        raise SystemExit(f"kvcachectl layout: unknown layout id {lid} (see `kvcachectl stats`)")
    lines = [f"[layout]  # {lid}"]
    for k, v in layouts[lid].items():
        lines.append(f"{k} = {json.dumps(v)}")  # JSON strings, numbers and arrays are TOML too
    print("\n".join(lines))
    return 0


def _evict(c: Any, args: argparse.Namespace) -> int:
    prefix = None
    if args.prefix:
        if not args.layout_id:
            raise SystemExit("kvcachectl evict --prefix needs --layout-id (see `kvcachectl stats`)")
        prefix = _read_tokens(args.prefix)
    chunks, nbytes = c.evict(args.layout_id, prefix)
    return _out(args, {"chunks": chunks, "bytes": nbytes}, [("evicted", f"{chunks} chunks, {human_bytes(nbytes)}")])


def _flush(c: Any, args: argparse.Namespace) -> int:
    n = c.flush()
    return _out(args, {"chunks": n}, [("flushed", f"{n} chunks written to NVMe")])


def _drain(c: Any, args: argparse.Namespace) -> int:
    flushed, leases = c.drain()
    return _out(args, {"flushed_chunks": flushed, "leases_active": leases},
                [("drained", f"new leases and puts refused; {flushed} chunks flushed; {leases} leases still active")])


def _report_prices(args: argparse.Namespace) -> Any:
    """The report's Prices: flags, else the config file's report_* keys."""
    from kvcached.costreport import Prices

    price, rate = args.gpu_hour_price, args.prefill_tokens_per_s
    if price is None or rate is None:
        settings = load_settings(args.config)  # 0 there: not stated
        price = (settings.report_gpu_hour_price or None) if price is None else price
        rate = (settings.report_prefill_tokens_per_s or None) if rate is None else rate
        missing = [f"--{flag} (or {key} in the config file)" for flag, key, v in (
            ("gpu-hour-price", "report_gpu_hour_price", price),
            ("prefill-tokens-per-s", "report_prefill_tokens_per_s", rate)) if v is None]
        if missing:
            raise ValueError(f"state {' and '.join(missing)}")
    return Prices(price, rate, args.month_days)


def _report(c: Any, args: argparse.Namespace) -> int:
    from kvcached.costreport import Usage, cost_report, render

    report = cost_report(Usage.from_stats(c.stats()), args.prices)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        print(render(report))
    return 0


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
    from kvcached.promptshape import judge as judge_prompt_shape

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


def _doctor(c: Any, args: argparse.Namespace) -> int:
    import shutil

    s = c.stats(doctor=True)
    checks = doctor_checks(s, shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None)
    return print_checks(checks, args.json)


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


_COMMANDS = {"doctor": _doctor, "status": _status, "stats": _stats, "lookup": _lookup, "evict": _evict, "flush": _flush,
             "drain": _drain, "report": _report, "layout": _layout}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(kvcached_main())
