"""Python client of Sluice: enqueue jobs over gRPC or Kafka, run workers on
``Work`` streams, answer floating-limit refresh tasks.

>>> from sluice_client import ClientOptions, Producer, job_request, concurrency
>>> # Producer(ClientOptions()).enqueue(job_request("acme", payload=b"x", limits=[concurrency("db", 2)]))
"""

from __future__ import annotations

from .errors import HandBack, InvalidRequest, JobFailed, NonRetryable, RpcError, SluiceError, Stopped
from .job import Job, StopReason
from .jobs import (
    adaptive,
    check_request,
    concurrency,
    floating,
    job_request,
    rate,
    rate_limit_key,
    retry_policy,
    to_json,
)
from .options import ClientOptions, TlsOptions
from .producer import AsyncProducer, Enqueued, KafkaProducer, Producer, Sent
from .refresh import RefreshHandler, RefreshTask
from .worker import AsyncWorker, Counters, JobHandler, Worker, WorkerStatus, default_worker_id

__all__ = [
    "AsyncProducer",
    "AsyncWorker",
    "ClientOptions",
    "Counters",
    "Enqueued",
    "HandBack",
    "InvalidRequest",
    "Job",
    "JobFailed",
    "JobHandler",
    "KafkaProducer",
    "NonRetryable",
    "Producer",
    "RefreshHandler",
    "RefreshTask",
    "RpcError",
    "Sent",
    "SluiceError",
    "StopReason",
    "Stopped",
    "TlsOptions",
    "Worker",
    "WorkerStatus",
    "adaptive",
    "check_request",
    "concurrency",
    "default_worker_id",
    "floating",
    "job_request",
    "rate",
    "rate_limit_key",
    "retry_policy",
    "to_json",
]
