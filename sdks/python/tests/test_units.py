"""What needs no stack: request building and its JSON form, the checks,
reported text, how an attempt's end is decided, offset tracking."""

from __future__ import annotations

import base64
import datetime
import json
import pathlib

import pytest

from sluice_client import (
    ClientOptions,
    HandBack,
    InvalidRequest,
    JobFailed,
    NonRetryable,
    StopReason,
    Stopped,
    adaptive,
    concurrency,
    floating,
    job_request,
    rate,
    rate_limit_key,
    retry_policy,
    to_json,
)
from sluice_client.job import DROPPED, decide, reported_text
from sluice_client.options import parse_endpoint
from sluice_client.proto import jobs_pb2
from sluice_client.refresh import Offsets

SCHEMA = pathlib.Path(__file__).resolve().parents[3] / "docs" / "job-request.schema.json"


def every_field() -> jobs_pb2.JobRequest:
    return job_request(
        "acme",
        "default",
        payload='{"report": 42}',
        job_id="report-42",
        priority=10,
        limits=[
            concurrency("warehouse", 2, shadow=True),
            floating("gpu", 2, refresh_every=60, metadata={"pool": "a100"}),
            adaptive("api", min=1, max=20, target_latency=0.5, max_error_ratio=0.2),
            rate("exports", 10, per=60, unique_key="u", cost=2),
            rate_limit_key("stripe"),
        ],
        retry=retry_policy(3, initial_backoff=0.5, max_backoff=60, multiplier=3, on_lease_expiry="fail"),
        idempotency_key="report-42",
        idempotency_window=3600,
        run_at=datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc),
        fairness_key="customer-7",
    )


def test_the_json_form_follows_the_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    document = to_json(every_field())
    jsonschema.validate(document, schema)
    assert document["payload"] == '{"report": 42}'
    assert document["retry"] == {
        "max_attempts": 3,
        "initial_backoff": "500ms",
        "max_backoff": "60000ms",
        "backoff_multiplier": 3.0,
        "on_lease_expiry": "fail",
    }
    assert document["limits"][0] == {"concurrency": {"key": "warehouse", "max_concurrency": 2, "shadow": True}}
    binary = to_json(job_request("acme", payload=b"\x00\xff"))
    jsonschema.validate(binary, schema)
    assert base64.b64decode(binary["payload_base64"]) == b"\x00\xff" and "payload" not in binary


def test_requests_the_service_would_refuse_are_refused_naming_the_field() -> None:
    cases = {
        "tenant": lambda: job_request(""),
        "task_group": lambda: job_request("acme", ""),
        "priority": lambda: job_request("acme", priority=100),
        "limits[1].concurrency.max_concurrency": lambda: job_request(
            "acme", limits=[concurrency("a", 1), concurrency("b", 0)]
        ),
        "limits[0].floating.refresh_interval_ms": lambda: job_request("acme", limits=[floating("f", 1, refresh_every=0)]),
        "limits[0].rate.inline.cost": lambda: job_request("acme", limits=[rate("r", 1, per=1, cost=2)]),
        "limits[0].adaptive.max": lambda: job_request("acme", limits=[adaptive("a", min=5, max=2)]),
    }
    for field, build in cases.items():
        with pytest.raises(InvalidRequest) as refused:
            build()
        assert refused.value.field == field
    with pytest.raises(InvalidRequest):
        job_request("*")


def test_reported_text_fits_what_admission_takes() -> None:
    assert reported_text("a\0b") == "a\ufffdb"
    cut = reported_text("é" * 20_000)
    assert len(cut.encode()) <= 16 * 1024 and cut.endswith("…")


def test_how_an_attempt_ends() -> None:
    assert decide(None, None).kind == "succeeded"
    assert decide(None, StopReason.SHUTDOWN).kind == "succeeded", "it returned: its work is done"
    assert decide(DROPPED, StopReason.SHUTDOWN).message == "worker shutting down"
    assert decide(Stopped("shutdown"), StopReason.SHUTDOWN).kind == "handed_back"
    assert decide(None, StopReason.LEASE_LOST).completion("j", 1) is None, "a lost lease reports nothing"
    cancelled = decide(Stopped("cancelled"), StopReason.CANCELLED).completion("j", 1)
    assert cancelled is not None and cancelled.failure.non_retryable
    failed = decide(NonRetryable("boom"), None)
    assert (failed.kind, failed.message, failed.non_retryable) == ("failed", "boom", True)
    assert decide(JobFailed("again"), None).non_retryable is False
    assert decide(ValueError("bad"), None).message == "ValueError: bad"
    handed = decide(HandBack("later"), None).completion("j", 2)
    assert handed is not None and handed.hand_back.reason == "later"


def test_offsets_are_stored_in_order() -> None:
    offsets = Offsets()
    partition = ("refresh.tasks", 0)
    for offset in (5, 6, 7):
        offsets.begin(partition, offset)
    assert offsets.finish(partition, 6) == 5  # 5 is not done: reading resumes there
    assert offsets.finish(partition, 5) == 7
    assert offsets.finish(partition, 7) == 8


def test_endpoints_and_options() -> None:
    assert parse_endpoint("https://sluice:443", False) == parse_endpoint("sluice:443", True)
    assert parse_endpoint("http://127.0.0.1:50051/", True).target == "127.0.0.1:50051"
    options = ClientOptions.from_env({"SLUICE_TOPIC_PREFIX": "t_", "SLUICE_TOKEN": " abc "})
    assert options.bearer() == "abc"
    assert options.requested_topic_for("acme") == "t_jobs.requested"
    assert options.replace(tenant_topics=frozenset({"acme"})).requested_topic_for("acme") == "t_jobs.requested.acme"
    assert options.refresh_group() == "t_sluice-workers.refresh"
