from __future__ import annotations

import os
import signal
import subprocess
from typing import Callable, Iterator

import pytest

from bench.harness.daemon import Daemon, pool_segments, remove_segments, segment_pid
from bench.harness.layouts import TINY, payload, prompt
from kvcached.config import StoreConfig
from kvcached.contract.keys import KVLayout
from kvcached.store import Store
from kvcached.tiers.pool_shm import process_alive

__all__ = ["TINY", "FakeClock", "payload", "prompt"]  # TINY, payload, prompt: shared with the benches


class FakeClock:
    """Deterministic time for TTL and LRU tests."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_store(tmp_path, clock) -> Iterator[Callable[..., Store]]:
    stores: list[Store] = []

    def factory(pool_blocks: int = 16, nvme_chunks: int | None = 64, layout: KVLayout = TINY, **kw) -> Store:
        """A store whose pool holds exactly ``pool_blocks`` chunks of ``layout``. Write-back is off
        unless asked for (``writeback=True``): these tests check placement deterministically, with a
        fake clock; tests/test_writeback.py runs the thread."""
        from kvcached.contract.record import HEADER_SIZE

        kw.setdefault("writeback", False)
        cfg = StoreConfig(
            state_dir=kw.pop("state_dir", str(tmp_path / "state")),
            pool_bytes=layout.chunk_bytes * pool_blocks,
            nvme_bytes=0 if nvme_chunks is None else (layout.chunk_bytes + HEADER_SIZE) * nvme_chunks,
            **kw,
        )
        s = Store(cfg, clock=clock)
        stores.append(s)
        return s

    yield factory
    for s in stores:
        s.close()


@pytest.fixture
def store(make_store) -> Store:
    return make_store()


@pytest.fixture
def lid(store):
    return store.register_layout(TINY)


def pytest_collection_modifyitems(config, items) -> None:
    """Files holding a test marked ``slow`` (real engines, installs, whole-README runs) run first.

    ./scripts/test hands whole files to its workers in this order (``--dist loadfile
    --no-loadscope-reorder``; pytest-xdist's own order puts the files with the most tests first,
    which left the heaviest, few-test files for last and one worker busy minutes after the
    other). With the heavy files first and the many quick ones last, the workers end together.
    The sort is stable, so each worker collects the same order, as xdist requires."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def pytest_report_header(config):
    return f"kvcached tests; /dev/shm free: {os.statvfs('/dev/shm').f_bavail * os.statvfs('/dev/shm').f_frsize >> 20} MiB"


@pytest.fixture
def make_daemon(tmp_path) -> Iterator[Callable[..., Daemon]]:
    daemons: list[Daemon] = []

    def factory(**settings: object) -> Daemon:
        d = Daemon(str(tmp_path), **settings)
        daemons.append(d)
        return d.start()

    yield factory
    for d in daemons:
        if d.proc is not None:
            d.stop(signal.SIGKILL)


@pytest.fixture
def daemon(make_daemon) -> Daemon:
    return make_daemon()


@pytest.fixture(scope="session", autouse=True)
def no_pool_segment_left_behind() -> Iterator[None]:
    """The suite leaves none of its host pool segments in /dev/shm (tmpfs keeps one until it is
    unlinked, so each one left is memory gone until reboot).

    Ours are the segments created by this process or by a process it started (daemons, client
    and writer processes: every ``subprocess.Popen`` is recorded), found at the end when all of
    them have exited. Segments present at the start, and those of processes this session did not
    start (other test runs on the host), are left alone. Any of ours are unlinked, then reported.
    """
    before = pool_segments()
    started: dict[int, str] = {os.getpid(): "this pytest process"}
    init = subprocess.Popen.__init__

    def recording_init(self: subprocess.Popen, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        cmd = args[0] if args else kwargs.get("args")
        started[self.pid] = " ".join(map(str, cmd))[:160] if isinstance(cmd, (list, tuple)) else str(cmd)[:160]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", recording_init)
        yield
    ours = {}
    for name in pool_segments() - before:
        pid = segment_pid(name)
        if pid in started and (pid == os.getpid() or not process_alive(pid)):  # a live one is not left behind (yet)
            ours[name] = started[pid]
    remove_segments(ours)
    assert not ours, "the suite left host pool segments in /dev/shm (unlinked now): " + "; ".join(
        f"{name} (from {cmd})" for name, cmd in sorted(ours.items()))


@pytest.fixture
def redis_server(tmp_path):
    """A standalone redis-server of this test's own on a free port (never the shared 6379)."""
    from bench.harness.redis_servers import RedisServer, free_ports
    from tests.requirements import require_redis

    require_redis()
    srv = RedisServer(free_ports(1)[0], str(tmp_path / "redis")).start()
    yield srv
    srv.stop()
