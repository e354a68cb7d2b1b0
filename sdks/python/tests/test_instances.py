"""Credits follow the work across admission instances: a worker that gave
all its credits to the only instance opens a stream to a second one when it
joins, and the idle first stream gives credits back (withdraw) so the jobs
the second instance now owns run. The stack's test adds the instance when
this test says so (files in SLUICE_TEST_SIGNAL_DIR)."""

from __future__ import annotations

import os
import pathlib

import pytest
from conftest import Recorder, running_worker, unique, wait_for, wait_status

from sluice_client import ClientOptions, Job, Producer, Worker, concurrency, job_request

pytestmark = pytest.mark.stack


def test_credits_move_to_the_instance_that_has_the_jobs(options: ClientOptions, producer: Producer) -> None:
    signals = pathlib.Path(os.environ["SLUICE_TEST_SIGNAL_DIR"])
    prefix = unique("moving")
    recorder = Recorder()

    def handle(job: Job) -> None:
        recorder.add(job.job_id, job.attempt, 0.0, 0.0)

    with running_worker(Worker(options, handle, concurrency=8), streams=1) as worker:
        wait_for(lambda: worker.status().credits == 8, "every credit on the only stream")
        (signals / "one-stream").touch()
        wait_for(lambda: (signals / "instance-added").exists(), "a second admission instance", timeout=120)
        wait_for(lambda: worker.status().streams == 2, "a stream to each instance")
        job_ids = {f"{prefix}-{index}" for index in range(40)}
        producer.enqueue_batch(
            [job_request("acme", job_id=job_id, limits=[concurrency(job_id, 1)]) for job_id in sorted(job_ids)]
        )
        wait_for(lambda: len(recorder.ran(job_ids)) == len(job_ids), "40 runs", timeout=60)
    assert sorted(run[0] for run in recorder.ran(job_ids)) == sorted(job_ids), "each job ran once"
    for job_id in job_ids:
        wait_status(producer, job_id, "JOB_STATUS_SUCCEEDED")
