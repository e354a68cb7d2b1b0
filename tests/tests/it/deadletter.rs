//! Malformed producer messages go to the dead-letter topic with the reason;
//! the consumer goes on and the next valid job is admitted.

use std::time::Duration;

use prost::Message as _;
use sluice_e2e::*;
use sluice_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_dead_lettered_with_the_reason_and_the_next_job_is_admitted() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("deadletter", &[("kafka.partitions.requested", "1")])?, 1).await?;
    let producer = RequestProducer::new(&stack.config)?;
    let no_tenant = pb::JobRequest {
        tenant: String::new(),
        ..concurrency_job("acme", "k", 1, 0, "bad")
    };
    let undeclared_group = pb::JobRequest {
        task_group: "nope".to_string(),
        ..concurrency_job("acme", "k", 1, 0, "bad")
    };
    let valid = concurrency_job("acme", "dl-key", 1, 0, "good");
    producer
        .send_messages(vec![
            RawRequest {
                partition: None,
                payload: b"\xff\xfe not protobuf".to_vec(),
                ..Default::default()
            },
            RawRequest {
                partition: None,
                payload: no_tenant.encode_to_vec(),
                ..Default::default()
            },
            RawRequest {
                partition: None,
                payload: undeclared_group.encode_to_vec(),
                ..Default::default()
            },
            RawRequest {
                partition: None,
                payload: valid.encode_to_vec(),
                ..Default::default()
            },
        ])
        .await?;

    let consumer = dead_letter_reader(&stack.config)?;
    let mut reasons = Vec::new();
    while reasons.len() < 3 {
        let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv()).await??;
        let reason = header_text(&message, "sluice-deadletter-reason");
        assert!(!reason.is_empty(), "dead letters carry a reason");
        assert!(
            !header_text(&message, "sluice-source-offset").is_empty(),
            "dead letters say where they came from"
        );
        reasons.push(reason);
    }
    assert!(reasons[0].contains("not a protobuf"), "{reasons:?}");
    assert!(reasons[1].starts_with("tenant: must not be empty"), "{reasons:?}");
    assert!(
        reasons[2].starts_with("task_group: undeclared task group \"nope\""),
        "{reasons:?}"
    );

    eventually(Duration::from_secs(30), "the valid job admitted", || async {
        let statuses = stack.job_statuses().await?;
        Ok(statuses.get(&(pb::JobStatus::Admitted as i16)) == Some(&1))
    })
    .await?;
    assert_eq!(
        stack.job_statuses().await?.values().sum::<i64>(),
        1,
        "only the valid request became a job"
    );
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_with_its_own_topic_is_refused_elsewhere_and_its_topic_carries_only_its_requests() -> anyhow::Result<()>
{
    let config = test_config(
        "tenanttopic",
        &[("kafka.partitions.requested", "1"), ("topics.tenant_requested", "acme")],
    )?;
    let stack = Stack::start(config, 1).await?;
    let acme_topic = stack.config.tenant_requested_topic("acme");
    let own = RequestProducer::to_topic(&stack.config, &acme_topic)?;
    let shared = RequestProducer::new(&stack.config)?;
    own.send(&[
        concurrency_job("acme", "k", 5, 0, "acme on its topic"),
        concurrency_job("globex", "k", 5, 0, "globex on acme's topic"),
    ])
    .await?;
    shared
        .send(&[
            concurrency_job("acme", "k", 5, 0, "acme on the shared topic"),
            concurrency_job("globex", "k", 5, 0, "globex on the shared topic"),
        ])
        .await?;

    let consumer = dead_letter_reader(&stack.config)?;
    let mut refused = Vec::new();
    while refused.len() < 2 {
        let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv()).await??;
        refused.push((
            header_text(&message, "sluice-deadletter-class"),
            header_text(&message, "sluice-deadletter-reason"),
        ));
    }
    refused.sort();
    assert!(
        refused.iter().all(|(class, _)| class == "tenant_mismatch"),
        "{refused:?}"
    );
    assert!(
        refused
            .iter()
            .any(|(_, reason)| reason.contains("names tenant \"globex\"") && reason.contains(&acme_topic)),
        "{refused:?}"
    );
    assert!(
        refused
            .iter()
            .any(|(_, reason)| reason.contains("tenant \"acme\" sends its requests on its own topic")),
        "{refused:?}"
    );
    eventually(
        Duration::from_secs(30),
        "the two rightful requests admitted",
        || async {
            let statuses = stack.job_statuses().await?;
            Ok(statuses.get(&(pb::JobStatus::Admitted as i16)) == Some(&2))
        },
    )
    .await?;
    let query = format!(
        "SELECT tenant FROM \"{}\".jobs ORDER BY tenant",
        stack.config.schema("admission")
    );
    let tenants: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(query))
        .fetch_all(&stack.pool)
        .await?;
    assert_eq!(tenants, vec!["acme".to_string(), "globex".to_string()]);
    stack.stop().await;
    Ok(())
}
