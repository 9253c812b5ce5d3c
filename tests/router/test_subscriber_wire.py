"""The subscriber's safety nets, on a wire this test controls: a PUB socket and a replay socket
speaking the daemon's protocol (``kvcached.service.kv_events``), fed batches dropped,
reordered, duplicated, or lost for good. The router's index must end as the daemon's truth
(what applying every batch in order gives), replaying what it missed, ignoring what it already
applied, and forgetting a host whose stream has a hole it cannot fill, never holding a chunk
the daemon removed. Each scenario removes a chunk inside the disturbed batches, so a subscriber
that skipped the safety net would end holding it (checked by mutation: see the note in each)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import zmq
import zmq.asyncio

from kvcached.contract.events import BlockRemoved, BlockStored, EventBatch
from kvcached_router.index import HostIndex
from kvcached_router.subscriber import END_SEQ, EventSubscriber

TOPIC = b"kv-events"


def h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def stored(*ids: int) -> BlockStored:
    return BlockStored([h(i) for i in ids], None, [], 4, None, "GPU", None)


def removed(*ids: int) -> BlockRemoved:
    return BlockRemoved([h(i) for i in ids], "GPU")


class FakeDaemon:
    """The daemon's two sockets, its batch numbering and replay buffer, under the test's control."""

    def __init__(self, tmp_path, ctx: zmq.asyncio.Context) -> None:
        self.events = f"ipc://{tmp_path}/ev"
        self.replay = f"ipc://{tmp_path}/rp"
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(self.events)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(self.replay)
        self.batches: list[tuple[int, bytes]] = []  # (seq, payload), in order
        self.forgotten: set[int] = set()  # batches the replay buffer no longer holds
        self._enc = msgspec.msgpack.Encoder()
        self._task = asyncio.get_running_loop().create_task(self._serve())

    def make(self, *events) -> int:
        seq = len(self.batches)
        self.batches.append((seq, self._enc.encode(EventBatch(time.time(), list(events), 0))))
        time.sleep(0.002)  # distinct, increasing timestamps
        return seq

    async def send(self, seq: int) -> None:
        await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), self.batches[seq][1]])

    def truth(self) -> set[bytes]:
        held: set[bytes] = set()
        for _, payload in self.batches:
            for ev in msgspec.msgpack.decode(payload, type=EventBatch).events:
                (held.update if ev["type"] == "BlockStored" else held.difference_update)(ev["block_hashes"])
        return held

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.batches:
                if seq >= first and seq not in self.forgotten:
                    await self.router.send_multipart([client, b"", TOPIC, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._task.cancel()
        self.pub.close(0)
        self.router.close(0)


def held(ix: HostIndex, ids) -> set[bytes]:
    return {h(i) for i in ids if ix.confirmed_prefix([h(i)])}


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def run(tmp_path, scenario) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        d = FakeDaemon(tmp_path, ctx)
        ix = HostIndex()
        sub = EventSubscriber("a", ix, d.events, d.replay, ctx=ctx, replay_timeout=2.0)
        sub.start()
        try:
            await asyncio.wait_for(sub.synced.wait(), 10)
            await asyncio.sleep(0.2)  # the SUB connection is up (a PUB drops what no one hears)
            await scenario(d, ix, sub)
        finally:
            await sub.stop()
            d.close()
            ctx.term()

    asyncio.run(main())


IDS = range(1, 10)


def test_dropped_batches_are_replayed(tmp_path):
    """Mutation: apply a batch that arrives after a gap without replaying -> 1 and 3 are never
    stored and 2 is never removed here; this test fails."""
    async def scenario(d: FakeDaemon, ix: HostIndex, sub: EventSubscriber) -> None:
        d.make(stored(1, 2)), d.make(stored(3)), d.make(removed(2)), d.make(stored(4))
        await d.send(0)
        await d.send(3)  # 1 and 2 dropped on the wire
        await until(lambda: sub.next_seq == 4)
        assert held(ix, IDS) == d.truth() == {h(1), h(3), h(4)}
        assert sub.replays >= 2 and sub.holes == 0  # the start's replay, and the gap's

    run(tmp_path, scenario)


def test_reordered_and_duplicated_batches_are_applied_once_in_order(tmp_path):
    """Mutation: drop the timestamp check that tells a late duplicate from a daemon restart ->
    the duplicate is taken for a restart (the index cleared and replayed: restarts == 1); apply
    duplicates as they come -> 5 is stored again after its removal; this test fails."""
    async def scenario(d: FakeDaemon, ix: HostIndex, sub: EventSubscriber) -> None:
        d.make(stored(5, 6)), d.make(removed(5)), d.make(stored(7))
        await d.send(0)
        await d.send(2)  # ahead of 1: a gap, filled by replay
        await until(lambda: sub.next_seq == 3)
        await d.send(1)  # the late original of a batch the replay already applied
        await d.send(0)  # and a duplicate of the first: it stored 5, which is removed since
        await asyncio.sleep(0.3)
        assert held(ix, IDS) == d.truth() == {h(6), h(7)}
        assert sub.restarts == 0 and sub.holes == 0

    run(tmp_path, scenario)


def test_a_hole_the_replay_cannot_fill_forgets_the_host(tmp_path):
    """The daemon's buffer no longer holds the missed batch, which removed a chunk: the index
    must not keep it. Mutation: make a hole not clear the index -> 8 is still held; fails."""
    async def scenario(d: FakeDaemon, ix: HostIndex, sub: EventSubscriber) -> None:
        d.make(stored(8)), d.make(removed(8)), d.make(stored(9))
        await d.send(0)
        await until(lambda: held(ix, IDS) == {h(8)})
        d.forgotten.add(1)
        await d.send(2)  # 1 is lost on the wire and gone from the replay buffer
        await until(lambda: sub.next_seq == 3)
        assert sub.holes == 1
        assert h(8) not in held(ix, IDS)  # never a wrong "held"
        assert held(ix, IDS) <= d.truth()  # what it knows is true; the rest comes back with new events

    run(tmp_path, scenario)


def test_a_dropped_connection_marks_the_host_stale_until_the_stream_resumes(tmp_path):
    """The daemon's PUB socket goes away (the daemon stopped): the index counts as holding
    nothing at once, not on what the old stream said; a batch on a new PUB brings it back.
    Mutation: never mark stale -> the prefix stays 1 while the daemon is gone; fails."""
    async def scenario(d: FakeDaemon, ix: HostIndex, sub: EventSubscriber) -> None:
        d.make(stored(1))
        await d.send(0)
        await until(lambda: ix.prefix([h(1)]) == 1)
        d.pub.close(0)  # the daemon is gone
        await until(lambda: ix.stale and ix.prefix([h(1)]) == 0, 5)
        assert sub.disconnects == 1
        d.pub = zmq.asyncio.Context.instance().socket(zmq.PUB)  # it is back, the same stream going on
        d.pub.bind(d.events)
        await asyncio.sleep(0.3)
        d.make(stored(2))
        await d.send(1)
        await until(lambda: not ix.stale and ix.prefix([h(1), h(2)]) == 2, 5)

    run(tmp_path, scenario)
