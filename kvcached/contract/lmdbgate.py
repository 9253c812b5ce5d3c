"""A gate that lets one thread resize an LMDB map while other threads use the environment.

LMDB's ``mdb_env_set_mapsize`` may only run while *no* transaction of this
process is open on the environment: it refuses when a write transaction is
open (``Cannot set_mapsize while a write transaction is active``) and does not
check read transactions at all: it unmaps the old mapping under them, and a
reader holding a ``buffers=True`` view then touches unmapped memory and the
process dies with SIGSEGV (measured; the tier's tests keep that as a positive
control, in a child process).

So every transaction in the process enters the gate *shared* and a resize
enters it *exclusive*: the resize waits for the open transactions to end and
new ones wait for the resize (writer preference, so a stream of reads cannot
starve a growth). Transactions here are short (one value, or one write-back
batch), so the wait is too.

Not re-entrant: a thread must never ask for the exclusive side while it holds
the shared side (it would wait for itself). Callers therefore resize only
after their failed transaction has been closed.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class TxnGate:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._open = 0  # transactions inside the gate
        self._resizing = False

    @contextmanager
    def txn(self) -> Iterator[None]:
        """Hold around one LMDB transaction (read or write)."""
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._open += 1
        try:
            yield
        finally:
            with self._cond:
                self._open -= 1
                if not self._open:
                    self._cond.notify_all()

    @contextmanager
    def resize(self) -> Iterator[None]:
        """Hold around ``set_mapsize``: no transaction of this process is open meanwhile."""
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._open:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()
