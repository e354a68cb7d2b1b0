"""Workers: run admitted jobs pushed on ``Work`` streams, and (optionally)
floating-limit refresh tasks.

:class:`AsyncWorker` runs on an asyncio event loop; :class:`Worker` is the
same worker for code without one (``run()`` blocks). Both take a handler that
is a coroutine function (run on the loop) or a plain function (run in a
thread of its own); see :class:`~sluice_client.Job` for what it gets and how
it reports. What the worker does for you is in ``sluice_client._stream``'s
docstring and the README.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Sequence

from ._stream import Counters, JobHandler, StreamCore, WorkerStatus
from .options import ClientOptions
from .refresh import RefreshConsumer, RefreshHandler

__all__ = ["AsyncWorker", "Worker", "WorkerStatus", "Counters", "JobHandler", "default_worker_id"]

log = logging.getLogger("sluice_client.worker")


def default_worker_id() -> str:
    """Host name, process id and a random suffix: unique per process."""
    host = os.environ.get("HOSTNAME") or socket.gethostname() or "worker"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class AsyncWorker:
    """A worker on ``Work`` streams, on asyncio.

    ``handler`` runs each pushed job (a coroutine function, or a plain
    function run in a thread). ``task_groups``: the groups whose jobs this
    worker runs. ``concurrency``: handlers at once in this process (the
    credits it gives). ``refresh_handler``: also answer floating-limit
    refresh tasks (needs Kafka: ``options.brokers``). Timers in seconds:

    - ``heartbeat_interval``: heartbeat every running attempt this often
      (default: each one a third of ``min(lease, stream end grace)`` after
      the last, the first at the next 250 ms tick);
    - ``stop_grace`` (5): after a stop (cancel, lost lease), how long a
      handler has to return before it is given up on;
    - ``shutdown_grace`` (30): on shutdown, how long running handlers have
      to finish before they are stopped and their jobs handed back.
    """

    def __init__(
        self,
        options: ClientOptions,
        handler: JobHandler,
        *,
        task_groups: Sequence[str] = ("default",),
        concurrency: int = 10,
        worker_id: str | None = None,
        heartbeat_interval: float | None = None,
        stop_grace: float = 5.0,
        shutdown_grace: float = 30.0,
        refresh_handler: RefreshHandler | None = None,
        refresh_concurrency: int = 4,
    ) -> None:
        if not task_groups:
            raise ValueError("task_groups: name at least one task group")
        if isinstance(task_groups, str):
            raise TypeError("task_groups: a sequence of names, not one string")
        self.options = options
        self.handler = handler
        self.task_groups = list(task_groups)
        self.concurrency = max(1, concurrency)
        self.worker_id = worker_id or default_worker_id()
        self.heartbeat_interval = heartbeat_interval
        self.stop_grace = stop_grace
        self.shutdown_grace = shutdown_grace
        self.refresh_handler = refresh_handler
        self.refresh_concurrency = refresh_concurrency
        self.counters = Counters()
        self._core: StreamCore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._stop_requested = False
        self._stop_now_requested = False
        self._lock = threading.Lock()

    def status(self) -> WorkerStatus:
        """A snapshot: open streams, running attempts, counters."""
        core = self._core
        if core is None:
            return WorkerStatus(self.worker_id, 0, 0, 0, 0, self._stop_requested, Counters(**vars(self.counters)))
        return core.status()

    def stop(self) -> None:
        """Begin the drain: no more jobs; running ones have the shutdown
        grace to finish. Callable from any thread, before or during ``run``."""
        with self._lock:
            self._stop_requested = True
            loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._apply_stop)

    def stop_now(self) -> None:
        """End the grace now: stop the running handlers, hand their jobs
        back, and return. Callable from any thread."""
        with self._lock:
            self._stop_requested = True
            self._stop_now_requested = True
            loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._apply_stop)

    def _apply_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()
        if self._stop_now_requested and self._core is not None:
            self._core.stop_now()

    def _on_signal(self) -> None:
        if self._stop_requested:
            log.info("second signal: stopping running handlers now")
            self.stop_now()
        else:
            log.info("signal: draining (a second one stops running handlers now)")
            self.stop()

    async def run(self, *, handle_signals: bool = False) -> None:
        """Run until :meth:`stop`, then drain and return. With
        ``handle_signals`` (main thread only), SIGTERM and SIGINT start the
        drain and a second one ends its grace at once."""
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        core = StreamCore(
            self.options,
            self.handler,
            worker_id=self.worker_id,
            task_groups=self.task_groups,
            concurrency=self.concurrency,
            heartbeat_interval=self.heartbeat_interval,
            stop_grace=self.stop_grace,
            shutdown_grace=self.shutdown_grace,
            counters=self.counters,
        )
        refresh = (
            RefreshConsumer(
                self.options,
                self.refresh_handler,
                concurrency=self.refresh_concurrency,
                shutdown_grace=self.shutdown_grace,
                counters=self.counters,
            )
            if self.refresh_handler is not None
            else None
        )
        with self._lock:
            self._loop = loop
            self._stopping = stopping
            self._core = core
        if self._stop_requested:
            self._apply_stop()
        signals = (signal.SIGTERM, signal.SIGINT)
        if handle_signals:
            for number in signals:
                loop.add_signal_handler(number, self._on_signal)
        log.info("worker %s started: task groups %s, concurrency %d", self.worker_id, self.task_groups, self.concurrency)
        refresh_task = asyncio.ensure_future(refresh.run(stopping)) if refresh is not None else None
        try:
            await core.run(stopping)
            if refresh_task is not None:
                await refresh_task
        finally:
            if refresh_task is not None and not refresh_task.done():
                refresh_task.cancel()
            if handle_signals:
                for number in signals:
                    loop.remove_signal_handler(number)
            with self._lock:
                self._loop = None
                self._stopping = None
            log.info("worker %s stopped", self.worker_id)


class Worker:
    """The blocking twin of :class:`AsyncWorker` (same arguments): ``run()``
    runs an event loop of its own in the calling thread until :meth:`stop`
    (from another thread or a handler) or, with ``handle_signals``, SIGTERM
    or SIGINT. Plain-function handlers run in threads of their own."""

    def __init__(
        self,
        options: ClientOptions,
        handler: JobHandler,
        *,
        task_groups: Sequence[str] = ("default",),
        concurrency: int = 10,
        worker_id: str | None = None,
        heartbeat_interval: float | None = None,
        stop_grace: float = 5.0,
        shutdown_grace: float = 30.0,
        refresh_handler: RefreshHandler | None = None,
        refresh_concurrency: int = 4,
    ) -> None:
        self._worker = AsyncWorker(
            options,
            handler,
            task_groups=task_groups,
            concurrency=concurrency,
            worker_id=worker_id,
            heartbeat_interval=heartbeat_interval,
            stop_grace=stop_grace,
            shutdown_grace=shutdown_grace,
            refresh_handler=refresh_handler,
            refresh_concurrency=refresh_concurrency,
        )

    @property
    def worker_id(self) -> str:
        return self._worker.worker_id

    def status(self) -> WorkerStatus:
        return self._worker.status()

    def stop(self) -> None:
        self._worker.stop()

    def stop_now(self) -> None:
        self._worker.stop_now()

    def run(self, *, handle_signals: bool | None = None) -> None:
        """Block until stopped and drained. Signals are handled by default
        when called from the main thread."""
        if handle_signals is None:
            handle_signals = threading.current_thread() is threading.main_thread()
        asyncio.run(self._worker.run(handle_signals=handle_signals))
