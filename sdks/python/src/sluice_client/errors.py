"""Errors the client raises, and the exceptions a job handler raises to say
how its attempt ended."""

from __future__ import annotations

import grpc

__all__ = [
    "SluiceError",
    "RpcError",
    "InvalidRequest",
    "JobFailed",
    "NonRetryable",
    "HandBack",
    "Stopped",
]


class SluiceError(Exception):
    """Base of the client's own errors."""


class InvalidRequest(SluiceError, ValueError):
    """A job request the service would refuse; ``field`` names it as the
    service would (``limits[0].concurrency.max_concurrency``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class RpcError(SluiceError):
    """A gRPC call failed. ``code`` is the gRPC status; ``retryable`` says
    whether trying again can help (the service was away or the call timed
    out; every Sluice call is idempotent)."""

    def __init__(self, method: str, target: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} on {target}: {code.name}: {details}")
        self.method = method
        self.target = target
        self.code = code
        self.details = details

    @property
    def retryable(self) -> bool:
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# -- raised by job handlers -------------------------------------------------


class JobFailed(Exception):
    """The attempt failed; the job retries while its retry policy allows.
    Any other exception a handler raises counts the same (its type and text
    become the job's ``last_error``)."""

    non_retryable = False


class NonRetryable(JobFailed):
    """The attempt failed and the job ends ``FAILED`` now, whatever attempts
    remain."""

    non_retryable = True


class HandBack(Exception):
    """Give the attempt back without using it up: the job's tickets return
    and it is admitted again, for any worker (e.g. a downstream this process
    cannot reach)."""

    def __init__(self, reason: str = "handed back by the handler") -> None:
        super().__init__(reason)
        self.reason = reason


class Stopped(Exception):
    """Raised by :meth:`Job.check` once the worker asked the handler to stop
    (see :attr:`Job.stop_reason`). Let it propagate: the worker reports what
    the stop reason calls for."""
