"""Progress of long start-up work: a bar on a terminal, timed log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("kvcached")


class Progress:
    def __init__(self, total: int, what: str, *, stream: TextIO | None = None, every_s: float = 5.0) -> None:
        self.total = total
        self.what = what
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._every = every_s
        self._t0 = self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self._tty and (now - self._last >= 0.1 or self.done == self.total):
            frac = self.done / self.total if self.total else 1.0
            bar = "#" * int(30 * frac)
            self._stream.write(f"\r{self.what}: [{bar:<30}] {self.done}/{self.total}")
            self._stream.flush()
            self._last = now
        elif not self._tty and now - self._last >= self._every:
            log.info("%s: %d/%d after %.1f s", self.what, self.done, self.total, now - self._t0)
            self._last = now

    def finish(self, summary: str) -> float:
        elapsed = time.monotonic() - self._t0
        if self._tty and self.total:
            self._stream.write("\n")
        log.info("%s: %s in %.2f s", self.what, summary, elapsed)
        return elapsed
