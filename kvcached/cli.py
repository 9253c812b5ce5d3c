"""Console script ``kvcached`` (DESIGN.md section 6, the contract).

``kvcached serve`` runs the daemon: embedded defaults < config file < flags.
``kvcached selfcheck`` opens the engine in process and checks a put/acquire
round trip (no daemon needed). ``kvcachectl``, which talks to a running daemon, is a
package of its own (``clients/kvcachectl``): the daemon package never imports the client.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence

from kvcached import __version__
from kvcached.settings import SettingsError, load_settings, parse_size


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
    from kvcached.contract.errors import KvcacheError

    try:
        return run(settings, config_file=args.config, overrides=overrides)
    except (KvcacheError, SettingsError, OSError) as e:
        print(f"kvcached: {e}", file=sys.stderr)
        return 1


def _selfcheck(settings: Any) -> int:
    from kvcached.contract.errors import KvcacheError
    from kvcached.contract.keys import KVLayout
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(kvcached_main())
