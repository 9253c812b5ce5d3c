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
])
def test_unusable_handle_is_a_pool_mapping_error(msg):
    with pytest.raises(PoolMappingError, match="pool handle is unusable") as e:
        handle_from_proto(msg)
    assert isinstance(e.value, KvcachedError)


def test_a_usable_handle_decodes():
    h = handle_from_proto(pb.PoolHandle(kind="shm", name="kvcached.x.1.a", block_bytes=4096, num_blocks=8,
                                        generation="a"))
    assert (h.kind, h.name, h.block_bytes, h.num_blocks) == ("shm", "kvcached.x.1.a", 4096, 8)
