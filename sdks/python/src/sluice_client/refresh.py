"""Floating-limit refresh handlers (docs/worker-protocol.md, §5): consume
``refresh.tasks`` in the group ``<prefix><group_id>.refresh``, compute each
key's new max with the application's handler, and report it with
``Refresh.ReportRefresh`` before the task's deadline.

A handler takes the ``RefreshTask`` (tenant and key, ``current_max``, the
limit's ``metadata``) and returns the new max (>= 1), or raises to report a
failure (the current max stays; the dispatcher retries with backoff). It may
be a plain function (run in a thread) or a coroutine function.

Offsets are stored once a task is dealt with (reported, skipped past its
deadline), in order per partition, and auto-committed; a redelivered task is
harmless (a report applies once).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, cast

import grpc
import grpc.aio

from . import _grpc
from .job import reported_text
from .options import ClientOptions
from .proto import refresh_pb2

if TYPE_CHECKING:
    import confluent_kafka

    from ._stream import Counters

__all__ = ["RefreshHandler", "RefreshTask"]

log = logging.getLogger("sluice_client.refresh")

RefreshTask = refresh_pb2.RefreshTask
RefreshHandler = Callable[[refresh_pb2.RefreshTask], Awaitable[int]] | Callable[[refresh_pb2.RefreshTask], int]

#: Wait at most this long in one poll (also how soon a stop is noticed).
POLL_TIMEOUT = 0.1


class Offsets:
    """Per partition, the offset up to which every message is dealt with."""

    def __init__(self) -> None:
        self.in_flight: dict[tuple[str, int], set[int]] = {}
        self.highest_done: dict[tuple[str, int], int] = {}
        self.stored: dict[tuple[str, int], int] = {}

    def begin(self, partition: tuple[str, int], offset: int) -> None:
        self.in_flight.setdefault(partition, set()).add(offset)

    def finish(self, partition: tuple[str, int], offset: int) -> int | None:
        """The position to store now (the next offset to read), if it moved."""
        in_flight = self.in_flight.setdefault(partition, set())
        in_flight.discard(offset)
        self.highest_done[partition] = max(self.highest_done.get(partition, -1), offset)
        position = min(in_flight) if in_flight else self.highest_done[partition] + 1
        if position <= self.stored.get(partition, -1):
            return None
        self.stored[partition] = position
        return position


def _now_ms() -> int:
    return int(time.time() * 1000)


class RefreshConsumer:
    """Runs a refresh handler on ``refresh.tasks`` until stopped."""

    def __init__(
        self,
        options: ClientOptions,
        handler: RefreshHandler,
        *,
        concurrency: int,
        shutdown_grace: float,
        counters: Counters,
    ) -> None:
        try:
            import confluent_kafka
        except ImportError as error:  # pragma: no cover - an install mistake
            raise ImportError("refresh handlers need confluent-kafka: pip install 'sluice-client[kafka]'") from error
        self.options = options
        self.handler = handler
        self.handler_is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004
        )
        self.concurrency = max(1, concurrency)
        self.shutdown_grace = shutdown_grace
        self.counters = counters
        self.topic = options.refresh_tasks_topic_name()
        config = options.kafka_config()
        config.update(
            {
                "group.id": options.refresh_group(),
                "enable.auto.commit": True,
                "enable.auto.offset.store": False,
                "auto.commit.interval.ms": 1000,
                "auto.offset.reset": "earliest",
                # Incremental rebalances: the other handlers keep consuming
                # while one joins or dies (docs/worker-protocol.md §1).
                "partition.assignment.strategy": "cooperative-sticky",
                # A killed handler's partitions move after this (librdkafka's
                # default is 45 s).
                "session.timeout.ms": 6000,
                "fetch.wait.max.ms": options.fetch_wait_max_ms,
            }
        )
        self.consumer = confluent_kafka.Consumer(config)
        # Every consumer call on one thread, none on the event loop.
        self.kafka_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sluice-refresh")
        self.offsets = Offsets()
        self.channel = _grpc.aio_channel(options.refresh_endpoint(), options.tls)
        self.report = _grpc.aio_unary(
            self.channel,
            _grpc.REFRESH + "ReportRefresh",
            refresh_pb2.ReportRefreshRequest,
            refresh_pb2.ReportRefreshResponse,
        )

    async def run(self, stopping: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.kafka_thread, self.consumer.subscribe, [self.topic])
        running: set[asyncio.Task[None]] = set()
        try:
            while not stopping.is_set():
                if len(running) >= self.concurrency:
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    continue
                message = await loop.run_in_executor(self.kafka_thread, self.consumer.poll, POLL_TIMEOUT)
                if message is None:
                    continue
                error = message.error()
                if error is not None:
                    log.warning("refresh tasks: kafka error %s", error)
                    continue
                partition = (message.topic() or self.topic, message.partition() or 0)
                offset = message.offset() or 0
                self.offsets.begin(partition, offset)
                task = asyncio.ensure_future(self.handle(message.value() or b""))
                running.add(task)
                task.add_done_callback(running.discard)
                task.add_done_callback(functools.partial(self.done, partition, offset))
            if running:
                _, late = await asyncio.wait(running, timeout=self.shutdown_grace)
                if late:
                    log.warning("%d refreshes still running at the end of the grace; the dispatcher retries them", len(late))
                    for task in late:
                        task.cancel()
        finally:
            await loop.run_in_executor(self.kafka_thread, self.close_consumer)
            self.kafka_thread.shutdown(wait=False)
            await self.channel.close(grace=None)

    def done(self, partition: tuple[str, int], offset: int, _task: object = None) -> None:
        position = self.offsets.finish(partition, offset)
        if position is None:
            return
        import confluent_kafka

        topic_partition = confluent_kafka.TopicPartition(partition[0], partition[1], position)
        self.kafka_thread.submit(self.store, topic_partition)

    def store(self, topic_partition: confluent_kafka.TopicPartition) -> None:
        try:
            self.consumer.store_offsets(offsets=[topic_partition])
        except Exception as error:  # noqa: BLE001 - a revoked partition: redelivered, harmless
            log.debug("storing a refresh offset failed: %s", error)

    def close_consumer(self) -> None:
        import confluent_kafka

        try:
            self.consumer.commit(asynchronous=False)
        except confluent_kafka.KafkaException as error:
            if error.args and getattr(error.args[0], "code", lambda: None)() != confluent_kafka.KafkaError._NO_OFFSET:
                log.warning("final refresh offset commit failed: %s", error)
        self.consumer.close()

    async def compute(self, task: refresh_pb2.RefreshTask) -> int:
        if self.handler_is_async:
            return await cast(Callable[[refresh_pb2.RefreshTask], Awaitable[int]], self.handler)(task)
        handler = cast(Callable[[refresh_pb2.RefreshTask], int], self.handler)
        return await asyncio.to_thread(handler, task)

    async def handle(self, value: bytes) -> None:
        task = refresh_pb2.RefreshTask()
        try:
            task.ParseFromString(value)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            log.error("skipping a message that is not a RefreshTask")
            return
        key = f"{task.key.tenant}/{task.key.key}"
        remaining = (task.deadline_ms - _now_ms()) / 1000 if task.deadline_ms > 0 else 30.0
        if remaining <= 0:
            # The dispatcher already counted it as failed and will retry.
            log.debug("refresh task %s for %s is past its deadline; skipped", task.task_id, key)
            return
        request = refresh_pb2.ReportRefreshRequest(task_id=task.task_id, key=task.key)
        try:
            new_max = await asyncio.wait_for(self.compute(task), timeout=remaining)
            request.new_max = int(new_max)
        except asyncio.TimeoutError:
            log.warning("refresh handler for %s ran past the task's deadline; not reported", key)
            return
        except Exception as error:  # noqa: BLE001 - a failed refresh keeps the current max
            text = str(error)
            request.error = reported_text(f"{type(error).__name__}: {text}" if text else type(error).__name__)
        delay = 0.1
        while True:
            try:
                response = await self.report(
                    request,
                    timeout=self.options.request_timeout,
                    metadata=_grpc.metadata(self.options),
                )
            except grpc.aio.AioRpcError as error:
                if task.deadline_ms > 0 and _now_ms() >= task.deadline_ms:
                    log.warning("could not report the refresh of %s before its deadline: %s", key, error.code())
                    return
                if error.code() not in _grpc.RETRYABLE:
                    log.error("ReportRefresh for %s refused: %s %s", key, error.code(), error.details())
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            self.counters.refreshes_reported += 1
            if not response.applied:
                log.info("refresh report for %s not applied: %s", key, response.detail)
            return
