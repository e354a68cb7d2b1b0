#!/usr/bin/env python3
"""A Sluice worker in Python, following docs/worker-protocol.md.

It consumes admitted jobs from `jobs.admitted.<task_group>` in a consumer
group, claims each one with `Claim` before running it, heartbeats running
jobs well within their lease, stops a handler whose job was cancelled or
whose lease was lost, and reports the outcome with `Complete` (success,
failure, or hand-back on shutdown). With --refresh it also answers the
refresh tasks of floating concurrency limits (`refresh.tasks`) with
`ReportRefresh`.

    python generate_stubs.py
    python worker.py --admission 127.0.0.1:50051 --concurrency 4

Replace `run_job` (and `compute_new_max`) with your own code. The example
handler reads the payload as JSON: {"work_ms": 200} sleeps that long,
{"fail": "reason"} fails (add "non_retryable": true to end the job), any
other payload sleeps --default-work-ms.
"""

import argparse
import json
import logging
import os
import pathlib
import signal
import socket
import sys
import threading
import time
import uuid

import grpc
from confluent_kafka import Consumer, KafkaError

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "generated"))
try:
    from sluice.v1 import admission_pb2, admission_pb2_grpc, jobs_pb2, refresh_pb2, refresh_pb2_grpc
except ImportError:  # pragma: no cover - a setup mistake, not a runtime path
    sys.exit("stubs missing: run `python generate_stubs.py` first")

log = logging.getLogger("sluice-worker")

# gRPC codes worth retrying: the service is restarting, overloaded, or the
# call timed out. Anything else (INVALID_ARGUMENT, ...) is a bug in the caller.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
CALL_TIMEOUT_S = 10


class NonRetryableError(Exception):
    """Raised by a handler to fail the job now, whatever attempts remain."""


class StopRequested(Exception):
    """Raised inside a handler when Sluice asked it to stop."""


# ---------------------------------------------------------------------------
# Your code


def run_job(job, context):
    """The job handler. `job` is a sluice.v1.AdmittedJob. Long handlers call
    `context.check()` now and then: it raises StopRequested once the job was
    cancelled or its lease lost. Raise to fail the attempt."""
    try:
        spec = json.loads(job.payload.decode("utf-8") or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        spec = {}
    if not isinstance(spec, dict):
        spec = {}
    if "fail" in spec:
        if spec.get("non_retryable"):
            raise NonRetryableError(str(spec["fail"]))
        raise RuntimeError(str(spec["fail"]))
    work_ms = int(spec.get("work_ms", context.default_work_ms))
    deadline = time.monotonic() + work_ms / 1000
    while time.monotonic() < deadline:
        context.check()
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def compute_new_max(task):
    """The refresh handler of floating concurrency limits. `task` is a
    sluice.v1.RefreshTask; return the key's new max (>= 1) or raise. This
    example reads it from the key's metadata ("next_max"), else keeps the
    current max."""
    return int(task.metadata.get("next_max", task.current_max))


# ---------------------------------------------------------------------------
# The protocol


EMIT_LOCK = threading.Lock()


def emit(args, event, **fields):
    """One JSON line per protocol event on stdout (--json-events), for tests
    and for watching what the worker does."""
    if args.json_events:
        fields.update(event=event, at=time.monotonic())
        line = json.dumps(fields) + "\n"
        with EMIT_LOCK:  # one whole line at a time, whatever the thread
            sys.stdout.write(line)
            sys.stdout.flush()


def call_with_retry(what, function, request, give_up_at):
    """Call a gRPC method, retrying transient errors with backoff until
    `give_up_at` (monotonic seconds). Other errors raise at once."""
    delay = 0.1
    while True:
        try:
            return function(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            if error.code() not in RETRYABLE or time.monotonic() + delay > give_up_at:
                raise
            log.warning("%s: %s %s; retrying in %.1fs", what, error.code().name, error.details(), delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


class RunningJob:
    """A claimed attempt: what the heartbeat thread and the handler share."""

    def __init__(self, job, lease_ms, lease_expires_at_ms, default_work_ms):
        self.job = job
        self.lease_s = lease_ms / 1000
        # Local deadline: without a successful heartbeat by then, the lease is
        # gone as far as this worker can tell.
        self.lease_deadline = time.monotonic() + self.lease_s
        self.lease_expires_at_ms = lease_expires_at_ms
        self.default_work_ms = default_work_ms
        self.stop_reason = None  # "cancelled", "lease_lost" or "shutdown"
        self.stopped = threading.Event()

    def stop(self, reason):
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stopped.set()

    def check(self):
        if self.stopped.is_set():
            raise StopRequested(self.stop_reason)


class Worker:
    def __init__(self, args):
        self.args = args
        self.worker_id = args.worker_id or f"py-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.admission = admission_pb2_grpc.AdmissionStub(grpc.insecure_channel(grpc_target(args.admission)))
        self.running = {}  # (job_id, attempt) -> RunningJob
        self.lock = threading.Lock()
        self.slots = threading.Semaphore(args.concurrency)
        self.stopping = threading.Event()
        self.finished = 0
        self.threads = []

    # -- consuming and claiming ----------------------------------------------

    def consumer(self, topic, group):
        settings = {
            "bootstrap.servers": self.args.brokers,
            "group.id": group,
            # A new group starts at the oldest admitted job, so nothing
            # admitted before the first start is missed.
            "auto.offset.reset": "earliest",
            # Offsets are stored only once a message is dealt with, and
            # committed in the background.
            "enable.auto.offset.store": False,
            # Incremental rebalances: when a worker joins or dies, the
            # others keep their partitions and go on consuming.
            "partition.assignment.strategy": "cooperative-sticky",
            # A killed worker's partitions move after this (librdkafka's
            # default is 45 s).
            "session.timeout.ms": 6000,
            "fetch.wait.max.ms": self.args.fetch_wait_max_ms,
        }
        for setting in self.args.kafka_property:
            name, _, value = setting.partition("=")
            settings[name] = value
        consumer = Consumer(settings)
        consumer.subscribe([topic])
        return consumer

    def run(self):
        topic = f"{self.args.topic_prefix}jobs.admitted.{self.args.task_group}"
        consumer = self.consumer(topic, self.args.group)
        log.info("worker %s consuming %s (group %s, concurrency %d)",
                 self.worker_id, topic, self.args.group, self.args.concurrency)
        emit(self.args, "started", worker_id=self.worker_id, topic=topic)
        self.start_thread("heartbeats", self.heartbeat_loop)
        if self.args.refresh:
            self.start_thread("refresh", self.refresh_loop)
        try:
            while not self.stopping.is_set():
                # Fetch only what can start now: a worker at its limit must not
                # sit on admitted jobs another worker could run.
                free = self.take_free_slots()
                if free == 0:
                    continue
                messages = consumer.consume(num_messages=free, timeout=0.2)
                admitted = []
                for message in messages:
                    if message.error():
                        if message.error().code() != KafkaError._PARTITION_EOF:
                            log.warning("kafka: %s", message.error())
                        consumer.store_offsets(message=message)
                        continue
                    job = jobs_pb2.AdmittedJob()
                    job.ParseFromString(message.value() or b"")
                    admitted.append((job, message))
                self.slots_release(free - len(admitted))
                if admitted:
                    self.claim_and_start(admitted, consumer)
        finally:
            self.shutdown()
            consumer.close()

    def take_free_slots(self):
        if not self.slots.acquire(timeout=0.2):
            return 0
        taken = 1
        while taken < self.args.concurrency and self.slots.acquire(blocking=False):
            taken += 1
        return taken

    def slots_release(self, count):
        for _ in range(count):
            self.slots.release()

    def claim_and_start(self, admitted, consumer):
        request = admission_pb2.ClaimRequest(
            worker_id=self.worker_id,
            jobs=[admission_pb2.JobAttempt(job_id=job.job_id, attempt=job.attempt) for job, _ in admitted],
        )
        try:
            # Nobody else can run these attempts until a claim wins, so a
            # failing Claim can be retried for a while; if admission stays
            # away, it re-sends the jobs after claim_timeout.
            response = call_with_retry("Claim", self.admission.Claim, request, time.monotonic() + 30)
        except grpc.RpcError as error:
            log.error("Claim failed: %s %s; the jobs will be re-sent", error.code().name, error.details())
            self.slots_release(len(admitted))
            return
        for (job, message), result in zip(admitted, response.results):
            # The claim's outcome is durable in admission: a redelivery of this
            # message could only be TAKEN or STALE now.
            consumer.store_offsets(message=message)
            outcome = admission_pb2.ClaimOutcome.Name(result.outcome)
            if result.outcome != admission_pb2.CLAIM_OUTCOME_CLAIMED:
                # TAKEN: another claim won (maybe ours, for a duplicate
                # delivery). STALE: an old attempt, or cancelled/finished.
                # NOT_FOUND: no such job. In every case: drop it.
                log.info("job %s attempt %d not ours: %s", job.job_id, job.attempt, outcome)
                emit(self.args, "not_claimed", job_id=job.job_id, attempt=job.attempt, outcome=outcome)
                self.slots.release()
                continue
            running = RunningJob(job, result.lease_ms, result.lease_expires_at_ms, self.args.default_work_ms)
            with self.lock:
                self.running[(job.job_id, job.attempt)] = running
            emit(self.args, "claimed", job_id=job.job_id, attempt=job.attempt, lease_ms=result.lease_ms)
            self.start_thread(f"job {job.job_id}", lambda running=running: self.run_one(running))

    def start_thread(self, name, target):
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)
        self.threads = [thread for thread in self.threads if thread.is_alive()]

    # -- running and completing ----------------------------------------------

    def run_one(self, running):
        job = running.job
        completion = admission_pb2.Completion(job_id=job.job_id, attempt=job.attempt)
        try:
            run_job(job, running)
            # A handler that finished its work reports success even if a stop
            # came meanwhile (a cancelled job still ends CANCELLED).
            completion.success.SetInParent()
            outcome = "succeeded"
        except StopRequested:
            outcome = running.stop_reason
            if outcome == "cancelled":
                # Any completion confirms a cancel; the job ends CANCELLED.
                completion.failure.error = "stopped: cancel requested"
            elif outcome == "shutdown":
                completion.hand_back.reason = "worker shutting down"
        except NonRetryableError as error:
            completion.failure.error = str(error) or type(error).__name__
            completion.failure.non_retryable = True
            outcome = "failed"
        except Exception as error:  # noqa: BLE001 - any handler error fails the attempt
            completion.failure.error = f"{type(error).__name__}: {error}"
            outcome = "failed"
        # Before Complete: nothing can take this job's place until Sluice has
        # the completion, so claimed -> handler_done is a safe run interval.
        emit(self.args, "handler_done", job_id=job.job_id, attempt=job.attempt, outcome=outcome)
        try:
            if outcome == "lease_lost":
                # The attempt is no longer ours: Complete would answer STALE.
                log.warning("job %s attempt %d: lease lost, handler stopped", job.job_id, job.attempt)
                emit(self.args, "lease_lost", job_id=job.job_id, attempt=job.attempt)
            else:
                self.complete(running, completion, outcome)
        finally:
            with self.lock:
                self.running.pop((job.job_id, job.attempt), None)
            self.slots.release()

    def complete(self, running, completion, outcome):
        job = running.job
        request = admission_pb2.CompleteRequest(worker_id=self.worker_id, completions=[completion])
        try:
            # Retrying is useful only while the lease lasts; after that the
            # attempt ends by lease expiry whatever this worker says.
            response = call_with_retry("Complete", self.admission.Complete, request, running.lease_deadline)
        except grpc.RpcError as error:
            log.error("Complete of %s attempt %d failed: %s %s",
                      job.job_id, job.attempt, error.code().name, error.details())
            emit(self.args, "complete_failed", job_id=job.job_id, attempt=job.attempt, code=error.code().name)
            return
        result = response.results[0]
        result_name = admission_pb2.CompleteOutcome.Name(result.outcome)
        status = jobs_pb2.JobStatus.Name(result.status)
        emit(self.args, "completed", job_id=job.job_id, attempt=job.attempt, outcome=outcome,
             result=result_name, status=status)
        log.info("job %s attempt %d %s: %s, job now %s", job.job_id, job.attempt, outcome, result_name, status)
        if result.outcome == admission_pb2.COMPLETE_OUTCOME_ACCEPTED and outcome != "shutdown":
            with self.lock:
                self.finished += 1
                done = self.args.exit_after and self.finished >= self.args.exit_after
            if done:
                log.info("finished %d jobs (--exit-after): stopping", self.finished)
                self.stopping.set()

    # -- heartbeats ------------------------------------------------------------

    def heartbeat_loop(self):
        while not self.stopping.is_set() or self.running:
            with self.lock:
                running = list(self.running.values())
            # A third of the shortest lease, so one lost heartbeat costs nothing.
            interval = min([job.lease_s for job in running] or [3.0]) / 3
            time.sleep(max(0.05, min(interval, 10.0)))
            with self.lock:
                running = [job for job in self.running.values() if not job.stopped.is_set()]
            if running:
                self.heartbeat(running)

    def heartbeat(self, running):
        request = admission_pb2.HeartbeatRequest(
            worker_id=self.worker_id,
            jobs=[admission_pb2.JobAttempt(job_id=job.job.job_id, attempt=job.job.attempt) for job in running],
        )
        sent_at = time.monotonic()
        try:
            response = self.admission.Heartbeat(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            log.warning("Heartbeat failed: %s %s", error.code().name, error.details())
            for job in running:
                if time.monotonic() > job.lease_deadline:
                    job.stop("lease_lost")
            return
        by_attempt = {(job.job.job_id, job.job.attempt): job for job in running}
        for result in response.results:
            job = by_attempt.get((result.job_id, result.attempt))
            if job is None:
                continue
            if result.outcome == admission_pb2.HEARTBEAT_OUTCOME_EXTENDED:
                job.lease_deadline = sent_at + job.lease_s
                job.lease_expires_at_ms = result.lease_expires_at_ms
            elif result.outcome == admission_pb2.HEARTBEAT_OUTCOME_CANCELLED:
                emit(self.args, "cancel_requested", job_id=result.job_id, attempt=result.attempt)
                job.stop("cancelled")
            else:
                job.stop("lease_lost")

    # -- floating-limit refreshes -----------------------------------------------

    def refresh_loop(self):
        refresh = refresh_pb2_grpc.RefreshStub(grpc.insecure_channel(grpc_target(self.args.refresh_dispatcher)))
        topic = f"{self.args.topic_prefix}refresh.tasks"
        consumer = self.consumer(topic, f"{self.args.group}-refresh")
        try:
            while not self.stopping.is_set():
                message = consumer.poll(0.2)
                if message is None:
                    continue
                if message.error():
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("kafka: %s", message.error())
                    continue
                task = refresh_pb2.RefreshTask()
                task.ParseFromString(message.value() or b"")
                self.answer_refresh(refresh, task)
                consumer.store_offsets(message=message)
        finally:
            consumer.close()

    def answer_refresh(self, refresh, task):
        key = f"{task.key.tenant}/{task.key.key}"
        now_ms = time.time() * 1000
        if task.deadline_ms and now_ms > task.deadline_ms:
            # The dispatcher already counted it as failed and will retry with
            # a new task: an answer now would be ignored.
            log.info("refresh task %s for %s is past its deadline; skipped", task.task_id, key)
            return
        request = refresh_pb2.ReportRefreshRequest(task_id=task.task_id, key=task.key)
        try:
            request.new_max = compute_new_max(task)
        except Exception as error:  # noqa: BLE001 - a failed refresh keeps the current max
            request.error = f"{type(error).__name__}: {error}"
        give_up_at = time.monotonic() + max(1.0, (task.deadline_ms - now_ms) / 1000)
        try:
            response = call_with_retry("ReportRefresh", refresh.ReportRefresh, request, give_up_at)
        except grpc.RpcError as error:
            log.error("ReportRefresh for %s failed: %s %s", key, error.code().name, error.details())
            return
        emit(self.args, "refresh_reported", key=key, task_id=task.task_id,
             new_max=request.new_max if request.HasField("new_max") else None,
             error=request.error or None, applied=response.applied, detail=response.detail)
        log.info("refresh of %s: %s (applied=%s %s)", key,
                 request.new_max if request.HasField("new_max") else request.error,
                 response.applied, response.detail)

    # -- shutdown ----------------------------------------------------------------

    def shutdown(self):
        """Stop fetching; let running jobs finish within the grace period;
        hand back the rest so their tickets return at once."""
        self.stopping.set()
        deadline = time.monotonic() + self.args.grace_s
        while time.monotonic() < deadline:
            with self.lock:
                if not self.running:
                    break
            time.sleep(0.05)
        with self.lock:
            left = list(self.running.values())
        for job in left:
            log.info("handing back job %s attempt %d", job.job.job_id, job.job.attempt)
            job.stop("shutdown")
        # The handlers see the stop flag and hand their jobs back themselves.
        for thread in list(self.threads):
            if thread.name.startswith("job "):
                thread.join(timeout=5)
        emit(self.args, "stopped", finished=self.finished)


def grpc_target(endpoint):
    """grpcio wants host:port; accept http://host:port as the CLI prints it."""
    for scheme in ("http://", "grpc://"):
        if endpoint.startswith(scheme):
            return endpoint[len(scheme):]
    return endpoint


def parse_args(argv):
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=env("SLUICE_BROKERS", "127.0.0.1:9092"))
    parser.add_argument("--admission", default=env("SLUICE_ADMISSION_ENDPOINT", "127.0.0.1:50051"))
    parser.add_argument("--refresh-dispatcher", default=env("SLUICE_REFRESH_DISPATCHER_ENDPOINT", "127.0.0.1:50054"))
    parser.add_argument("--topic-prefix", default=env("SLUICE_TOPIC_PREFIX", ""),
                        help="kafka.topic_prefix of the Sluice deployment")
    parser.add_argument("--task-group", default="default")
    parser.add_argument("--group", default="",
                        help="Kafka consumer group (default: <topic prefix>sluice-python-worker)")
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--concurrency", type=int, default=4, help="jobs this process runs at once")
    parser.add_argument("--refresh", action="store_true", help="also answer floating-limit refresh tasks")
    parser.add_argument("--default-work-ms", type=int, default=200)
    parser.add_argument("--grace-s", type=float, default=10.0,
                        help="on SIGTERM, how long running jobs may finish before they are handed back")
    parser.add_argument("--exit-after", type=int, default=0, help="stop after this many completed jobs (0: never)")
    parser.add_argument("--fetch-wait-max-ms", type=int, default=int(env("SLUICE_FETCH_WAIT_MAX_MS", "5")),
                        help="5 suits the tansu dev broker; real Kafka is fine with 500")
    parser.add_argument("--kafka-property", action="append", default=[], metavar="NAME=VALUE",
                        help="extra librdkafka setting, repeatable")
    parser.add_argument("--json-events", action="store_true", help="print one JSON line per protocol event")
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    args.group = args.group or f"{args.topic_prefix}sluice-python-worker"
    return args


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = Worker(args)

    def on_signal(signum, _frame):
        log.info("signal %d: stopping (grace %.1fs)", signum, args.grace_s)
        worker.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.run()


if __name__ == "__main__":
    main()
