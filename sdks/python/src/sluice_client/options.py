"""Where the client finds Sluice, and how it proves who it is.

One small settings object shared by the producers and the worker, so an
application never needs the services' own configuration. The defaults match
a local ``make run`` (``sluice dev``): admission on 127.0.0.1:50051, the
refresh-dispatcher on :50054, the broker on :9092, no topic prefix, no
authentication, no TLS.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["ClientOptions", "TlsOptions", "Endpoint", "parse_endpoint"]

TokenSource = str | Callable[[], str]


@dataclass(frozen=True)
class TlsOptions:
    """TLS of the gRPC channels (the services' ``[tls]`` section).

    ``ca_pem`` are the roots trusted for the services' certificates (the
    services' ``tls.ca_file``); None trusts gRPC's default roots.
    ``cert_pem``/``key_pem`` are a client certificate chain and its key, for
    services that require one (``tls.client_ca_file``). ``server_name`` is the
    name checked in the services' certificates whatever address is dialled
    (the services' ``tls.server_name``): Work streams dial the addresses the
    admission instances advertise, pod IPs in Kubernetes.
    """

    ca_pem: bytes | None = None
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_files(
        cls,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        server_name: str | None = None,
    ) -> TlsOptions:
        def read(path: str | None) -> bytes | None:
            return pathlib.Path(path).read_bytes() if path else None

        return cls(read(ca_file), read(cert_file), read(key_file), server_name or None)


@dataclass(frozen=True)
class Endpoint:
    """A gRPC target (``host:port``) and whether it speaks TLS."""

    target: str
    tls: bool


def parse_endpoint(text: str, tls_by_default: bool) -> Endpoint:
    """``https://host:port`` is TLS, ``http://host:port`` plaintext, and a
    bare ``host:port`` is TLS when TLS options are set."""
    text = text.strip()
    if text.startswith("https://"):
        return Endpoint(text[len("https://") :].rstrip("/"), True)
    if text.startswith("http://"):
        return Endpoint(text[len("http://") :].rstrip("/"), False)
    return Endpoint(text.rstrip("/"), tls_by_default)


@dataclass(frozen=True)
class ClientOptions:
    """Settings shared by :class:`~sluice_client.Producer`,
    :class:`~sluice_client.KafkaProducer` and the workers.

    Endpoints are ``host:port`` or URLs (``http://``, ``https://``). ``token``
    is the bearer token (a JWT) sent on every gRPC call to services with
    ``auth.enabled``; its claims name the tenants and roles it may act on.
    Give a callable to supply a fresh token for every call (rotation).
    """

    #: Any admission instance: enqueue, jobs, and where a worker asks for the
    #: other instances.
    admission: str = "127.0.0.1:50051"
    #: Any refresh-dispatcher instance (``ReportRefresh``).
    refresh_dispatcher: str = "127.0.0.1:50054"
    #: Kafka bootstrap servers, for the Kafka producer and refresh handlers.
    brokers: str = "127.0.0.1:9092"
    #: The services' ``kafka.topic_prefix``: before every topic and group.
    topic_prefix: str = ""
    requested_topic: str = "jobs.requested"
    #: Tenants listed in the services' ``topics.tenant_requested``: their
    #: requests go to ``jobs.requested.<tenant>``.
    tenant_topics: frozenset[str] = frozenset()
    refresh_tasks_topic: str = "refresh.tasks"
    #: Refresh handlers consume in the group ``<prefix><group_id>.refresh``.
    group_id: str = "sluice-workers"
    token: TokenSource | None = None
    tls: TlsOptions | None = None
    #: Seconds each unary gRPC call may take.
    request_timeout: float = 10.0
    #: librdkafka ``fetch.wait.max.ms`` of consumers. Real Kafka answers a
    #: waiting fetch when data arrives; the tansu dev broker sleeps it out.
    fetch_wait_max_ms: int = 5
    #: Extra librdkafka settings of every Kafka client (security.protocol,
    #: sasl.*, ssl.*, ...), applied last.
    kafka_properties: Mapping[str, str] = field(default_factory=dict)

    def replace(self, **changes: object) -> ClientOptions:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientOptions:
        """Options from the environment, as the ``sluice`` command reads them:
        ``SLUICE_ADMISSION_ENDPOINT``, ``SLUICE_REFRESH_DISPATCHER_ENDPOINT``,
        ``SLUICE_BROKERS``, ``SLUICE_TOPIC_PREFIX``, ``SLUICE_TOKEN`` or
        ``SLUICE_TOKEN_FILE`` (read again on every call), and
        ``SLUICE_TLS_CA_FILE``, ``SLUICE_TLS_CERT_FILE``,
        ``SLUICE_TLS_KEY_FILE``, ``SLUICE_TLS_SERVER_NAME``. Unset ones keep
        their defaults."""
        env = os.environ if environ is None else environ
        defaults = cls()
        token: TokenSource | None = env.get("SLUICE_TOKEN") or None
        token_file = env.get("SLUICE_TOKEN_FILE")
        if token is None and token_file:
            path = pathlib.Path(token_file)

            def read_token() -> str:
                return path.read_text().strip()

            token = read_token
        tls: TlsOptions | None = None
        if any(env.get(name) for name in ("SLUICE_TLS_CA_FILE", "SLUICE_TLS_CERT_FILE", "SLUICE_TLS_SERVER_NAME")):
            tls = TlsOptions.from_files(
                env.get("SLUICE_TLS_CA_FILE"),
                env.get("SLUICE_TLS_CERT_FILE"),
                env.get("SLUICE_TLS_KEY_FILE"),
                env.get("SLUICE_TLS_SERVER_NAME"),
            )
        return cls(
            admission=env.get("SLUICE_ADMISSION_ENDPOINT", defaults.admission),
            refresh_dispatcher=env.get("SLUICE_REFRESH_DISPATCHER_ENDPOINT", defaults.refresh_dispatcher),
            brokers=env.get("SLUICE_BROKERS", defaults.brokers),
            topic_prefix=env.get("SLUICE_TOPIC_PREFIX", defaults.topic_prefix),
            token=token,
            tls=tls,
        )

    # -- names -----------------------------------------------------------

    def requested_topic_for(self, tenant: str) -> str:
        """The topic a request of ``tenant`` goes to."""
        if tenant in self.tenant_topics:
            return f"{self.topic_prefix}{self.requested_topic}.{tenant}"
        return f"{self.topic_prefix}{self.requested_topic}"

    def refresh_tasks_topic_name(self) -> str:
        return f"{self.topic_prefix}{self.refresh_tasks_topic}"

    def refresh_group(self) -> str:
        return f"{self.topic_prefix}{self.group_id}.refresh"

    # -- credentials -----------------------------------------------------

    def bearer(self) -> str | None:
        """The current bearer token, if any."""
        if self.token is None:
            return None
        token = self.token() if callable(self.token) else self.token
        token = token.strip()
        return token or None

    def admission_endpoint(self) -> Endpoint:
        return parse_endpoint(self.admission, self.tls is not None)

    def refresh_endpoint(self) -> Endpoint:
        return parse_endpoint(self.refresh_dispatcher, self.tls is not None)

    def kafka_config(self) -> dict[str, str | int | float | bool]:
        config: dict[str, str | int | float | bool] = {"bootstrap.servers": self.brokers}
        config.update(self.kafka_properties)
        return config
