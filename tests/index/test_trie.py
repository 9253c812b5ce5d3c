from __future__ import annotations

import pytest

from kvcached.contract.errors import InternalInvariantError, RefcountUnderflow
from kvcached.index import PrefixIndex
from kvcached.contract.keys import ChunkHash, LayoutId
from kvcached.contract.locations import TierId

L = LayoutId("layout")
P, N = TierId.POOL, TierId.NVME


def h(name: str) -> ChunkHash:
    return ChunkHash(name.encode().ljust(16, b"."))


def build(index: PrefixIndex, spec: dict[str, str | None], tiers=P, t0: float = 0.0):
    """spec: child -> parent (None for a first chunk), inserted in order with increasing time."""
    nodes = {}
    for i, (name, parent) in enumerate(spec.items()):
        off = (i + 1) * 4096 if tiers & P else -1
        nodes[name] = index.insert(h(name), nodes[parent] if parent else None, L, tiers, t0 + i, off)
    return nodes


def order(queue) -> list[str]:
    out = []
    while (n := queue.pop()) is not None:
        out.append(n.hash.rstrip(b".").decode())
    return out


def test_match_is_longest_prefix():
    ix = PrefixIndex()
    build(ix, {"a": None, "b": "a", "c": "b", "x": "a"})
    assert [n.hash for n in ix.match([h("a"), h("b"), h("c"), h("d")])] == [h("a"), h("b"), h("c")]
    assert [n.hash for n in ix.match([h("a"), h("zz"), h("c")])] == [h("a")]  # stops at the first miss
    assert ix.match([h("q")]) == []
    assert len(ix) == 4


def test_child_counts_and_depth():
    ix = PrefixIndex()
    n = build(ix, {"a": None, "b": "a", "c": "b", "x": "a"})
    assert (n["a"].children, n["b"].children, n["c"].children) == (2, 1, 0)
    assert (n["a"].depth, n["c"].depth, n["x"].depth) == (0, 2, 1)
    ix.check_invariants()


def test_leaves_queue_is_exact_lru_of_leaves():
    ix = PrefixIndex()
    build(ix, {"a": None, "b": "a", "c": "b", "x": "a", "y": None})
    # leaves: c(t=2) x(t=3) y(t=4); inner nodes a, b never appear while they have children
    assert order(ix.leaves) == ["c", "x", "y"]


def test_parent_joins_queue_by_its_own_last_use_not_at_the_young_end():
    ix = PrefixIndex()
    n = build(ix, {"a": None, "b": "a", "y": None, "z": None})  # a=0 b=1 y=2 z=3
    ix.touch([n["z"]], 10.0)
    ix.remove(n["b"])  # a becomes a leaf with last_use 0: older than y and z
    assert order(ix.leaves) == ["a", "y", "z"]


def test_touch_reorders():
    ix = PrefixIndex()
    n = build(ix, {"a": None, "b": None, "c": None})
    ix.touch([n["a"]], 100.0)
    assert order(ix.leaves) == ["b", "c", "a"]


def test_pinned_nodes_are_not_evictable_and_release_counts_as_use():
    ix = PrefixIndex()
    n = build(ix, {"a": None, "b": None, "c": None})
    ix.pin([n["a"]], 5.0)
    ix.pin([n["a"]], 5.0)
    assert n["a"] not in ix.leaves and n["a"] not in ix.pool_lru
    ix.unpin([n["a"]], 6.0)
    assert n["a"] not in ix.leaves  # still one pin
    ix.unpin([n["a"]], 7.0)
    assert n["a"].refcount == 0 and n["a"].last_use == 7.0
    assert order(ix.leaves) == ["b", "c", "a"]


def test_refcount_underflow_raises_and_changes_nothing():
    ix = PrefixIndex()
    n = build(ix, {"a": None, "b": None})
    ix.pin([n["a"]], 1.0)
    with pytest.raises(RefcountUnderflow):
        ix.unpin([n["a"], n["b"]], 2.0)  # b was never pinned
    assert n["a"].refcount == 1 and n["b"].refcount == 0
    ix.check_invariants()


def test_remove_only_unpinned_leaves():
    ix = PrefixIndex()
    n = build(ix, {"a": None, "b": "a"})
    with pytest.raises(InternalInvariantError):
        ix.remove(n["a"])  # has a child
    ix.pin([n["b"]], 1.0)
    with pytest.raises(InternalInvariantError):
        ix.remove(n["b"])  # pinned
    ix.unpin([n["b"]], 2.0)
    ix.remove(n["b"])
    ix.remove(n["a"])
    assert len(ix) == 0
    ix.check_invariants()


def test_insert_requires_indexed_parent_and_new_hash():
    ix = PrefixIndex()
    n = build(ix, {"a": None})
    with pytest.raises(InternalInvariantError):
        ix.insert(h("a"), None, L, P, 1.0, 0)
    ix.remove(n["a"])
    with pytest.raises(InternalInvariantError):
        ix.insert(h("b"), n["a"], L, P, 1.0, 0)


def test_pool_queue_is_leaf_first_within_the_pool():
    ix = PrefixIndex()
    n = build(ix, {"a": None, "b": "a", "c": "b"})  # all in the pool
    assert [x.hash for x in [ix.pool_lru.peek()]] == [h("c")]
    ix.add_tier(n["c"], N)
    ix.drop_tier(n["c"], P)  # c demoted: b now has no pool child
    assert n["b"] in ix.pool_lru and n["c"] not in ix.pool_lru
    assert n["c"] in ix.nvme_leaves and n["c"] in ix.leaves
    assert order(ix.pool_lru) == ["b"]


def test_nvme_leaves_tracks_nvme_copies_of_leaves():
    ix = PrefixIndex()
    n = build(ix, {"a": None, "b": "a"}, tiers=N)
    assert n["b"] in ix.nvme_leaves and n["a"] not in ix.nvme_leaves
    ix.add_tier(n["b"], P, 8192)
    ix.check_invariants()
    ix.drop_tier(n["b"], N)
    assert n["b"] not in ix.nvme_leaves and n["b"] in ix.leaves
    ix.check_invariants()


def test_detach_subtree_removes_descendants_and_keeps_pins_balanced():
    ix = PrefixIndex()
    n = build(ix, {"a": None, "b": "a", "c": "b", "d": "b", "x": "a"})
    ix.pin([n["c"]], 1.0)
    removed = ix.detach_subtree(n["b"])
    assert {r.hash for r in removed} == {h("b"), h("c"), h("d")}
    assert removed[-1] is n["b"]  # deepest first
    assert len(ix) == 2 and n["a"].children == 1
    ix.check_invariants()
    ix.unpin([n["c"]], 2.0)  # the pin taken before the detach still balances
    assert PrefixIndex.is_detached(n["c"]) and n["c"] not in ix.leaves
    ix.check_invariants()


def test_eviction_queue_compacts_stale_entries():
    ix = PrefixIndex()
    n = build(ix, {"a": None})
    for t in range(5000):
        ix.touch([n["a"]], 10.0 + t)
    assert len(ix.leaves._heap) < 2 * len(ix.leaves) + 1100
    assert ix.leaves.peek() is n["a"]


def test_insert_chain_equals_repeated_insert():
    a, b = PrefixIndex(), PrefixIndex()
    root_a = a.insert(h("r"), None, L, P, 0.0, 0)
    root_b = b.insert(h("r"), None, L, P, 0.0, 0)
    chain = [h(f"c{i}") for i in range(5)]
    offsets = [(i + 1) * 4096 for i in range(5)]
    prev = root_a
    for x, off in zip(chain, offsets):
        prev = a.insert(x, prev, L, P, 1.0, off)
    nodes = b.insert_chain(chain, root_b, L, P, 1.0, offsets)
    a.check_invariants()
    b.check_invariants()
    def shape(ix):
        return sorted((n.hash, n.depth, n.children, n.pool_children, n.pool_offset, n in ix.leaves) for n in ix.nodes())

    assert shape(a) == shape(b)
    assert [n.depth for n in nodes] == [1, 2, 3, 4, 5]
    assert len(b.leaves._heap) < len(a.leaves._heap)  # no stale entries for the inner nodes
    with pytest.raises(InternalInvariantError):
        b.insert_chain([h("c0")], root_b, L, P, 2.0, [0])


def test_a_node_knows_its_pool_offset_exactly_while_it_has_a_pool_copy():
    ix = PrefixIndex()
    n = build(ix, {"a": None, "b": "a"}, tiers=N)
    assert n["b"].pool_offset == -1
    ix.add_tier(n["b"], P, 8192)
    assert n["b"].pool_offset == 8192
    ix.check_invariants()
    ix.drop_tier(n["b"], P)
    assert n["b"].pool_offset == -1
    ix.add_tier(n["b"], P, 4096)
    ix.remove(n["b"])
    assert n["b"].pool_offset == -1
    ix.check_invariants()


@pytest.mark.parametrize("call", [
    lambda ix, a: ix.insert(h("x"), a, L, P, 1.0),               # pool tier without an offset
    lambda ix, a: ix.insert(h("x"), a, L, N, 1.0, 4096),         # an offset without the pool tier
    lambda ix, a: ix.insert_chain([h("x"), h("y")], a, L, P, 1.0, [4096]),
    lambda ix, a: ix.insert_chain([h("x")], a, L, P, 1.0, [-1]),
    lambda ix, a: ix.add_tier(a, P),
    lambda ix, a: ix.add_tier(a, P, -1),
])
def test_pool_offsets_that_do_not_match_the_tier_are_refused(call):
    ix = PrefixIndex()
    a = build(ix, {"a": None}, tiers=N)["a"]
    with pytest.raises(InternalInvariantError):
        call(ix, a)
    assert len(ix) == 1 and a.pool_offset == -1
    ix.check_invariants()
