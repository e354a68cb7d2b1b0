//! Per-tenant quotas (issue 14): set at run time and stored; over a quota an
//! enqueue answers RESOURCE_EXHAUSTED naming it, and a Kafka request is
//! dead-lettered with class `quota`; other tenants are not affected.

use std::time::Duration;

use sluice_e2e::*;
use sluice_proto::v1 as pb;

fn quota(tenant: &str, max_waiting: Option<u64>, rate: Option<f64>) -> pb::SetTenantQuotaRequest {
    pb::SetTenantQuotaRequest {
        tenant: tenant.to_string(),
        max_waiting,
        max_enqueues_per_second: rate,
        clear: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_hold_on_grpc_and_kafka_and_leave_other_tenants_alone() -> anyhow::Result<()> {
    // One job partition: its share of a quota is the whole quota.
    let config = test_config(
        "quota",
        &[("kafka.partitions.jobs", "1"), ("kafka.partitions.requested", "1")],
    )?;
    let stack = Stack::start(config, 1).await?;
    let mut admission = stack.admission_client().await?;

    let set = admission
        .set_tenant_quota(quota("acme", Some(3), None))
        .await?
        .into_inner();
    assert_eq!(set.max_waiting, Some(3));
    assert!(set.overridden);
    let stored: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT max_waiting FROM \"{}\".tenant_quotas WHERE tenant = 'acme'",
        stack.config.schema("admission")
    )))
    .fetch_optional(&stack.pool)
    .await?;
    assert_eq!(stored, Some(3), "the quota is stored");

    // No worker runs them: acme's jobs stay unfinished.
    for index in 0..3 {
        enqueue_with_id(
            &admission,
            &format!("acme-{index}"),
            concurrency_job("acme", "k", 1, 0, "x"),
        )
        .await?;
    }
    let refused = enqueue_with_id(&admission, "acme-3", concurrency_job("acme", "k", 1, 0, "x"))
        .await
        .expect_err("a fourth unfinished job was accepted");
    let status = refused.downcast_ref::<tonic::Status>().expect("a gRPC status");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("max_waiting"), "{}", status.message());
    assert!(status.message().contains("\"acme\""), "{}", status.message());
    // Another tenant is not held back.
    enqueue_with_id(&admission, "globex-0", concurrency_job("globex", "k", 1, 0, "x")).await?;

    // Over Kafka, the same quota: a dead letter of class quota.
    RequestProducer::new(&stack.config)?
        .send(&[concurrency_job("acme", "k", 1, 0, "over quota by kafka")])
        .await?;
    let consumer = dead_letter_reader(&stack.config)?;
    let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv()).await??;
    let header = |name: &str| header_text(&message, name);
    assert_eq!(header("sluice-deadletter-class"), "quota");
    assert!(header("sluice-deadletter-reason").contains("max_waiting"));

    // A rate quota: one token, refilled in a thousand seconds.
    admission.set_tenant_quota(quota("globex", None, Some(0.001))).await?;
    enqueue_with_id(&admission, "globex-1", concurrency_job("globex", "k", 1, 0, "x")).await?;
    let refused = enqueue_with_id(&admission, "globex-2", concurrency_job("globex", "k", 1, 0, "x"))
        .await
        .expect_err("a second job within the rate was accepted");
    let status = refused.downcast_ref::<tonic::Status>().expect("a gRPC status");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(
        status.message().contains("max_enqueues_per_second"),
        "{}",
        status.message()
    );

    // Hostile quotas: each refused naming its field, and nothing else
    // changes (acme's quota still holds below).
    for (request, field) in [
        (quota("ac\0me", Some(1), None), "tenant"),
        (quota("acme", None, Some(f64::NAN)), "max_enqueues_per_second"),
        (quota("acme", None, Some(1e300)), "max_enqueues_per_second"),
        (quota("*", Some(1), None), "tenant"),
        (
            pb::SetTenantQuotaRequest {
                clear: true,
                ..quota("acme", Some(1), None)
            },
            "clear",
        ),
    ] {
        let refused = admission
            .set_tenant_quota(request)
            .await
            .expect_err("a hostile quota was stored");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().starts_with(field), "{field}: {}", refused.message());
    }
    // The largest number there is: stored and read back, not a crash.
    let huge = admission
        .set_tenant_quota(quota("initech", Some(u64::MAX), None))
        .await?
        .into_inner();
    assert!(huge.max_waiting.is_some_and(|max| max >= i64::MAX as u64), "{huge:?}");
    enqueue_with_id(&admission, "initech-0", concurrency_job("initech", "k", 1, 0, "x")).await?;
    assert!(
        enqueue_with_id(&admission, "acme-4", concurrency_job("acme", "k", 1, 0, "x"))
            .await
            .is_err(),
        "acme's quota still holds"
    );

    // Cleared: acme is back to the (unlimited) default.
    let listed = admission
        .list_tenant_quotas(pb::ListTenantQuotasRequest::default())
        .await?
        .into_inner();
    let tenants: Vec<&str> = listed.quotas.iter().map(|quota| quota.tenant.as_str()).collect();
    assert_eq!(tenants, vec!["acme", "globex", "initech"]);
    admission
        .set_tenant_quota(pb::SetTenantQuotaRequest {
            tenant: "acme".to_string(),
            clear: true,
            ..Default::default()
        })
        .await?;
    enqueue_with_id(&admission, "acme-3", concurrency_job("acme", "k", 1, 0, "x")).await?;
    stack.stop().await;
    Ok(())
}
