"""Send job requests: over gRPC to admission (``Enqueue``/``EnqueueBatch``,
which answer with the job id, its status and whether an idempotency key
matched), or over Kafka to ``jobs.requested`` (fire and forget, protobuf or
JSON, with the ``content-type`` header admission decodes by).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import grpc
import grpc.aio

from . import _grpc
from .errors import RpcError, SluiceError
from .jobs import check_request, to_json
from .options import ClientOptions
from .proto import admission_pb2, jobs_pb2

if TYPE_CHECKING:
    import confluent_kafka

__all__ = ["Enqueued", "Producer", "AsyncProducer", "KafkaProducer", "Sent"]

JSON_CONTENT_TYPE = "application/json"
PROTOBUF_CONTENT_TYPE = "application/x-protobuf"


@dataclass(frozen=True)
class Enqueued:
    """Admission's answer to an enqueue."""

    job_id: str
    #: A ``jobs_pb2.JobStatus`` value (``jobs_pb2.JobStatus.Name(status)``).
    status: int
    #: An idempotency key matched a job inside its window; ``job_id`` is that job's.
    deduplicated: bool

    @property
    def status_name(self) -> str:
        return jobs_pb2.JobStatus.Name(self.status)


def _enqueued(response: admission_pb2.EnqueueResponse) -> Enqueued:
    return Enqueued(response.job_id, int(response.status), response.deduplicated)


def _check_batch(requests: Sequence[jobs_pb2.JobRequest]) -> None:
    for index, request in enumerate(requests):
        check_request(request, f"jobs[{index}].")


class _Methods:
    """The admission calls of one channel, sync."""

    def __init__(self, channel: grpc.Channel) -> None:
        a = _grpc.ADMISSION
        self.enqueue = _grpc.sync_unary(
            channel, a + "Enqueue", admission_pb2.EnqueueRequest, admission_pb2.EnqueueResponse
        )
        self.enqueue_batch = _grpc.sync_unary(
            channel, a + "EnqueueBatch", admission_pb2.EnqueueBatchRequest, admission_pb2.EnqueueBatchResponse
        )
        self.get_job = _grpc.sync_unary(channel, a + "GetJob", admission_pb2.GetJobRequest, admission_pb2.GetJobResponse)
        self.cancel_job = _grpc.sync_unary(
            channel, a + "CancelJob", admission_pb2.CancelJobRequest, admission_pb2.CancelJobResponse
        )


class Producer:
    """Enqueues jobs over gRPC (blocking calls). Thread-safe; share one per
    process, and ``close()`` it (or use it as a context manager)."""

    def __init__(self, options: ClientOptions | None = None) -> None:
        self._options = options or ClientOptions()
        endpoint = self._options.admission_endpoint()
        self._target = endpoint.target
        self._channel = _grpc.sync_channel(endpoint, self._options.tls)
        self._calls = _Methods(self._channel)

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _failed(self, method: str, error: grpc.RpcError) -> RpcError:
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
        return RpcError(method, self._target, code, details)

    def enqueue(self, request: jobs_pb2.JobRequest) -> Enqueued:
        """``Admission.Enqueue``: the job id, its status, and whether an
        idempotency key matched. Raises :class:`RpcError`."""
        check_request(request)
        try:
            response = self._calls.enqueue(
                admission_pb2.EnqueueRequest(job=request),
                timeout=self._options.request_timeout,
                metadata=_grpc.metadata(self._options),
            )
        except grpc.RpcError as error:
            raise self._failed("Enqueue", error) from None
        return _enqueued(response)

    def enqueue_batch(self, requests: Sequence[jobs_pb2.JobRequest]) -> list[Enqueued]:
        """``Admission.EnqueueBatch``: all or nothing; one answer per request,
        in order. An invalid job fails the call naming ``jobs[i].<field>``."""
        _check_batch(requests)
        try:
            response = self._calls.enqueue_batch(
                admission_pb2.EnqueueBatchRequest(jobs=list(requests)),
                timeout=self._options.request_timeout,
                metadata=_grpc.metadata(self._options),
            )
        except grpc.RpcError as error:
            raise self._failed("EnqueueBatch", error) from None
        if len(response.results) != len(requests):
            raise SluiceError(f"EnqueueBatch answered {len(response.results)} results for {len(requests)} jobs")
        return [_enqueued(result) for result in response.results]

    def get_job(self, job_id: str) -> admission_pb2.JobView:
        """``Admission.GetJob``: status, attempt, limits, why it waits, history."""
        try:
            response = self._calls.get_job(
                admission_pb2.GetJobRequest(job_id=job_id),
                timeout=self._options.request_timeout,
                metadata=_grpc.metadata(self._options),
            )
        except grpc.RpcError as error:
            raise self._failed("GetJob", error) from None
        return response.job

    def cancel_job(self, job_id: str, reason: str = "") -> int:
        """``Admission.CancelJob``; the job's status after it (a ``JobStatus``)."""
        try:
            response = self._calls.cancel_job(
                admission_pb2.CancelJobRequest(job_id=job_id, reason=reason),
                timeout=self._options.request_timeout,
                metadata=_grpc.metadata(self._options),
            )
        except grpc.RpcError as error:
            raise self._failed("CancelJob", error) from None
        return int(response.status)


class AsyncProducer:
    """The asyncio twin of :class:`Producer`. Create and use it on one event
    loop; ``await close()`` at the end (or ``async with``)."""

    def __init__(self, options: ClientOptions | None = None) -> None:
        self._options = options or ClientOptions()
        endpoint = self._options.admission_endpoint()
        self._target = endpoint.target
        self._channel = _grpc.aio_channel(endpoint, self._options.tls)
        a = _grpc.ADMISSION
        self._enqueue = _grpc.aio_unary(
            self._channel, a + "Enqueue", admission_pb2.EnqueueRequest, admission_pb2.EnqueueResponse
        )
        self._enqueue_batch = _grpc.aio_unary(
            self._channel, a + "EnqueueBatch", admission_pb2.EnqueueBatchRequest, admission_pb2.EnqueueBatchResponse
        )
        self._get_job = _grpc.aio_unary(
            self._channel, a + "GetJob", admission_pb2.GetJobRequest, admission_pb2.GetJobResponse
        )
        self._cancel_job = _grpc.aio_unary(
            self._channel, a + "CancelJob", admission_pb2.CancelJobRequest, admission_pb2.CancelJobResponse
        )

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _failed(self, method: str, error: grpc.aio.AioRpcError) -> RpcError:
        return RpcError(method, self._target, error.code(), error.details() or "")

    async def enqueue(self, request: jobs_pb2.JobRequest) -> Enqueued:
        check_request(request)
        try:
            response = await self._enqueue(
                admission_pb2.EnqueueRequest(job=request),
                timeout=self._options.request_timeout,
                metadata=_grpc.metadata(self._options),
            )
        except grpc.aio.AioRpcError as error:
            raise self._failed("Enqueue", error) from None
        return _enqueued(response)

    async def enqueue_batch(self, requests: Sequence[jobs_pb2.JobRequest]) -> list[Enqueued]:
        _check_batch(requests)
        try:
            response = await self._enqueue_batch(
                admission_pb2.EnqueueBatchRequest(jobs=list(requests)),
                timeout=self._options.request_timeout,
                metadata=_grpc.metadata(self._options),
            )
        except grpc.aio.AioRpcError as error:
            raise self._failed("EnqueueBatch", error) from None
        if len(response.results) != len(requests):
            raise SluiceError(f"EnqueueBatch answered {len(response.results)} results for {len(requests)} jobs")
        return [_enqueued(result) for result in response.results]

    async def get_job(self, job_id: str) -> admission_pb2.JobView:
        try:
            response = await self._get_job(
                admission_pb2.GetJobRequest(job_id=job_id),
                timeout=self._options.request_timeout,
                metadata=_grpc.metadata(self._options),
            )
        except grpc.aio.AioRpcError as error:
            raise self._failed("GetJob", error) from None
        return response.job

    async def cancel_job(self, job_id: str, reason: str = "") -> int:
        try:
            response = await self._cancel_job(
                admission_pb2.CancelJobRequest(job_id=job_id, reason=reason),
                timeout=self._options.request_timeout,
                metadata=_grpc.metadata(self._options),
            )
        except grpc.aio.AioRpcError as error:
            raise self._failed("CancelJob", error) from None
        return int(response.status)


# -- Kafka ------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """Where a request sent over Kafka landed."""

    topic: str
    partition: int
    offset: int


Format = Literal["protobuf", "json"]


class KafkaProducer:
    """Writes job requests to ``jobs.requested`` (``jobs.requested.<tenant>``
    for tenants in ``options.tenant_topics``) with confluent-kafka (the
    ``kafka`` extra), as protobuf (``content-type: application/x-protobuf``)
    or JSON (``content-type: application/json``). Keyed by the job id when
    the request has one. Idempotent producer, ``acks=all``.

    Fire and forget: admission reads the request, so there is no job id to
    return unless you set one; a request it refuses goes to the
    ``deadletter`` topic with the reason in its headers.
    """

    def __init__(
        self,
        options: ClientOptions | None = None,
        *,
        format: Format = "protobuf",
        linger_ms: int = 5,
    ) -> None:
        try:
            import confluent_kafka
        except ImportError as error:  # pragma: no cover - an install mistake
            raise ImportError("KafkaProducer needs confluent-kafka: pip install 'sluice-client[kafka]'") from error
        self._options = options or ClientOptions()
        self._format: Format = format
        config = self._options.kafka_config()
        config.update({"enable.idempotence": True, "acks": "all", "linger.ms": linger_ms})
        self._producer = confluent_kafka.Producer(config)

    def __enter__(self) -> KafkaProducer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def encode(
        self,
        request: jobs_pb2.JobRequest,
        format: Format | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> tuple[bytes, list[tuple[str, str | bytes | None]]]:
        """The message value and headers ``send`` writes for ``request``."""
        check_request(request)
        chosen = format or self._format
        if chosen == "json":
            value = json.dumps(to_json(request), separators=(",", ":")).encode()
            headers: list[tuple[str, str | bytes | None]] = [("content-type", JSON_CONTENT_TYPE.encode())]
        else:
            value = request.SerializeToString()
            headers = [("content-type", PROTOBUF_CONTENT_TYPE.encode())]
        if traceparent:
            headers.append(("traceparent", traceparent.encode()))
            if tracestate:
                headers.append(("tracestate", tracestate.encode()))
        return value, headers

    def produce(
        self,
        request: jobs_pb2.JobRequest,
        *,
        format: Format | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> None:
        """Queue one request without waiting (``flush()`` waits)."""
        self._produce(request, format, traceparent, tracestate, None, 0)

    def _produce(
        self,
        request: jobs_pb2.JobRequest,
        format: Format | None,
        traceparent: str | None,
        tracestate: str | None,
        results: list[Sent | Exception | None] | None,
        index: int,
    ) -> None:
        value, headers = self.encode(request, format, traceparent, tracestate)

        def delivered(error: confluent_kafka.KafkaError | None, message: confluent_kafka.Message) -> None:
            if results is None:
                return
            if error is not None:
                results[index] = SluiceError(f"producing to {message.topic()}: {error}")
            else:
                results[index] = Sent(message.topic() or "", message.partition() or 0, message.offset() or 0)

        topic = self._options.requested_topic_for(request.tenant)
        key = request.job_id.encode() if request.HasField("job_id") else None
        self._producer.produce(topic, value, key, on_delivery=delivered, headers=headers)
        self._producer.poll(0)

    def send(
        self,
        request: jobs_pb2.JobRequest,
        *,
        format: Format | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        timeout: float = 30.0,
    ) -> Sent:
        """Write one request and wait for the broker's acknowledgement."""
        return self.send_many([request], format=format, traceparent=traceparent, tracestate=tracestate, timeout=timeout)[
            0
        ]

    def send_many(
        self,
        requests: Sequence[jobs_pb2.JobRequest],
        *,
        format: Format | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        timeout: float = 30.0,
    ) -> list[Sent]:
        """Write several requests (all in flight at once) and wait for every
        acknowledgement. Raises on the first failure (others may be sent)."""
        for request in requests:
            check_request(request)
        results: list[Sent | Exception | None] = [None] * len(requests)
        for index, request in enumerate(requests):
            self._produce(request, format, traceparent, tracestate, results, index)
        left = self._producer.flush(timeout)
        if left:
            raise SluiceError(f"{left} job requests not acknowledged within {timeout}s")
        sent: list[Sent] = []
        for result in results:
            if isinstance(result, Exception):
                raise result
            if result is None:
                raise SluiceError("a job request was flushed without a delivery report")
            sent.append(result)
        return sent

    def flush(self, timeout: float = 30.0) -> int:
        """Wait for queued requests; how many are still unacknowledged."""
        return self._producer.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self._producer.flush(timeout)
