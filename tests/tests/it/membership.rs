//! The partitioned consumer survives a lost group session: its own tansu
//! broker is frozen (SIGSTOP) for longer than the session timeout, so the
//! member's session expires; afterwards every message is still processed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use sluice_common::kafka::{
    ensure_topics, run_partitioned_consumer, ConsumerOptions, ConsumerProgress, OutMsg, PartitionInput,
    PartitionTaskError, PartitionTaskFactory, Publisher, TopicSpec,
};
use sluice_common::Shutdown;
use sluice_e2e::*;

/// Records every (partition, offset) it is given and stores the offsets.
struct Recording {
    seen: Arc<Mutex<HashSet<(i32, i64)>>>,
}

impl PartitionTaskFactory for Recording {
    fn start(&self, mut input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>> {
        let seen = self.seen.clone();
        async move {
            loop {
                let message = tokio::select! {
                    _ = input.stop.cancelled() => return Ok(()),
                    received = input.messages.recv() => match received {
                        Some(message) => message,
                        None => return Ok(()),
                    },
                };
                seen.lock().unwrap().insert((message.partition, message.offset));
                input.offsets.store(message.offset + 1);
            }
        }
        .boxed()
    }
}

async fn produce(publisher: &Publisher, topic: &Arc<str>, count: usize, tag: &str) -> anyhow::Result<()> {
    let messages = (0..count)
        .map(|index| OutMsg {
            topic: topic.clone(),
            partition: Some(i32::try_from(index % 2).unwrap()),
            key: None,
            payload: format!("{tag}-{index}").into_bytes(),
            headers: Vec::new(),
        })
        .collect();
    publisher.send_all(messages).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_group_session_was_lost_processes_everything_afterwards() -> anyhow::Result<()> {
    init_logging();
    let broker = PrivateBroker::start().await?;
    let config = test_config(
        "membership",
        &[
            ("kafka.brokers", broker.address.as_str()),
            ("kafka.session_timeout_ms", "6000"),
        ],
    )?;
    let topic_name = config.topic("member-input");
    let topic: Arc<str> = Arc::from(topic_name.as_str());
    ensure_topics(
        &config.kafka,
        &[TopicSpec {
            name: topic_name.clone(),
            partitions: 2,
            internal: false,
        }],
        true,
    )
    .await?;
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let shutdown = Shutdown::new();
    let consumer = tokio::spawn({
        let kafka = config.kafka.clone();
        let group = config.group("member-group");
        let seen = seen.clone();
        let shutdown = shutdown.clone();
        let topic_name = topic_name.clone();
        async move {
            run_partitioned_consumer(
                &kafka,
                ConsumerOptions {
                    group,
                    topic: topic_name,
                    channel_capacity: 100,
                    track_end: false,
                    readiness: sluice_common::readiness::Readiness::new(),
                },
                Arc::new(Recording { seen }),
                Arc::new(ConsumerProgress::default()),
                shutdown,
            )
            .await
        }
    });
    let publisher = Publisher::new(&config.kafka)?;
    produce(&publisher, &topic, 10, "before").await?;
    eventually(Duration::from_secs(60), "the first 10 messages", || async {
        Ok(seen.lock().unwrap().len() == 10)
    })
    .await?;

    // Freeze the broker past the session timeout: the member's session is lost.
    broker.signal("-STOP")?;
    tokio::time::sleep(Duration::from_secs(9)).await;
    broker.signal("-CONT")?;

    produce(&publisher, &topic, 10, "after").await?;
    eventually(
        Duration::from_secs(90),
        "all 20 messages after the lost session",
        || async { Ok(seen.lock().unwrap().len() == 20) },
    )
    .await?;
    shutdown.trigger();
    let _ = tokio::time::timeout(Duration::from_secs(30), consumer).await;
    Ok(())
}

/// Whether a partition's log was lost is read from the log itself, not
/// from the broker's high watermark alone: ten messages written in one
/// batch (tansu then reports the batch's base offset + 1 as the log end,
/// below messages it holds) are all there, and the offset after the last
/// one is not. An owner that had applied offset 5 saw "the broker lost the
/// log" (and replayed it) although nothing was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_is_lost_only_when_the_offset_is_not_there() -> anyhow::Result<()> {
    init_logging();
    let config = test_config("logprobe", &[])?;
    let topic_name = config.topic("probed");
    let topic: Arc<str> = Arc::from(topic_name.as_str());
    ensure_topics(
        &config.kafka,
        &[TopicSpec {
            name: topic_name.clone(),
            partitions: 1,
            internal: false,
        }],
        true,
    )
    .await?;
    let publisher = Publisher::new(&config.kafka)?;
    let messages = (0..10)
        .map(|index| OutMsg {
            topic: topic.clone(),
            partition: Some(0),
            key: None,
            payload: format!("m-{index}").into_bytes(),
            headers: Vec::new(),
        })
        .collect();
    publisher.send_all(messages).await?;
    let probe = Arc::new(sluice_common::kafka::probe_config(&config.kafka));
    let holds = |offset: i64| {
        sluice_common::kafka::log_holds_offset(probe.clone(), topic.clone(), 0, offset, Duration::from_secs(3))
    };
    assert_eq!(holds(0).await, Some(true));
    assert_eq!(holds(5).await, Some(true), "offset 5 is in the log");
    assert_eq!(holds(9).await, Some(true));
    assert_eq!(holds(10).await, Some(false), "the log ends at 10");
    assert_eq!(holds(5_000).await, Some(false));
    Ok(())
}
