"""Build, bind and stop the gRPC server (grpc.aio; the daemon runs it on uvloop).

Listens on a Unix socket (mode ``socket_mode``, default 0660, owner/group
from settings) and, optionally, on TCP: TLS there unless the address is
loopback or ``allow_insecure_tcp`` is set (checked in
:class:`kvcached.settings.DaemonSettings`). Registers the standard health
service (``grpc.health.v1``, so ``grpc_health_probe`` works) and server
reflection (so ``grpcurl`` works without the .proto).

Shutdown order (after grpc's own graceful-shutdown example): health goes
NOT_SERVING first, then the server stops accepting and gives in-flight calls
a grace period, then the worker threads are joined.
"""

from __future__ import annotations

import logging
import os
import pwd
import socket
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvcached.service.decoding import add_servicer
from kvcached.service.servicer import KVCacheServicer
from kvcached.settings import DaemonSettings, SettingsError
from kvcached.store import Store
from kvcached.v1 import kvcached_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCache"].full_name  # "kvcached.v1.KVCache"


@dataclass
class RunningServer:
    server: grpc.aio.Server
    servicer: KVCacheServicer
    health: HealthServicer
    socket_path: str
    tcp_port: int | None

    async def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls, end the Session streams (they would hold the drain for all of
        ``grace``), let the other in-flight calls finish within ``grace``, close."""
        await self.health.enter_graceful_shutdown()
        await self.servicer.end_sessions()
        await self.server.stop(grace)
        self.servicer.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass


async def start_server(settings: DaemonSettings, store: Store, interceptors: Sequence[Any] = (),
                       observe_call: Callable[[str, float], None] | None = None) -> RunningServer:
    """``observe_call(method, seconds)``: times the calls answered on Session streams, which no
    interceptor sees (the daemon passes the RPC latency histogram's)."""
    opts = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Notice dead peers on TCP; on a Unix socket the kernel tells us at once.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    server = grpc.aio.server(options=opts, interceptors=list(interceptors) or None)
    listen = f"unix:{settings.socket}" + (f" + tcp:{settings.tcp_listen}" if settings.tcp_listen else "")
    servicer = KVCacheServicer(store, workers=settings.worker_threads, call_timeout=settings.call_timeout,
                               listen=listen, bypass_generation_tokens=settings.bypass_generation_tokens,
                               max_sessions=settings.max_sessions, max_message_bytes=settings.max_message_bytes)
    servicer.observe_call = observe_call
    add_servicer(servicer, server)  # undecodable requests -> INVALID_ARGUMENT, not UNKNOWN
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    _bind_unix(server, settings)
    tcp_port = None
    if settings.tcp_listen:
        settings.check_tcp()
        if settings.tls_cert:
            with open(settings.tls_key, "rb") as k, open(settings.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            tcp_port = server.add_secure_port(settings.tcp_listen, creds)
        else:
            tcp_port = server.add_insecure_port(settings.tcp_listen)
        if not tcp_port:
            raise SettingsError(f"could not listen on tcp {settings.tcp_listen}")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, servicer, health, settings.socket, tcp_port)


def _bind_unix(server: grpc.aio.Server, settings: DaemonSettings) -> None:
    path = settings.socket
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    if os.path.exists(path):
        if _socket_alive(path):
            raise SettingsError(f"{path} is already served by another process")
        os.unlink(path)  # left behind by a daemon that died
    # Bind with a umask that already yields the final mode: no window where the socket is wider.
    old = os.umask(0o777 & ~settings.socket_mode)
    try:
        if not server.add_insecure_port(f"unix:{path}"):
            raise SettingsError(f"could not bind unix socket {path}")
    finally:
        os.umask(old)
    os.chmod(path, settings.socket_mode)
    if settings.socket_owner or settings.socket_group:
        uid = pwd.getpwnam(settings.socket_owner).pw_uid if settings.socket_owner else -1
        os.chown(path, uid, settings.socket_gid())


def _socket_alive(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.5)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()
