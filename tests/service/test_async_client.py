"""AsyncClient is Client over grpc.aio: the same public surface (checked name by name, parameter
by parameter), and each call doing against a real daemon what the sync one does."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from kvcached_client import AsyncClient, Client
from kvcached_client.aio import AsyncCacheRequest, AsyncLease, AsyncLeaseView, AsyncReservation, AsyncReservationView
from kvcached_client.client import CacheRequest, Lease, LeaseView, Reservation, ReservationView
from tests.service.conftest import LAYOUT

CT = LAYOUT.chunk_tokens

PAIRS = [(Client, AsyncClient), (Lease, AsyncLease), (LeaseView, AsyncLeaseView), (Reservation, AsyncReservation),
         (ReservationView, AsyncReservationView), (CacheRequest, AsyncCacheRequest)]
#: Methods that make no call to the daemon: plain functions in both flavours. Every other public
#: method of an async class must be a coroutine function.
LOCAL = {"chunk", "copy_chunk", "kv", "copy_into", "runs", "chunk_views", "ticket", "view", "receipt", "write"}


def public(cls: type) -> dict[str, object]:
    return {n: getattr(cls, n) for n in dir(cls) if not n.startswith("_")}


@pytest.mark.parametrize("sync_cls, async_cls", PAIRS, ids=[a.__name__ for _, a in PAIRS])
def test_the_async_flavour_has_the_same_public_surface(sync_cls, async_cls):
    s, a = public(sync_cls), public(async_cls)
    assert sorted(s) == sorted(a), f"only in {sync_cls.__name__}: {sorted(set(s) - set(a))}; " \
                                   f"only in {async_cls.__name__}: {sorted(set(a) - set(s))}"
    for name, fs in s.items():
        fa = a[name]
        if isinstance(fs, property) or not callable(fs):
            assert isinstance(fa, property) == isinstance(fs, property), name
            continue
        ps = [(p.name, p.kind, p.default) for p in inspect.signature(fs).parameters.values()]
        pa = [(p.name, p.kind, p.default) for p in inspect.signature(fa).parameters.values()]
        assert ps == pa, f"{async_cls.__name__}.{name}{inspect.signature(fa)} != {inspect.signature(fs)}"
        assert inspect.iscoroutinefunction(fa) == (name not in LOCAL), f"{async_cls.__name__}.{name}"
    if sync_cls is Client:
        ps = list(inspect.signature(Client.__init__).parameters)
        assert ps == list(inspect.signature(AsyncClient.__init__).parameters)


def test_every_call_of_the_async_client_against_a_daemon(daemon):
    kv = torch.randn(2, 2, 2, 3 * CT, 8)
    prompt = list(range(3 * CT))

    async def main() -> None:
        async with AsyncClient(daemon.socket) as c, AsyncClient(daemon.socket) as other:
            await c.warm_up()
            assert c.pool_maps == 1 and (await c.pool_handle()).nbytes > 0
            # reserve, write in place, commit
            r = await c.reserve(LAYOUT, prompt[: 2 * CT])
            assert r.opened and [s.position for s in r.slots] == [0, 1]
            for s in r.slots:
                r.view(s).copy_(kv[:, :, :, s.position * CT:(s.position + 1) * CT])
            assert (await r.commit()).stored_chunks == 2 and r.done
            assert not (await c.reserve(LAYOUT, prompt[: 2 * CT], skip_empty=True)).opened
            # one request's two round trips: lease the prefix, reserve the rest, finish
            async with await c.acquire_reserve(LAYOUT, prompt) as req:
                assert isinstance(req, AsyncCacheRequest) and req.matched_tokens == 2 * CT
                assert torch.equal(req.lease.kv(), kv[:, :, :, : 2 * CT])
                assert [s.position for s in req.reservation.slots] == [2]
                req.write(kv)
            assert req.lease.released and req.reservation.done
            assert await c.lookup(LAYOUT, prompt) == 3 * CT
            # tickets: another client reads a lease and fills a reservation this one holds
            lease = await c.acquire(LAYOUT, prompt)
            assert (await c.stats())["leases_active"] == 1  # the count the check below expects at 0 sees one
            view = await other.open_lease(lease.ticket())
            assert torch.equal(view.kv(), kv)
            await view.release()
            await lease.release()
            longer = prompt + list(range(10_000, 10_000 + CT))
            r = await c.reserve(LAYOUT, longer)
            wv = await other.open_reservation(r.ticket())
            wv.view(wv.slots[0]).fill_(7)
            with pytest.raises(Exception, match="cannot commit"):
                await wv.commit()
            assert (await r.commit()).stored_chunks == 1
            async with await c.acquire(LAYOUT, longer) as lease:
                assert bool((lease.chunk(3) == 7).all())
            # an aborted request stores nothing and releases its lease
            req = await c.acquire_reserve(LAYOUT, prompt + list(range(20_000, 20_000 + CT)))
            assert (await c.stats())["reservations_active"] == 1
            receipt = await req.finish(commit=False)
            assert receipt.stored_chunks == 0 and req.lease.released
            await c.sync()
            s = await c.stats(doctor=True)
            assert s["leases_active"] == 0 and s["reservations_active"] == 0 and "doctor" in s
            # the bytes fallback, eviction, flush, drain
            b_prompt = list(range(30_000, 30_000 + CT))
            chunk = kv[:, :, :, :CT].contiguous().numpy().tobytes()
            assert (await c.put_bytes(LAYOUT, b_prompt, [chunk])).stored_chunks == 1
            assert await c.get_bytes(LAYOUT, b_prompt) == [chunk]
            evicted, nbytes = await c.evict(await c.register(LAYOUT), prefix=b_prompt)
            assert evicted == 1 and nbytes == len(chunk) and await c.lookup(LAYOUT, b_prompt) == 0
            assert await c.flush() >= 0
            flushed, active = await c.drain()
            assert flushed >= 0 and active == 0
        async with AsyncClient(daemon.socket, session=False) as c:
            assert await c.session_id() == ""
            assert await c.lookup(LAYOUT, prompt) == 3 * CT

    asyncio.run(main())
