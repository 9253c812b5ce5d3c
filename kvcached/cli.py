"""Console scripts ``kvcached`` and ``kvcachectl`` (DESIGN.md section 6).

Until the gRPC service lands, ``kvcached serve`` opens the engine on the
embedded defaults, rebuilds the index from NVMe, runs a self-check
(put -> acquire -> read back -> release -> evict on a scratch layout) and
reports what it holds. ``kvcachectl`` commands that need the daemon say so.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from typing import Sequence

from kvcached import __version__
from kvcached.config import StoreConfig
from kvcached.errors import KvcacheError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"512M"``, ``"2GiB"``, ``"1048576"`` -> bytes (binary multiples)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M, 2G, 1073741824)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def default_state_dir() -> str:
    """``$STATE_DIRECTORY`` (systemd) or ``~/.local/state/kvcached``."""
    sd = os.environ.get("STATE_DIRECTORY")
    if sd:
        return sd.split(":")[0]
    return os.path.join(os.path.expanduser("~"), ".local", "state", "kvcached")


def default_socket() -> str:
    """``$KVCACHED_SOCKET``, else under ``$RUNTIME_DIRECTORY`` / ``$XDG_RUNTIME_DIR`` / /tmp."""
    if os.environ.get("KVCACHED_SOCKET"):
        return os.environ["KVCACHED_SOCKET"]
    base = os.environ.get("RUNTIME_DIRECTORY") or os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return os.path.join(base.split(":")[0], "kvcached.sock")
    return os.path.join("/tmp", f"kvcached-{os.getuid()}", "kvcached.sock")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the daemon (for now: open the engine and self-check)")
    p.add_argument("--config", help="TOML config file (default /etc/kvcached/kvcached.toml if present)")
    p.add_argument("--socket", help="Unix socket path")
    p.add_argument("--state-dir", help="state directory (hash key, NVMe tier)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--pool-bytes", type=parse_size, help="device pool size, e.g. 2G")
    p.add_argument("--nvme-bytes", type=parse_size, help="NVMe tier size, e.g. 64G; 0 disables it")
    p.add_argument("--metrics-addr", help="HOST:PORT for Prometheus metrics")


def kvcached_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvcached", description="KV-cache reuse daemon for LLM serving")
    ap.add_argument("--version", action="version", version=f"kvcached {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.device not in ("auto", "cpu") and not args.device.startswith("cuda"):
        ap.error(f"--device must be auto, cpu or cuda[:N], not {args.device!r}")
    state_dir = args.state_dir or default_state_dir()
    kwargs: dict = {"state_dir": state_dir}
    if args.pool_bytes is not None:
        kwargs["pool_bytes"] = args.pool_bytes
        # A small pool still gets 16 blocks (the self-check needs 4).
        kwargs["pool_block_bytes"] = max(1, min(StoreConfig.pool_block_bytes, args.pool_bytes // 16))
    else:
        kwargs["pool_bytes"] = 256 << 20  # embedded default for the host pool until the daemon sizes it
    if args.nvme_bytes is not None:
        kwargs["nvme_bytes"] = args.nvme_bytes
    try:
        return _selfcheck(StoreConfig(**kwargs))
    except (KvcacheError, ValueError, OSError) as e:
        print(f"kvcached: {e}", file=sys.stderr)
        return 1


def _selfcheck(config: StoreConfig) -> int:
    from kvcached.keys import KVLayout
    from kvcached.store import Store

    t0 = time.monotonic()
    with Store(config) as store:
        print(f"kvcached {__version__}: state in {config.state_dir}")
        r = store.rebuild_report
        if r is not None:
            print(f"  NVMe: {r.chunks} chunks indexed in {r.seconds:.2f} s "
                  f"({r.orphans_dropped} orphans, {r.corrupt_dropped} corrupt dropped)")
        layout = KVLayout("kvcached/selfcheck@0", 2, 2, 16, "float16", chunk_tokens=16)
        lid = store.register_layout(layout)
        tokens = list(range(64))
        payloads = [bytes([i]) * layout.chunk_bytes for i in range(4)]
        store.put(lid, tokens, payloads)
        lease = store.acquire(lid, tokens)
        ok = lease.matched_tokens == 64 and all(
            bytes(store.read_chunk(lease, i)) == payloads[i] for i in range(4)
        )
        store.release(lease.lease_id)
        store.evict(lid)
        s = store.stats()
        print(f"  pool: {s.pool.blocks_total} blocks of {s.pool.block_bytes} bytes (host shared memory)")
        if s.nvme is not None:
            print(f"  NVMe: {s.nvme.chunks} chunks, {s.nvme.used_bytes} of {s.nvme.capacity_bytes} bytes")
        print(f"  self-check: {'ok' if ok else 'FAILED'} in {time.monotonic() - t0:.2f} s")
        print("  gRPC service: not yet (arrives with the daemon issue); exiting")
        return 0 if ok else 1


def kvcachectl_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvcachectl", description="inspect and drive a kvcached daemon")
    ap.add_argument("--socket", default=None, help="daemon socket (default $KVCACHED_SOCKET)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status")
    st = sub.add_parser("stats")
    st.add_argument("--json", action="store_true")
    for name in ("lookup", "evict", "flush", "drain", "doctor"):
        sub.add_parser(name)
    args = ap.parse_args(argv)
    sock = args.socket or default_socket()
    print(json.dumps({"error": "not yet", "command": args.cmd, "socket": sock,
                      "detail": "kvcachectl talks to the gRPC daemon, which is not built yet"}),
          file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(kvcached_main())
