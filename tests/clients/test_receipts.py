"""PutReceipt from the daemon's Commit reply, and the warning when write-through falls short:
logged once when puts start falling short and once when they recover, not once per put."""

from __future__ import annotations

import logging

from kvcached.v1 import kvcached_pb2 as pb
from kvcached_client.receipts import PutReceipt, _ShortfallLog, put_receipt


def _reply(durable: int, write_through: bool = True) -> pb.CommitResponse:
    return pb.CommitResponse(committed_chunks=2, cached_tokens=32, durable_tokens=durable, write_through=write_through)


def test_receipt_carries_the_reply():
    r = put_receipt(_reply(16), in_flight_tokens=16)
    assert r == PutReceipt(2, 32, 16, 16, True) and not r.durable
    assert put_receipt(_reply(32)).durable


def test_shortfall_is_logged_once_per_change(caplog):
    log = _ShortfallLog()
    caplog.set_level(logging.INFO, logger="kvcached_client")
    for durable in (32, 16, 0, 16, 32, 32, 16):
        log.note(PutReceipt(2, 32, durable, 0, True))
    log.note(PutReceipt(2, 32, 0, 0, False))  # write-back: not durable yet is normal, never logged
    got = [(rec.levelname, rec.message.startswith("write-through puts are durable again")) for rec in caplog.records]
    assert got == [("WARNING", False), ("INFO", True), ("WARNING", False)]
