"""Faults the vLLM tests cannot cause from outside: a connector that SIGKILLs the daemon at the
worst moment, after the lookup promised a hit and before the lease is taken; one whose copies
are reported late, as a GPU's are while they run on a side stream."""

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


#: while this file exists, the worker holds back its reports of completed copies (as a slow GPU
#: copy would: the load is still "in flight" for the scheduler)
HOLD_FILE_ENV = "KVCACHED_TEST_HOLD_FILE"


class HoldCopyReports(KvcachedConnector):
    """The worker's copies are done at once (a CPU engine), but their completion is reported
    only once the test removes the hold file: the window in which a GPU copy is still running."""

    def get_finished(self, finished_req_ids):  # noqa: ANN001
        if os.path.exists(os.environ.get(HOLD_FILE_ENV, "")):
            return None, None
        return super().get_finished(finished_req_ids)

    def build_connector_worker_meta(self):  # noqa: ANN201
        if os.path.exists(os.environ.get(HOLD_FILE_ENV, "")):
            return None
        return super().build_connector_worker_meta()
