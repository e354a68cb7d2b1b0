#!/usr/bin/env python3
"""A Sluice worker in Python on `Work` streams (docs/worker-protocol.md, §7).

No Kafka: the worker asks admission for its instances (`Instances`), opens
one `Work` stream to each, and gives them credits for its free slots.
Admission pushes jobs already claimed for this worker (dispatch is the
claim); the worker runs each one, heartbeats it (the first heartbeat also
confirms the push), and completes it on the stream it came from.

    python generate_stubs.py
    python stream_worker.py --admission 127.0.0.1:50051 --concurrency 4

Replace `run_job` with your own code; it is worker.py's example handler
(the payload as JSON: {"work_ms": 200}, {"fail": "reason"}).
"""

import argparse
import itertools
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import uuid

import grpc

from worker import NonRetryableError, RunningJob, StopRequested, admission_pb2, admission_pb2_grpc, emit, grpc_target, run_job

log = logging.getLogger("sluice-stream-worker")

HEARTBEAT_TICK_S = 0.25
DISCOVER_EVERY_S = 3.0


class Stream:
    """One `Work` stream to one admission instance."""

    def __init__(self, worker, endpoint):
        self.worker = worker
        self.endpoint = endpoint
        self.up = queue.Queue()
        self.alive = True
        self.credits = 0  # given and not used by a push
        self.channel = grpc.insecure_channel(grpc_target(endpoint))
        stub = admission_pb2_grpc.AdmissionStub(self.channel)
        self.up.put(admission_pb2.WorkRequest(open=admission_pb2.WorkOpen(
            worker_id=worker.worker_id, task_groups=[worker.args.task_group], credits=0)))
        self.thread = threading.Thread(target=self.read, args=(stub,), name=f"stream {endpoint}", daemon=True)
        self.thread.start()

    def requests(self):
        while True:
            request = self.up.get()
            if request is None:
                return
            yield request

    def read(self, stub):
        try:
            for response in stub.Work(self.requests()):
                self.worker.events.put(("down", self, response))
        except grpc.RpcError as error:
            log.info("work stream to %s ended: %s", self.endpoint, error.code())
        self.worker.events.put(("closed", self, None))

    def send(self, request):
        if self.alive:
            self.up.put(request)
        return self.alive

    def close(self):
        self.alive = False
        self.up.put(None)


class StreamWorker:
    def __init__(self, args):
        self.args = args
        self.worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.events = queue.Queue()
        self.streams = {}  # endpoint -> Stream
        self.running = {}  # (job_id, attempt) -> dict(stream, running, heartbeat_at, lease_until)
        self.pending = {}  # request id -> (kind, payload) until answered
        self.ids = itertools.count(1)
        self.stopping = threading.Event()
        self.finished = 0

    def discover(self):
        try:
            channel = grpc.insecure_channel(grpc_target(self.args.admission))
            answer = admission_pb2_grpc.AdmissionStub(channel).Instances(admission_pb2.InstancesRequest(), timeout=10)
            endpoints = list(answer.endpoints) or [self.args.admission]
            channel.close()
        except grpc.RpcError as error:
            log.warning("asking for the admission instances failed (%s); using %s", error.code(), self.args.admission)
            endpoints = [self.args.admission]
        for endpoint in endpoints:
            if endpoint not in self.streams and not self.stopping.is_set():
                self.streams[endpoint] = Stream(self, endpoint)

    def free_slots(self):
        given = sum(stream.credits for stream in self.streams.values() if stream.alive)
        return self.args.concurrency - len(self.running) - given

    def spread_credits(self):
        """Free slots go to the open streams with the fewest credits."""
        if self.stopping.is_set():
            return
        alive = [stream for stream in self.streams.values() if stream.alive]
        for _ in range(max(0, self.free_slots())):
            if not alive:
                return
            stream = min(alive, key=lambda s: s.credits)
            stream.credits += 1
            stream.send(admission_pb2.WorkRequest(credits=admission_pb2.WorkCredits(credits=1)))

    def request(self, kind, payload, preferred=None):
        """Send a heartbeat or completion on `preferred`, else any open stream; keep it until answered."""
        request_id = next(self.ids)
        if kind == "complete":
            message = admission_pb2.WorkRequest(complete=admission_pb2.WorkComplete(id=request_id, completions=payload))
        else:
            message = admission_pb2.WorkRequest(heartbeat=admission_pb2.WorkHeartbeat(id=request_id, jobs=payload))
        streams = ([preferred] if preferred else []) + list(self.streams.values())
        for stream in streams:
            if stream.alive and stream.send(message):
                self.pending[request_id] = (kind, payload, stream)
                return
        self.pending[request_id] = (kind, payload, None)  # sent again by the next tick

    def start(self, stream, dispatched):
        stream.credits = max(0, stream.credits - 1)
        job = dispatched.job
        key = (job.job_id, job.attempt)
        if key in self.running:
            return
        running = RunningJob(job, max(job.lease_ms, 1000), dispatched.lease_expires_at_ms, self.args.default_work_ms)
        entry = {"stream": stream, "running": running, "heartbeat_at": time.monotonic(),
                 "lease_until": time.monotonic() + running.lease_s}
        self.running[key] = entry
        emit(self.args, "claimed", job_id=job.job_id, attempt=job.attempt)

        def run():
            completion = admission_pb2.Completion(job_id=job.job_id, attempt=job.attempt)
            try:
                run_job(job, running)
                completion.success.SetInParent()
            except StopRequested:
                if running.stop_reason == "lease_lost":
                    completion = None  # no longer ours: Complete would answer STALE
                else:  # any completion confirms a cancel; the job ends CANCELLED
                    completion.failure.error = "stopped: cancel requested"
            except NonRetryableError as error:
                completion.failure.error = str(error)[:16000] or type(error).__name__
                completion.failure.non_retryable = True
            except Exception as error:  # noqa: BLE001 - any handler error fails the attempt
                completion.failure.error = f"{type(error).__name__}: {error}"[:16000]
            emit(self.args, "handler_done", job_id=job.job_id, attempt=job.attempt)
            self.events.put(("finished", key, completion))

        threading.Thread(target=run, name=f"job {job.job_id}", daemon=True).start()

    def on_answer(self, answer):
        sent = self.pending.pop(answer.id, None)
        if sent is None:
            return
        kind, payload, _stream = sent
        which = answer.WhichOneof("result")
        if which == "error":
            code = answer.error.code
            if code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
                log.error("admission refused a %s: %s", kind, answer.error.message)
                return
            self.pending[answer.id] = (kind, payload, None)  # sent again by the next tick
            return
        if which == "completed":
            for result in answer.completed.results:
                emit(self.args, "completed", job_id=result.job_id, attempt=result.attempt,
                     outcome=admission_pb2.CompleteOutcome.Name(result.outcome))
            return
        for result in answer.heartbeats.results:
            entry = self.running.get((result.job_id, result.attempt))
            if entry is None:
                continue
            if result.outcome == admission_pb2.HEARTBEAT_OUTCOME_EXTENDED:
                entry["lease_until"] = time.monotonic() + entry["running"].lease_s
            elif result.outcome == admission_pb2.HEARTBEAT_OUTCOME_CANCELLED:
                entry["running"].stop("cancelled")
            else:
                entry["running"].stop("lease_lost")

    def tick(self):
        now = time.monotonic()
        due = []
        for (job_id, attempt), entry in self.running.items():
            running = entry["running"]
            if entry["lease_until"] <= now:
                running.stop("lease_lost")
            if not running.stopped.is_set() and entry["heartbeat_at"] <= now:
                entry["heartbeat_at"] = now + running.lease_s / 3
                due.append(admission_pb2.JobAttempt(job_id=job_id, attempt=attempt))
        if due:
            self.request("heartbeat", due)
        for request_id, (kind, payload, stream) in list(self.pending.items()):
            if stream is None or not stream.alive:
                del self.pending[request_id]
                self.request(kind, payload)

    def run(self):
        emit(self.args, "started", worker_id=self.worker_id)
        self.discover()
        next_tick = next_discover = time.monotonic()
        while True:
            if self.stopping.is_set() and not self.running and not self.pending:
                break
            try:
                kind, subject, value = self.events.get(timeout=HEARTBEAT_TICK_S)
            except queue.Empty:
                kind = None
            if kind == "down":
                which = value.WhichOneof("message")
                if which == "jobs":
                    for dispatched in value.jobs.jobs:
                        self.start(subject, dispatched)
                elif which == "answer":
                    self.on_answer(value.answer)
            elif kind == "closed":
                subject.alive = False
                self.streams.pop(subject.endpoint, None)
            elif kind == "finished":
                entry = self.running.pop(subject)
                if value is not None:
                    self.request("complete", [value], entry["stream"])
                self.finished += 1
                if self.args.exit_after and self.finished >= self.args.exit_after:
                    self.stopping.set()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + HEARTBEAT_TICK_S
                self.tick()
            if now >= next_discover and not self.stopping.is_set():
                next_discover = now + DISCOVER_EVERY_S
                self.discover()
            self.spread_credits()
        for stream in self.streams.values():
            stream.close()
        emit(self.args, "stopped", finished=self.finished)


def parse_args(argv):
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--admission", default=env("SLUICE_ADMISSION_ENDPOINT", "127.0.0.1:50051"),
                        help="any admission instance; the worker finds the others")
    parser.add_argument("--task-group", default="default")
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--concurrency", type=int, default=4, help="jobs this process runs at once")
    parser.add_argument("--default-work-ms", type=int, default=200)
    parser.add_argument("--exit-after", type=int, default=0, help="stop after this many finished jobs (0: never)")
    parser.add_argument("--json-events", action="store_true", help="print one JSON line per protocol event")
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = StreamWorker(args)
    signal.signal(signal.SIGTERM, lambda *_: worker.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: worker.stopping.set())
    worker.run()


if __name__ == "__main__":
    main()
