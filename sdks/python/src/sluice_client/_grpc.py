"""gRPC channels and typed method handles (sync and asyncio).

The methods are built from their full names and the generated message
classes, so no generated service stub (untyped) is needed. The bearer token
rides in each call's metadata rather than as call credentials: gRPC refuses
call credentials on plaintext channels, and a development stack with
authentication but no TLS is common.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from .options import ClientOptions, Endpoint, TlsOptions

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

ADMISSION = "/sluice.v1.Admission/"
REFRESH = "/sluice.v1.Refresh/"

# Statuses a call may be retried after (the call was idempotent): the
# service is restarting or moving an owner, or the call timed out.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def channel_options(tls: TlsOptions | None) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        # Find a dead connection under a long Work stream within seconds.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect soon after an instance comes back.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def credentials(tls: TlsOptions | None) -> grpc.ChannelCredentials:
    tls = tls or TlsOptions()
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca_pem,
        private_key=tls.key_pem,
        certificate_chain=tls.cert_pem,
    )


def aio_channel(endpoint: Endpoint, tls: TlsOptions | None) -> grpc.aio.Channel:
    if endpoint.tls:
        return grpc.aio.secure_channel(endpoint.target, credentials(tls), options=channel_options(tls))
    return grpc.aio.insecure_channel(endpoint.target, options=channel_options(tls))


def sync_channel(endpoint: Endpoint, tls: TlsOptions | None) -> grpc.Channel:
    if endpoint.tls:
        return grpc.secure_channel(endpoint.target, credentials(tls), options=channel_options(tls))
    return grpc.insecure_channel(endpoint.target, options=channel_options(tls))


def metadata(options: ClientOptions) -> tuple[tuple[str, str], ...]:
    token = options.bearer()
    if token is None:
        return ()
    return (("authorization", f"Bearer {token}"),)


def aio_unary(
    channel: grpc.aio.Channel, method: str, request_type: type[Req], response_type: type[Resp]
) -> grpc.aio.UnaryUnaryMultiCallable[Req, Resp]:
    del request_type  # for the type checker only
    deserialize: Callable[[bytes], Resp] = response_type.FromString
    return channel.unary_unary(method, request_serializer=_serialize, response_deserializer=deserialize)


def sync_unary(
    channel: grpc.Channel, method: str, request_type: type[Req], response_type: type[Resp]
) -> grpc.UnaryUnaryMultiCallable[Req, Resp]:
    del request_type
    deserialize: Callable[[bytes], Resp] = response_type.FromString
    return channel.unary_unary(method, request_serializer=_serialize, response_deserializer=deserialize)


def aio_stream(
    channel: grpc.aio.Channel, method: str, request_type: type[Req], response_type: type[Resp]
) -> grpc.aio.StreamStreamMultiCallable[Req, Resp]:
    del request_type
    deserialize: Callable[[bytes], Resp] = response_type.FromString
    return channel.stream_stream(method, request_serializer=_serialize, response_deserializer=deserialize)
