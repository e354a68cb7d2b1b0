"""Job requests: the protobuf ``JobRequest`` of ``proto/sluice/v1/jobs.proto``
built from keyword arguments, checked for the mistakes the service would
refuse anyway (naming the field as it would), and its JSON form for Kafka
producers (``docs/job-request.schema.json``).

>>> request = job_request(
...     "acme", "default",
...     payload=b"resize:42",
...     limits=[concurrency("images", 4), floating("gpu-pool", 2, refresh_every=60, metadata={"pool": "a100"}),
...             rate("api", 100, per=1.0)],
...     retry=retry_policy(3, initial_backoff=0.5, max_backoff=60),
...     idempotency_key="order-42",
... )
>>> len(request.limits)
3
"""

from __future__ import annotations

import base64
import datetime
import time
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from google.protobuf import json_format

from .errors import InvalidRequest
from .proto import jobs_pb2

__all__ = [
    "job_request",
    "concurrency",
    "floating",
    "adaptive",
    "rate",
    "rate_limit_key",
    "retry_policy",
    "check_request",
    "to_json",
]

GLOBAL_TENANT = "*"


def _duration_text(seconds: float) -> str:
    return f"{max(0, round(seconds * 1000))}ms"


def _millis(seconds: float) -> int:
    return max(0, round(seconds * 1000))


def concurrency(key: str, max_concurrency: int, *, shadow: bool = False) -> jobs_pb2.Limit:
    """At most ``max_concurrency`` holders of ``key`` (in the job's tenant)
    at once. ``shadow``: measure what the limit would do without enforcing it."""
    return jobs_pb2.Limit(
        concurrency=jobs_pb2.ConcurrencyLimit(key=key, max_concurrency=max_concurrency, shadow=shadow)
    )


def floating(
    key: str,
    default_max: int,
    *,
    refresh_every: float = 60.0,
    metadata: Mapping[str, str] | None = None,
) -> jobs_pb2.Limit:
    """A concurrency limit whose max a refresh handler recomputes every
    ``refresh_every`` seconds; ``metadata`` reaches the handler unchanged.
    The first job naming the key creates its state; later jobs' values are
    ignored."""
    return jobs_pb2.Limit(
        floating=jobs_pb2.FloatingConcurrencyLimit(
            key=key,
            default_max=default_max,
            refresh_interval_ms=_millis(refresh_every),
            metadata=dict(metadata or {}),
        )
    )


def adaptive(
    key: str,
    *,
    min: int = 0,
    max: int = 0,
    initial: int = 0,
    target_latency: float = 0.0,
    max_error_ratio: float = 0.0,
    smoothing: float = 0.0,
) -> jobs_pb2.Limit:
    """A concurrency limit whose max Sluice computes from the key's run
    times (``target_latency`` in seconds) and error ratio; 0 means the
    service's default for every field."""
    return jobs_pb2.Limit(
        adaptive=jobs_pb2.AdaptiveConcurrencyLimit(
            key=key,
            min=min,
            max=max,
            initial=initial,
            target_latency_ms=_millis(target_latency),
            max_error_ratio=max_error_ratio,
            smoothing=smoothing,
        )
    )


def rate(name: str, limit: int, *, per: float, unique_key: str = "", cost: int = 0) -> jobs_pb2.Limit:
    """At most ``limit`` units per sliding ``per`` seconds for (tenant,
    ``name``, ``unique_key``); the job takes ``cost`` units (0 means 1)."""
    return jobs_pb2.Limit(
        rate=jobs_pb2.RateLimit(
            inline=jobs_pb2.InlineRateLimit(
                name=name, unique_key=unique_key, limit=limit, duration_ms=_millis(per), cost=cost
            )
        )
    )


def rate_limit_key(resource_key: str) -> jobs_pb2.Limit:
    """A stored rate-limit resource (``RateLimits.PutRateLimit``)."""
    return jobs_pb2.Limit(rate=jobs_pb2.RateLimit(rate_limit_key=resource_key))


def retry_policy(
    max_attempts: int,
    *,
    initial_backoff: float | None = None,
    max_backoff: float | None = None,
    multiplier: float = 0.0,
    on_lease_expiry: Literal["retry", "fail"] = "retry",
) -> jobs_pb2.RetryPolicy:
    """Attempts in total (including the first), backoffs in seconds (unset:
    1 s and 5 min), the multiplier (0: 2.0), and what an expired lease does."""
    policy = jobs_pb2.RetryPolicy(max_attempts=max_attempts, backoff_multiplier=multiplier)
    if initial_backoff is not None:
        policy.initial_backoff = _duration_text(initial_backoff)
    if max_backoff is not None:
        policy.max_backoff = _duration_text(max_backoff)
    if on_lease_expiry == "fail":
        policy.on_lease_expiry = jobs_pb2.LEASE_EXPIRY_POLICY_FAIL
    return policy


def job_request(
    tenant: str,
    task_group: str = "default",
    *,
    payload: bytes | str = b"",
    job_id: str | None = None,
    priority: int | None = None,
    limits: Iterable[jobs_pb2.Limit] = (),
    retry: jobs_pb2.RetryPolicy | None = None,
    idempotency_key: str = "",
    idempotency_window: float | None = None,
    run_at: datetime.datetime | None = None,
    run_after: float | None = None,
    fairness_key: str = "",
) -> jobs_pb2.JobRequest:
    """A checked ``JobRequest``.

    ``payload`` (text is sent as UTF-8) reaches the worker unchanged.
    ``job_id``: your own id (else Kafka requests get one derived from where
    they land, gRPC ones a random one). ``priority``: 0 most urgent to 99
    (unset: 50). ``idempotency_window`` in seconds (unset: the service's
    24 h). ``run_at`` (an aware datetime) or ``run_after`` (seconds from now)
    delays the first acquisition. ``fairness_key``: the job's flow among the
    waiters of each key. Raises :class:`InvalidRequest` naming the field.
    """
    request = jobs_pb2.JobRequest(
        tenant=tenant,
        task_group=task_group,
        payload=payload.encode() if isinstance(payload, str) else payload,
        limits=list(limits),
        idempotency_key=idempotency_key,
        fairness_key=fairness_key,
    )
    if job_id is not None:
        request.job_id = job_id
    if priority is not None:
        request.priority = priority
    if retry is not None:
        request.retry.CopyFrom(retry)
    if idempotency_window is not None:
        request.idempotency_window = _duration_text(idempotency_window)
    if run_at is not None:
        request.run_at_ms = round(run_at.timestamp() * 1000)
    elif run_after is not None:
        request.run_at_ms = round((time.time() + run_after) * 1000)
    check_request(request)
    return request


def check_request(request: jobs_pb2.JobRequest, field_prefix: str = "") -> None:
    """Raise :class:`InvalidRequest` for what the service would refuse
    anyway (its full checks, e.g. byte lengths, stay the service's)."""

    def invalid(field: str, message: str) -> InvalidRequest:
        return InvalidRequest(field_prefix + field, message)

    if not request.tenant:
        raise invalid("tenant", "must not be empty")
    if request.tenant == GLOBAL_TENANT:
        raise invalid("tenant", '"*" is reserved for global caps')
    if not request.task_group:
        raise invalid("task_group", "must not be empty")
    if request.HasField("priority") and request.priority > 99:
        raise invalid("priority", "must be 0 (most urgent) to 99")
    if not request.idempotency_key and request.idempotency_window:
        raise invalid("idempotency_window", "set only together with idempotency_key")
    if request.idempotency_window == "0ms":
        raise invalid("idempotency_window", "must be greater than 0")
    for index, limit in enumerate(request.limits):
        _check_limit(limit, f"{field_prefix}limits[{index}].")


def _check_limit(limit: jobs_pb2.Limit, prefix: str) -> None:
    kind = limit.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(prefix + "kind", "set concurrency, floating, rate or adaptive")
    if kind == "concurrency":
        if not limit.concurrency.key:
            raise InvalidRequest(prefix + "concurrency.key", "must not be empty")
        if limit.concurrency.max_concurrency == 0:
            raise InvalidRequest(prefix + "concurrency.max_concurrency", "must be at least 1")
    elif kind == "floating":
        if not limit.floating.key:
            raise InvalidRequest(prefix + "floating.key", "must not be empty")
        if limit.floating.default_max == 0:
            raise InvalidRequest(prefix + "floating.default_max", "must be at least 1")
        if limit.floating.refresh_interval_ms == 0:
            raise InvalidRequest(prefix + "floating.refresh_interval_ms", "must be greater than 0")
    elif kind == "adaptive":
        if not limit.adaptive.key:
            raise InvalidRequest(prefix + "adaptive.key", "must not be empty")
        if limit.adaptive.max != 0 and limit.adaptive.max < limit.adaptive.min:
            raise InvalidRequest(prefix + "adaptive.max", "must be at least min")
        for name in ("max_error_ratio", "smoothing"):
            if not 0.0 <= getattr(limit.adaptive, name) <= 1.0:
                raise InvalidRequest(prefix + f"adaptive.{name}", "must be between 0 and 1")
    else:
        spec = limit.rate.WhichOneof("spec")
        if spec is None:
            raise InvalidRequest(prefix + "rate.spec", "set inline or rate_limit_key")
        if spec == "rate_limit_key":
            if not limit.rate.rate_limit_key:
                raise InvalidRequest(prefix + "rate.rate_limit_key", "must not be empty")
            return
        inline = limit.rate.inline
        if not inline.name:
            raise InvalidRequest(prefix + "rate.inline.name", "must not be empty")
        if inline.limit < 1:
            raise InvalidRequest(prefix + "rate.inline.limit", "must be at least 1")
        if inline.duration_ms < 1:
            raise InvalidRequest(prefix + "rate.inline.duration_ms", "must be at least 1")
        if inline.cost < 0 or inline.cost > inline.limit:
            raise InvalidRequest(prefix + "rate.inline.cost", "must be 0 (meaning 1) up to the limit")


def to_json(request: jobs_pb2.JobRequest) -> dict[str, Any]:
    """The JSON form of ``request`` (``docs/job-request.schema.json``): the
    proto's field names, the payload as text when it is UTF-8 (else
    ``payload_base64``), ``on_lease_expiry`` as ``"retry"``/``"fail"``."""
    document: dict[str, Any] = json_format.MessageToDict(request, preserving_proto_field_name=True)
    document.pop("payload", None)
    if request.payload:
        try:
            document["payload"] = request.payload.decode("utf-8")
        except UnicodeDecodeError:
            document["payload_base64"] = base64.b64encode(request.payload).decode("ascii")
    retry = document.get("retry")
    if isinstance(retry, dict) and "on_lease_expiry" in retry:
        policy = request.retry.on_lease_expiry
        if policy == jobs_pb2.LEASE_EXPIRY_POLICY_FAIL:
            retry["on_lease_expiry"] = "fail"
        elif policy == jobs_pb2.LEASE_EXPIRY_POLICY_RETRY:
            retry["on_lease_expiry"] = "retry"
        else:
            del retry["on_lease_expiry"]
    return document
