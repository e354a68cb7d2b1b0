//! An admitted job whose partition of `jobs.admitted.<group>` nobody
//! consumes (its worker hangs while its Kafka client still heartbeats, or
//! the group is slow to hand a dead worker's partitions on) is published
//! again after the claim timeout under a new key, on a partition picked
//! anew, where a live worker gets it.

use std::time::Duration;

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use sluice_common::kafka::client_config;
use sluice_e2e::{claim_one, concurrency_job, keyed_partition, test_config, Stack};
use sluice_proto::v1 as pb;

use prost::Message as _;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_on_a_partition_nobody_consumes_is_sent_again_to_another() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("stranded", &[("admission.claim_timeout", "1s")])?, 1).await?;
    stack.wait_owned(Duration::from_secs(60)).await?;
    let partitions = stack.config.kafka.partitions.admitted;
    assert!(partitions >= 2, "the test needs two admitted partitions");
    // A job first published to partition 0, which nobody consumes here,
    // and published again (one claim timeout later) to partition 1.
    let job_id = (0..)
        .map(|index| format!("stranded-{index}"))
        .find(|job_id| {
            let first = sluice_admission::effects::admitted_key(job_id, 1, 0);
            let again = sluice_admission::effects::admitted_key(job_id, 1, 1);
            keyed_partition(first.as_bytes(), partitions) == 0 && keyed_partition(again.as_bytes(), partitions) == 1
        })
        .unwrap_or_default();

    // The only live worker reads partition 1.
    let topic = stack.config.admitted_topic("default");
    let mut settings = client_config(&stack.config.kafka);
    settings.set(
        "group.id",
        format!("{}stranded-worker", stack.config.kafka.topic_prefix),
    );
    let consumer: StreamConsumer = settings.create()?;
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(&topic, 1, Offset::Beginning)?;
    consumer.assign(&assignment)?;

    let mut admission = stack.admission_client().await?;
    let mut request = concurrency_job("acme", "stranded", 1, 50, "x");
    request.job_id = Some(job_id.clone());
    admission.enqueue(pb::EnqueueRequest { job: Some(request) }).await?;

    let received = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let message = consumer.recv().await?;
            let job = pb::AdmittedJob::decode(message.payload().unwrap_or_default())?;
            if job.job_id == job_id {
                let key = String::from_utf8_lossy(message.key().unwrap_or_default()).to_string();
                return anyhow::Ok((job, key));
            }
        }
    })
    .await;
    let (job, key) = match received {
        Ok(received) => received?,
        Err(_) => anyhow::bail!("{job_id} never reached partition 1 within 30 s (claim timeout 1 s)"),
    };
    assert_eq!(job.attempt, 1);
    assert_eq!(key, sluice_admission::effects::admitted_key(&job_id, 1, 1));
    assert_eq!(
        claim_one(&admission, "live-worker", &job_id, 1).await?,
        pb::ClaimOutcome::Claimed as i32
    );
    stack.stop().await;
    Ok(())
}
