"""One async client for any ragline service: channel reuse and deadline propagation.

    embedding = connect("embedding", embedding_pb2_grpc.EmbeddingServiceStub)
    reply = await embedding.unary("Embed", request)
    async for message in generation.stream("Generate", request): ...

Every call: timeout = the current deadline's remaining time - hop margin (capped by an
optional stage budget), or DEADLINE_EXCEEDED without calling when nothing is left; the
caller's identity and run id travel in metadata. Cancelling the awaiting task cancels the
RPC, and the callee sees the cancellation. Unary calls may pass a `ragline.retry` policy;
its retries share the same deadline.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message
from opentelemetry import trace

from ragline import auth, deadlines, identity, tracing
from ragline.config import TRANSPORT_CAP_BYTES, CommonConfig, channel_target
from ragline.retry import RetryPolicy, call_with_retry
from ragline.tls import ClientCredentials, TlsConfig

# gRPC's default backoff grows to 120 s between connection attempts: a peer restarted
# after a few seconds down would stay unreached for as long again. Capped, a restart is
# seen within ~2 s, at the cost of one connection attempt per 2 s while it is down.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Calls go round-robin over every address the target resolves to (a headless Service's
# pods, an `ipv4:` list), not to the first one only; servers close connections at their
# MAX_CONNECTION_AGE_S, and the name is resolved again then (at most every 5 s), so
# replicas added later get their share.
_SPREAD_OPTIONS = [
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
    ("grpc.dns_min_time_between_resolutions_ms", 5_000),
]
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", TRANSPORT_CAP_BYTES),
    ("grpc.max_send_message_length", TRANSPORT_CAP_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    *RECONNECT_OPTIONS,
    *_SPREAD_OPTIONS,
]


def open_channel(
    target: str,
    tls: TlsConfig | None = None,
    options: Sequence[tuple[str, Any]] = (),
    *,
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.aio.Channel:
    """An aio channel to `target`, under TLS when `tls` (default: the environment's
    RAGLINE_TLS_*) says so. `credentials`: channel credentials already made from it."""
    tls = tls if tls is not None else TlsConfig()
    options = [*options, *tls.channel_options()]
    if not tls.on:
        return grpc.aio.insecure_channel(channel_target(target), options=options)
    credentials = credentials or tls.channel_credentials()
    return grpc.aio.secure_channel(channel_target(target), credentials, options=options)


@dataclass(frozen=True)
class Replica:
    """One process of a service: `target` reaches it alone; `server_name` is the name its
    certificate holds where `target` is an IP address (empty: the target's own host)."""

    target: str
    server_name: str = ""


async def each_replica(address: str) -> list[Replica]:
    """Every replica behind a configured address, each reachable alone: the members of an
    address list, each address a name resolves to (a headless Service's pods), else the
    address itself (a unix socket; a name that does not resolve: tried as it is, so the
    call fails as a call to it would). For what every replica must hear, where the
    round-robin of one channel reaches one."""
    target = channel_target(address)
    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return [Replica(part) for part in rest.split(",")]
    if target.startswith("unix"):  # unix: and unix-abstract: sockets
        return [Replica(target)]
    hostport = rest.rpartition("/")[2] if scheme == "dns" else target
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        return [Replica(target)]  # one address already
    except ValueError:
        pass
    try:
        found = await asyncio.get_running_loop().getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM
        )
    except (OSError, ValueError):
        return [Replica(target)]
    # One family: a dual-stack name gives each replica twice, once per family.
    family = socket.AF_INET if any(info[0] == socket.AF_INET for info in found) else None
    addresses = dict.fromkeys(
        str(info[4][0]) for info in found if family is None or info[0] == family
    )
    return [
        Replica(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}", server_name=host)
        for ip in addresses
    ]


def open_sync_channel(target: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """The same for a blocking caller (a tool waiting for a service to start)."""
    tls = tls if tls is not None else TlsConfig()
    if not tls.on:
        return grpc.insecure_channel(channel_target(target))
    return grpc.secure_channel(
        channel_target(target), tls.channel_credentials(), options=tls.channel_options()
    )


class ChannelPool:
    """One channel per target per event loop (an aio channel is bound to its loop).

    Under TLS, a channel opened before the certificate files changed is replaced by one
    with the new credentials; the old one closes after the rotation grace (its calls in
    flight finish on it).
    """

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self._channels: dict[tuple[int, str, str], grpc.aio.Channel] = {}
        self._closing: set[asyncio.Future[None]] = set()  # retired channels closing after a grace
        self._tls = tls
        self._credentials: ClientCredentials | None = None

    def _client_credentials(self) -> ClientCredentials | None:
        if self._tls is None:
            self._tls = TlsConfig()  # read at first use: a process sets its env first
            self._tls.check(server=False)
        if not self._tls.on:
            return None
        if self._credentials is None:
            self._credentials = ClientCredentials(self._tls)
        elif self._credentials.changed():
            self._retire_all()
        return self._credentials

    def _retire_all(self) -> None:
        retired, self._channels = self._channels, {}
        grace_s = self._tls.client_rotation_grace_s if self._tls else 0.0
        loop = asyncio.get_running_loop()
        for (loop_id, _, _), channel in retired.items():
            if loop_id == id(loop):
                loop.call_later(grace_s, self._close_retired, channel)

    def _close_retired(self, channel: grpc.aio.Channel) -> None:
        closing = asyncio.ensure_future(channel.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def get(self, target: str, server_name: str = "") -> grpc.aio.Channel:
        """`server_name`: the name to check in the server's certificate instead of the
        target's host (a replica reached by its IP address, see `each_replica`)."""
        credentials = self._client_credentials()
        key = (id(asyncio.get_running_loop()), target, server_name)
        channel = self._channels.get(key)
        if channel is None:
            named = [("grpc.ssl_target_name_override", server_name)] if server_name else []
            channel = open_channel(
                target,
                self._tls,
                [*_CHANNEL_OPTIONS, *named],
                credentials=credentials.credentials if credentials else None,
            )
            self._channels[key] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


default_pool = ChannelPool()


class ServiceClient:
    """Deadline- and identity-aware calls through a generated stub class."""

    def __init__(
        self,
        stub_class: Callable[[grpc.aio.Channel], object],
        target: str,
        *,
        pool: ChannelPool | None = None,
        hop_margin_s: float = 0.005,
        caller: identity.Caller | None = None,
        token: str | None = None,
        service_credential: bool = True,
        server_name: str = "",
    ) -> None:
        """`caller` replaces the propagated identity (a CLI, a test); `token` is a client
        token sent as `authorization: Bearer` (a client outside the services). Otherwise
        the process's service credential goes with the propagated identity, unless
        `service_credential` is False (a process that passes on a caller it has not
        verified, the HTTP gateway: the services behind verify the caller themselves).
        `server_name`: the name its certificate holds where `target` is an IP address."""
        self.stub_class = stub_class
        self.target = target
        self._pool = pool or default_pool
        self._hop_margin_s = hop_margin_s
        self._caller = caller
        self._token = token
        self._service_credential = service_credential
        self._server_name = server_name
        self._stub_cache: tuple[grpc.aio.Channel, object] | None = None
        # `ragline.v1.EmbeddingService`: the RPC service a client span names, made once.
        package = stub_class.__module__.rpartition(".")[0]
        self.rpc_service = f"{package}.{self.service}"

    @property
    def hop_margin_s(self) -> float:
        return self._hop_margin_s

    @property
    def service(self) -> str:
        """The stub's service name, for messages (`EmbeddingService`)."""
        return self.stub_class.__name__.removesuffix("Stub")

    def stub(self) -> Any:
        """The generated stub on this event loop's channel (its methods are called by
        name, so to the checker it is Any)."""
        channel = self._pool.get(self.target, self._server_name)
        if self._stub_cache is None or self._stub_cache[0] is not channel:
            self._stub_cache = (channel, self.stub_class(channel))
        return self._stub_cache[1]

    def call_options(
        self, method: str, stage_budget_s: float | None = None, span: trace.Span | None = None
    ) -> tuple[float | None, tuple[tuple[str, str], ...]]:
        """(timeout, metadata) of a call made now: the deadline rule, the identity, and
        the trace context of `span` (the call's client span) while tracing is on."""
        timeout = deadlines.outbound_timeout(
            f"{self.service}.{method}", margin_s=self._hop_margin_s, stage_budget_s=stage_budget_s
        )
        metadata = identity.outbound_metadata()
        if self._caller is not None:
            # An explicit caller (a CLI, a test) replaces the propagated identity.
            metadata = [kv for kv in metadata if kv[0] == identity.RUN_ID_KEY]
            metadata.extend(self._caller.metadata())
        if self._token:
            metadata.append((auth.AUTHORIZATION_KEY, f"Bearer {self._token}"))
        elif self._service_credential:
            metadata.extend(auth.process_credential().metadata())
        return timeout, (
            *metadata,
            *deadlines.timeout_metadata(timeout),
            *tracing.inject(span),
        )

    async def unary(
        self,
        method: str,
        request: Message,
        *,
        stage_budget_s: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> Any:  # the reply message of `method`
        span = tracing.client_span(self.rpc_service, method)

        async def attempt() -> Any:
            timeout, metadata = self.call_options(method, stage_budget_s, span)
            return await getattr(self.stub(), method)(request, timeout=timeout, metadata=metadata)

        try:
            if retry is None:
                reply = await attempt()
            else:
                reply = await call_with_retry(
                    attempt, retry, what=f"{self.service}.{method}", margin_s=self._hop_margin_s
                )
        except BaseException as error:
            tracing.end_client_span(span, error)
            raise
        tracing.end_client_span(span)
        return reply

    async def stream(
        self, method: str, request: Message, *, stage_budget_s: float | None = None
    ) -> AsyncIterator[Any]:  # the reply messages of `method`
        span = tracing.client_span(self.rpc_service, method)
        failed: BaseException | None = None
        try:
            timeout, metadata = self.call_options(method, stage_budget_s, span)
            call = getattr(self.stub(), method)(request, timeout=timeout, metadata=metadata)
            try:
                async for message in call:
                    yield message
            finally:
                # The consumer stopped early or was cancelled: stop the server's work too.
                call.cancel()
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the consumer stopped reading: not the call's failure
        except BaseException as error:
            failed = error
            raise
        finally:
            tracing.end_client_span(span, failed)


def connect(
    name: str,
    stub_class: Callable[[grpc.aio.Channel], object],
    common: CommonConfig | None = None,
    **kwargs: Any,
) -> ServiceClient:
    """A client of the service registered as `name`, at its configured address."""
    common = common or CommonConfig()
    return ServiceClient(
        stub_class, common.address_of(name), hop_margin_s=common.hop_margin_s, **kwargs
    )
