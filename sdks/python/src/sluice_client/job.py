"""What a job handler sees (:class:`Job`), why it is asked to stop
(:class:`StopReason`), and how its attempt is reported to admission."""

from __future__ import annotations

import asyncio
import enum
import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

from .errors import HandBack, JobFailed, Stopped
from .proto import admission_pb2, jobs_pb2

__all__ = ["Job", "StopReason"]

#: The most bytes admission takes in a reported error or reason.
MAX_REPORTED_TEXT_BYTES = 16 * 1024


class StopReason(enum.Enum):
    """Why a running handler is asked to stop."""

    #: ``CancelJob`` was called. The worker confirms with ``Complete`` once
    #: the handler returned (or was given up on); the job ends CANCELLED.
    CANCELLED = "cancelled"
    #: The lease is gone (expired, superseded, or not renewed in time):
    #: another attempt may run. Nothing is reported.
    LEASE_LOST = "lease_lost"
    #: The worker is shutting down and its grace period is over: the job is
    #: handed back and runs again elsewhere.
    SHUTDOWN = "shutdown"


class StopSignal:
    """The stop signal of one attempt, for threads and coroutines alike.
    Set on the worker's event loop; the first reason wins."""

    def __init__(self) -> None:
        self._reason: StopReason | None = None
        self._thread_event = threading.Event()
        self._async_event = asyncio.Event()

    def stop(self, reason: StopReason) -> None:
        if self._reason is None:
            self._reason = reason
        self._thread_event.set()
        self._async_event.set()

    @property
    def reason(self) -> StopReason | None:
        return self._reason

    def wait_thread(self, timeout: float | None) -> bool:
        return self._thread_event.wait(timeout)

    async def wait_async(self) -> None:
        await self._async_event.wait()


class Job:
    """One attempt of an admitted job, claimed for this worker, handed to the
    handler. The handler returns to report success; raises
    :class:`~sluice_client.JobFailed` / :class:`~sluice_client.NonRetryable`
    (or any exception) to fail the attempt, or
    :class:`~sluice_client.HandBack` to give it back unused.

    A long handler watches for a stop: ``job.check()`` (raises
    :class:`~sluice_client.Stopped`), ``job.stopping``,
    ``job.wait_stopped(timeout)`` in a thread, ``await job.stopped()`` in a
    coroutine. After a stop the handler has the worker's ``stop_grace`` to
    return before it is given up on.
    """

    def __init__(
        self,
        dispatched: admission_pb2.DispatchedJob,
        worker_id: str,
        signal: StopSignal,
    ) -> None:
        self._admitted = dispatched.job
        self._signal = signal
        self.worker_id = worker_id
        #: When the lease ends unless renewed (ms since the epoch, admission's clock).
        self.lease_expires_at_ms: int = dispatched.lease_expires_at_ms
        #: The W3C trace context of the job's admission span: make your
        #: handler's span its child, and one trace follows the job.
        self.traceparent: str = dispatched.trace.traceparent
        self.tracestate: str = dispatched.trace.tracestate

    @property
    def job_id(self) -> str:
        return self._admitted.job_id

    @property
    def attempt(self) -> int:
        return self._admitted.attempt

    @property
    def tenant(self) -> str:
        return self._admitted.tenant

    @property
    def task_group(self) -> str:
        return self._admitted.task_group

    @property
    def priority(self) -> int:
        return self._admitted.priority

    @property
    def payload(self) -> bytes:
        """The producer's bytes, unchanged."""
        return self._admitted.payload

    @property
    def max_attempts(self) -> int:
        return self._admitted.max_attempts

    @property
    def lease_ms(self) -> int:
        return self._admitted.lease_ms

    @property
    def admitted(self) -> jobs_pb2.AdmittedJob:
        """Everything admission published about the attempt."""
        return self._admitted

    def json(self) -> Any:
        """The payload parsed as JSON."""
        return json.loads(self._admitted.payload)

    @property
    def stop_reason(self) -> StopReason | None:
        """Why the handler must stop, once it must."""
        return self._signal.reason

    @property
    def stopping(self) -> bool:
        return self._signal.reason is not None

    def check(self) -> None:
        """Raise :class:`~sluice_client.Stopped` once the handler must stop."""
        if self._signal.reason is not None:
            raise Stopped(self._signal.reason.value)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block (a thread) until the handler must stop or ``timeout``
        seconds pass; True when it must stop. A handler's interruptible sleep."""
        return self._signal.wait_thread(timeout)

    async def stopped(self) -> None:
        """Resolves when the handler must stop."""
        await self._signal.wait_async()

    def __repr__(self) -> str:
        return f"Job(job_id={self.job_id!r}, attempt={self.attempt}, tenant={self.tenant!r})"


def reported_text(text: str) -> str:
    """``text`` as admission takes it: no NUL bytes, at most 16 KiB of UTF-8
    (a long stack trace must not make the report itself fail)."""
    text = text.replace("\0", "\ufffd")
    encoded = text.encode("utf-8")
    if len(encoded) <= MAX_REPORTED_TEXT_BYTES:
        return text
    ellipsis = "…"
    cut = encoded[: MAX_REPORTED_TEXT_BYTES - len(ellipsis.encode())]
    return cut.decode("utf-8", errors="ignore") + ellipsis


OutcomeKind = Literal["succeeded", "failed", "handed_back", "cancelled", "lease_lost"]


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as reported."""

    kind: OutcomeKind
    message: str = ""
    non_retryable: bool = False

    def completion(self, job_id: str, attempt: int) -> admission_pb2.Completion | None:
        """What ``Complete`` reports; None for a lost lease (the attempt is
        not this worker's any more)."""
        completion = admission_pb2.Completion(job_id=job_id, attempt=attempt)
        if self.kind == "succeeded":
            completion.success.SetInParent()
        elif self.kind == "failed":
            completion.failure.error = reported_text(self.message)
            completion.failure.non_retryable = self.non_retryable
        elif self.kind == "handed_back":
            completion.hand_back.reason = reported_text(self.message)
        elif self.kind == "cancelled":
            # Any outcome confirms a cancel; a failure that cannot retry says
            # what happened should the cancel somehow not be recorded.
            completion.failure.error = "stopped: cancel requested"
            completion.failure.non_retryable = True
        else:
            return None
        return completion


#: How a handler ended: it returned (None), raised, or was given up on.
DROPPED = object()


def decide(ended: BaseException | object | None, reason: StopReason | None) -> Outcome:
    """The outcome of an attempt from how its handler ended and why it was
    asked to stop (the stop reason wins)."""
    if reason is StopReason.LEASE_LOST:
        return Outcome("lease_lost")
    if reason is StopReason.CANCELLED:
        return Outcome("cancelled")
    if ended is DROPPED or (reason is StopReason.SHUTDOWN and isinstance(ended, Stopped)):
        return Outcome("handed_back", "worker shutting down")
    if ended is None:
        return Outcome("succeeded")
    if isinstance(ended, HandBack):
        return Outcome("handed_back", ended.reason)
    if isinstance(ended, JobFailed):
        return Outcome("failed", str(ended) or type(ended).__name__, ended.non_retryable)
    if isinstance(ended, BaseException):
        text = str(ended)
        return Outcome("failed", f"{type(ended).__name__}: {text}" if text else type(ended).__name__)
    return Outcome("failed", "handler ended in an unknown way")
