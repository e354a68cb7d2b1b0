//! JSON job requests on `jobs.requested` (`content-type: application/json`):
//! good ones are admitted and run like protobuf ones; bad JSON, unknown
//! fields and invalid values are dead-lettered with the reason, and the
//! consumer goes on.

use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use sluice_common::kafka::client_config;
use sluice_common::{Shutdown, SluiceConfig};
use sluice_e2e::*;
use sluice_proto::v1 as pb;

use crate::support::LOW_CONNECTIONS;

fn json_request(body: &str, content_type: &str) -> RawRequest {
    RawRequest {
        partition: None,
        key: None,
        payload: body.as_bytes().to_vec(),
        headers: vec![("content-type".to_string(), content_type.as_bytes().to_vec())],
    }
}

/// One dead letter: the reason header, the other headers, the payload.
pub struct DeadLetter {
    pub reason: String,
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
}

pub async fn read_dead_letters(config: &SluiceConfig, count: usize) -> anyhow::Result<Vec<DeadLetter>> {
    let mut settings = client_config(&config.kafka);
    settings
        .set("group.id", format!("{}dlq-reader", config.kafka.topic_prefix))
        .set("auto.offset.reset", "earliest");
    let consumer: StreamConsumer = settings.create()?;
    consumer.subscribe(&[&config.topic(&config.topics.deadletter)])?;
    let mut letters = Vec::new();
    while letters.len() < count {
        let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv()).await??;
        let headers: Vec<(String, String)> = message
            .headers()
            .map(|headers| {
                headers
                    .iter()
                    .map(|header| {
                        (
                            header.key.to_string(),
                            String::from_utf8_lossy(header.value.unwrap_or_default()).to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let reason = headers
            .iter()
            .find(|(name, _)| name == "sluice-deadletter-reason")
            .map(|(_, value)| value.clone())
            .unwrap_or_default();
        letters.push(DeadLetter {
            reason,
            headers,
            payload: message.payload().unwrap_or_default().to_vec(),
        });
    }
    Ok(letters)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_requests_are_admitted_and_run_and_bad_ones_are_dead_lettered_with_the_reason() -> anyhow::Result<()> {
    let mut settings = LOW_CONNECTIONS.to_vec();
    settings.push(("kafka.partitions.requested", "1"));
    let stack = Stack::start(test_config("jsonrequests", &settings)?, 1).await?;
    let stop = Shutdown::new();
    let recorder = Arc::new(Recorder::default());
    tokio::spawn(run_worker(
        stack.config.clone(),
        stack.admissions[0].endpoint.clone(),
        WorkerOptions {
            worker_id: "json-worker".to_string(),
            task_group: "default".to_string(),
            group: format!("{}workers", stack.config.kafka.topic_prefix),
            concurrency: 4,
            min_run: Duration::from_millis(10),
            max_run: Duration::from_millis(20),
        },
        recorder.clone(),
        stop.clone(),
    ));

    let producer = RequestProducer::new(&stack.config)?;
    let same_invalid_request = pb::JobRequest {
        tenant: String::new(),
        ..concurrency_job("acme", "k", 1, 0, "x")
    };
    let bad_json = r#"{"tenant": "acme", "task_group": "default""#;
    producer
        .send_messages(vec![
            // 0: good, text payload, every kind of limit.
            json_request(
                r#"{"job_id": "json-good", "tenant": "acme", "task_group": "default", "priority": 5,
                    "payload": "{\"hello\": \"world\"}",
                    "retry": {"max_attempts": 2, "initial_backoff": "1s", "on_lease_expiry": "fail"},
                    "limits": [
                      {"concurrency": {"key": "json-key", "max_concurrency": 2}},
                      {"floating": {"key": "json-float", "default_max": 3, "refresh_interval_ms": "60000",
                                    "metadata": {"pool": "a"}}},
                      {"rate": {"inline": {"name": "json-api", "limit": 100, "duration_ms": 1000}}},
                      {"rate": {"rate_limit_key": "no-such-resource"}}
                    ]}"#,
                "application/json",
            ),
            // 1: not JSON.
            json_request(bad_json, "application/json"),
            // 2: an unknown field, nested.
            json_request(
                r#"{"tenant": "acme", "task_group": "default",
                    "limits": [{"concurrency": {"key": "k", "max_concurrency": 1, "burst": 3}}]}"#,
                "application/json",
            ),
            // 3: an invalid value, refused by the validation protobuf requests get.
            json_request(
                r#"{"tenant": "acme", "task_group": "default",
                    "limits": [{"concurrency": {"key": "k", "max_concurrency": 0}}]}"#,
                "application/json",
            ),
            // 4: a wrong type.
            json_request(
                r#"{"tenant": "acme", "task_group": "default", "priority": "high"}"#,
                "application/json",
            ),
            // 5 and 6: the same invalid request as JSON and as protobuf.
            json_request(r#"{"tenant": "", "task_group": "default"}"#, "application/json"),
            RawRequest {
                partition: None,
                payload: same_invalid_request.encode_to_vec(),
                ..Default::default()
            },
            // 7: good after the bad ones, binary payload, charset parameter.
            json_request(
                r#"{"job_id": "json-after-bad", "tenant": "acme", "task_group": "default",
                    "payload_base64": "AAEC/w==", "run_at": "2001-01-01T00:00:00Z"}"#,
                "application/json; charset=utf-8",
            ),
        ])
        .await?;

    let letters = read_dead_letters(&stack.config, 6).await?;
    let reasons: Vec<&str> = letters.iter().map(|letter| letter.reason.as_str()).collect();
    assert!(
        reasons[0].starts_with("message is not valid JSON: EOF while parsing an object"),
        "{reasons:#?}"
    );
    assert!(
        reasons[1]
            .starts_with("limits[0].concurrency.burst: unknown field (expected one of: key, max_concurrency, shadow)"),
        "{reasons:#?}"
    );
    assert!(
        reasons[2].starts_with("limits[0].concurrency.max_concurrency: must be at least 1"),
        "{reasons:#?}"
    );
    assert_eq!(
        reasons[3], "priority: must be an integer from 0 to 4294967295",
        "{reasons:#?}"
    );
    assert_eq!(reasons[4], "tenant: must not be empty", "{reasons:#?}");
    assert_eq!(reasons[4], reasons[5], "JSON and protobuf requests are validated alike");
    assert_eq!(
        letters[0].payload,
        bad_json.as_bytes(),
        "the dead letter keeps the message"
    );
    for letter in &letters[..5] {
        let header = |name: &str| {
            letter
                .headers
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.clone())
        };
        assert_eq!(header("content-type").as_deref(), Some("application/json"));
        assert_eq!(
            header("sluice-source-topic"),
            Some(stack.config.topic(&stack.config.topics.requested))
        );
        assert!(header("sluice-source-offset").is_some());
    }

    let admission = stack.admission_client().await?;
    let good = wait_status(
        &admission,
        "json-good",
        pb::JobStatus::Succeeded,
        Duration::from_secs(30),
    )
    .await?;
    assert_eq!(good.priority, 5);
    assert_eq!(good.max_attempts, 2);
    let kinds: Vec<i32> = good.acquisition_order.iter().map(|step| step.kind).collect();
    assert_eq!(
        kinds,
        vec![
            // Own keys sorted by (tenant, key): json-float before json-key.
            pb::LimitKind::Floating as i32,
            pb::LimitKind::Concurrency as i32,
            pb::LimitKind::Rate as i32,
            pb::LimitKind::Rate as i32
        ]
    );
    let after_bad = wait_status(
        &admission,
        "json-after-bad",
        pb::JobStatus::Succeeded,
        Duration::from_secs(30),
    )
    .await?;
    assert_eq!(after_bad.run_at_ms, Some(978_307_200_000));
    // The worker records a run once its Complete has been answered.
    eventually(Duration::from_secs(10), "both runs recorded", || async {
        Ok(recorder.completed() == 2)
    })
    .await?;
    let payloads: std::collections::HashMap<String, String> = recorder
        .runs()
        .into_iter()
        .map(|run| (run.job_id, run.payload))
        .collect();
    assert_eq!(payloads["json-good"], r#"{"hello": "world"}"#);
    assert_eq!(
        payloads["json-after-bad"],
        String::from_utf8_lossy(&[0x00, 0x01, 0x02, 0xff])
    );
    assert_eq!(
        stack.job_statuses().await?.values().sum::<i64>(),
        2,
        "only the two good requests became jobs"
    );
    stop.trigger();
    stack.stop().await;
    Ok(())
}
