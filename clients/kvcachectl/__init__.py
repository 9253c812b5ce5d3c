"""Console script ``kvcachectl``: inspect and drive a running kvcached daemon (DESIGN.md section 6).

An operator's tool, above both the client library (it talks to the daemon through
:class:`kvcached_client.Client`) and the daemon's own files (it reads the config file for the
cost report's prices, writes hash key files, prints the Grafana dashboard the daemon ships).
The daemon package never imports it. Exit codes: 0 ok, 1 the daemon refused or a doctor check
is not ok, 2 bad arguments, 3 the daemon is not reachable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any, Sequence

from kvcached.contract.socket_path import default_socket
from kvcached.settings import SettingsError, load_settings
from kvcached.units import human_bytes
from kvcachectl.doctor import doctor_checks, print_checks


def main(argv: Sequence[str] | None = None) -> int:
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
    from kvcached.contract.keys import write_new_key

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
    from kvcached.contract.keys import KVLayout

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


def _doctor(c: Any, args: argparse.Namespace) -> int:
    import shutil

    s = c.stats(doctor=True)
    checks = doctor_checks(s, shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None)
    return print_checks(checks, args.json)


_COMMANDS = {"doctor": _doctor, "status": _status, "stats": _stats, "lookup": _lookup, "evict": _evict, "flush": _flush,
             "drain": _drain, "report": _report, "layout": _layout}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
