from __future__ import annotations

from kvcached.leases import SessionId, TimedTable

S1, S2 = SessionId("s1"), SessionId("s2")


def test_add_remove_is_idempotent_and_remembers_why():
    t: TimedTable[str] = TimedTable("lease")
    e = t.add(S1, "payload", ttl=10, now=0)
    assert e.id.startswith("lease-") and t.get(e.id) is e and len(t) == 1
    assert t.remove(e.id, "released") is e
    assert t.remove(e.id, "released") is None
    assert t.closed_reason(e.id) == "released"
    assert t.closed_reason("lease-never") is None
    assert len(t) == 0 and t.sessions() == 0


def test_ids_are_unique_and_unguessable():
    t: TimedTable[int] = TimedTable("x")
    ids = {t.add(S1, i, 10, 0).id for i in range(2000)}  # several 512-id random batches
    assert len(ids) == 2000
    assert all(len(i) == len("x-") + 16 and int(i[2:], 16) >= 0 for i in ids)
    other: TimedTable[int] = TimedTable("x")  # each table draws its own randomness
    assert not {other.add(S1, i, 10, 0).id for i in range(600)} & ids


def test_expiry_in_deadline_order_and_renewal_postpones():
    t: TimedTable[str] = TimedTable("lease")
    a = t.add(S1, "a", ttl=10, now=0)
    b = t.add(S1, "b", ttl=5, now=0)
    t.add(S2, "c", ttl=20, now=0)
    t.renew(b.id, ttl=30, now=1)  # b now ends at 31
    assert t.pop_expired(4.9) == []
    assert [e.payload for e in t.pop_expired(10)] == ["a"]
    assert t.next_deadline() == 20
    assert [e.payload for e in t.pop_expired(25)] == ["c"]
    assert [e.payload for e in t.pop_expired(31)] == ["b"]
    assert t.closed_reason(a.id) == "expired" and len(t) == 0
    assert t.renew(a.id, 10, 40) is None


def test_sessions_group_entries():
    t: TimedTable[str] = TimedTable("lease")
    for p in "abc":
        t.add(S1, p, 10, 0)
    d = t.add(S2, "d", 10, 0)
    assert sorted(e.payload for e in t.of_session(S1)) == ["a", "b", "c"]
    assert t.sessions() == 2
    t.remove(d.id, "released")
    assert t.of_session(S2) == [] and t.sessions() == 1


def test_deadline_heap_stays_bounded_without_expire():
    t: TimedTable[int] = TimedTable("lease")
    keep = t.add(S1, -1, ttl=10, now=0)
    for i in range(10_000):
        t.remove(t.add(S1, i, ttl=10, now=0).id, "released")
        t.renew(keep.id, ttl=10, now=i)
    assert len(t._deadlines) <= 2 * len(t) + 1024
    assert t.next_deadline() == 9_999 + 10
