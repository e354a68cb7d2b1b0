//! A Kafka producer that turns fatal — an idempotent producer does when the
//! broker lost its state (an unknown producer id, an out-of-order sequence)
//! — fails every send from then on. Sluice rebuilds it (readiness is
//! NOT_SERVING meanwhile) and the messages that failed are sent again, so
//! jobs keep flowing. The fault hook makes the producer fatal for good until
//! it is rebuilt, as librdkafka's is: without the rebuild no job would pass.
//!
//! The broker really losing its log, and a process stopping with the broker
//! gone, are tested on `sluice dev` as a process (crates/sluice-cli, tests
//! `broker_loss`): librdkafka 2.12 can crash on tansu's answers about
//! vanished topics, which would take this test binary down.

use std::time::Duration;

use sluice_common::FaultPoint;
use sluice_e2e::*;
use sluice_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_producer_that_turned_fatal_is_rebuilt_and_jobs_keep_flowing() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("fatal", &[])?, 1).await?;
    // The stack's one admission instance owns every job partition and
    // publishes the admitted jobs: its producer turns fatal at its next send.
    // (Adding a faulted instance and stopping the first one instead waited
    // on the group's rebalance, which tansu sometimes did not finish within
    // a minute.)
    let admission_faults = stack.admissions[0].faults.clone();
    admission_faults.arm(FaultPoint::ProducerFatal, 0, 1);
    stack.limit_grants[0].faults.arm(FaultPoint::ProducerFatal, 0, 1);
    let admission =
        sluice_proto::v1::admission_client::AdmissionClient::new(connect(&stack.admissions[0].endpoint).await?);
    for index in 0..3 {
        enqueue_with_id(
            &admission,
            &format!("fatal-{index}"),
            concurrency_job("acme", &format!("fatal-key-{index}"), 1, 0, "x"),
        )
        .await?;
    }
    for index in 0..3 {
        wait_status(
            &admission,
            &format!("fatal-{index}"),
            pb::JobStatus::Admitted,
            Duration::from_secs(60),
        )
        .await?;
    }
    // limit-grant sends grants on links, not Kafka; a floating key with a
    // waiter makes it publish a refresh-due event to Kafka.
    enqueue_with_id(
        &admission,
        "fatal-floating-0",
        floating_job("acme", "fatal-gpu", 1, 1000, "x"),
    )
    .await?;
    enqueue_with_id(
        &admission,
        "fatal-floating-1",
        floating_job("acme", "fatal-gpu", 1, 1000, "x"),
    )
    .await?;
    eventually(
        Duration::from_secs(60),
        "limit-grant's producer made fatal once",
        || async { Ok(stack.limit_grants[0].faults.fired(FaultPoint::ProducerFatal) == 1) },
    )
    .await?;
    assert_eq!(admission_faults.fired(FaultPoint::ProducerFatal), 1);
    assert_eq!(stack.limit_grants[0].faults.fired(FaultPoint::ProducerFatal), 1);
    eventually(Duration::from_secs(30), "serving again", || async {
        Ok(health_serving(&stack.admissions[0].endpoint).await?
            && health_serving(&stack.limit_grants[0].endpoint).await?)
    })
    .await?;
    stack.stop().await;
    Ok(())
}
