"""Faults the vLLM tests cannot cause from outside: a connector that SIGKILLs the daemon at the
worst moment, after the lookup promised a hit and before the lease is taken."""

from __future__ import annotations

import os
import signal
import time

from kvcached_client.vllm.connector import KvcachedConnector

#: holds the daemon's pid; the connector kills it once, at the next load it plans, and removes the file
KILL_FILE_ENV = "KVCACHED_TEST_KILL_FILE"


class KillDaemonBeforeAcquire(KvcachedConnector):
    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001
        path = os.environ.get(KILL_FILE_ENV, "")
        if num_external_tokens > 0 and path and os.path.exists(path):
            pid = int(open(path).read())
            os.unlink(path)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # gone: its socket refuses
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.01)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
