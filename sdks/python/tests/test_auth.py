"""Bearer tokens and TLS, against a stack with authentication on that serves
only TLS (its certificate names ``SLUICE_TLS_SERVER_NAME``, not the address
dialled). Tokens come from the stack's test: ``TOKEN_A`` (tenant a:
producer, reader, worker), ``TOKEN_B`` (tenant b: the same roles)."""

from __future__ import annotations

import os
import threading

import grpc
import pytest
from conftest import running_worker, unique, wait_status

from sluice_client import ClientOptions, Job, Producer, RpcError, Worker, concurrency, job_request

pytestmark = pytest.mark.stack


def test_a_token_acts_only_on_its_tenant_over_tls(options: ClientOptions) -> None:
    assert options.tls is not None and options.admission.startswith("https://")
    as_a = options.replace(token=os.environ["TOKEN_A"])
    as_b = options.replace(token=os.environ["TOKEN_B"])
    job_id = unique("tenant-a")
    with Producer(as_a) as producer_a, Producer(as_b) as producer_b, Producer(options) as anonymous:
        with pytest.raises(RpcError) as refused:
            anonymous.enqueue(job_request("a", limits=[concurrency("k", 1)]))
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(RpcError) as refused:
            producer_a.enqueue(job_request("b", limits=[concurrency("k", 1)]))
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED

        b_ran: list[str] = []
        a_ran: list[str] = []
        a_done = threading.Event()

        def run_as_b(job: Job) -> None:
            b_ran.append(job.job_id)

        def run_as_a(job: Job) -> None:
            a_ran.append(job.job_id)
            a_done.set()

        # Tenant b's worker is connected, with credits, before tenant a's
        # job is admitted; tenant a's worker connects after.
        with running_worker(Worker(as_b, run_as_b, concurrency=4)):
            producer_a.enqueue(job_request("a", job_id=job_id, limits=[concurrency(job_id, 1)]))
            wait_status(producer_a, job_id, "JOB_STATUS_ADMITTED")
            # Tenant b cannot see it.
            with pytest.raises(RpcError) as hidden:
                producer_b.get_job(job_id)
            assert hidden.value.code == grpc.StatusCode.NOT_FOUND
            with running_worker(Worker(as_a, run_as_a, concurrency=4)):
                assert a_done.wait(30)
                wait_status(producer_a, job_id, "JOB_STATUS_SUCCEEDED")
        assert a_ran == [job_id]
        assert job_id not in b_ran, "tenant b's worker was pushed tenant a's job"


def test_plaintext_reaches_no_tls_service(options: ClientOptions) -> None:
    plaintext = options.replace(
        admission=options.admission.replace("https://", "http://"), tls=None, token=os.environ["TOKEN_A"], request_timeout=5.0
    )
    with Producer(plaintext) as producer, pytest.raises(RpcError) as failed:
        producer.enqueue(job_request("a", limits=[concurrency("k", 1)]))
    assert failed.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
