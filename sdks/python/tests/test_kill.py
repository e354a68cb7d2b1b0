"""A worker process killed mid-job (SIGKILL): its jobs come back and another
worker runs them."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import sys
import threading

import pytest
from conftest import running_worker, unique, wait_status

from sluice_client import ClientOptions, Job, Producer, Worker, concurrency, job_request, retry_policy

pytestmark = pytest.mark.stack

HERE = pathlib.Path(__file__).resolve().parent


def test_a_killed_workers_jobs_come_back_and_run_elsewhere(options: ClientOptions, producer: Producer) -> None:
    prefix = unique("killed")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE.parent / "src")
    doomed = subprocess.Popen(
        [sys.executable, str(HERE / "worker_process.py"), "2", f"{prefix}-doomed"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    events: queue.Queue[dict[str, object]] = queue.Queue()

    def read() -> None:
        assert doomed.stdout is not None
        for line in doomed.stdout:
            events.put(json.loads(line))

    threading.Thread(target=read, daemon=True).start()
    try:
        assert events.get(timeout=30) == {"event": "ready"}
        job_ids = {f"{prefix}-{index}" for index in range(2)}
        for job_id in sorted(job_ids):
            producer.enqueue(
                job_request(
                    "acme",
                    job_id=job_id,
                    payload=b"{}",
                    limits=[concurrency(job_id, 1)],
                    retry=retry_policy(3, initial_backoff=0.1),
                )
            )
        started = set()
        while started != job_ids:
            event = events.get(timeout=30)
            assert event["event"] == "started", event
            started.add(str(event["job_id"]))
        for job_id in job_ids:
            assert wait_status(producer, job_id, "JOB_STATUS_RUNNING").claimed_by == f"{prefix}-doomed"
    finally:
        doomed.kill()
        doomed.wait(30)

    ran: list[tuple[str, int]] = []

    def handle(job: Job) -> None:
        ran.append((job.job_id, job.attempt))

    with running_worker(Worker(options, handle, concurrency=2, worker_id=f"{prefix}-survivor")):
        views = [wait_status(producer, job_id, "JOB_STATUS_SUCCEEDED", timeout=40) for job_id in sorted(job_ids)]
    assert sorted(job_id for job_id, _ in ran) == sorted(job_ids), "the survivor ran both"
    for view in views:
        assert view.attempt >= 2, view.history
        first = [record for record in view.history if record.attempt == 1]
        assert first and first[0].outcome in ("lease_expired", "handed_back", "retried"), view.history
