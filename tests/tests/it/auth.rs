//! Authentication and authorization (issue 14): bearer JWTs verified against
//! a configured key, roles, tenants, and client certificates mapped to
//! principals. A whole stack runs with auth on; its services reach each
//! other with the internal token.

use std::time::{Duration, Instant};

use sluice_e2e::pki::{folder, new_pki, write_pki};
use sluice_e2e::tokens::{auth_settings, with_token, TokenIssuer, AUDIENCE, ISSUER};
use sluice_e2e::*;
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;
use tonic::transport::Channel;

fn settings<'a>(pairs: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    pairs.iter().map(|(key, value)| (*key, value.as_str())).collect()
}

fn code<T>(answer: Result<T, tonic::Status>) -> tonic::Code {
    match answer {
        Ok(_) => tonic::Code::Ok,
        Err(status) => status.code(),
    }
}

/// Enqueue `request` as `token`'s holder.
async fn enqueue(
    admission: &AdmissionClient<Channel>,
    token: &str,
    request: pb::JobRequest,
) -> Result<pb::EnqueueResponse, tonic::Status> {
    let mut client = admission.clone();
    Ok(client
        .enqueue(with_token(pb::EnqueueRequest { job: Some(request) }, token))
        .await?
        .into_inner())
}

async fn get_job(
    admission: &AdmissionClient<Channel>,
    token: &str,
    job_id: &str,
) -> Result<pb::JobView, tonic::Status> {
    let mut client = admission.clone();
    let request = with_token(
        pb::GetJobRequest {
            job_id: job_id.to_string(),
        },
        token,
    );
    Ok(client.get_job(request).await?.into_inner().job.unwrap_or_default())
}

/// Wait (as `token`'s holder) until the job is admitted.
async fn wait_admitted(admission: &AdmissionClient<Channel>, token: &str, job_id: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = match get_job(admission, token, job_id).await {
            Ok(view) if view.status == pb::JobStatus::Admitted as i32 => return Ok(()),
            Ok(view) => format!("{:?}", pb::JobStatus::try_from(view.status)),
            Err(status) if status.code() == tonic::Code::NotFound => "not found yet".to_string(),
            Err(status) => return Err(status.into()),
        };
        anyhow::ensure!(Instant::now() < deadline, "job {job_id} not admitted: {seen}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn claim(
    admission: &AdmissionClient<Channel>,
    token: &str,
    job_id: &str,
) -> Result<pb::ClaimOutcome, tonic::Status> {
    let mut client = admission.clone();
    let request = with_token(
        pb::ClaimRequest {
            worker_id: "worker".to_string(),
            jobs: vec![pb::JobAttempt {
                job_id: job_id.to_string(),
                attempt: 1,
            }],
        },
        token,
    );
    let results = client.claim(request).await?.into_inner().results;
    Ok(results
        .first()
        .and_then(|result| pb::ClaimOutcome::try_from(result.outcome).ok())
        .unwrap_or_default())
}

fn set_limit(tenant: &str, key: &str, max: u32) -> pb::SetLimitRequest {
    pb::SetLimitRequest {
        key: Some(pb::KeyRef {
            tenant: tenant.to_string(),
            key: key.to_string(),
        }),
        change: Some(pb::set_limit_request::Change::Max(max)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_need_a_valid_token_and_act_only_on_their_tenants_with_their_roles() -> anyhow::Result<()> {
    init_logging();
    let folder = folder("auth")?;
    let issuer = TokenIssuer::new()?;
    let auth = auth_settings(&folder, &issuer)?;
    let config = test_config("authz", &settings(&auth))?;
    let mut stack = Stack::start(config, 1).await?;
    // Two admission instances: calls about jobs of the other's partition
    // are forwarded, and stay authorized as the caller's.
    stack.add_admission(sluice_common::Faults::none()).await?;
    let first = connect(&stack.admissions[0].endpoint).await?;
    let second = connect(&stack.admissions[1].endpoint).await?;
    let admission = AdmissionClient::new(first.clone());
    let other_instance = AdmissionClient::new(second);
    let mut limits = stack.limits_client().await?;

    let producer_a = issuer.token("producer-a", &["a"], &["producer"])?;
    let reader_a = issuer.token("reader-a", &["a"], &["reader"])?;
    let reader_b = issuer.token("reader-b", &["b"], &["reader"])?;
    let worker_b = issuer.token("worker-b", &["b"], &["worker"])?;
    let worker_a = issuer.token("worker-a", &["a"], &["worker"])?;
    let operator_a = issuer.token("operator-a", &["a"], &["operator"])?;
    let admin = issuer.token("admin", &[], &["admin"])?;

    // Health stays open for probes: answered without a token.
    assert!(health_serving(&stack.admissions[0].endpoint).await?);

    // No token, an expired one, one for another audience, one signed by
    // another key: UNAUTHENTICATED, saying why.
    let job = concurrency_job("a", "k", 5, 0, "payload");
    let mut anonymous = admission.clone();
    let refused = anonymous
        .enqueue(pb::EnqueueRequest { job: Some(job.clone()) })
        .await
        .expect_err("a call without credentials was served");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    let expired = issuer.sign(serde_json::json!({
        "sub": "late", "iss": ISSUER, "aud": AUDIENCE,
        "exp": TokenIssuer::now_s() - 3600,
        "sluice_tenants": ["a"], "sluice_roles": ["producer"],
    }))?;
    let refused = enqueue(&admission, &expired, job.clone())
        .await
        .expect_err("expired token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert!(refused.message().contains("expired"), "{}", refused.message());
    let elsewhere = issuer.sign(serde_json::json!({
        "sub": "elsewhere", "iss": ISSUER, "aud": "another-service",
        "exp": TokenIssuer::now_s() + 3600,
        "sluice_tenants": ["a"], "sluice_roles": ["producer"],
    }))?;
    let refused = enqueue(&admission, &elsewhere, job.clone())
        .await
        .expect_err("wrong audience");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert!(refused.message().contains("audience"), "{}", refused.message());
    let forged = TokenIssuer::new()?.token("forger", &["a"], &["admin"])?;
    assert_eq!(
        code(enqueue(&admission, &forged, job.clone()).await),
        tonic::Code::Unauthenticated
    );

    // A producer enqueues for its tenant only, and cannot cancel.
    assert_eq!(
        code(enqueue(&admission, &producer_a, concurrency_job("b", "k", 5, 0, "x")).await),
        tonic::Code::PermissionDenied
    );
    let mut job_ids = Vec::new();
    for index in 0..6 {
        let mut request = concurrency_job("a", "k", 5, 0, "card 4242");
        request.job_id = Some(format!("a-job-{index}"));
        job_ids.push(enqueue(&admission, &producer_a, request).await?.job_id);
    }
    let mut cancel = admission.clone();
    let denied = cancel
        .cancel_job(with_token(
            pb::CancelJobRequest {
                job_id: job_ids[0].clone(),
                reason: String::new(),
            },
            &producer_a,
        ))
        .await
        .expect_err("a producer cancelled a job");
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");

    // Only admission instances report an ended Work stream (it shortens
    // leases): a worker that says so is refused, naming the field.
    let mut heartbeat = admission.clone();
    let ended = heartbeat
        .heartbeat(with_token(
            pb::HeartbeatRequest {
                worker_id: "worker-a".to_string(),
                jobs: vec![pb::JobAttempt {
                    job_id: job_ids[0].clone(),
                    attempt: 1,
                }],
                stream_ended: Some(pb::StreamEnded {
                    closed_at_ms: 0,
                    grace_ms: 0,
                }),
            },
            &worker_a,
        ))
        .await
        .expect_err("a worker reported an ended stream");
    assert_eq!(ended.code(), tonic::Code::PermissionDenied, "{ended:?}");
    assert!(ended.message().contains("stream_ended"), "{}", ended.message());

    // Jobs of another tenant do not exist for a caller, at either instance
    // (one of them forwards to the job's owner).
    for job_id in &job_ids[..5] {
        wait_admitted(&admission, &reader_a, job_id).await?;
        for instance in [&admission, &other_instance] {
            let seen = get_job(instance, &reader_a, job_id).await?;
            assert_eq!(seen.tenant, "a");
            let hidden = get_job(instance, &reader_b, job_id)
                .await
                .expect_err("a cross-tenant read");
            assert_eq!(hidden.code(), tonic::Code::NotFound, "{hidden:?}");
            assert!(!hidden.message().contains("card"), "{}", hidden.message());
        }
    }

    // A worker of tenant b cannot claim tenant a's job (it does not exist
    // for it); a worker of tenant a can.
    for instance in [&admission, &other_instance] {
        assert_eq!(
            claim(instance, &worker_b, &job_ids[0]).await?,
            pb::ClaimOutcome::NotFound
        );
    }
    assert_eq!(
        claim(&other_instance, &worker_a, &job_ids[0]).await?,
        pb::ClaimOutcome::Claimed
    );
    // A reader may not claim at all.
    assert_eq!(
        code(claim(&admission, &reader_a, &job_ids[1]).await),
        tonic::Code::PermissionDenied
    );

    // Keys: an operator changes its tenant's, another tenant's do not
    // exist for it, and the global tenant `*` is an admin's only.
    limits
        .set_limit(with_token(set_limit("a", "k", 3), &operator_a))
        .await?;
    let hidden = limits
        .set_limit(with_token(set_limit("b", "k", 3), &operator_a))
        .await
        .expect_err("an operator changed another tenant's key");
    assert_eq!(hidden.code(), tonic::Code::NotFound);
    let describe = |tenant: &str| pb::DescribeKeyRequest {
        key: Some(pb::KeyRef {
            tenant: tenant.to_string(),
            key: "k".to_string(),
        }),
        ..Default::default()
    };
    assert_eq!(
        code(limits.describe_key(with_token(describe("a"), &reader_b)).await),
        tonic::Code::NotFound
    );
    limits.describe_key(with_token(describe("a"), &reader_a)).await?;
    let global = limits
        .set_limit(with_token(set_limit("*", "cap:everything", 10), &operator_a))
        .await
        .expect_err("a tenant operator changed a global cap");
    assert_eq!(global.code(), tonic::Code::PermissionDenied);
    assert!(global.message().contains("admin"), "{}", global.message());
    limits
        .set_limit(with_token(set_limit("*", "cap:everything", 10), &admin))
        .await?;
    assert_eq!(
        code(limits.set_limit(with_token(set_limit("a", "k", 3), &reader_a)).await),
        tonic::Code::PermissionDenied
    );

    // An operator of tenant a cancels its job; rate limits of tenant b do
    // not exist for it.
    let mut cancel = other_instance.clone();
    cancel
        .cancel_job(with_token(
            pb::CancelJobRequest {
                job_id: job_ids[2].clone(),
                reason: "by its operator".to_string(),
            },
            &operator_a,
        ))
        .await?;
    let mut rates = stack.rates_client().await?;
    let put = |tenant: &str| pb::PutRateLimitRequest {
        resource: Some(pb::RateLimitResource {
            tenant: tenant.to_string(),
            resource_key: "api".to_string(),
            max_count: 10,
            window_seconds: 1,
        }),
    };
    assert_eq!(
        code(rates.put_rate_limit(with_token(put("b"), &operator_a)).await),
        tonic::Code::NotFound
    );
    rates.put_rate_limit(with_token(put("a"), &operator_a)).await?;

    // The services' own API is theirs: not even an admin's token opens it.
    let mut link =
        sluice_proto::v1::owner_link_client::OwnerLinkClient::new(connect(&stack.limit_grants[0].endpoint).await?);
    let refused = link
        .directory(with_token(pb::DirectoryRequest {}, &admin))
        .await
        .expect_err("a user read the owner directory");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);

    stack.stop().await;
    Ok(())
}

/// Open a Work stream as `token`'s holder; returns the sender of more
/// requests and the stream down, once it is open.
async fn open_work(
    admission: &AdmissionClient<Channel>,
    token: &str,
    worker_id: &str,
) -> anyhow::Result<(
    tokio::sync::mpsc::Sender<pb::WorkRequest>,
    tonic::Streaming<pb::WorkResponse>,
)> {
    let (sender, receiver) = tokio::sync::mpsc::channel(16);
    sender
        .send(pb::WorkRequest {
            message: Some(pb::work_request::Message::Open(pb::WorkOpen {
                worker_id: worker_id.to_string(),
                task_groups: vec!["default".to_string()],
                credits: 10,
            })),
        })
        .await?;
    let mut client = admission.clone();
    let mut down = client
        .work(with_token(tokio_stream::wrappers::ReceiverStream::new(receiver), token))
        .await?
        .into_inner();
    match down.message().await?.and_then(|response| response.message) {
        Some(pb::work_response::Message::Opened(_)) => Ok((sender, down)),
        other => anyhow::bail!("the Work stream did not open: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_stream_is_pushed_only_the_jobs_of_its_workers_tenants() -> anyhow::Result<()> {
    init_logging();
    let folder = folder("authwork")?;
    let issuer = TokenIssuer::new()?;
    let auth = auth_settings(&folder, &issuer)?;
    let config = test_config("authwork", &settings(&auth))?;
    let stack = Stack::start(config, 1).await?;
    let admission = AdmissionClient::new(connect(&stack.admissions[0].endpoint).await?);
    let producer_a = issuer.token("producer-a", &["a"], &["producer"])?;

    // Tenant b's worker is connected, with credits, before tenant a's job
    // is admitted; tenant a's worker connects after.
    let (_b_up, mut b_down) =
        open_work(&admission, &issuer.token("worker-b", &["b"], &["worker"])?, "worker-b").await?;
    let job_id = enqueue(&admission, &producer_a, concurrency_job("a", "k", 5, 0, "for a"))
        .await?
        .job_id;
    wait_admitted(&admission, &issuer.token("reader-a", &["a"], &["reader"])?, &job_id).await?;
    let (_a_up, mut a_down) =
        open_work(&admission, &issuer.token("worker-a", &["a"], &["worker"])?, "worker-a").await?;
    let pushed = tokio::time::timeout(Duration::from_secs(30), a_down.message())
        .await?
        .map_err(anyhow::Error::from)?
        .and_then(|response| response.message);
    match pushed {
        Some(pb::work_response::Message::Jobs(jobs)) => {
            let ids: Vec<&str> = jobs
                .jobs
                .iter()
                .filter_map(|job| job.job.as_ref())
                .map(|job| job.job_id.as_str())
                .collect();
            assert_eq!(ids, vec![job_id.as_str()]);
        }
        other => anyhow::bail!("tenant a's worker was pushed {other:?}"),
    }
    // A job is pushed once: tenant b's stream got nothing.
    assert!(
        futures::FutureExt::now_or_never(b_down.message()).is_none(),
        "tenant b's worker was pushed a message"
    );
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_is_mapped_to_its_principal() -> anyhow::Result<()> {
    init_logging();
    let folder = folder("authcert")?;
    let pki = new_pki("authcert")?;
    let (cert, key, ca) = write_pki(&folder, &pki)?;
    let issuer = TokenIssuer::new()?;
    let auth = auth_settings(&folder, &issuer)?;
    let toml = r#"
[[auth.client_certificates]]
name = "reader-a.clients.test"
tenants = ["a"]
roles = ["reader"]
"#;
    let mut overrides = settings(&auth);
    overrides.extend([
        ("tls.cert_file", cert.as_str()),
        ("tls.key_file", key.as_str()),
        ("tls.ca_file", ca.as_str()),
        ("tls.client_ca_file", ca.as_str()),
    ]);
    let config = test_config_toml("authcert", toml, &overrides)?;
    let stack = Stack::start(config, 1).await?;
    let endpoint = stack.admissions[0].endpoint.clone();
    let dial = |identity: (String, String)| {
        let tls = sluice_common::tls::client_tls(
            Some(pki.ca_pem.as_bytes()),
            Some((identity.0.into_bytes(), identity.1.into_bytes())),
        );
        let endpoint = endpoint.clone();
        async move {
            let channel = tonic::transport::Endpoint::from_shared(endpoint)?
                .tls_config(tls)?
                .connect()
                .await?;
            anyhow::Ok(AdmissionClient::new(channel))
        }
    };
    let reader = dial(pki.client_certificate("reader-a.clients.test")?).await?;
    let stranger = dial(pki.client_certificate("stranger.clients.test")?).await?;

    let producer_a = issuer.token("producer-a", &["a"], &["producer"])?;
    let producer_b = issuer.token("producer-b", &["b"], &["producer"])?;
    let job_a = enqueue(&reader, &producer_a, concurrency_job("a", "k", 5, 0, "a"))
        .await?
        .job_id;
    let job_b = enqueue(&reader, &producer_b, concurrency_job("b", "k", 5, 0, "b"))
        .await?
        .job_id;

    // The certificate alone (no token) makes the call: a reader of tenant a.
    let read = |client: &AdmissionClient<Channel>, job_id: &str| {
        let mut client = client.clone();
        let request = pb::GetJobRequest {
            job_id: job_id.to_string(),
        };
        async move { client.get_job(request).await }
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match read(&reader, &job_a).await {
            Ok(response) => {
                assert_eq!(response.into_inner().job.unwrap_or_default().tenant, "a");
                break;
            }
            // Sent, saved once its owner has read it.
            Err(status) if status.code() == tonic::Code::NotFound && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            Err(status) => return Err(status.into()),
        }
    }
    assert_eq!(code(read(&reader, &job_b).await), tonic::Code::NotFound);
    let mut cancel = reader.clone();
    assert_eq!(
        code(
            cancel
                .cancel_job(pb::CancelJobRequest {
                    job_id: job_a.clone(),
                    reason: String::new(),
                })
                .await
        ),
        tonic::Code::PermissionDenied
    );
    // A certificate the CA signed but no mapping names: no principal.
    let refused = read(&stranger, &job_a)
        .await
        .expect_err("an unmapped certificate was served");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert!(refused.message().contains("not mapped"), "{}", refused.message());
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sdk_worker_with_a_bearer_token_runs_its_tenants_jobs() -> anyhow::Result<()> {
    use std::sync::atomic::Ordering;

    init_logging();
    let folder = folder("authsdk")?;
    let issuer = TokenIssuer::new()?;
    let auth = auth_settings(&folder, &issuer)?;
    let stack = Stack::start(test_config("authsdk", &settings(&auth))?, 1).await?;
    let admission = AdmissionClient::new(connect(&stack.admissions[0].endpoint).await?);
    let options = sluice_client::ClientOptions {
        brokers: String::new(),
        admission_endpoint: stack.admissions[0].endpoint.clone(),
        bearer_token: Some(issuer.token("sdk-worker", &["a"], &["worker"])?),
        ..sluice_client::ClientOptions::default()
    };
    let (ran, token) = start_counting_stream_worker(options).await?;
    let producer = issuer.token("producer-a", &["a"], &["producer"])?;
    let job_id = enqueue(&admission, &producer, concurrency_job("a", "k", 1, 0, "for the sdk"))
        .await?
        .job_id;
    let reader = issuer.token("reader-a", &["a"], &["reader"])?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let view = get_job(&admission, &reader, &job_id).await;
        if matches!(&view, Ok(view) if view.status == pb::JobStatus::Succeeded as i32) {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the job did not succeed: {view:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    token.cancel();
    stack.stop().await;
    Ok(())
}
