"""Shared by the SDK's tests.

Tests marked ``stack`` run against a real Sluice stack (PostgreSQL and a
Kafka-protocol broker): ``crates/sluice-cli/tests/it/python_sdk.rs`` starts
one and passes its endpoints in ``SLUICE_ADMISSION_ENDPOINT``,
``SLUICE_REFRESH_DISPATCHER_ENDPOINT``, ``SLUICE_BROKERS`` and
``SLUICE_TOPIC_PREFIX``. Without them those tests are skipped.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from sluice_client import ClientOptions, Producer, Worker
from sluice_client.proto import admission_pb2, jobs_pb2


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stack: needs a running Sluice stack (see conftest.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SLUICE_ADMISSION_ENDPOINT"):
        return
    skip = pytest.mark.skip(reason="no stack: SLUICE_ADMISSION_ENDPOINT is not set")
    for item in items:
        if "stack" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def options() -> ClientOptions:
    # The tansu test broker sleeps out fetch.wait.max.ms on every fetch.
    return ClientOptions.from_env().replace(fetch_wait_max_ms=25)


@pytest.fixture
def producer(options: ClientOptions) -> Iterator[Producer]:
    with Producer(options) as producer:
        yield producer


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` (state in a process or the stack) until true."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Recorder:
    """Each handler run: (job id, attempt, start, end) from the worker's own
    clock, to measure how many ran at once."""

    runs: list[tuple[str, int, float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, job_id: str, attempt: int, start: float, end: float) -> None:
        with self.lock:
            self.runs.append((job_id, attempt, start, end))

    def ran(self, job_ids: set[str]) -> list[tuple[str, int, float, float]]:
        with self.lock:
            return [run for run in self.runs if run[0] in job_ids]


def peak(runs: list[tuple[str, int, float, float]]) -> int:
    """The most runs overlapping at any instant (an end before a start at
    the same instant)."""
    edges = sorted([(start, 1) for _, _, start, _ in runs] + [(end, -1) for _, _, _, end in runs])
    running = best = 0
    for _, delta in edges:
        running += delta
        best = max(best, running)
    return best


@contextlib.contextmanager
def running_worker(worker: Worker, streams: int = 1) -> Iterator[Worker]:
    """Run ``worker`` in a thread until the block ends (then stop and drain
    it); the block starts once its streams are open."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(handle_signals=False)
        except BaseException as error:  # noqa: BLE001 - reported below
            failure.append(error)

    thread = threading.Thread(target=run, name="worker", daemon=True)
    thread.start()
    try:
        wait_for(lambda: failure or worker.status().streams >= streams, f"{streams} open work streams")
        if failure:
            raise failure[0]
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the worker did not stop within 60s"
        if failure:
            raise failure[0]


def job_status(producer: Producer, job_id: str) -> str:
    return jobs_pb2.JobStatus.Name(producer.get_job(job_id).status)


def wait_status(producer: Producer, job_id: str, status: str, timeout: float = 30.0) -> admission_pb2.JobView:
    seen: list[str] = []

    def reached() -> bool:
        try:
            view = producer.get_job(job_id)
        except Exception as error:  # noqa: BLE001 - NOT_FOUND until its owner read it
            seen.append(str(error))
            return False
        seen.append(jobs_pb2.JobStatus.Name(view.status))
        return view.status == jobs_pb2.JobStatus.Value(status)

    try:
        wait_for(reached, f"{job_id} {status}", timeout)
    except AssertionError as error:
        raise AssertionError(f"{error}; last seen: {seen[-1:] or 'nothing'}") from None
    return producer.get_job(job_id)
