"""The worker against a real stack: limits hold, the process never runs more
than its concurrency, every outcome is reported as admission takes it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import Recorder, peak, running_worker, unique, wait_for, wait_status

from sluice_client import (
    AsyncProducer,
    AsyncWorker,
    ClientOptions,
    HandBack,
    Job,
    JobFailed,
    NonRetryable,
    Producer,
    StopReason,
    Worker,
    concurrency,
    job_request,
    retry_policy,
)

pytestmark = pytest.mark.stack

JOBS = 30


def test_a_sync_worker_runs_jobs_under_a_limit_of_two_never_more(options: ClientOptions, producer: Producer) -> None:
    key = unique("sync-two")
    recorder = Recorder()

    def handle(job: Job) -> None:
        start = time.monotonic()
        job.wait_stopped(0.06)
        recorder.add(job.job_id, job.attempt, start, time.monotonic())

    job_ids = {f"{key}-{index}" for index in range(JOBS)}
    with running_worker(Worker(options, handle, concurrency=6)):
        producer.enqueue_batch(
            [job_request("acme", job_id=job_id, payload=b"{}", limits=[concurrency(key, 2)]) for job_id in sorted(job_ids)]
        )
        wait_for(lambda: len(recorder.ran(job_ids)) == JOBS, f"{JOBS} runs")
    runs = recorder.ran(job_ids)
    assert sorted(run[0] for run in runs) == sorted(job_ids), "each job ran once"
    assert {run[1] for run in runs} == {1}, "every job on its first attempt"
    assert peak(runs) == 2, f"two at a time under a limit of 2 with 6 slots: {runs}"
    for job_id in job_ids:
        wait_status(producer, job_id, "JOB_STATUS_SUCCEEDED")


def test_an_asyncio_worker_runs_jobs_under_a_limit_of_two_never_more(options: ClientOptions) -> None:
    key = unique("async-two")
    recorder = Recorder()
    job_ids = {f"{key}-{index}" for index in range(JOBS)}

    async def handle(job: Job) -> None:
        start = time.monotonic()
        await asyncio.sleep(0.06)
        recorder.add(job.job_id, job.attempt, start, time.monotonic())

    async def main() -> None:
        worker = AsyncWorker(options, handle, concurrency=6)
        running = asyncio.ensure_future(worker.run())
        while worker.status().streams < 1:
            assert not running.done(), running
            await asyncio.sleep(0.02)
        async with AsyncProducer(options) as producer:
            await producer.enqueue_batch(
                [
                    job_request("acme", job_id=job_id, payload=b"{}", limits=[concurrency(key, 2)])
                    for job_id in sorted(job_ids)
                ]
            )
            deadline = time.monotonic() + 30
            while len(recorder.ran(job_ids)) < JOBS:
                assert time.monotonic() < deadline, f"{len(recorder.ran(job_ids))} of {JOBS} ran"
                await asyncio.sleep(0.02)
            worker.stop()
            await asyncio.wait_for(running, 30)
            for job_id in job_ids:
                view = await producer.get_job(job_id)
                assert view.status == 6, (job_id, view.reason)  # SUCCEEDED
        assert worker.status().counters.succeeded >= JOBS

    asyncio.run(main())
    runs = recorder.ran(job_ids)
    assert sorted(run[0] for run in runs) == sorted(job_ids), "each job ran once"
    assert peak(runs) == 2, f"two at a time under a limit of 2 with 6 slots: {runs}"


def test_a_worker_runs_at_most_its_concurrency(options: ClientOptions, producer: Producer) -> None:
    key = unique("wide")
    recorder = Recorder()

    def handle(job: Job) -> None:
        start = time.monotonic()
        job.wait_stopped(0.08)
        recorder.add(job.job_id, job.attempt, start, time.monotonic())

    job_ids = {f"{key}-{index}" for index in range(24)}
    with running_worker(Worker(options, handle, concurrency=3)) as worker:
        producer.enqueue_batch(
            [
                job_request("acme", job_id=job_id, payload=b"{}", limits=[concurrency(key, 100)])
                for job_id in sorted(job_ids)
            ]
        )
        wait_for(lambda: len(recorder.ran(job_ids)) == len(job_ids), "24 runs")
        assert worker.status().busy <= 3
    runs = recorder.ran(job_ids)
    assert peak(runs) == 3, f"the worker's 3 slots bound it, not the key's 100: {runs}"


def test_every_outcome_is_reported(options: ClientOptions, producer: Producer) -> None:
    prefix = unique("outcome")
    seen_stop: dict[str, StopReason | None] = {}
    attempts: dict[str, list[int]] = {}
    started = threading.Event()

    def handle(job: Job) -> None:
        attempts.setdefault(job.job_id, []).append(job.attempt)
        what = job.json()["do"]
        if what == "fail":
            raise NonRetryable("boom")
        if what == "flaky" and job.attempt == 1:
            raise JobFailed("try again")
        if what == "crash":
            raise KeyError("no such thing")
        if what == "hand-back" and job.attempt == 1:
            raise HandBack("not here")
        if what == "long":
            # 3.5 s against a 2 s lease: only heartbeats keep it.
            job.wait_stopped(3.5)
            job.check()
        if what == "cancel":
            started.set()
            job.wait_stopped(30)
            seen_stop[job.job_id] = job.stop_reason
            job.check()

    def request(name: str, do: str, attempts: int = 1) -> None:
        producer.enqueue(
            job_request(
                "acme",
                job_id=f"{prefix}-{name}",
                payload=f'{{"do": "{do}"}}',
                limits=[concurrency(f"{prefix}-{name}", 1)],
                retry=retry_policy(attempts, initial_backoff=0.05),
            )
        )

    with running_worker(Worker(options, handle, concurrency=8, stop_grace=2.0)):
        request("ok", "ok")
        request("fail", "fail", attempts=3)
        request("flaky", "flaky", attempts=2)
        request("crash", "crash")
        request("hand-back", "hand-back")
        request("long", "long")
        request("cancel", "cancel")
        started.wait(30)
        producer.cancel_job(f"{prefix}-cancel", "test")
        assert wait_status(producer, f"{prefix}-ok", "JOB_STATUS_SUCCEEDED").attempt == 1
        failed = wait_status(producer, f"{prefix}-fail", "JOB_STATUS_FAILED")
        assert (failed.attempt, failed.last_error) == (1, "boom"), "non-retryable: no second attempt"
        flaky = wait_status(producer, f"{prefix}-flaky", "JOB_STATUS_SUCCEEDED")
        assert flaky.attempt == 2
        crashed = wait_status(producer, f"{prefix}-crash", "JOB_STATUS_FAILED")
        assert crashed.last_error == "KeyError: 'no such thing'"
        handed = wait_status(producer, f"{prefix}-hand-back", "JOB_STATUS_SUCCEEDED")
        assert handed.attempt == 2
        assert any(r.outcome == "handed_back" and r.detail == "not here" for r in handed.history), handed.history
        cancelled = wait_status(producer, f"{prefix}-cancel", "JOB_STATUS_CANCELLED")
        assert seen_stop[f"{prefix}-cancel"] is StopReason.CANCELLED, cancelled.history
        long = wait_status(producer, f"{prefix}-long", "JOB_STATUS_SUCCEEDED", timeout=30)
        assert long.attempt == 1, f"heartbeats kept the lease: {long.history}"
    assert attempts[f"{prefix}-fail"] == [1]


def test_stopping_a_worker_hands_back_what_it_runs(options: ClientOptions, producer: Producer) -> None:
    job_id = unique("hand-back-on-stop")
    started = threading.Event()
    reasons: list[StopReason | None] = []

    def stubborn(job: Job) -> None:
        started.set()
        job.wait_stopped(60)
        reasons.append(job.stop_reason)
        job.check()

    worker = Worker(options, stubborn, concurrency=2, shutdown_grace=0.3)
    with running_worker(worker):
        producer.enqueue(job_request("acme", job_id=job_id, payload=b"{}", limits=[concurrency(job_id, 1)]))
        assert started.wait(30)
    # The grace ended: the handler was stopped and its job handed back.
    assert reasons == [StopReason.SHUTDOWN]
    view = producer.get_job(job_id)
    assert view.attempt == 2, view.history
    assert any(r.outcome == "handed_back" and r.detail == "worker shutting down" for r in view.history), view.history
    # Another worker runs the next attempt.
    with running_worker(Worker(options, lambda job: None, concurrency=2)):
        assert wait_status(producer, job_id, "JOB_STATUS_SUCCEEDED").attempt == 2
