"""The client refuses an unusable pool handle as a mapping failure (a KvcachedError), not a raw
engine error, so an acquire falls back and callers catch one error family."""

from __future__ import annotations

import pytest

from kvcached.v1 import kvcached_pb2 as pb
from kvcached_client import KvcachedError, PoolMappingError
from kvcached_client._core import handle_from_proto


@pytest.mark.parametrize("msg", [
    pb.PoolHandle(kind="tpu", name="kvcached.x.1.a", block_bytes=4096, num_blocks=1, generation="a"),
    pb.PoolHandle(kind="shm", name="../etc/passwd", block_bytes=4096, num_blocks=1, generation="a"),
    pb.PoolHandle(kind="shm", name="kvcached.x.1.a", block_bytes=4096, num_blocks=0, generation="a"),
    pb.PoolHandle(kind="shm", name="kvcached.x.1.a", size_bytes=4100, align_bytes=64, generation="a"),
])
def test_unusable_handle_is_a_pool_mapping_error(msg):
    with pytest.raises(PoolMappingError, match="pool handle is unusable") as e:
        handle_from_proto(msg)
    assert isinstance(e.value, KvcachedError)


def test_a_usable_handle_decodes():
    h = handle_from_proto(pb.PoolHandle(kind="shm", name="kvcached.x.1.a", size_bytes=8 << 20, align_bytes=64,
                                        generation="a"))
    assert (h.kind, h.name, h.size_bytes, h.align_bytes, h.nbytes) == ("shm", "kvcached.x.1.a", 8 << 20, 64, 8 << 20)


def test_a_handle_from_an_older_daemon_still_decodes():
    """Before the packed pool a handle said block_bytes x num_blocks; the slab is the same."""
    h = handle_from_proto(pb.PoolHandle(kind="shm", name="kvcached.x.1.a", block_bytes=4096, num_blocks=8,
                                        generation="a"))
    assert (h.size_bytes, h.align_bytes) == (8 * 4096, 4096)
