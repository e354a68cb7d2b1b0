"""A refresh handler moves a floating max, against a real stack."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from conftest import Recorder, peak, running_worker, unique, wait_for, wait_status

from sluice_client import ClientOptions, Job, Producer, RefreshTask, Worker, floating, job_request
from sluice_client import _grpc
from sluice_client.proto import limits_pb2, refresh_pb2

pytestmark = pytest.mark.stack


def current_max(options: ClientOptions, key: str) -> int | None:
    """The key's floating max as the refresh-dispatcher describes it (None
    before its first refresh is due)."""
    with _grpc.sync_channel(options.refresh_endpoint(), options.tls) as channel:
        describe = _grpc.sync_unary(
            channel,
            _grpc.REFRESH + "DescribeFloatingLimit",
            refresh_pb2.DescribeFloatingLimitRequest,
            refresh_pb2.DescribeFloatingLimitResponse,
        )
        try:
            response = describe(
                refresh_pb2.DescribeFloatingLimitRequest(key=limits_pb2.KeyRef(tenant="acme", key=key)),
                timeout=5,
                metadata=_grpc.metadata(options),
            )
        except grpc.RpcError as error:
            if isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return response.current_max


def test_a_refresh_handler_moves_a_floating_max(options: ClientOptions, producer: Producer) -> None:
    key = unique("float")
    tasks: list[RefreshTask] = []
    recorder = Recorder()
    hold = threading.Event()

    def refresh(task: RefreshTask) -> int:
        tasks.append(task)
        return int(task.metadata["next_max"])

    def handle(job: Job) -> None:
        start = time.monotonic()
        if job.json().get("hold"):
            hold.wait(30)
        else:
            job.wait_stopped(0.4)
        recorder.add(job.job_id, job.attempt, start, time.monotonic())

    def request(job_id: str, hold: bool = False) -> None:
        producer.enqueue(
            job_request(
                "acme",
                job_id=job_id,
                payload=b'{"hold": true}' if hold else b"{}",
                limits=[floating(key, 1, refresh_every=0.2, metadata={"next_max": "3"})],
            )
        )

    with running_worker(Worker(options, handle, concurrency=8, refresh_handler=refresh)):
        # Max 1: one runs, one waits, which makes the first refresh due.
        request(f"{key}-hold-0", hold=True)
        request(f"{key}-hold-1", hold=True)
        wait_for(lambda: current_max(options, key) == 3, "the refreshed max 3", timeout=30)
        hold.set()
        job_ids = {f"{key}-{index}" for index in range(9)}
        for job_id in sorted(job_ids):
            request(job_id)
        for job_id in job_ids:
            wait_status(producer, job_id, "JOB_STATUS_SUCCEEDED")
    assert tasks, "the handler was asked"
    first = tasks[0]
    assert (first.key.tenant, first.key.key, first.current_max) == ("acme", key, 1)
    assert dict(first.metadata) == {"next_max": "3"}
    assert peak(recorder.ran(job_ids)) == 3, recorder.ran(job_ids)
