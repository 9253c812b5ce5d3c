"""Daemon lifecycle: open the store, serve, expire on a timer, reload, stop.

Order at start: settings -> store (takes the state-dir lock, creates the
pool, rebuilds the index from NVMe) -> server bound and SERVING -> "ready"
line. Order at stop (SIGTERM/SIGINT): health NOT_SERVING, stop accepting,
grace period for in-flight calls, write pool-only chunks to NVMe, close.
SIGHUP re-reads the config file and applies the reloadable settings
(:data:`kvcached.settings.RELOADABLE`); the others are logged as needing a
restart. Under systemd each step is also reported by sd_notify
(:mod:`kvcached.systemd`): READY only once serving, WATCHDOG from the loop,
RELOADING/READY around a reload, STOPPING on SIGTERM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcached.service.kv_events import KvEventPublisher

from kvcached import __version__
from kvcached.journal import JournalHandler, stderr_is_journal, stream_is_journal
from kvcached.metrics import Metrics
from kvcached.settings import RELOADABLE, STORE_RELOADABLE, DaemonSettings, SettingsError, load_settings
from kvcached.store import Store
from kvcached.systemd import Notifier
from kvcached.units import human_bytes

log = logging.getLogger("kvcached.daemon")


def configure_logging(level: str) -> None:
    """Native journald records with structured fields when stderr is the journal, plain lines otherwise."""
    if stderr_is_journal():
        logging.basicConfig(level=getattr(logging, level.upper()), handlers=[JournalHandler()], force=True)
    else:
        logging.basicConfig(
            level=getattr(logging, level.upper()),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
            force=True,
        )


def run(settings: DaemonSettings, *, config_file: str | None = None, overrides: dict[str, Any] | None = None) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit status."""
    configure_logging(settings.log_level)
    try:
        import uvloop

        runner: Callable[[Coroutine[Any, Any, int]], int] = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep working without it
        runner = asyncio.run
    return runner(_serve(settings, config_file, overrides or {}))


async def _serve(settings: DaemonSettings, config_file: str | None, overrides: dict[str, Any]) -> int:
    from kvcached.service.server import start_server

    loop = asyncio.get_running_loop()
    notify = Notifier()
    domains = [settings, *settings.extra_domains]  # one store, pool, NVMe env and socket each
    for d in domains:
        if d.pool_block_bytes:
            log.warning("pool_block_bytes (domain %s) is ignored: the pool is packed, chunks of any size share it",
                        d.domain, extra={"event": "deprecated_setting"})
    configs = settings.store_configs()  # default pool sizes from the memory free before any pool exists
    stores: list[Store] = []
    try:
        for config in configs:
            # Pool allocation and the NVMe rebuild can take long: keep extending the start timeout.
            opening = loop.run_in_executor(None, Store, config)
            while not opening.done():
                notify.extend_timeout(30)
                await asyncio.wait([opening], timeout=10)
            stores.append(opening.result())
    except BaseException:
        for st in stores:
            st.close()
        raise
    metrics = Metrics({d.domain: st for d, st in zip(domains, stores)})
    metrics_port = None
    if settings.metrics_addr and settings.metrics_addr != "off":
        try:
            metrics_port = metrics.serve(settings.metrics_addr)
        except OSError as e:  # a busy port must not keep the cache down
            log.error("cannot serve metrics on %s: %s; running without /metrics", settings.metrics_addr, e)
    runnings: list[Any] = []
    event_pubs: "list[KvEventPublisher]" = []
    try:
        for d, st in zip(domains, stores):
            cfg = d.kv_events_config()
            if cfg is not None and st.events is not None:
                from kvcached.service.kv_events import KvEventPublisher

                pub = await loop.run_in_executor(None, KvEventPublisher(st.events, cfg).start)
                event_pubs.append(pub)
                metrics.add_event_publisher(d.domain, pub)
        for d, st in zip(domains, stores):
            runnings.append(await start_server(d, st, [metrics.interceptor], metrics.interceptor.observe))
    except BaseException:
        for r in runnings:
            await r.stop(grace=0)
        for pub in event_pubs:
            pub.stop()
        metrics.close()
        for st in stores:
            st.close()
        raise
    stop = asyncio.Event()

    def on_stop() -> None:
        notify.stopping()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)
    loop.add_signal_handler(
        signal.SIGHUP,
        lambda: asyncio.ensure_future(_reload(domains, stores, runnings, config_file, overrides, notify)),
    )
    for d, st, r in zip(domains, stores, runnings):
        own = next((p for p in event_pubs if p.source is st.events), None)
        _announce(d, st, r.tcp_port, metrics_port if d is settings else None, own)
    notify.ready(_status_line(stores[0]))  # only now: every socket is bound and every index rebuilt
    tasks = [asyncio.create_task(_expire_loop(st, settings.expire_interval, notify if i == 0 else None))
             for i, st in enumerate(stores)]
    if notify.watchdog_interval:
        tasks.append(asyncio.create_task(_watchdog_loop(notify, notify.watchdog_interval)))
    await stop.wait()
    log.info("stopping: health NOT_SERVING, draining in-flight calls", extra={"event": "stop"})
    for t in tasks:
        t.cancel()
    # The KV event streams first: a router sees the connection drop and stops counting this
    # host's chunks at once, while the RPCs drain (up to 5 s) and the pool is flushed. Left
    # open until after the flush, the stream kept saying "held" while every call was refused:
    # a restart storm measured a quarter of routes wrong that way. The next start's stream
    # begins with AllBlocksCleared and a snapshot, the flushed chunks included.
    for pub in event_pubs:
        await loop.run_in_executor(None, pub.stop)
    for r in runnings:
        await r.stop(grace=5.0)
    metrics.close()
    flushed = 0
    for st in stores:
        flushed += await loop.run_in_executor(None, st.flush)
    for st in stores:
        st.close()
    log.info("stopped; wrote %d pool-only chunks to NVMe", flushed, extra={"event": "stopped"})
    return 0


def _announce(settings: DaemonSettings, store: Store, tcp_port: int | None, metrics_port: int | None = None,
              events: Any = None) -> None:
    s = store.stats()
    r = store.rebuild_report
    lines = [
        f"kvcached {__version__} ready",
        f"  listening: unix:{settings.socket} (mode {settings.socket_mode:04o})"
        + (f", tcp {settings.tcp_listen}" if tcp_port else ""),
        f"  state: {settings.state_dir} (domain {settings.domain})",
        "  metrics: " + (f"http://{settings.metrics_addr.rpartition(':')[0]}:{metrics_port}/metrics" if metrics_port
                         else "off"),
        (f"  pool: host shared memory /dev/shm/{store.pool.name}, " if store.config.device == "cpu"
         else f"  pool: GPU {store.pool.name}, ")
        + f"{human_bytes(s.pool.capacity_bytes)}, packed",
        "  nvme: " + (f"{s.nvme.chunks} chunks, {human_bytes(s.nvme.used_bytes)} of {human_bytes(s.nvme.capacity_bytes)}"
                      + (f", index rebuilt in {r.seconds:.2f} s" if r else "") if s.nvme else "disabled"),
        "  kv events: " + (f"{events.pub_endpoint}" + (f", replay {events.replay_endpoint}" if events.replay_endpoint
                                                         else "") if events is not None else "off"),
        f"  layouts: {s.layouts}",  # the last line (tests wait for it)
    ]
    # Once, not twice: one log line (the journal's "ready" event), and the same on stdout as a
    # block for a terminal; under systemd stdout goes to the journal too, so there only the log line.
    log.info("%s: %s", lines[0], "; ".join(line.strip() for line in lines[1:]), extra={"event": "ready"})
    if not stream_is_journal(1):
        print("\n".join(lines), flush=True)


def _status_line(store: Store) -> str:
    s = store.stats()
    return (f"{s.indexed_chunks} chunks, pool {s.pool.used_bytes >> 20}/{s.pool.capacity_bytes >> 20} MiB, "
            f"{s.leases_active} leases, hit rate {s.hit_rate:.1%}")


async def _watchdog_loop(notify: Notifier, interval: float) -> None:
    """WATCHDOG=1 from the event loop itself: if the loop stalls, the pings stop."""
    while True:
        notify.watchdog()
        await asyncio.sleep(interval)


async def _expire_loop(store: Store, interval: float, notify: Notifier | None = None) -> None:
    loop = asyncio.get_running_loop()
    last_status = 0.0
    last_summary, last_ev = loop.time(), (0, 0, 0, 0)
    while True:
        await asyncio.sleep(interval)
        if notify is not None and notify.enabled and loop.time() - last_status >= 10:
            notify.status(_status_line(store))
            last_status = loop.time()
        try:
            out = await loop.run_in_executor(None, store.expire)
        except Exception:  # keep the loop alive; the error is a bug worth a traceback
            log.exception("expiry pass failed")
            continue
        if any(out.values()):
            log.info("expired %d leases, %d reservations, %d chunks", out["leases"], out["reservations"], out["chunks"],
                     extra={"event": "expired"})
        now = loop.time()
        if now - last_summary >= 60:
            c = store.counters
            ev = (c.pool_evictions, c.nvme_evictions, c.promotions, c.demotions)
            if ev != last_ev:
                log.info("last %.0f s: %d pool evictions, %d NVMe evictions, %d promotions, %d demotions",
                         now - last_summary, *(a - b for a, b in zip(ev, last_ev)), extra={"event": "evictions"})
            last_summary, last_ev = now, ev


async def _reload(domains: list[DaemonSettings], stores: list[Store], runnings: list[Any], config_file: str | None,
                  overrides: dict[str, Any], notify: Notifier | None = None) -> None:
    notify = notify or Notifier({})
    notify.reloading()
    try:
        await _apply_reload(domains, stores, runnings, config_file, overrides)
    except SettingsError as e:
        log.error("reload refused, keeping the running settings: %s", e, extra={"event": "reload_failed"})
    except Exception as e:  # noqa: BLE001 - a reload must never take the daemon down or go unlogged
        log.exception("reload failed, keeping the running settings: %s", e, extra={"event": "reload_failed"})
    notify.ready(_status_line(stores[0]))


async def _apply_reload(domains: list[DaemonSettings], stores: list[Store], runnings: list[Any],
                        config_file: str | None, overrides: dict[str, Any]) -> None:
    """Load and apply; :func:`load_settings` refuses a bad value before anything is applied."""
    new = load_settings(config_file, overrides)
    fresh = {d.domain: d for d in (new, *new.extra_domains)}
    fields = [f.name for f in dataclasses.fields(DaemonSettings) if f.name != "extra_domains"]
    changed: set[str] = set()
    for d, st, running in zip(domains, stores, runnings):
        nd = fresh.get(d.domain)
        if nd is None:
            changed.add(f"domains.{d.domain} (removed)")
            continue
        changed |= {f for f in fields if getattr(nd, f) != getattr(d, f)}
        st.reconfigure(**{name: getattr(nd, name) for name in STORE_RELOADABLE})
        running.servicer.call_timeout = nd.call_timeout
        running.servicer.max_sessions = nd.max_sessions
        running.servicer.bypass_generation_tokens = nd.bypass_generation_tokens
    if set(fresh) - {d.domain for d in domains}:
        changed.add("domains (added)")
    ignored = sorted(changed - RELOADABLE)
    if ignored:
        log.warning("reload: %s need a restart to take effect", ", ".join(ignored))
    applied = sorted(changed & RELOADABLE)
    logging.getLogger().setLevel(getattr(logging, new.log_level.upper()))
    log.info("reloaded: %s", ", ".join(applied) or "nothing changed", extra={"event": "reload"})
