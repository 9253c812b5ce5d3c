"""Where the daemon's socket is: the one rule the daemon, ``kvcachectl``, the clients, the vLLM
connector, the SGLang backend and the router share (a setting or flag overrides it)."""

from __future__ import annotations

import os


#: The socket of the daemon run as a system service (the unit's RuntimeDirectory=kvcached).
SYSTEM_SOCKET = "/run/kvcached/kvcached.sock"


def default_socket() -> str:
    """The one rule the daemon, ``kvcachectl``, the clients, the vLLM connector and the router
    share: ``$KVCACHED_SOCKET``; else ``kvcached.sock`` under ``$RUNTIME_DIRECTORY`` (what
    systemd gives the service); else the system service's socket, :data:`SYSTEM_SOCKET`, when
    it exists (a host that runs the service: every process finds it without a setting); else
    under ``$XDG_RUNTIME_DIR``; else under ``/tmp/kvcached-$UID`` (``./scripts/serve``)."""
    if os.environ.get("KVCACHED_SOCKET"):
        return os.environ["KVCACHED_SOCKET"]
    if os.environ.get("RUNTIME_DIRECTORY"):
        return os.path.join(os.environ["RUNTIME_DIRECTORY"].split(":")[0], "kvcached.sock")
    if os.path.exists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"].split(":")[0], "kvcached.sock")
    return os.path.join("/tmp", f"kvcached-{os.getuid()}", "kvcached.sock")
