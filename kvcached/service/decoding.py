"""Register the servicer with request parsing that cannot fail inside gRPC.

With the generated ``add_KVCacheServicer_to_server``, bytes that do not parse
as the RPC's request message (truncated, wrong wire types, invalid UTF-8) make
grpc answer ``UNKNOWN "Unexpected DecodeError"``: the wrong status, and a
message nobody can act on. Here each method's deserializer returns an
:class:`Undecodable` marker instead of raising, and a thin guard in front of
the servicer method answers ``INVALID_ARGUMENT`` naming the message type. The
servicer never sees the marker, so it stays pure translation.

The method table is built from the service descriptor, so a new RPC in the
.proto is registered without touching this file.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError, Message

from kvcached.v1 import kvcached_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KVCache"]


class Undecodable:
    """What a request that failed to parse becomes; answered with INVALID_ARGUMENT."""

    __slots__ = ("type_name", "error")

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error

    def describe(self) -> str:
        return (f"cannot parse the request as {self.type_name} ({self.error}); "
                "the client and daemon may disagree on the API version, or the bytes were cut short")


def _parser(cls: type[Message]) -> Callable[[bytes], Any]:
    name = cls.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError) as e:
            return Undecodable(name, str(e) or type(e).__name__)

    return parse


def _guard_unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is Undecodable:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        return await fn(request, context)

    return handler


def _guard_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def checked() -> AsyncIterator[Any]:
            async for msg in request_iterator:
                if type(msg) is Undecodable:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg.describe())
                yield msg

        async for out in fn(checked(), context):
            yield out

    return handler


def add_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register every method of ``kvcached.v1.KVCache`` implemented by ``servicer``."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in SERVICE.methods:
        req = getattr(pb, method.input_type.name)
        resp = getattr(pb, method.output_type.name)
        fn = getattr(servicer, method.name)
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _guard_stream(fn), request_deserializer=_parser(req), response_serializer=resp.SerializeToString)
        elif not method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _guard_unary(fn), request_deserializer=_parser(req), response_serializer=resp.SerializeToString)
        else:  # pragma: no cover - the .proto has no such RPC; fail loudly if one is added
            raise NotImplementedError(f"{method.name}: only unary and bidi-streaming RPCs are wired")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
