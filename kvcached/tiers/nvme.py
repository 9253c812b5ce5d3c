"""NVMe tier: chunk payloads in an LMDB environment in the state directory.

Durability settings (``lmdb.open`` flags and why):

* ``sync=True, metasync=False``: data pages are flushed at commit, the meta
  page lazily. LMDB documents that a *system* crash may then undo the last
  committed transaction but never corrupts the file. A killed *process*
  loses nothing that was committed (the pages are in the page cache).
* ``writemap=False``: a stray write through a pointer cannot scribble on the
  file; with ``writemap`` plus lazy sync LMDB no longer promises integrity.
* ``readahead=False``: access is random and the file may exceed RAM.
* ``map_size`` is large (virtual address space, the file is sparse). A full
  map (``MapFullError``: large values need runs of contiguous free pages, so a
  fragmented file can fill its map before the tier holds ``capacity`` bytes)
  grows the map by a quarter and retries, up to ``max_map_size`` (4x the
  start); past that the tier stops admitting and the store evicts, instead of
  the daemon crashing. ENOSPC is treated the same way. Growing is safe while
  other threads read or write: every transaction holds a :class:`TxnGate`
  shared and the resize holds it exclusive (see :mod:`kvcached.contract.lmdbgate`
  for what happens otherwise). Clients reading the file directly map far more
  than the file and adopt a grown map themselves (:mod:`kvcached_client.nvme`).
* Stale reader slots left by killed processes are cleared at open
  (``reader_check``), and every read transaction is short: one value, or one
  batch of headers during the rebuild scan, so a reader never pins old pages
  long enough to make the file grow.

Named databases: ``chunks`` (chunk hash -> header + payload, see
:mod:`kvcached.contract.record`) and ``layouts`` (layout id -> JSON), so that
the index can be rebuilt without any client having re-registered.

Not thread-safe on its own (see :mod:`kvcached.tiers.base`); LMDB calls here
block on disk I/O, so the daemon calls the store from worker threads.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, TypeVar

import lmdb

from kvcached.contract.errors import ChunkNotCached, CorruptChunk, InternalInvariantError, InvalidKV, TierFull
from kvcached.contract.keys import ChunkHash, KVLayout, LayoutId
from kvcached.config import FileAccess
from kvcached.contract.locations import TierId
from kvcached.contract.record import ChunkMeta
from kvcached.tiers.base import Slot, Tier
from kvcached.contract.lmdbgate import TxnGate
from kvcached.contract.record import (
    FORMAT_VERSION,
    HEADER_SIZE,
    RecordBuffer,
    copy_verified,
    decode_header,
    verified_payload,
)

log = logging.getLogger(__name__)

_SCAN_BATCH = 4096
T = TypeVar("T")
#: How far a full map may grow, as a multiple of the map the tier opened with.
MAP_GROWTH_LIMIT = 4


@dataclass
class BatchResult:
    """What :meth:`NvmeTier.write_batch` did, for :meth:`NvmeTier.settle` to account."""

    written: list[tuple[ChunkHash, int, int]] = field(default_factory=list)  # (hash, new size, replaced size)
    deleted: list[tuple[ChunkHash, int]] = field(default_factory=list)  # (hash, size freed)
    error: "TierFull | None" = None  # the whole transaction was rolled back


class NvmeTier(Tier):
    tier_id = TierId.NVME

    def __init__(self, path: str, capacity_bytes: int, *, map_size: int | None = None,
                 max_map_size: int | None = None, access: FileAccess = FileAccess()) -> None:
        os.makedirs(path, mode=0o700, exist_ok=True)
        access.open_parent(os.path.dirname(os.path.abspath(path)))
        access.apply(path, access.dir_mode)
        self.path = path
        self._capacity = capacity_bytes
        self.map_size = map_size or max(2 * capacity_bytes, 1 << 30)
        self.max_map_size = max(max_map_size or MAP_GROWTH_LIMIT * self.map_size, self.map_size)
        self.map_grows = 0  # times a full map was grown
        self._gate = TxnGate()
        self._env = lmdb.open(
            path,
            map_size=self.map_size,
            subdir=True,
            max_dbs=4,
            sync=True,
            metasync=False,
            writemap=False,
            map_async=False,
            readahead=False,
            lock=True,
            max_readers=256,
        )
        # Clients read the tier directly (kvcached_client.nvme): data read-only, lock file
        # read-write (LMDB's reader table lives there).
        access.apply(os.path.join(path, "data.mdb"), access.read_mode)
        access.apply(os.path.join(path, "lock.mdb"), access.shared_mode)
        self.stale_readers_cleared = self._env.reader_check()
        if self.stale_readers_cleared:
            log.warning("cleared %d stale LMDB reader slots in %s", self.stale_readers_cleared, path)
        self._chunks = self._env.open_db(b"chunks")
        self._layouts = self._env.open_db(b"layouts")
        self._used = 0  # committed value bytes; set by scan()
        self._reserved: dict[int, int] = {}
        self._staged: dict[int, memoryview | bytes] = {}
        self._next_slot = 0
        self._count = 0
        self.admitting = True
        self.dropped_corrupt = 0
        #: Chunks stored in an older record format (found by scan); rewritten in the current one
        #: when they are demoted again (kvcached.writeback), read as they are until then.
        self.legacy: set[ChunkHash] = set()
        self._closed = False

    # -- Tier -----------------------------------------------------------------------

    def reserve(self, nbytes: int) -> Slot:
        need = nbytes + HEADER_SIZE
        if not self.can_admit(nbytes):
            raise TierFull(
                f"NVMe tier is full ({self.used_bytes} of {self._capacity} bytes used"
                f"{', not admitting after a full map/disk' if not self.admitting else ''})"
            )
        self._next_slot += 1
        self._reserved[self._next_slot] = need
        return Slot(TierId.NVME, self._next_slot, 0, nbytes)

    def reserve_unchecked(self, nbytes: int) -> Slot:
        """Count ``nbytes`` (headers included) as reserved without checking capacity: for a
        write-back batch whose room the caller made by choosing victims that its own
        transaction deletes (their bytes are still counted until :meth:`settle`)."""
        self._next_slot += 1
        self._reserved[self._next_slot] = nbytes
        return Slot(TierId.NVME, self._next_slot, 0, nbytes)

    def can_admit(self, nbytes: int) -> bool:
        return self.admitting and self.used_bytes + nbytes + HEADER_SIZE <= self._capacity

    def write(self, slot: Slot, data: bytes | memoryview) -> None:
        """Stage ``data`` for commit. Not copied: it must stay valid until commit/abort."""
        if slot.slot_id not in self._reserved:
            raise InternalInvariantError(f"NVMe slot {slot.slot_id} is not reserved")
        mv = memoryview(data).cast("B")
        if mv.nbytes != slot.nbytes:
            raise InvalidKV(f"chunk data is {mv.nbytes} bytes, the slot holds exactly {slot.nbytes}")
        self._staged[slot.slot_id] = mv

    def commit(self, slot: Slot, meta: ChunkMeta) -> None:
        """Write header + payload in one transaction.

        On a full map or disk: raises :class:`TierFull`, sets ``admitting``
        to False (the store evicts and calls :meth:`resume_admission`), and
        leaves the slot reserved for the caller to abort.
        """
        data = self._staged.get(slot.slot_id)
        if data is None:
            raise InternalInvariantError(f"NVMe slot {slot.slot_id} was committed without a write")
        value = RecordBuffer().record(meta, data)

        def put(txn: lmdb.Transaction) -> None:
            if not txn.put(meta.chunk_hash, value, overwrite=False):
                raise InternalInvariantError(f"NVMe already holds chunk {meta.chunk_hash.hex()}")

        try:
            self._write_txn(put)
        except lmdb.MapFullError as e:
            self.admitting = False
            raise TierFull(f"LMDB map of {self.map_size} bytes is full in {self.path}") from e
        except lmdb.Error as e:
            # A full disk shows up as ENOSPC, or as EIO when LMDB's page flush makes a short
            # write (mdb_page_flush). Either way the transaction was aborted and the file is
            # intact: stop admitting, and let the store evict and serve on.
            self.admitting = False
            what = "disk full" if _is_enospc(e) else f"write failed ({e}; disk full or failing)"
            raise TierFull(f"{what} under {self.path}") from e
        del self._staged[slot.slot_id]
        del self._reserved[slot.slot_id]
        self._used += len(value)
        self._count += 1

    def abort(self, slot: Slot) -> None:
        self._staged.pop(slot.slot_id, None)
        self._reserved.pop(slot.slot_id, None)

    # -- batches (background write-back) -------------------------------------------------

    def write_batch(self, puts: Sequence[tuple[ChunkMeta, memoryview | bytes]],
                    deletes: Sequence[ChunkHash] = ()) -> BatchResult:
        """Write ``puts`` (replacing any record of the same hash: a legacy-format rewrite) and
        delete ``deletes`` in ONE write transaction, so one sync for the whole batch.

        Thread contract: unlike every other method this may run *outside* the store lock, on
        the write-back thread, while the store serves reads and runs its own transactions (LMDB
        lets one write transaction run at a time and readers never block). It therefore
        touches no accounting: the caller reserved the space first (:meth:`reserve`) and calls
        :meth:`settle` with the result, under the lock. The payload views must stay valid and
        unchanged until this returns (the write-back thread pins their chunks).
        """
        out = BatchResult()
        scratch = RecordBuffer()  # the records are assembled with the GIL released: readers run meanwhile

        def batch(txn: lmdb.Transaction) -> None:
            nonlocal out
            out = BatchResult()  # afresh on a retry after the map grew
            for h in deletes:
                old = txn.get(h)
                if old is not None:
                    size = len(old)
                    txn.delete(h)
                    out.deleted.append((h, size))
            for meta, data in puts:
                old = txn.get(meta.chunk_hash)
                replaced = len(old) if old is not None else 0
                value = scratch.record(meta, data)
                txn.put(meta.chunk_hash, value)
                out.written.append((meta.chunk_hash, len(value), replaced))

        try:
            self._write_txn(batch)
        except lmdb.MapFullError as e:
            full = TierFull(f"LMDB map of {self.map_size} bytes is full in {self.path}")
            full.__cause__ = e
            out = BatchResult(error=full)
        except lmdb.Error as e:
            what = "disk full" if _is_enospc(e) else f"write failed ({e}; disk full or failing)"
            failed = TierFull(f"{what} under {self.path}")
            failed.__cause__ = e
            out = BatchResult(error=failed)
        return out

    def settle(self, result: BatchResult, slots: Sequence[Slot]) -> None:
        """Account a finished :meth:`write_batch` and return its reservations. Under the store lock."""
        for slot in slots:
            self._reserved.pop(slot.slot_id, None)
            self._staged.pop(slot.slot_id, None)
        if result.error is not None:
            self.admitting = False
            return
        for h, size in result.deleted:
            self._used -= size
            self._count -= 1
            self.legacy.discard(h)
        for h, size, replaced in result.written:
            self._used += size - replaced
            if not replaced:
                self._count += 1
            self.legacy.discard(h)

    def read(self, h: ChunkHash) -> memoryview:
        """A checked copy of the payload (the LMDB buffer dies with the transaction)."""
        out: bytes | None = None
        err: CorruptChunk | None = None
        with self._gate.txn(), self._env.begin(db=self._chunks, buffers=True) as txn:
            value = txn.get(h)
            if value is not None:
                try:
                    out = bytes(verified_payload(value, h))
                except CorruptChunk as e:
                    err = e
                else:
                    err = None
        if value is None:
            raise ChunkNotCached(f"chunk {h.hex()} is not on NVMe")
        if err is not None:
            self._drop_corrupt(h, str(err))
            raise err
        return memoryview(out)  # type: ignore[arg-type]

    def read_into(self, h: ChunkHash, dest: memoryview) -> None:
        """Check and copy the payload straight into ``dest`` (e.g. a pool block): one copy."""
        err: CorruptChunk | None = None
        with self._gate.txn(), self._env.begin(db=self._chunks, buffers=True) as txn:
            value = txn.get(h)
            if value is None:
                raise ChunkNotCached(f"chunk {h.hex()} is not on NVMe")
            try:
                copy_verified(value, h, dest)
            except CorruptChunk as e:
                err = e
        if err is not None:
            self._drop_corrupt(h, str(err))
            raise err

    def delete(self, h: ChunkHash) -> bool:
        size = self._delete_raw(h)
        if size is None:
            return False
        self._used -= size
        self._count -= 1
        self.legacy.discard(h)
        return True

    def _delete_raw(self, h: ChunkHash) -> int | None:
        """Delete without touching the accounting; returns the value size or None.

        A delete writes pages too (copy-on-write), so on a completely full
        map it can fail; it then gets a little headroom (see :meth:`_write_txn`).
        """

        def delete(txn: lmdb.Transaction) -> int | None:
            with txn.cursor() as cur:
                if not cur.set_key(h):
                    return None
                size = len(cur.value())
                cur.delete()
            return size

        return self._write_txn(delete, headroom=True)

    def _write_txn(self, fn: "Callable[[lmdb.Transaction], T]", *, db: "lmdb._Database | None" = None,
                   headroom: bool = False) -> T:
        """``fn(txn)`` in one write transaction (on ``chunks``, or ``db``); returns its result.

        On a full map, a chunk write grows the map by a quarter (up to ``max_map_size``) and runs
        ``fn`` again in a new transaction, raising ``MapFullError`` at the cap. A bookkeeping
        write (``headroom``: a delete, a layout record) grows it once by a little, past the cap
        if need be (otherwise a full map could never be emptied), and runs ``fn`` once more.
        """
        grown = False
        while True:
            seen = self.map_size
            try:
                with self._gate.txn(), self._env.begin(write=True, db=db or self._chunks, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                # The failed transaction is closed here, so this thread holds no gate.
                if headroom:
                    if grown:
                        raise
                    grown = True
                    self._grow_map(seen, seen + max(1 << 18, seen // 16), "for a delete or a layout record")
                elif seen >= self.max_map_size:
                    raise
                else:
                    self._grow_map(seen, min(self.max_map_size, seen + max(1 << 20, seen // 4)), "")

    def _grow_map(self, seen: int, new: int, why: str) -> None:
        """Set the map to ``new`` bytes (address space; the file stays sparse) unless another
        thread grew it since this one saw ``seen``. Waits for every open transaction to end."""
        with self._gate.resize():
            if self.map_size != seen:
                return  # grown meanwhile by another thread: just retry
            self._env.set_mapsize(new)
            self.map_size = new
            self.map_grows += 1
        log.warning("LMDB map of %s was full%s; grew it to %d bytes (limit %d)", self.path,
                    f" {why}" if why else "", new, self.max_map_size,
                    extra={"event": "lmdb_map_grown", "tier": "nvme"})

    def __contains__(self, h: ChunkHash) -> bool:
        with self._gate.txn(), self._env.begin(db=self._chunks, buffers=True) as txn:
            return txn.get(h) is not None

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used + sum(self._reserved.values())

    @property
    def chunk_count(self) -> int:
        return self._count

    def entry_count(self) -> int:
        """Entries as LMDB counts them (cheap; used for the rebuild progress total)."""
        with self._gate.txn(), self._env.begin() as txn:
            return int(txn.stat(self._chunks)["entries"])

    def resume_admission(self) -> None:
        self.admitting = True

    def scan(self) -> Iterator[ChunkMeta]:
        """Every chunk's header, in key order, in short batched read transactions.

        Values whose header is corrupt are deleted and counted in
        ``dropped_corrupt``. Recomputes ``used_bytes`` from what it finds.
        """
        self._used = 0
        self._count = 0
        last: bytes | None = None
        while True:
            batch: list[tuple[ChunkMeta, int]] = []
            bad: list[tuple[bytes, str]] = []
            with self._gate.txn(), self._env.begin(db=self._chunks, buffers=True) as txn, txn.cursor() as cur:
                ok = cur.set_range(last) if last is not None else cur.first()
                if ok and last is not None and bytes(cur.key()) == last:
                    ok = cur.next()
                while ok and len(batch) + len(bad) < _SCAN_BATCH:
                    key, value = bytes(cur.key()), cur.value()
                    try:
                        header = decode_header(value, key)
                        batch.append((header.meta, len(value)))
                        if header.version != FORMAT_VERSION:
                            self.legacy.add(ChunkHash(key))
                    except CorruptChunk as e:
                        bad.append((key, str(e)))
                    last = key
                    ok = cur.next()
            for key, why in bad:
                self._drop_corrupt(ChunkHash(key), why, counted=False)
            for meta, size in batch:
                self._used += size
                self._count += 1
                yield meta
            if not ok:
                return

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with self._gate.resize():  # after any transaction still open on another thread
                self._env.close()

    # -- layouts ------------------------------------------------------------------------

    def save_layout(self, layout: KVLayout) -> None:
        record = json.dumps(layout.to_dict(), sort_keys=True).encode()
        self._write_txn(lambda txn: txn.put(layout.layout_id.encode(), record), db=self._layouts, headroom=True)

    def load_layouts(self) -> dict[LayoutId, KVLayout]:
        out: dict[LayoutId, KVLayout] = {}
        with self._gate.txn(), self._env.begin(db=self._layouts) as txn:
            for key, value in txn.cursor():
                try:
                    layout = KVLayout.from_dict(json.loads(value))
                except Exception as e:  # a layout we cannot parse orphans its chunks; say so
                    log.error("ignoring unreadable layout record %r: %s", key, e)
                    continue
                if layout.layout_id != key.decode():
                    log.error("ignoring layout record %r whose contents hash to %s", key, layout.layout_id)
                    continue
                out[layout.layout_id] = layout
        return out

    # -- stats ---------------------------------------------------------------------------

    def file_bytes(self) -> int:
        with self._gate.txn():
            info = self._env.info()
            return (info["last_pgno"] + 1) * self._env.stat()["psize"]

    def clear_stale_readers(self) -> int:
        """Free reader slots left by dead processes (LMDB's reader_check); returns how many."""
        return self._env.reader_check()

    def readers(self) -> int:
        return self._env.info()["num_readers"]

    def _drop_corrupt(self, h: ChunkHash, why: str, *, counted: bool = True) -> None:
        log.error("dropping corrupt NVMe chunk %s from %s: %s", h.hex(), self.path, why)
        self.dropped_corrupt += 1
        try:
            if counted:
                self.delete(h)
            else:
                self._delete_raw(h)
        except lmdb.Error as e:  # pragma: no cover - disk trouble on top of corruption
            log.error("could not delete corrupt chunk %s: %s", h.hex(), e)


def _is_enospc(e: lmdb.Error) -> bool:
    return getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)
