//! A partition's buffer between the consumer and its task is bounded by
//! bytes (`kafka.consumer_buffer_bytes`), not only by a count: a task that
//! falls behind holds at most that many bytes of fetched messages, however
//! large they are, and gets every message once it catches up.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use sluice_common::kafka::{
    ensure_topics, run_partitioned_consumer, ConsumerOptions, ConsumerProgress, OutMsg, PartitionInput,
    PartitionTaskError, PartitionTaskFactory, Publisher, TopicSpec,
};
use sluice_common::Shutdown;
use sluice_e2e::*;

/// A task that reads nothing until released, reporting how many bytes wait
/// for it (and the most it ever saw); then reads everything.
struct Stalled {
    buffered: Arc<AtomicUsize>,
    most_buffered: Arc<AtomicUsize>,
    release: Arc<tokio::sync::Notify>,
    seen: Arc<AtomicUsize>,
}

impl PartitionTaskFactory for Stalled {
    fn start(&self, mut input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>> {
        let buffered = self.buffered.clone();
        let most_buffered = self.most_buffered.clone();
        let release = self.release.clone();
        let seen = self.seen.clone();
        async move {
            let released = release.notified();
            tokio::pin!(released);
            loop {
                // What waits for the task, counted by messages (each is
                // MESSAGE bytes), not by the budget's own bookkeeping.
                let now = input.messages.len() * MESSAGE;
                buffered.store(now, Ordering::Relaxed);
                most_buffered.fetch_max(now, Ordering::Relaxed);
                tokio::select! {
                    _ = &mut released => break,
                    _ = input.stop.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
            loop {
                most_buffered.fetch_max(input.messages.len() * MESSAGE, Ordering::Relaxed);
                let message = tokio::select! {
                    _ = input.stop.cancelled() => return Ok(()),
                    received = input.messages.recv() => match received {
                        Some(message) => message,
                        None => return Ok(()),
                    },
                };
                seen.fetch_add(1, Ordering::Relaxed);
                input.offsets.store(message.offset + 1);
            }
        }
        .boxed()
    }
}

/// The partitioned consumer of `topic` in group `group`, running `task`
/// until `shutdown`.
fn spawn_consumer(
    config: &sluice_common::SluiceConfig,
    topic: &str,
    group: &str,
    task: impl PartitionTaskFactory + 'static,
    shutdown: &Shutdown,
) -> tokio::task::JoinHandle<Result<(), sluice_common::kafka::KafkaPlumbingError>> {
    let kafka = config.kafka.clone();
    let options = ConsumerOptions {
        group: config.group(group),
        topic: topic.to_string(),
        channel_capacity: 10_000,
        track_end: false,
        readiness: sluice_common::readiness::Readiness::new(),
    };
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        run_partitioned_consumer(
            &kafka,
            options,
            Arc::new(task),
            Arc::new(ConsumerProgress::default()),
            shutdown,
        )
        .await
    })
}

const BUDGET: usize = 1_000_000;
const MESSAGE: usize = 100_000;
const MESSAGES: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_falls_behind_holds_at_most_the_buffer_bytes() -> anyhow::Result<()> {
    init_logging();
    let config = test_config(
        "buffer",
        &[
            ("kafka.max_message_bytes", "200000"),
            ("admission.max_payload_bytes", "100000"),
            ("kafka.consumer_buffer_bytes", "1000000"),
        ],
    )?;
    let topic = config.topic("buffer-input");
    ensure_topics(
        &config.kafka,
        &[TopicSpec {
            name: topic.clone(),
            partitions: 1,
            internal: false,
        }],
        true,
    )
    .await?;
    let task = Stalled {
        buffered: Arc::new(AtomicUsize::new(0)),
        most_buffered: Arc::new(AtomicUsize::new(0)),
        release: Arc::new(tokio::sync::Notify::new()),
        seen: Arc::new(AtomicUsize::new(0)),
    };
    let (buffered, most_buffered, release, seen) = (
        task.buffered.clone(),
        task.most_buffered.clone(),
        task.release.clone(),
        task.seen.clone(),
    );
    let shutdown = Shutdown::new();
    let consumer = spawn_consumer(&config, &topic, "buffer-group", task, &shutdown);
    let topic_name: Arc<str> = Arc::from(topic.as_str());
    let messages = (0..MESSAGES)
        .map(|index| OutMsg {
            topic: topic_name.clone(),
            partition: Some(0),
            key: None,
            payload: vec![u8::try_from(index % 256).unwrap(); MESSAGE],
            headers: Vec::new(),
        })
        .collect();
    Publisher::new(&config.kafka)?.send_all(messages).await?;
    // 4 MB sent: the stalled task's buffer fills to its bound and no further.
    eventually(Duration::from_secs(60), "the buffer full", || async {
        Ok(buffered.load(Ordering::Relaxed) + MESSAGE > BUDGET)
    })
    .await?;
    assert!(
        most_buffered.load(Ordering::Relaxed) <= BUDGET,
        "{} bytes buffered, over the {BUDGET}-byte bound",
        most_buffered.load(Ordering::Relaxed)
    );
    release.notify_one();
    eventually(Duration::from_secs(60), "every message, once caught up", || async {
        Ok(seen.load(Ordering::Relaxed) == MESSAGES)
    })
    .await?;
    assert!(most_buffered.load(Ordering::Relaxed) <= BUDGET);
    shutdown.trigger();
    let _ = tokio::time::timeout(Duration::from_secs(30), consumer).await;
    Ok(())
}

/// Partition 0's task reads nothing until released; partition 1's counts
/// what it reads at once.
struct OneStalled {
    release: Arc<tokio::sync::Notify>,
    seen: [Arc<AtomicUsize>; 2],
    /// Partition 0's offsets, in the order its task got them.
    offsets: Arc<std::sync::Mutex<Vec<i64>>>,
}

impl PartitionTaskFactory for OneStalled {
    fn start(&self, mut input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>> {
        let release = self.release.clone();
        let Some(seen) = usize::try_from(input.partition)
            .ok()
            .and_then(|index| self.seen.get(index))
            .cloned()
        else {
            return async { Ok(()) }.boxed();
        };
        let stalled = input.partition == 0;
        let offsets = self.offsets.clone();
        async move {
            if stalled {
                tokio::select! {
                    _ = release.notified() => {}
                    _ = input.stop.cancelled() => return Ok(()),
                }
            }
            loop {
                let message = tokio::select! {
                    _ = input.stop.cancelled() => return Ok(()),
                    received = input.messages.recv() => match received {
                        Some(message) => message,
                        None => return Ok(()),
                    },
                };
                if stalled {
                    offsets.lock().unwrap().push(message.offset);
                }
                seen.fetch_add(1, Ordering::Relaxed);
                input.offsets.store(message.offset + 1);
            }
        }
        .boxed()
    }
}

/// One partition whose task is blocked (its buffer full, its messages
/// piling up in the topic) does not hold up another partition of the same
/// consumer: partition 1's messages reach its task while partition 0's task
/// reads nothing. Once released, partition 0 gets every message, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_partition_does_not_delay_the_others() -> anyhow::Result<()> {
    init_logging();
    let config = test_config(
        "onestalled",
        &[
            ("kafka.max_message_bytes", "200000"),
            ("admission.max_payload_bytes", "100000"),
            ("kafka.consumer_buffer_bytes", "1000000"),
        ],
    )?;
    let topic = config.topic("stalled-input");
    ensure_topics(
        &config.kafka,
        &[TopicSpec {
            name: topic.clone(),
            partitions: 2,
            internal: false,
        }],
        true,
    )
    .await?;
    let task = OneStalled {
        release: Arc::new(tokio::sync::Notify::new()),
        seen: [Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0))],
        offsets: Arc::new(std::sync::Mutex::new(Vec::new())),
    };
    let (release, seen, offsets) = (task.release.clone(), task.seen.clone(), task.offsets.clone());
    let shutdown = Shutdown::new();
    let consumer = spawn_consumer(&config, &topic, "stalled-group", task, &shutdown);
    let topic_name: Arc<str> = Arc::from(topic.as_str());
    let to = |partition: i32, count: usize, size: usize| -> Vec<OutMsg> {
        (0..count)
            .map(|index| OutMsg {
                topic: topic_name.clone(),
                partition: Some(partition),
                key: None,
                payload: vec![u8::try_from(index % 256).unwrap(); size],
                headers: Vec::new(),
            })
            .collect()
    };
    let publisher = Publisher::new(&config.kafka)?;
    // 4 MB for partition 0, four times what its task may hold.
    publisher.send_all(to(0, MESSAGES, MESSAGE)).await?;
    publisher.send_all(to(1, 1, 10)).await?;
    eventually(Duration::from_secs(60), "partition 1's first message", || async {
        Ok(seen[1].load(Ordering::Relaxed) == 1)
    })
    .await?;
    // Partition 0 is full and still blocked; partition 1 keeps flowing.
    publisher.send_all(to(1, 20, 10)).await?;
    eventually(
        Duration::from_secs(60),
        "partition 1's messages while partition 0 is blocked",
        || async { Ok(seen[1].load(Ordering::Relaxed) == 21) },
    )
    .await?;
    assert_eq!(
        seen[0].load(Ordering::Relaxed),
        0,
        "partition 0's task is still blocked"
    );
    release.notify_one();
    eventually(Duration::from_secs(60), "every message of partition 0", || async {
        Ok(seen[0].load(Ordering::Relaxed) >= MESSAGES)
    })
    .await?;
    // In order, each once, across the pause and the resume.
    let expected: Vec<i64> = (0..i64::try_from(MESSAGES)?).collect();
    shutdown.trigger();
    let _ = tokio::time::timeout(Duration::from_secs(30), consumer).await;
    assert_eq!(*offsets.lock().unwrap(), expected);
    Ok(())
}

/// A task that reads nothing until released, reporting how many messages
/// wait for it; then reads everything, keeping the offsets in order.
struct Released {
    waiting: Arc<AtomicUsize>,
    release: Arc<tokio::sync::Notify>,
    offsets: Arc<std::sync::Mutex<Vec<i64>>>,
}

impl PartitionTaskFactory for Released {
    fn start(&self, mut input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>> {
        let waiting = self.waiting.clone();
        let release = self.release.clone();
        let offsets = self.offsets.clone();
        async move {
            let released = release.notified();
            tokio::pin!(released);
            loop {
                waiting.store(input.messages.len(), Ordering::Relaxed);
                tokio::select! {
                    _ = &mut released => break,
                    _ = input.stop.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
            loop {
                let message = tokio::select! {
                    _ = input.stop.cancelled() => return Ok(()),
                    received = input.messages.recv() => match received {
                        Some(message) => message,
                        None => return Ok(()),
                    },
                };
                offsets.lock().unwrap().push(message.offset);
                input.offsets.store(message.offset + 1);
            }
        }
        .boxed()
    }
}

/// Issue 30: a burst larger than a task's buffer, produced as producers do
/// (many messages per batch), reaches the task whole once it catches up,
/// in order, each message once. When the partition was paused while its
/// task was behind, the resume fetched again from inside a batch, and the
/// test broker (tansu) answers such a fetch from the next batch on: the
/// rest of the batch never came (or, in the last batch, nothing did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_in_large_batches_reaches_a_task_that_was_behind_whole() -> anyhow::Result<()> {
    const SMALL: usize = 100;
    const BURST: usize = 3_000;
    const SMALL_BUDGET: usize = 20_000;
    init_logging();
    let mut config = test_config(
        "burst",
        &[
            ("kafka.max_message_bytes", "20000"),
            ("admission.max_payload_bytes", "1000"),
            ("kafka.consumer_buffer_bytes", "20000"),
            ("kafka.linger_ms", "50"),
        ],
    )?;
    // Many messages per produce batch, as a producer dumping a backlog sends them.
    config.kafka.producer_properties.clear();
    let topic = config.topic("burst-input");
    ensure_topics(
        &config.kafka,
        &[TopicSpec {
            name: topic.clone(),
            partitions: 1,
            internal: false,
        }],
        true,
    )
    .await?;
    let task = Released {
        waiting: Arc::new(AtomicUsize::new(0)),
        release: Arc::new(tokio::sync::Notify::new()),
        offsets: Arc::new(std::sync::Mutex::new(Vec::new())),
    };
    let (waiting, release, offsets) = (task.waiting.clone(), task.release.clone(), task.offsets.clone());
    let shutdown = Shutdown::new();
    let consumer = spawn_consumer(&config, &topic, "burst-group", task, &shutdown);
    let topic_name: Arc<str> = Arc::from(topic.as_str());
    let messages = (0..BURST)
        .map(|index| OutMsg {
            topic: topic_name.clone(),
            partition: Some(0),
            key: None,
            payload: vec![u8::try_from(index % 256).unwrap(); SMALL],
            headers: Vec::new(),
        })
        .collect();
    Publisher::new(&config.kafka)?.send_all(messages).await?;
    // The task's buffer holds 200 of the 3,000 messages: it is behind.
    eventually(Duration::from_secs(60), "the task's buffer full", || async {
        Ok(waiting.load(Ordering::Relaxed) * SMALL + SMALL > SMALL_BUDGET)
    })
    .await?;
    release.notify_one();
    eventually(Duration::from_secs(60), "every message of the burst", || async {
        Ok(offsets.lock().unwrap().len() >= BURST)
    })
    .await?;
    shutdown.trigger();
    let _ = tokio::time::timeout(Duration::from_secs(30), consumer).await;
    let expected: Vec<i64> = (0..i64::try_from(BURST)?).collect();
    assert_eq!(*offsets.lock().unwrap(), expected);
    Ok(())
}

/// Issue 30 end to end: a producer dumps a backlog onto `jobs.requested` in
/// large batches, many times what admission's request consumer buffers per
/// partition (20 KB here, 16 MiB by default): every request becomes a job.
/// Before, the request consumer paused a partition whose task was behind,
/// resumed inside a batch, and the rest of the batch was never read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_larger_than_the_consumer_buffer_is_saved_whole() -> anyhow::Result<()> {
    const JOBS: i64 = 3_000;
    init_logging();
    let mut config = test_config(
        "backlog",
        &[
            ("kafka.max_message_bytes", "20000"),
            ("admission.max_payload_bytes", "1000"),
            ("kafka.consumer_buffer_bytes", "20000"),
        ],
    )?;
    // Many requests per produce batch, as a producer dumping a backlog sends them.
    config.kafka.producer_properties.clear();
    let stack = Stack::start(config, 1).await?;
    let requests: Vec<sluice_proto::v1::JobRequest> = (0..JOBS)
        .map(|index| concurrency_job("backlog", &format!("key-{}", index % 10), 1_000, 50, &index.to_string()))
        .collect();
    RequestProducer::new(&stack.config)?.send(&requests).await?;
    let query = format!("SELECT count(*) FROM \"{}\".jobs", stack.config.schema("admission"));
    eventually(Duration::from_secs(120), "every request saved as a job", || async {
        let saved: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(query.clone()))
            .fetch_one(&stack.pool)
            .await?;
        Ok(saved == JOBS)
    })
    .await?;
    stack.stop().await;
    Ok(())
}
