"""Producers against a real stack: gRPC Enqueue/EnqueueBatch, and requests
written to Kafka as protobuf and as JSON."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conftest import running_worker, unique, wait_for, wait_status

from sluice_client import (
    AsyncProducer,
    ClientOptions,
    InvalidRequest,
    Job,
    KafkaProducer,
    Producer,
    RpcError,
    Worker,
    concurrency,
    floating,
    job_request,
    rate,
)

pytestmark = pytest.mark.stack


def test_enqueue_answers_the_job_and_an_idempotency_key_deduplicates(producer: Producer) -> None:
    key = unique("idem")
    request = job_request("acme", payload=b"once", limits=[concurrency(key, 3)], idempotency_key=key, priority=7)
    first = producer.enqueue(request)
    again = producer.enqueue(request)
    assert first.job_id and not first.deduplicated
    assert (again.job_id, again.deduplicated) == (first.job_id, True)
    view = producer.get_job(first.job_id)
    assert (view.tenant, view.priority, view.idempotency_key) == ("acme", 7, key)
    assert view.listed_limits[0].concurrency.key == key


def test_enqueue_batch_is_all_or_nothing(producer: Producer) -> None:
    key = unique("batch")
    results = producer.enqueue_batch([job_request("acme", job_id=f"{key}-{i}", limits=[concurrency(key, 1)]) for i in range(3)])
    assert [result.job_id for result in results] == [f"{key}-{i}" for i in range(3)]
    # Checked before sending, naming the field as the service would.
    bad = job_request("acme", limits=[concurrency(key, 1)])
    bad.limits[0].concurrency.max_concurrency = 0
    with pytest.raises(InvalidRequest) as refused:
        producer.enqueue_batch([job_request("acme"), bad])
    assert refused.value.field == "jobs[1].limits[0].concurrency.max_concurrency"
    # Refused by the service: an undeclared task group.
    with pytest.raises(RpcError) as failed:
        producer.enqueue(job_request("acme", "no-such-group"))
    assert failed.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert not failed.value.retryable


def test_the_asyncio_producer_enqueues_and_reads_jobs(options: ClientOptions) -> None:
    key = unique("async-producer")

    async def main() -> None:
        async with AsyncProducer(options) as producer:
            enqueued = await producer.enqueue(job_request("acme", job_id=key, limits=[concurrency(key, 1)]))
            assert enqueued.job_id == key
            assert enqueued.status_name in ("JOB_STATUS_WAITING", "JOB_STATUS_ADMITTED", "JOB_STATUS_SCHEDULED")
            batch = await producer.enqueue_batch([job_request("acme", job_id=f"{key}-b", limits=[concurrency(key, 1)])])
            assert batch[0].job_id == f"{key}-b"
            view = await producer.get_job(key)
            assert view.job_id == key
            with pytest.raises(RpcError) as missing:
                await producer.get_job(unique("missing"))
            assert missing.value.code == grpc.StatusCode.NOT_FOUND
            assert await producer.cancel_job(key, "test") in (8, 5)  # CANCELLED, or CANCELLING if it already ran
            await producer.cancel_job(f"{key}-b", "test")

    asyncio.run(main())


def test_kafka_requests_in_protobuf_and_json_run(options: ClientOptions, producer: Producer) -> None:
    key = unique("kafka")
    payloads: dict[str, bytes] = {}

    def handle(job: Job) -> None:
        payloads[job.job_id] = job.payload

    requests = {
        "protobuf": job_request(
            "acme", job_id=f"{key}-pb", payload=b"\x00\xffbinary", limits=[concurrency(key, 2), rate(key, 100, per=1.0)]
        ),
        "json": job_request(
            "acme",
            job_id=f"{key}-json",
            payload='{"text": "héllo"}',
            priority=3,
            limits=[concurrency(key, 2), floating(f"{key}-f", 2, refresh_every=60, metadata={"pool": "a"})],
        ),
        "json-binary": job_request("acme", job_id=f"{key}-json-bin", payload=b"\x00\xfe", limits=[concurrency(key, 2)]),
    }
    with running_worker(Worker(options, handle, concurrency=4)), KafkaProducer(options) as kafka:
        sent = kafka.send(requests["protobuf"])
        assert sent.topic == f"{options.topic_prefix}jobs.requested" and sent.offset >= 0
        kafka.send_many([requests["json"], requests["json-binary"]], format="json")
        for request in requests.values():
            wait_status(producer, request.job_id, "JOB_STATUS_SUCCEEDED")
        # (The worker also runs jobs earlier tests left behind.)
        wait_for(lambda: all(request.job_id in payloads for request in requests.values()), "three handled")
    for request in requests.values():
        assert payloads[request.job_id] == request.payload
    view = producer.get_job(f"{key}-json")
    assert view.priority == 3
    assert [limit.WhichOneof("kind") for limit in view.listed_limits] == ["concurrency", "floating"]
