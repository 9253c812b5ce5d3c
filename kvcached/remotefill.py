"""Filling a prompt from the remote tier before an acquire: the chunks after the local prefix.

The store calls :meth:`RemoteFill.fill` off the event loop (it blocks on the network, up to the
remote tier's deadline per window), and never with the store lock held: the in-place path
reserves from the remote tier's I/O thread, which takes that lock while the caller waits for
it. Its collaborators are handed in: the remote tier, and a :class:`FillTarget`, the store's
side (prefix matching, reservations, commits), each of whose calls takes the store lock itself;
nothing here holds it across a network call.

* **Windows.** A long prompt is fetched :data:`FETCH_WINDOW_BYTES` of chunks at a time (one
  pipelined round trip per Redis node each); the next window only if this one arrived whole.
  No separate probe: a GET of a key Redis lacks costs what an EXISTS does.
* **In place** (a host pool and the remote tier's direct reader): the window's reservation is
  made when its first value arrives (a miss reserves, and so evicts, nothing); each value is
  read from the socket into its reserved slot and verified there; the verified leading chunks
  are committed and the rest aborted. Otherwise (a CUDA pool, or TLS): the verified payloads
  are fetched first, then reserved, copied in and committed.
* **Fail-open.** Any remote trouble is a shorter (or empty) fill, never an error: the acquire
  that follows serves what is local. What came from the remote is not published back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvcached.contract.keys import ChunkHash, KVLayout, LayoutId, TokenInput
from kvcached.leases import ReservationId
from kvcached.receipts import CommitReceipt, ReservationReceipt
from kvcached.tiers.remote import RemoteTier
from kvcached.tiers.remote_redis import ROUND_TRIP_BYTES

#: How many bytes of chunks one remote fetch asks for at most: what one round trip carries
#: within the remote timeout.
FETCH_WINDOW_BYTES = ROUND_TRIP_BYTES


class FillTarget(Protocol):
    """What a fill needs of the store; every call takes the store lock itself."""

    def hashes(self, layout_id: LayoutId, tokens: TokenInput) -> list[ChunkHash]: ...

    def local_prefix(self, layout_id: LayoutId, hashes: Sequence[ChunkHash]) -> tuple[KVLayout, int]:
        """The layout, and how many leading ``hashes`` are cached here (raises while not admitting)."""

    def packed_tokens(self, layout: KVLayout, tokens: TokenInput) -> bytes: ...

    def reserve(self, layout_id: LayoutId, tokens: TokenInput, *, open_empty: bool = ...,
                placement: str = ...) -> ReservationReceipt: ...

    def write_reserved(self, reservation_id: ReservationId, position: int, data: bytes | memoryview) -> None: ...

    def reserved_view(self, reservation_id: ReservationId, position: int) -> memoryview: ...

    def commit_filled(self, reservation_id: ReservationId, chunks: int | None) -> CommitReceipt:
        """Commit what a fill wrote (the first ``chunks``, or all); not published back."""

    def abort(self, reservation_id: ReservationId) -> bool: ...

    def count_filled(self, chunks: int) -> None: ...


class RemoteFill:
    def __init__(self, remote: RemoteTier, target: FillTarget, *, in_place: bool) -> None:
        """``in_place``: the pool is host memory this process writes (``reserved_view`` works)."""
        self.remote = remote
        self._target = target
        self._in_place = in_place

    def fill(self, layout_id: LayoutId, tokens: TokenInput, placement: str = "") -> int:
        """Fetch the chunks after the locally cached prefix from the remote tier, verified, and
        store them here (pool, then NVMe as any chunk), so the acquire that follows finds them.
        Returns the chunks stored; 0 on any remote trouble. It spends at most ``remote_timeout``
        × the windows fetched waiting for Redis (waits for the store lock are not the remote's)."""
        t = self._target
        hashes = t.hashes(layout_id, tokens)
        layout, k = t.local_prefix(layout_id, hashes)
        if k == len(hashes):
            return 0
        window = max(1, FETCH_WINDOW_BYTES // layout.chunk_bytes)
        packed = t.packed_tokens(layout, tokens)
        in_place = self._in_place and self.remote.direct
        stored = 0
        while k < len(hashes):
            want = hashes[k: k + window]
            step = self._window_in_place if in_place else self._window_copied
            n, whole = step(layout_id, layout, packed, k, want, placement)
            stored += n
            if not whole:
                break
            k += len(want)
        if stored:
            t.count_filled(stored)
        return stored

    def _window_in_place(self, layout_id: LayoutId, layout: KVLayout, packed: bytes, k: int,
                         want: Sequence[ChunkHash], placement: str) -> tuple[int, bool]:
        """One window read straight into reserved pool slots: (chunks stored, whether the whole
        window was). The reservation covers the whole window, made on the first value's arrival."""
        t = self._target
        end = (k + len(want)) * layout.chunk_tokens * 4
        made: list[ReservationReceipt] = []

        def dest(i: int) -> memoryview | None:  # on a remote I/O thread, one call at a time
            if not made:
                made.append(t.reserve(layout_id, packed[:end], open_empty=False, placement=placement))
            r = made[0]
            if not r.slots or k + i < r.slots[0].position:  # no room, or another writer has it already
                return None
            return t.reserved_view(r.reservation_id, k + i)

        n = self.remote.fetch_into(layout_id, want, layout.chunk_bytes, dest)  # nothing writes after it
        if not made or not made[0].opened:
            return 0, False
        r = made[0]
        keep = sum(1 for loc in r.slots if loc.position < k + n)  # slots: consecutive positions
        if keep == 0:
            t.abort(r.reservation_id)
            return 0, False
        c = t.commit_filled(r.reservation_id, keep)
        return c.committed_chunks, n == len(want) and keep == len(r.slots) == c.committed_chunks

    def _window_copied(self, layout_id: LayoutId, layout: KVLayout, packed: bytes, k: int,
                       want: Sequence[ChunkHash], placement: str) -> tuple[int, bool]:
        """One window fetched as payloads, then reserved, copied in and committed."""
        t = self._target
        payloads = self.remote.fetch(layout_id, want, layout.chunk_bytes)
        if not payloads:
            return 0, False
        n = k + len(payloads)
        r = t.reserve(layout_id, packed[: n * layout.chunk_tokens * 4], open_empty=False, placement=placement)
        if not r.opened:
            return 0, False
        try:
            for loc in r.slots:  # positions k..n-1 (or fewer, if another writer got there first)
                t.write_reserved(r.reservation_id, loc.position, payloads[loc.position - k])
        except BaseException:
            t.abort(r.reservation_id)
            raise
        c = t.commit_filled(r.reservation_id, None)
        return c.committed_chunks, len(payloads) == len(want) and len(r.slots) == len(payloads) == c.committed_chunks
