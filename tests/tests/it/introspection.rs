//! GetJob: status, attempt, step, and while waiting the key, holders vs max
//! and position. Enqueue over gRPC, duplicates, and bad input.

use sluice_e2e::*;
use sluice_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_job_says_why_a_job_waits() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("getjob", &[])?, 1).await?;
    let mut admission = stack.admission_client().await?;
    let mut ids = Vec::new();
    for index in 0..3 {
        let mut request = concurrency_job("acme", "report-key", 1, 10, &format!("job-{index}"));
        request.job_id = Some(format!("{}job-{index}", stack.config.kafka.topic_prefix));
        request.limits.push(pb::Limit {
            kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                key: "another-key".to_string(),
                max_concurrency: 5,
                shadow: false,
            })),
        });
        let response = admission
            .enqueue(pb::EnqueueRequest { job: Some(request) })
            .await?
            .into_inner();
        assert!(!response.deduplicated);
        ids.push(response.job_id);
    }
    let view = |job_id: String| {
        let mut admission = admission.clone();
        async move {
            anyhow::Ok(
                admission
                    .get_job(pb::GetJobRequest { job_id })
                    .await?
                    .into_inner()
                    .job
                    .unwrap_or_default(),
            )
        }
    };
    // Every job gets "another-key" (max 5) at once; their acquires of
    // "report-key" then race, so any one of them may be the holder. The other
    // two queue by enqueue time.
    eventually(
        std::time::Duration::from_secs(30),
        "one admitted, two queued",
        || async {
            let mut admitted = 0;
            let mut queued = 0;
            for job_id in &ids {
                let job = view(job_id.clone()).await?;
                if job.status == pb::JobStatus::Admitted as i32 {
                    admitted += 1;
                } else if job.waiting.as_ref().is_some_and(|waiting| waiting.waiting == 2) {
                    queued += 1;
                }
            }
            Ok(admitted == 1 && queued == 2)
        },
    )
    .await?;
    let mut views = Vec::new();
    for job_id in &ids {
        views.push(view(job_id.clone()).await?);
    }
    let holder = views
        .iter()
        .find(|job| job.status == pb::JobStatus::Admitted as i32)
        .expect("one holder");
    assert_eq!(holder.step, 2);
    assert!(holder.reason.starts_with("admitted"), "{}", holder.reason);
    let waiters: Vec<&pb::JobView> = views
        .iter()
        .filter(|job| job.status == pb::JobStatus::Waiting as i32)
        .collect();
    for (expected_position, job) in waiters.iter().enumerate() {
        assert_eq!(job.attempt, 1);
        // "another-key" sorts before "report-key": held, then waiting on the second step.
        let order: Vec<&str> = job.acquisition_order.iter().map(|step| step.key.as_str()).collect();
        assert_eq!(order, vec!["another-key", "report-key"]);
        assert_eq!(job.step, 1);
        let waiting = job.waiting.clone().expect("wait info");
        assert_eq!(waiting.key, "report-key");
        let position = u32::try_from(expected_position).unwrap();
        assert_eq!(
            (waiting.holders, waiting.max, waiting.position, waiting.waiting),
            (1, 1, position, 2)
        );
        assert!(
            job.reason
                .contains(&format!("1 of 1 held, {position} ahead of this job among 2 waiting")),
            "{}",
            job.reason
        );
    }
    let first_id = holder.job_id.clone();
    let first_index = ids
        .iter()
        .position(|id| *id == first_id)
        .expect("the holder is one of ours");

    // The same request again changes nothing and answers with the job.
    let mut again = concurrency_job("acme", "report-key", 1, 10, &format!("job-{first_index}"));
    again.job_id = Some(first_id.clone());
    again.limits.push(pb::Limit {
        kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
            key: "another-key".to_string(),
            max_concurrency: 5,
            shadow: false,
        })),
    });
    let duplicate = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(again.clone()),
        })
        .await?
        .into_inner();
    assert_eq!(duplicate.job_id, first_id);
    assert!(duplicate.deduplicated, "the same request again is a duplicate");
    assert_eq!(duplicate.status, pb::JobStatus::Admitted as i32);
    // The same job id with another request is refused, naming it.
    let different = pb::JobRequest {
        payload: b"another body".to_vec(),
        ..again.clone()
    };
    let conflict = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(different.clone()),
        })
        .await
        .unwrap_err();
    assert_eq!(conflict.code(), tonic::Code::AlreadyExists, "{conflict:?}");
    assert!(
        conflict.message().starts_with(&format!(
            "job_id: job {first_id:?} already exists with a different request"
        )),
        "{}",
        conflict.message()
    );
    // In a batch, nothing of the batch is saved and the entry is named.
    let error = admission
        .enqueue_batch(pb::EnqueueBatchRequest {
            jobs: vec![concurrency_job("acme", "batch-key", 1, 1, "fresh"), different],
        })
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::AlreadyExists);
    assert!(error.message().starts_with("jobs[1].job_id:"), "{}", error.message());
    assert_eq!(
        stack.job_statuses().await?.values().sum::<i64>(),
        3,
        "nothing else saved"
    );

    // Bad input names the field.
    let mut bad = concurrency_job("acme", "report-key", 1, 10, "bad");
    bad.task_group = "missing".to_string();
    let error = admission
        .enqueue_batch(pb::EnqueueBatchRequest {
            jobs: vec![concurrency_job("acme", "k", 1, 1, "ok"), bad],
        })
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::InvalidArgument);
    assert!(
        error.message().starts_with("jobs[1].task_group: undeclared task group"),
        "{}",
        error.message()
    );
    let error = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(concurrency_job("acme", "", 1, 1, "bad")),
        })
        .await
        .unwrap_err();
    assert_eq!(error.message(), "limits[0].concurrency.key: must not be empty");
    stack.stop().await;
    Ok(())
}
