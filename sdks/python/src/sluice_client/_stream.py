"""The worker on ``Work`` streams (docs/worker-protocol.md, §7), on asyncio.

One task owns the state (this module's ``StreamCore``, driven from one event
loop): streams, credits, running attempts, requests waiting for answers.

- **One stream per admission instance.** ``Admission.Instances`` on the
  configured endpoint lists them (asked again every 3 s); each gets a stream,
  opened with no credit, and a broken one is opened again at the next look.
- **Credits.** Free slots (``concurrency`` minus handlers running minus
  credits given) go to the streams with the fewest, one at a time; a freed
  slot goes back to the stream its job came from. When a stream has none
  and another holds more than its share and pushed nothing for 250 ms, the
  other gives the rest back (``withdraw``) to be spread again.
- **Confirmation and renewal.** A pushed attempt is heartbeaten at the next
  tick (250 ms), which confirms the push, then every third of
  ``min(lease_ms, stream_end_grace_ms)``. A renewal counts for that long from
  when its heartbeat was *sent*; an attempt not renewed in time is stopped as
  lease-lost (admission may run another attempt by then). A heartbeat goes on
  the job's own stream when it is open, so on a server that applies one
  stream's requests in order it is applied before the job's completion; a
  ``LEASE_LOST`` answer for an attempt already completed is ignored.
- **Broken streams.** The attempts pushed on it are heartbeaten at once on
  another stream (admission shortens their leases to the stream's end grace
  unless it hears from the worker); requests it did not answer are sent again
  on another stream. ``UNAVAILABLE`` answers are sent again after 200 ms.
- **Shutdown.** Credits are taken back (``withdraw``) and none are given;
  a job pushed meanwhile is handed back at once; running handlers have
  ``shutdown_grace`` to finish, then are stopped and handed back; the last
  answers are awaited (15 s at most), then the streams are closed.
"""

from __future__ import annotations

import asyncio
import collections
import collections.abc
import dataclasses
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import grpc.aio

from . import _grpc
from .job import DROPPED, Job, Outcome, StopReason, StopSignal, decide
from .options import ClientOptions, Endpoint, parse_endpoint
from .proto import admission_pb2

log = logging.getLogger("sluice_client.worker")

#: How often the instance list is asked again, and broken streams reopened.
DISCOVER_EVERY = 3.0
#: A request answered UNAVAILABLE (an owner moving) is sent again after this.
RESEND_AFTER = 0.2
#: Attempts per heartbeat or completion message, at most.
MAX_PER_MESSAGE = 500
#: How often due heartbeats are looked for (no fixed interval set).
HEARTBEAT_TICK = 0.25
#: A stream holding more than its share gives the rest back once it pushed
#: nothing for this long while another stream has no credit.
IDLE_BEFORE_WITHDRAW = 0.25
#: Messages buffered up one stream.
UP_BUFFER = 1024
#: After the shutdown grace, answers still missing are given up this much later.
GIVE_UP_AFTER_GRACE = 15.0

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]

JobHandler = Callable[[Job], Awaitable[None]] | Callable[[Job], None]


@dataclass
class Counters:
    """What the worker did since it started."""

    delivered: int = 0
    succeeded: int = 0
    failed: int = 0
    handed_back: int = 0
    cancelled: int = 0
    lease_lost: int = 0
    #: Completions admission answered STALE or NOT_FOUND.
    completions_refused: int = 0
    refreshes_reported: int = 0


@dataclass(frozen=True)
class WorkerStatus:
    """A snapshot of a running worker."""

    worker_id: str
    #: Streams whose ``opened`` came (registered with an instance).
    streams: int
    #: Attempts running (their outcome not decided yet).
    running: int
    #: Handler slots in use (a sync handler given up on holds its slot until
    #: its thread returns).
    busy: int
    #: Credits given and not used by a push, over every stream.
    credits: int
    draining: bool
    counters: Counters


@dataclass
class _Session:
    key: str
    endpoint: Endpoint
    up: asyncio.Queue[admission_pb2.WorkRequest | None]
    generation: int
    confirmed: bool = False
    credits: int = 0
    end_grace: float | None = None
    withdraws: bool = False
    withdrawing: bool = False
    last_push: float = 0.0
    task: asyncio.Task[None] | None = None


@dataclass
class _Running:
    signal: StopSignal
    endpoint: str
    lease: float
    lease_until: float
    heartbeat_at: float
    end_grace: float | None

    def renewal(self) -> float:
        """How long one renewal holds, from when its heartbeat was sent."""
        return self.lease if self.end_grace is None else min(self.lease, self.end_grace)


@dataclass
class _Pending:
    """A heartbeat or completion, preferably sent on ``endpoint``'s stream."""

    kind: str  # "heartbeat" | "complete"
    endpoint: str | None
    attempts: list[admission_pb2.JobAttempt] = field(default_factory=list)
    completions: list[admission_pb2.Completion] = field(default_factory=list)


@dataclass
class _Sent:
    request: _Pending
    endpoint: str
    generation: int
    at: float


def _is_async(handler: object) -> bool:
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 - callable objects
    return inspect.iscoroutinefunction(call)


class StreamCore:
    """The state of one stream worker; every method runs on its event loop."""

    def __init__(
        self,
        options: ClientOptions,
        handler: JobHandler,
        *,
        worker_id: str,
        task_groups: list[str],
        concurrency: int,
        heartbeat_interval: float | None,
        stop_grace: float,
        shutdown_grace: float,
        counters: Counters,
    ) -> None:
        self.options = options
        self.handler = handler
        self.handler_is_async = _is_async(handler)
        self.worker_id = worker_id
        self.task_groups = task_groups
        self.concurrency = concurrency
        self.heartbeat_interval = heartbeat_interval
        self.stop_grace = stop_grace
        self.shutdown_grace = shutdown_grace
        self.counters = counters
        self.loop = asyncio.get_running_loop()
        seed = options.admission_endpoint()
        self.seed = seed
        self.seed_key = ("https://" if seed.tls else "http://") + seed.target
        self.sessions: dict[str, _Session] = {}
        self.next_generation = 1
        self.running: dict[tuple[str, int], _Running] = {}
        self.busy = 0
        self.pending: dict[int, _Sent] = {}
        self.unsent: collections.deque[_Pending] = collections.deque()
        self.withdrawing: dict[int, str] = {}
        self.next_id = 1
        self.draining = False
        self.force_stop = asyncio.Event()
        self.changed = asyncio.Event()
        self.flush_scheduled = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.seed_channel = _grpc.aio_channel(seed, options.tls)
        self.snapshot = self.take_snapshot()
        self.instances_call = _grpc.aio_unary(
            self.seed_channel,
            _grpc.ADMISSION + "Instances",
            admission_pb2.InstancesRequest,
            admission_pb2.InstancesResponse,
        )

    # -- helpers ---------------------------------------------------------

    def now(self) -> float:
        return self.loop.time()

    def spawn(self, coroutine: Awaitable[None], name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def take_id(self) -> int:
        request_id = self.next_id
        self.next_id += 1
        return request_id

    def schedule_flush(self) -> None:
        """Send what waits at the end of this loop turn, so completions and
        credits of jobs that end together travel in one message each."""
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def status(self) -> WorkerStatus:
        """The snapshot taken at the last flush: safe to read from any thread."""
        return self.snapshot

    def take_snapshot(self) -> WorkerStatus:
        return WorkerStatus(
            worker_id=self.worker_id,
            streams=sum(1 for session in self.sessions.values() if session.confirmed),
            running=len(self.running),
            busy=self.busy,
            credits=sum(session.credits for session in self.sessions.values()),
            draining=self.draining,
            counters=dataclasses.replace(self.counters),
        )

    # -- discovery and streams -------------------------------------------

    async def discover_forever(self) -> None:
        # Also while draining: running attempts need a stream for their
        # heartbeats and completions (no credit is given then).
        while True:
            await self.discover()
            await asyncio.sleep(DISCOVER_EVERY)

    async def discover(self) -> None:
        """Open streams to the instances that have none."""
        targets: dict[str, Endpoint] = {}
        try:
            response = await self.instances_call(
                admission_pb2.InstancesRequest(),
                timeout=self.options.request_timeout,
                metadata=_grpc.metadata(self.options),
            )
            for instance in response.instances:
                endpoint = Endpoint(instance.address, instance.tls)
                key = instance.endpoint or ("https://" if instance.tls else "http://") + instance.address
                targets[key] = endpoint
            if not targets:
                # An older server: URLs only.
                for url in response.endpoints:
                    endpoint = parse_endpoint(url, self.options.tls is not None)
                    targets[("https://" if endpoint.tls else "http://") + endpoint.target] = endpoint
        except grpc.aio.AioRpcError as error:
            log.debug("asking %s for the admission instances failed (%s); using it", self.seed.target, error.code())
        if not targets:
            targets[self.seed_key] = self.seed
        for key, endpoint in sorted(targets.items()):
            if key not in self.sessions:
                self.open(key, endpoint)
        self.schedule_flush()

    def open(self, key: str, endpoint: Endpoint) -> None:
        """A stream to ``endpoint`` with no credits (``flush`` gives them)."""
        generation = self.next_generation
        self.next_generation += 1
        up: asyncio.Queue[admission_pb2.WorkRequest | None] = asyncio.Queue(maxsize=UP_BUFFER)
        up.put_nowait(
            admission_pb2.WorkRequest(
                open=admission_pb2.WorkOpen(worker_id=self.worker_id, task_groups=self.task_groups, credits=0)
            )
        )
        session = _Session(key=key, endpoint=endpoint, up=up, generation=generation, last_push=self.now())
        self.sessions[key] = session
        session.task = self.spawn(self.carry(session), f"work stream {key}")

    async def carry(self, session: _Session) -> None:
        """Requests up from the session's queue, everything down to ``down``."""
        channel = _grpc.aio_channel(session.endpoint, self.options.tls)
        work = _grpc.aio_stream(channel, _grpc.ADMISSION + "Work", admission_pb2.WorkRequest, admission_pb2.WorkResponse)

        async def requests() -> collections.abc.AsyncIterator[admission_pb2.WorkRequest]:
            while True:
                request = await session.up.get()
                if request is None:
                    return
                yield request

        try:
            call = work(requests(), metadata=_grpc.metadata(self.options))
            async for response in call:
                self.down(session, response)
        except grpc.aio.AioRpcError as error:
            log.debug("work stream to %s ended: %s %s", session.key, error.code(), error.details())
        except asyncio.CancelledError:
            pass
        finally:
            self.closed(session)
            await channel.close(grace=None)

    def closed(self, session: _Session) -> None:
        if self.sessions.get(session.key) is not session:
            return
        del self.sessions[session.key]
        log.debug("work stream to %s closed", session.key)
        now = self.now()
        # Admission shortens the leases of the attempts pushed on it unless
        # it hears from this worker: heartbeat them at once, on another stream.
        for running in self.running.values():
            if running.endpoint == session.key:
                running.heartbeat_at = now
        for request_id in [
            request_id
            for request_id, sent in self.pending.items()
            if sent.endpoint == session.key and sent.generation == session.generation
        ]:
            self.unsent.append(self.pending.pop(request_id).request)
        self.changed.set()
        self.schedule_flush()

    def down(self, session: _Session, response: admission_pb2.WorkResponse) -> None:
        which = response.WhichOneof("message")
        if which == "jobs":
            for dispatched in response.jobs.jobs:
                self.start(session, dispatched)
        elif which == "answer":
            self.answered(response.answer)
        elif which == "opened":
            session.confirmed = True
            grace_ms = response.opened.stream_end_grace_ms
            session.end_grace = grace_ms / 1000 if grace_ms > 0 else None
            session.withdraws = response.opened.withdraws
            if self.draining:
                self.withdraw_all(session)
        self.schedule_flush()

    # -- attempts --------------------------------------------------------

    def start(self, session: _Session, dispatched: admission_pb2.DispatchedJob) -> None:
        """Run a pushed job: it is claimed for this worker already."""
        session.credits = max(0, session.credits - 1)
        session.last_push = self.now()
        if not dispatched.HasField("job"):
            return
        admitted = dispatched.job
        key = (admitted.job_id, admitted.attempt)
        self.counters.delivered += 1
        if key in self.running:
            return  # pushed twice (a stream reopened mid-push): it runs once
        if self.draining:
            # Never started: give it back at once for another worker.
            self.counters.handed_back += 1
            completion = Outcome("handed_back", "worker shutting down").completion(*key)
            if completion is not None:
                self.unsent.append(_Pending("complete", session.key, completions=[completion]))
            return
        lease = max(admitted.lease_ms, 1000) / 1000
        signal = StopSignal()
        now = self.now()
        running = _Running(
            signal=signal,
            endpoint=session.key,
            lease=lease,
            lease_until=now,
            heartbeat_at=now,
            end_grace=session.end_grace,
        )
        running.lease_until = now + running.renewal()
        self.running[key] = running
        self.busy += 1
        job = Job(dispatched, self.worker_id, signal)
        self.spawn(self.run_attempt(key, running, job), f"job {admitted.job_id}/{admitted.attempt}")

    async def run_attempt(self, key: tuple[str, int], running: _Running, job: Job) -> None:
        ended = await self.supervise(job, running)
        outcome = decide(ended, running.signal.reason)
        self.finished(key, running, outcome)

    async def supervise(self, job: Job, running: _Running) -> BaseException | object | None:
        """Run the handler until it returns, or stop it: after its stop
        signal it has ``stop_grace`` to return; when the shutdown grace is
        over it is given up on at once. Returns None (it returned), the
        exception it raised, or ``DROPPED``."""
        endpoint = running.endpoint
        handling: asyncio.Future[None]
        if self.handler_is_async:
            handler = cast(Callable[[Job], Awaitable[None]], self.handler)
            handling = asyncio.ensure_future(handler(job))
            handling.add_done_callback(lambda _: self.slot_free(endpoint))
        else:
            handling = self.loop.create_future()
            self.run_in_thread(job, handling, endpoint)
        stop_wait = asyncio.ensure_future(running.signal.wait_async())
        force_wait = asyncio.ensure_future(self.force_stop.wait())
        try:
            first: set[asyncio.Future[Any]] = {handling, stop_wait, force_wait}
            await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
            if not handling.done() and not force_wait.done():
                # Asked to stop: give the handler its stop grace.
                graced: set[asyncio.Future[Any]] = {handling, force_wait}
                await asyncio.wait(graced, timeout=self.stop_grace)
            if handling.done():
                if handling.cancelled():
                    return DROPPED
                return handling.exception()
            if force_wait.done():
                running.signal.stop(StopReason.SHUTDOWN)
            handling.cancel()
            return DROPPED
        finally:
            stop_wait.cancel()
            force_wait.cancel()

    def run_in_thread(self, job: Job, handling: asyncio.Future[None], endpoint: str) -> None:
        handler = cast(Callable[[Job], None], self.handler)
        loop = self.loop

        def report(error: BaseException | None) -> None:
            if handling.done():
                return  # given up on already
            if error is None:
                handling.set_result(None)
            else:
                handling.set_exception(error)

        def work() -> None:
            error: BaseException | None = None
            try:
                handler(job)
            except BaseException as raised:  # noqa: BLE001 - any failure is the attempt's
                error = raised
            try:
                loop.call_soon_threadsafe(report, error)
                loop.call_soon_threadsafe(self.slot_free, endpoint)
            except RuntimeError:
                pass  # the worker's loop is closed: it stopped without us

        # A daemon thread: a handler that ignores its stop signal must not
        # keep the process from exiting.
        threading.Thread(target=work, name=f"sluice job {job.job_id}", daemon=True).start()

    def slot_free(self, endpoint: str) -> None:
        """A handler ended: its slot's credit goes back to its stream."""
        self.busy -= 1
        session = self.sessions.get(endpoint)
        if not self.draining and session is not None:
            session.credits += 1
            self.send_credits(session, 1)
        self.changed.set()
        self.schedule_flush()

    def finished(self, key: tuple[str, int], running: _Running, outcome: Outcome) -> None:
        if self.running.get(key) is running:
            del self.running[key]
        counters = self.counters
        if outcome.kind == "succeeded":
            counters.succeeded += 1
        elif outcome.kind == "failed":
            counters.failed += 1
            log.warning("job %s attempt %s failed: %s", key[0], key[1], outcome.message)
        elif outcome.kind == "handed_back":
            counters.handed_back += 1
        elif outcome.kind == "cancelled":
            counters.cancelled += 1
        else:
            counters.lease_lost += 1
            log.warning("job %s attempt %s: lease lost; handler stopped", key[0], key[1])
        completion = outcome.completion(*key)
        if completion is not None:
            self.unsent.append(_Pending("complete", running.endpoint, completions=[completion]))
        self.changed.set()
        self.schedule_flush()

    # -- answers ---------------------------------------------------------

    def answered(self, answer: admission_pb2.WorkAnswer) -> None:
        which = answer.WhichOneof("result")
        if which == "withdrawn":
            key = self.withdrawing.pop(answer.id, None)
            session = self.sessions.get(key) if key is not None else None
            if session is not None:
                session.withdrawing = False
                session.credits = max(0, session.credits - answer.withdrawn.credits)
            return
        sent = self.pending.pop(answer.id, None)
        if sent is None:
            return
        self.changed.set()
        if which == "completed":
            for completed in answer.completed.results:
                if completed.outcome != admission_pb2.COMPLETE_OUTCOME_ACCEPTED:
                    self.counters.completions_refused += 1
                    log.info(
                        "completion of %s attempt %s answered %s",
                        completed.job_id,
                        completed.attempt,
                        admission_pb2.CompleteOutcome.Name(completed.outcome),
                    )
        elif which == "heartbeats":
            for result in answer.heartbeats.results:
                running = self.running.get((result.job_id, result.attempt))
                if running is None:
                    continue  # completed meanwhile: whatever the answer, harmless
                if result.outcome == admission_pb2.HEARTBEAT_OUTCOME_EXTENDED:
                    # From when it was sent: admission renewed it no earlier.
                    running.lease_until = max(running.lease_until, sent.at + running.renewal())
                elif result.outcome == admission_pb2.HEARTBEAT_OUTCOME_CANCELLED:
                    running.signal.stop(StopReason.CANCELLED)
                else:
                    running.signal.stop(StopReason.LEASE_LOST)
        elif which == "error":
            if answer.error.code == INVALID_ARGUMENT:
                # Sending it again cannot help (the SDK built it).
                log.error("admission refused a work request: %s", answer.error.message)
                return
            log.debug("work request failed (%s %s); sending it again", answer.error.code, answer.error.message)
            request_id = self.take_id()
            self.pending[request_id] = sent
            self.loop.call_later(RESEND_AFTER, self.resend, request_id)

    def resend(self, request_id: int) -> None:
        sent = self.pending.pop(request_id, None)
        if sent is not None:
            self.unsent.append(sent.request)
            self.schedule_flush()

    # -- timers ----------------------------------------------------------

    async def tick_forever(self) -> None:
        every = max(self.heartbeat_interval or HEARTBEAT_TICK, 0.05)
        while True:
            await asyncio.sleep(every)
            self.rebalance_credits()
            self.heartbeat()

    def heartbeat(self) -> None:
        """Heartbeat the attempts that are due, each on its own stream when
        open; stop handlers whose lease went by without a renewal."""
        now = self.now()
        fixed = self.heartbeat_interval is not None
        due: dict[str, list[admission_pb2.JobAttempt]] = {}
        for (job_id, attempt), running in self.running.items():
            if running.lease_until <= now:
                running.signal.stop(StopReason.LEASE_LOST)
            if running.signal.reason is not None or (not fixed and running.heartbeat_at > now):
                continue
            running.heartbeat_at = now + running.renewal() / 3
            due.setdefault(running.endpoint, []).append(admission_pb2.JobAttempt(job_id=job_id, attempt=attempt))
        for endpoint, attempts in due.items():
            for start in range(0, len(attempts), MAX_PER_MESSAGE):
                self.unsent.append(_Pending("heartbeat", endpoint, attempts=attempts[start : start + MAX_PER_MESSAGE]))
        self.flush()

    def rebalance_credits(self) -> None:
        """When a stream has no credit, a stream holding more than its share
        that pushed nothing for ``IDLE_BEFORE_WITHDRAW`` gives the rest back
        (``spread_credits`` then gives it to the streams with the fewest):
        credits follow the work, and the work moves between instances."""
        if self.draining:
            return
        confirmed = [session for session in self.sessions.values() if session.confirmed]
        if len(confirmed) < 2 or not any(session.credits == 0 for session in confirmed):
            return
        free = max(0, self.concurrency - self.busy)
        share = max(free // len(confirmed), 1)
        now = self.now()
        for session in confirmed:
            if (
                session.withdraws
                and not session.withdrawing
                and session.credits > share
                and now - session.last_push >= IDLE_BEFORE_WITHDRAW
            ):
                self.withdraw(session, session.credits - share)

    def withdraw(self, session: _Session, credits: int) -> None:
        request_id = self.take_id()
        request = admission_pb2.WorkRequest(withdraw=admission_pb2.WorkWithdraw(id=request_id, credits=credits))
        try:
            session.up.put_nowait(request)
        except asyncio.QueueFull:
            return
        session.withdrawing = True
        self.withdrawing[request_id] = session.key

    def withdraw_all(self, session: _Session) -> None:
        if session.confirmed and session.withdraws and not session.withdrawing and session.credits > 0:
            self.withdraw(session, session.credits)

    # -- sending ---------------------------------------------------------

    def flush(self) -> None:
        """Send what waits, on the open streams; give free slots' credits to
        the streams with the fewest. Heartbeats go before completions."""
        self.flush_scheduled = False
        self.spread_credits()
        heartbeats: list[_Pending] = []
        completions: dict[str | None, list[admission_pb2.Completion]] = {}
        while self.unsent:
            pending = self.unsent.popleft()
            if pending.kind == "heartbeat":
                heartbeats.append(pending)
            else:
                completions.setdefault(pending.endpoint, []).extend(pending.completions)
        for pending in heartbeats:
            self.send(pending)
        for endpoint, batch in completions.items():
            for start in range(0, len(batch), MAX_PER_MESSAGE):
                self.send(_Pending("complete", endpoint, completions=batch[start : start + MAX_PER_MESSAGE]))
        self.snapshot = self.take_snapshot()

    def send(self, request: _Pending) -> None:
        """Send one request on its preferred stream when open, else on any;
        keep it until answered. Without an open stream it waits for one."""
        request_id = self.take_id()
        if request.kind == "heartbeat":
            message = admission_pb2.WorkRequest(
                heartbeat=admission_pb2.WorkHeartbeat(id=request_id, jobs=request.attempts)
            )
        else:
            message = admission_pb2.WorkRequest(
                complete=admission_pb2.WorkComplete(id=request_id, completions=request.completions)
            )
        candidates: list[_Session] = []
        preferred = self.sessions.get(request.endpoint) if request.endpoint is not None else None
        if preferred is not None:
            candidates.append(preferred)
        others = sorted(self.sessions.values(), key=lambda session: (not session.confirmed, session.key))
        candidates.extend(session for session in others if session is not preferred)
        for session in candidates:
            try:
                session.up.put_nowait(message)
            except asyncio.QueueFull:
                continue
            self.pending[request_id] = _Sent(request, session.key, session.generation, self.now())
            return
        self.unsent.append(request)

    def send_credits(self, session: _Session, credits: int) -> None:
        request = admission_pb2.WorkRequest(credits=admission_pb2.WorkCredits(credits=credits))
        try:
            session.up.put_nowait(request)
        except asyncio.QueueFull:
            # The stream is stuck or going away; its credits are spread again.
            session.credits = max(0, session.credits - credits)

    def spread_credits(self) -> None:
        """Free slots not held as credits by any stream go to the streams
        with the fewest, one at a time, so every instance can push."""
        if self.draining or not self.sessions:
            return
        given = sum(session.credits for session in self.sessions.values())
        free = self.concurrency - self.busy - given
        if free <= 0:
            return
        added: dict[str, int] = {}
        sessions = sorted(self.sessions.values(), key=lambda session: session.key)
        for _ in range(free):
            session = min(sessions, key=lambda candidate: candidate.credits)
            session.credits += 1
            added[session.key] = added.get(session.key, 0) + 1
        for key, credits in added.items():
            self.send_credits(self.sessions[key], credits)

    # -- running and draining --------------------------------------------

    def begin_drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        log.info("worker %s draining: %d running", self.worker_id, len(self.running))
        for session in list(self.sessions.values()):
            self.withdraw_all(session)
        self.changed.set()
        self.schedule_flush()

    def stop_now(self) -> None:
        """End the shutdown grace at once: stop every handler, hand back."""
        self.begin_drain()
        if not self.force_stop.is_set():
            log.info("worker %s: stopping %d running handlers", self.worker_id, len(self.running))
            for running in self.running.values():
                running.signal.stop(StopReason.SHUTDOWN)
            self.force_stop.set()

    def drained(self) -> bool:
        return not self.running and not self.pending and not self.unsent

    async def run(self, stopping: asyncio.Event) -> None:
        discover = self.spawn(self.discover_forever(), "discover instances")
        tick = self.spawn(self.tick_forever(), "heartbeats")
        try:
            await stopping.wait()
            self.begin_drain()
            grace_ends = self.now() + self.shutdown_grace
            give_up_at: float | None = None
            while not self.drained():
                now = self.now()
                if not self.force_stop.is_set() and now >= grace_ends:
                    self.stop_now()
                if self.force_stop.is_set() and give_up_at is None:
                    give_up_at = now + GIVE_UP_AFTER_GRACE
                if give_up_at is not None and now >= give_up_at:
                    log.warning(
                        "worker %s: giving up on %d unanswered requests", self.worker_id, len(self.pending) + len(self.unsent)
                    )
                    break
                deadline = give_up_at if give_up_at is not None else grace_ends
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout=max(0.0, deadline - now))
                except asyncio.TimeoutError:
                    pass
        finally:
            tick.cancel()
            discover.cancel()
            await self.close()
            self.snapshot = self.take_snapshot()

    async def close(self) -> None:
        sessions = list(self.sessions.values())
        for session in sessions:
            try:
                session.up.put_nowait(None)  # ends the requests: the stream closes
            except asyncio.QueueFull:
                pass
        carriers = [session.task for session in sessions if session.task is not None]
        if carriers:
            _, late = await asyncio.wait(carriers, timeout=2.0)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=2.0)
        # Handlers given up on (their tasks were cancelled) end on their own.
        for task in list(self.tasks):
            if not task.done() and task.get_name().startswith("job "):
                task.cancel()
        await self.seed_channel.close(grace=None)
