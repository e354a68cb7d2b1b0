//! Input Sluice does not control, on the real broker and PostgreSQL: no
//! message stops a partition. Producer messages that can never be jobs are
//! dead-lettered with the reason (none lost, whatever their size); internal
//! messages that can never be applied are set aside in a quarantine table;
//! bad gRPC input answers INVALID_ARGUMENT naming the field; and every valid
//! job sent after the poison is admitted.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use rand::Rng;
use sluice_common::hostile::HostileRequests;
use sluice_common::kafka::OutMsg;
use sluice_common::partition::{key_partition, rate_key_partition};
use sluice_common::FaultPoint;
use sluice_e2e::*;
use sluice_proto::v1 as pb;

async fn all_serving(stack: &Stack) -> anyhow::Result<bool> {
    for node in stack
        .admissions
        .iter()
        .chain(&stack.limit_grants)
        .chain(&stack.rate_windows)
        .chain(&stack.refresh_dispatchers)
    {
        if !health_serving(&node.endpoint).await.unwrap_or(false) {
            return Ok(false);
        }
    }
    Ok(true)
}

async fn job_count(stack: &Stack) -> anyhow::Result<i64> {
    Ok(stack.job_statuses().await?.values().sum())
}

/// The job's status as GetJob says (`None`: no such job).
async fn status_of(stack: &Stack, job_id: &str) -> anyhow::Result<Option<i16>> {
    let mut admission = stack.admission_client().await?;
    match admission
        .get_job(pb::GetJobRequest {
            job_id: job_id.to_string(),
        })
        .await
    {
        Ok(response) => Ok(response
            .into_inner()
            .job
            .map(|job| i16::try_from(job.status).unwrap_or_default())),
        Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
        Err(status) => Err(status.into()),
    }
}

fn admitted_or_later(status: Option<i16>) -> bool {
    status.is_some_and(|status| status >= pb::JobStatus::Admitted as i16)
}

const DEAD_LETTER_CLASSES: &[&str] = &["undecodable", "invalid", "conflict", "storage", "internal"];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousands_of_hostile_messages_each_become_a_job_or_a_dead_letter_and_valid_jobs_after_them_are_admitted(
) -> anyhow::Result<()> {
    let stack = Stack::start(test_config("hostile", &[])?, 1).await?;
    let seed: u64 = std::env::var("SLUICE_FUZZ_SEED")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    println!("hostile seed {seed}");
    let mut generator = HostileRequests::new(seed, stack.config.admission.max_payload_bytes).unique_ids();
    // A message the broker refuses never reaches Sluice: the generator's
    // rare payload of max_payload_bytes plus long fields (or base64 in
    // JSON) can pass the broker's limit, so such messages are not sent.
    let broker_limit = stack.config.kafka.max_message_bytes - 4096;
    let messages: Vec<RawRequest> = (0..3_000i64)
        .map(|index| {
            let message = generator.message(index);
            RawRequest {
                partition: None,
                key: message.key,
                payload: message.payload.unwrap_or_default(),
                headers: message.headers,
            }
        })
        .filter(|message| {
            let headers: usize = message
                .headers
                .iter()
                .map(|(name, value)| name.len() + value.len())
                .sum();
            message.payload.len() + message.key.as_ref().map_or(0, Vec::len) + headers <= broker_limit
        })
        .collect();
    let hostile = messages.len();
    println!("{hostile} hostile messages within the broker's size limit");
    let producer = RequestProducer::new(&stack.config)?;
    producer.send_messages(messages).await?;
    // Valid jobs after the poison, on every partition of the topic: a
    // partition's messages are handled in order, so once its valid jobs are
    // admitted every hostile message before them is a job or a delivered
    // dead letter.
    let partitions = stack.config.kafka.partitions.requested;
    let valid: Vec<pb::JobRequest> = (0..50)
        .map(|index| {
            let mut request = concurrency_job("after", &format!("after-{index}"), 5, 1, "valid");
            request.job_id = Some(format!("after-{index}"));
            request
        })
        .collect();
    producer
        .send_messages(
            valid
                .iter()
                .zip((0..partitions).cycle())
                .map(|(request, partition)| RawRequest {
                    partition: Some(partition),
                    key: None,
                    payload: request.encode_to_vec(),
                    headers: Vec::new(),
                })
                .collect(),
        )
        .await?;

    // Every valid job sent after the poison is admitted: every partition
    // went on.
    eventually(Duration::from_secs(120), "the valid jobs admitted", || async {
        for index in 0..50 {
            if !admitted_or_later(status_of(&stack, &format!("after-{index}")).await?) {
                return Ok(false);
            }
        }
        Ok(true)
    })
    .await?;
    // Each message is one job or one dead letter.
    let jobs = job_count(&stack).await?;
    let expected_dead = i64::try_from(hostile + valid.len())? - jobs;
    let letters = read_dead_letters(&stack.config, Duration::from_secs(60), |letters| {
        let sources: HashSet<(String, String)> = letters.iter().map(DeadLetter::source).collect();
        i64::try_from(sources.len()).unwrap_or(i64::MAX) >= expected_dead
    })
    .await?;
    let sources: HashSet<(String, String)> = letters.iter().map(DeadLetter::source).collect();
    assert_eq!(
        i64::try_from(sources.len())? + jobs,
        i64::try_from(hostile + valid.len())?,
        "dead letters plus jobs equal the messages sent (seed {seed})"
    );
    let mut classes = BTreeMap::new();
    for letter in &letters {
        assert!(
            !letter.header("sluice-deadletter-reason").is_empty(),
            "a reason: {letter:?}"
        );
        let class = letter.header("sluice-deadletter-class");
        assert!(
            DEAD_LETTER_CLASSES.contains(&class),
            "a class of the fixed set: {class:?}"
        );
        *classes.entry(class.to_string()).or_insert(0) += 1;
    }
    println!("{jobs} jobs, {} dead letters by class {classes:?}", sources.len());
    assert!(jobs > 50 && !sources.is_empty(), "both jobs and dead letters");
    // Every service SERVING, nothing internal set aside: what admission
    // accepted, every owner accepted.
    eventually(Duration::from_secs(30), "every service serving", || all_serving(&stack)).await?;
    for schema in ["admission", "limit_grant", "rate_window", "refresh_dispatcher"] {
        assert_eq!(
            quarantined(&stack, schema).await?,
            Vec::new(),
            "{schema} set nothing aside"
        );
    }
    stack.stop().await;
    Ok(())
}

/// A JSON job request (the `content-type` header says so).
fn json_request(body: &str) -> RawRequest {
    RawRequest {
        partition: None,
        key: None,
        payload: body.as_bytes().to_vec(),
        headers: vec![("content-type".to_string(), b"application/json".to_vec())],
    }
}

fn proto_request(request: &pb::JobRequest) -> RawRequest {
    RawRequest {
        partition: None,
        key: None,
        payload: request.encode_to_vec(),
        headers: Vec::new(),
    }
}

fn with_id(mut request: pb::JobRequest, job_id: &str) -> pb::JobRequest {
    request.job_id = Some(job_id.to_string());
    request
}

/// Each class of poison the issue found, in one partition, in order: each is
/// refused with its reason (or, for a bad trace header, ignored), a dead
/// letter too large for the broker arrives cut and the one after it arrives
/// too, a payload of exactly `max_payload_bytes` reaches the workers, and the
/// job after all of them is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_class_of_poisoned_request_is_refused_with_its_reason_and_the_partition_goes_on() -> anyhow::Result<()> {
    // A broker limit of 300 kB, so a request the producer can still send
    // makes a dead letter too large for it.
    let stack = Stack::start(
        test_config(
            "poison",
            &[
                ("kafka.partitions.requested", "1"),
                ("kafka.max_message_bytes", "300000"),
                ("admission.max_payload_bytes", "290000"),
            ],
        )?,
        1,
    )
    .await?;
    let max_payload = stack.config.admission.max_payload_bytes;
    let multibyte_field = "é".repeat(2000);
    let mut nul_metadata = floating_job("acme", "gpu", 1, 1000, "x");
    if let Some(pb::limit::Kind::Floating(floating)) = &mut nul_metadata.limits[0].kind {
        floating.metadata.insert("pool".to_string(), "a\0b".to_string());
    }
    let absurd_window = rate_job("acme", "api", 10, i64::MAX, "x");
    let dup = with_id(concurrency_job("acme", "dup-key", 1, 0, "first body"), "dup");
    let dup_other_body = with_id(concurrency_job("acme", "dup-key", 1, 0, "another body"), "dup");
    let mut nul_trace = proto_request(&with_id(concurrency_job("acme", "trace-key", 1, 0, "x"), "nul-trace"));
    nul_trace.headers.push((
        "traceparent".to_string(),
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\0".to_vec(),
    ));
    // Over max_payload_bytes, and nearly as large as the broker takes: its
    // dead letter (the payload plus Sluice's headers) would be too large.
    let mut huge = concurrency_job("acme", "huge-key", 1, 0, "");
    huge.payload = vec![b'h'; 299_800];
    let mut huge_window = concurrency_job("acme", "k", 1, 0, "x");
    huge_window.idempotency_key = "idem".to_string();
    huge_window.idempotency_window = "300000000000d".to_string();
    let mut exact = with_id(concurrency_job("acme", "exact-key", 1, 0, ""), "max-payload");
    exact.payload = vec![b'm'; max_payload];
    let messages = vec![
        json_request(&format!(
            r#"{{"tenant": "acme", "task_group": "default", "{multibyte_field}": 1}}"#
        )),
        nul_trace,
        proto_request(&nul_metadata),
        proto_request(&absurd_window),
        proto_request(&dup),
        proto_request(&dup_other_body),
        proto_request(&dup),
        proto_request(&huge),
        proto_request(&pb::JobRequest {
            tenant: String::new(),
            ..concurrency_job("acme", "k", 1, 0, "no tenant")
        }),
        proto_request(&huge_window),
        proto_request(&exact),
        proto_request(&with_id(concurrency_job("acme", "after-key", 1, 0, "after"), "after")),
    ];
    RequestProducer::new(&stack.config)?.send_messages(messages).await?;

    eventually(Duration::from_secs(60), "the job after the poison admitted", || async {
        Ok(admitted_or_later(status_of(&stack, "after").await?))
    })
    .await?;
    let letters = read_dead_letters(&stack.config, Duration::from_secs(30), |letters| letters.len() >= 7).await?;
    let by_offset: BTreeMap<i64, &DeadLetter> = letters
        .iter()
        .map(|letter| (letter.header("sluice-source-offset").parse().unwrap_or(-1), letter))
        .collect();
    let reason = |offset: i64| {
        by_offset
            .get(&offset)
            .map_or("", |letter| letter.header("sluice-deadletter-reason"))
    };
    let class = |offset: i64| {
        by_offset
            .get(&offset)
            .map_or("", |letter| letter.header("sluice-deadletter-class"))
    };
    // 0: the unknown field of 2,000 multibyte characters (it panicked admission).
    assert_eq!(class(0), "invalid");
    assert!(reason(0).starts_with("éé"), "{}", reason(0));
    assert!(
        reason(0).contains("unknown field") || reason(0).ends_with('…'),
        "{}",
        reason(0)
    );
    // 1: a NUL in the traceparent header: the job is accepted, its trace dropped.
    assert!(!by_offset.contains_key(&1));
    let trace_query = format!(
        "SELECT traceparent FROM \"{}\".jobs WHERE job_id = 'nul-trace'",
        stack.config.schema("admission")
    );
    let traceparent: String = sqlx::query_scalar(sqlx::AssertSqlSafe(trace_query))
        .fetch_one(&stack.pool)
        .await?;
    assert_eq!(traceparent, "", "an invalid traceparent is not kept");
    // 2: NUL in floating metadata; 3: a rate window rate-window would refuse.
    assert!(reason(2).starts_with("limits[0].floating.metadata: "), "{}", reason(2));
    assert!(
        reason(3).starts_with("limits[0].rate.inline.duration_ms: "),
        "{}",
        reason(3)
    );
    // 4 saved; 5 the same id with another body: a conflict; 6 the same again: a duplicate.
    assert_eq!(class(5), "conflict");
    assert!(reason(5).starts_with("conflict: job \"dup\""), "{}", reason(5));
    assert!(
        !by_offset.contains_key(&4) && !by_offset.contains_key(&6),
        "{} / {}",
        reason(4),
        reason(6)
    );
    // 7: a dead letter too large for the broker is sent cut, with a header
    // saying so; 8, right after it, is not lost with it.
    let huge_letter = by_offset.get(&7).expect("the huge request's dead letter");
    assert!(reason(7).starts_with("payload: "), "{}", reason(7));
    assert_eq!(
        huge_letter.header("sluice-deadletter-payload-truncated"),
        huge.encode_to_vec().len().to_string()
    );
    assert!(huge_letter.payload.len() < huge.encode_to_vec().len());
    assert!(reason(8).starts_with("tenant: must not be empty"), "{}", reason(8));
    // 9: an idempotency window that overflowed.
    assert!(reason(9).starts_with("idempotency_window: "), "{}", reason(9));
    // 10: a payload of exactly max_payload_bytes is admitted and handed to workers.
    assert!(!by_offset.contains_key(&10));
    let admitted_topic = stack.config.admitted_topic("default");
    let delivered = read_topic(&stack.config, &admitted_topic, Duration::from_secs(30), |messages| {
        messages
            .iter()
            .any(|payload| pb::AdmittedJob::decode(payload.as_slice()).is_ok_and(|job| job.job_id == "max-payload"))
    })
    .await?;
    let admitted = delivered
        .iter()
        .filter_map(|payload| pb::AdmittedJob::decode(payload.as_slice()).ok())
        .find(|job| job.job_id == "max-payload")
        .expect("the admitted message");
    assert_eq!(admitted.payload.len(), max_payload);
    assert_eq!(letters.len(), 7, "one dead letter per refused message: {by_offset:#?}");
    assert!(all_serving(&stack).await?);
    stack.stop().await;
    Ok(())
}

fn assert_invalid(result: Result<impl std::fmt::Debug, tonic::Status>, field: &str) {
    let error = result.expect_err("refused");
    assert_eq!(error.code(), tonic::Code::InvalidArgument, "{field}: {error:?}");
    assert!(
        error.message().starts_with(&format!("{field}: ")),
        "names {field}: {}",
        error.message()
    );
}

/// Bad gRPC input: INVALID_ARGUMENT naming the field, never UNAVAILABLE (a
/// retry) or INTERNAL, and never stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_grpc_input_answers_invalid_argument_naming_the_field() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("badgrpc", &[])?, 1).await?;
    let admission = stack.admission_client().await?;
    let mut client = admission.clone();

    // NUL in text PostgreSQL would store.
    let mut nul_metadata = floating_job("acme", "gpu", 1, 1000, "x");
    if let Some(pb::limit::Kind::Floating(floating)) = &mut nul_metadata.limits[0].kind {
        floating.metadata.insert("pool\0".to_string(), "a".to_string());
    }
    assert_invalid(
        client
            .enqueue(pb::EnqueueRequest {
                job: Some(nul_metadata),
            })
            .await,
        "limits[0].floating.metadata",
    );
    enqueue_with_id(&admission, "nul-target", concurrency_job("acme", "nul-key", 1, 0, "x")).await?;
    assert_invalid(
        client
            .cancel_job(pb::CancelJobRequest {
                job_id: "nul-target".to_string(),
                reason: "a\0b".to_string(),
            })
            .await,
        "reason",
    );
    let view = wait_status(
        &admission,
        "nul-target",
        pb::JobStatus::Admitted,
        Duration::from_secs(30),
    )
    .await?;
    assert_eq!(
        claim_one(&admission, "w", "nul-target", view.attempt).await?,
        pb::ClaimOutcome::Claimed as i32
    );
    assert_invalid(
        client
            .complete(pb::CompleteRequest {
                worker_id: "w".to_string(),
                completions: vec![pb::Completion {
                    job_id: "nul-target".to_string(),
                    attempt: 1,
                    outcome: Some(pb::completion::Outcome::Failure(pb::Failure {
                        error: "boom\0".to_string(),
                        non_retryable: false,
                    })),
                }],
            })
            .await,
        "completions[0].failure.error",
    );
    let mut limits = stack.limits_client().await?;
    assert_invalid(
        limits
            .list_keys(pb::ListKeysRequest {
                tenant: "acme".to_string(),
                prefix: String::new(),
                page_size: 10,
                page_token: "a\0".to_string(),
            })
            .await,
        "page_token",
    );
    // -1 written as a 64-bit varint into `max` (a uint32) arrives as 4294967295.
    let error = limits
        .set_limit(pb::SetLimitRequest {
            key: Some(pb::KeyRef {
                tenant: "acme".to_string(),
                key: "k".to_string(),
            }),
            change: Some(pb::set_limit_request::Change::Max(u32::MAX)),
        })
        .await
        .expect_err("refused");
    assert_eq!(error.code(), tonic::Code::InvalidArgument);
    assert!(
        error
            .message()
            .starts_with("max: 4294967295 is above the maximum 2147483647"),
        "{}",
        error.message()
    );
    // A window that would overflow.
    let mut huge_window = concurrency_job("acme", "k", 1, 0, "x");
    huge_window.idempotency_key = "idem".to_string();
    huge_window.idempotency_window = "300000000000d".to_string();
    assert_invalid(
        client.enqueue(pb::EnqueueRequest { job: Some(huge_window) }).await,
        "idempotency_window",
    );
    assert_invalid(
        client
            .enqueue(pb::EnqueueRequest {
                job: Some(rate_job("acme", "api", 10, i64::MAX, "x")),
            })
            .await,
        "limits[0].rate.inline.duration_ms",
    );
    let mut rates = stack.rates_client().await?;
    let error = rates
        .put_rate_limit(pb::PutRateLimitRequest {
            resource: Some(pb::RateLimitResource {
                tenant: "acme".to_string(),
                resource_key: "big".to_string(),
                max_count: 5,
                window_seconds: i64::MAX,
            }),
        })
        .await
        .expect_err("refused");
    assert_eq!(error.code(), tonic::Code::InvalidArgument);
    assert!(
        error
            .message()
            .starts_with("resource.window_seconds: 9223372036854775807 is above the maximum"),
        "{}",
        error.message()
    );
    let mut refresh = stack.refresh_client().await?;
    assert_invalid(
        refresh
            .report_refresh(pb::ReportRefreshRequest {
                task_id: "t".to_string(),
                key: Some(pb::KeyRef {
                    tenant: "acme".to_string(),
                    key: "gpu".to_string(),
                }),
                result: Some(pb::report_refresh_request::Result::Error("\0".to_string())),
            })
            .await,
        "error",
    );
    // Bytes that are not an EnqueueRequest: field 1 holds a message whose
    // only byte is a tag with wire type 7.
    let mut raw = tonic::client::Grpc::new(sluice_e2e::connect(&stack.admissions[0].endpoint).await?);
    raw.ready().await?;
    let undecodable = raw
        .unary(
            tonic::Request::new(pb::GetJobRequest {
                job_id: "\u{f}".to_string(),
            }),
            tonic::codegen::http::uri::PathAndQuery::from_static("/sluice.v1.Admission/Enqueue"),
            tonic_prost::ProstCodec::<pb::GetJobRequest, pb::EnqueueResponse>::default(),
        )
        .await
        .expect_err("refused");
    assert_eq!(undecodable.code(), tonic::Code::InvalidArgument, "{undecodable:?}");

    // One attempt named twice in one Claim (a redelivered admitted message
    // batched with the first) is claimed once.
    enqueue_with_id(&admission, "twice", concurrency_job("acme", "twice-key", 1, 0, "x")).await?;
    wait_status(&admission, "twice", pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    let attempt = pb::JobAttempt {
        job_id: "twice".to_string(),
        attempt: 1,
    };
    let results = client
        .claim(pb::ClaimRequest {
            worker_id: "w".to_string(),
            jobs: vec![attempt.clone(), attempt],
        })
        .await?
        .into_inner()
        .results;
    let outcomes: Vec<i32> = results.iter().map(|result| result.outcome).collect();
    assert_eq!(
        outcomes,
        vec![pb::ClaimOutcome::Claimed as i32, pb::ClaimOutcome::Taken as i32],
        "exactly one claim per attempt wins"
    );
    assert!(all_serving(&stack).await?);
    stack.stop().await;
    Ok(())
}

/// A key of `tenant` (with `prefix`) whose limit-command partition is `partition`.
fn key_on(config: &sluice_common::SluiceConfig, tenant: &str, prefix: &str, partition: i32) -> String {
    (0..10_000)
        .map(|index| format!("{prefix}{index}"))
        .find(|key| key_partition(tenant, key, config.kafka.partitions.limit_commands) == partition)
        .expect("a key on the partition")
}

fn set_override(tenant: &str, key: &str, max: u32) -> pb::LimitCommand {
    pb::LimitCommand {
        trace: None,
        sent_at_ms: 0,
        command: Some(pb::limit_command::Command::SetOverride(pb::SetOverride {
            key: Some(pb::KeyRef {
                tenant: tenant.to_string(),
                key: key.to_string(),
            }),
            max: Some(max),
        })),
    }
}

fn limit_batch(config: &sluice_common::SluiceConfig, partition: i32, payload: Vec<u8>) -> OutMsg {
    OutMsg {
        topic: Arc::from(config.topic(&config.topics.limit_commands)),
        partition: Some(partition),
        key: None,
        payload,
        headers: Vec::new(),
    }
}

/// Internal messages an owner can never apply — undecodable, a key of
/// another partition, a NUL in a key, a rate window rate-window refuses, a
/// batch PostgreSQL refuses — are set aside in the quarantine table with
/// their bytes and the reason, alone; the partition goes on with the rest and
/// stays served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owners_set_aside_internal_input_they_can_never_apply_and_go_on() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("quarantine", &[])?, 1).await?;
    let config = stack.config.clone();
    let partition = 1;
    let good = key_on(&config, "acme", "good-", partition);
    let other = key_on(&config, "acme", "other-", 0);
    let nul_key = key_on(&config, "acme", "nul\0", partition);
    let mixed = pb::LimitCommandBatch {
        commands: vec![
            acquire_command("acme", &other, "misrouted", 5),
            acquire_command("acme", &nul_key, "nul-key", 5),
            set_override("acme", &good, 7),
        ],
    };
    publish_raw(
        &config,
        vec![
            limit_batch(&config, partition, vec![0xff, 0xff, 0xff]),
            limit_batch(&config, partition, mixed.encode_to_vec()),
        ],
    )
    .await?;
    // The good entry after the poison is applied (and persisted).
    eventually(Duration::from_secs(30), "the good command applied", || async {
        Ok(key_state(&stack, "acme", &good).await?.override_max == Some(7))
    })
    .await?;
    let set_aside = quarantined(&stack, "limit_grant").await?;
    assert_eq!(set_aside.len(), 3, "{set_aside:?}");
    assert_eq!(set_aside[0].1, vec![0xff, 0xff, 0xff], "the undecodable message, whole");
    assert!(
        set_aside[0].2.starts_with("undecodable limit command batch"),
        "{}",
        set_aside[0].2
    );
    let misrouted = pb::LimitCommand::decode(set_aside[1].1.as_slice())?;
    assert_eq!(
        misrouted,
        acquire_command("acme", &other, "misrouted", 5),
        "the entry's own bytes"
    );
    assert!(set_aside[1].2.contains("hashes to partition 0"), "{}", set_aside[1].2);
    assert!(
        set_aside[2]
            .2
            .starts_with("key.key: must not contain control characters"),
        "{}",
        set_aside[2].2
    );

    // A rate window rate-window refuses (the issue's absurd duration_ms),
    // then a good acquire on the same partition.
    let rate_key = |name: &str| pb::RateKeyRef {
        tenant: "acme".to_string(),
        kind: Some(pb::rate_key_ref::Kind::Inline(pb::InlineKey {
            name: name.to_string(),
            unique_key: String::new(),
        })),
    };
    let rate_partitions = config.kafka.partitions.rate_commands;
    let absurd = rate_key("absurd");
    let fine = (0..1000)
        .map(|index| rate_key(&format!("fine-{index}")))
        .find(|key| rate_key_partition(key, rate_partitions) == rate_key_partition(&absurd, rate_partitions))
        .expect("a key on the same partition");
    let rate_acquire = |key: &pb::RateKeyRef, job_id: &str, window_ms: i64| pb::RateCommand {
        trace: None,
        sent_at_ms: 0,
        command: Some(pb::rate_command::Command::Acquire(pb::RateAcquire {
            key: Some(key.clone()),
            ticket: Some(pb::TicketId {
                job_id: job_id.to_string(),
                attempt: 1,
                step: 0,
            }),
            priority: 10,
            enqueued_at_us: 1,
            limit: 10,
            window_ms,
            cost: 1,
        })),
    };
    let batch = pb::RateCommandBatch {
        commands: vec![
            rate_acquire(&absurd, "absurd", i64::MAX),
            rate_acquire(&fine, "fine", 1000),
        ],
    };
    publish_raw(
        &config,
        vec![OutMsg {
            topic: Arc::from(config.topic(&config.topics.rate_commands)),
            partition: Some(rate_key_partition(&absurd, rate_partitions)),
            key: None,
            payload: batch.encode_to_vec(),
            headers: Vec::new(),
        }],
    )
    .await?;
    let mut rates = stack.rates_client().await?;
    eventually(Duration::from_secs(30), "the fine rate acquire granted", || {
        let mut rates = rates.clone();
        let fine = fine.clone();
        async move {
            let described = rates
                .describe_rate_key(pb::DescribeRateKeyRequest {
                    key: Some(fine),
                    ticket: None,
                })
                .await?
                .into_inner();
            Ok(described.used == 1)
        }
    })
    .await?;
    let rate_set_aside = quarantined(&stack, "rate_window").await?;
    assert_eq!(rate_set_aside.len(), 1, "{rate_set_aside:?}");
    assert!(
        rate_set_aside[0].2.starts_with("acquire.duration_ms: "),
        "{}",
        rate_set_aside[0].2
    );
    // The partition answers as its owner (not NOT_OWNER naming itself).
    rates
        .describe_rate_key(pb::DescribeRateKeyRequest {
            key: Some(absurd),
            ticket: None,
        })
        .await?;

    // PostgreSQL refusing a batch's commit, every time: the batch is applied
    // again one message, then one entry at a time, and only the entry that
    // still fails is set aside (the fault hook refuses three commits: the
    // batch, its message, its first entry).
    let entries: Vec<String> = (0..3)
        .map(|index| key_on(&config, "acme", &format!("refused-{index}-"), partition))
        .collect();
    let refused_batch = pb::LimitCommandBatch {
        commands: entries
            .iter()
            .enumerate()
            .map(|(index, key)| set_override("acme", key, u32::try_from(index).unwrap() + 1))
            .collect(),
    };
    stack.limit_grants[0].faults.arm(FaultPoint::OwnerCommitRefused, 0, 3);
    publish_raw(
        &config,
        vec![limit_batch(&config, partition, refused_batch.encode_to_vec())],
    )
    .await?;
    eventually(Duration::from_secs(30), "the other two entries applied", || async {
        Ok(key_state(&stack, "acme", &entries[1]).await?.override_max == Some(2)
            && key_state(&stack, "acme", &entries[2]).await?.override_max == Some(3))
    })
    .await?;
    assert_eq!(stack.limit_grants[0].faults.fired(FaultPoint::OwnerCommitRefused), 3);
    assert_eq!(
        key_state(&stack, "acme", &entries[0]).await?.override_max,
        None,
        "the refused entry is not applied"
    );
    let set_aside = quarantined(&stack, "limit_grant").await?;
    assert_eq!(set_aside.len(), 4);
    assert_eq!(
        pb::LimitCommand::decode(set_aside[3].1.as_slice())?,
        set_override("acme", &entries[0], 1)
    );
    assert!(
        set_aside[3].2.starts_with("PostgreSQL refused the commit"),
        "{}",
        set_aside[3].2
    );
    eventually(Duration::from_secs(30), "every service serving", || all_serving(&stack)).await?;
    stack.stop().await;
    Ok(())
}

/// admission: a request PostgreSQL refuses to store, every time, is
/// dead-lettered (class `storage`) and the requests around it are saved; an
/// undecodable internal message (a hand-over) is set aside in admission's
/// quarantine table and jobs go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admission_dead_letters_what_postgresql_refuses_and_sets_aside_bad_grants() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("admrefuse", &[("kafka.partitions.requested", "1")])?, 1).await?;
    let config = stack.config.clone();
    // PostgreSQL refuses to store the first request, every time.
    stack.admissions[0].faults.refuse_job("refuse-0");
    let requests: Vec<pb::JobRequest> = (0..3)
        .map(|index| {
            with_id(
                concurrency_job("acme", "refuse-key", 5, 0, "x"),
                &format!("refuse-{index}"),
            )
        })
        .collect();
    RequestProducer::new(&config)?.send(&requests).await?;
    eventually(Duration::from_secs(30), "the others saved", || async {
        Ok(status_of(&stack, "refuse-1").await?.is_some() && status_of(&stack, "refuse-2").await?.is_some())
    })
    .await?;
    assert_eq!(status_of(&stack, "refuse-0").await?, None);
    let letters = read_dead_letters(&config, Duration::from_secs(30), |letters| !letters.is_empty()).await?;
    assert_eq!(letters[0].header("sluice-deadletter-class"), "storage");
    assert!(
        letters[0]
            .header("sluice-deadletter-reason")
            .starts_with("PostgreSQL refuses to store this request"),
        "{letters:?}"
    );
    assert_eq!(letters[0].header("sluice-source-offset"), "0");

    // An undecodable hand-over message (internal input), then the flow goes on.
    publish_raw(
        &config,
        vec![OutMsg {
            topic: Arc::from(config.topic(&config.topics.jobs)),
            partition: Some(0),
            key: None,
            payload: vec![0x0a, 0x7f],
            headers: Vec::new(),
        }],
    )
    .await?;
    eventually(Duration::from_secs(30), "the bad grant message set aside", || async {
        Ok(quarantined(&stack, "admission").await?.len() == 1)
    })
    .await?;
    let admission = stack.admission_client().await?;
    enqueue_with_id(
        &admission,
        "after-grant",
        concurrency_job("acme", "after-grant-key", 1, 0, "x"),
    )
    .await?;
    wait_status(
        &admission,
        "after-grant",
        pb::JobStatus::Admitted,
        Duration::from_secs(30),
    )
    .await?;
    assert!(all_serving(&stack).await?);
    stack.stop().await;
    Ok(())
}
