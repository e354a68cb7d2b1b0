//! Diagnostics on stderr while a run goes: where the jobs that waited
//! longest are, and who holds the floating key.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_e2e::connect;
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;

use crate::events::now_ms;
use anyhow::Context;
use rand::Rng;

use crate::workload::{is_floating, job_id, rate_key_of, FLOATING_CEILING, FLOATING_KEY};

/// What the runner knows of the jobs while a run goes (from the producer
/// and the workers' logs).
#[derive(Default)]
pub struct Progress {
    pub enqueued: Mutex<HashMap<usize, i64>>,
    /// Jobs some handler started, and when the last handler of each did.
    pub started: Mutex<HashMap<usize, i64>>,
    /// Jobs whose success was ACCEPTED, and when the last one was.
    pub succeeded: Mutex<(HashSet<usize>, i64)>,
}

/// Every 5 s, say on stderr where the jobs on concurrency keys alone that
/// have waited longest without running are (a stall's cause, while it
/// lasts), and the oldest floating-limit job past 20 s.
pub async fn watch_slow_jobs(
    client: AdmissionClient<tonic::transport::Channel>,
    limit_grant: String,
    progress: Arc<Progress>,
    keys: usize,
    started_ms: i64,
) {
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let now = now_ms();
        let ran = progress
            .started
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        let done = progress
            .succeeded
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .0
            .clone();
        // Waiting since it was enqueued, or since its last attempt started
        // (a retry: handlers run for milliseconds).
        let mut slow: Vec<(usize, i64)> = progress
            .enqueued
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .filter(|(job, _)| !done.contains(job))
            .map(|(job, at)| (*job, ran.get(job).copied().unwrap_or(*at)))
            .filter(|(_, since)| now - since > 10_000)
            .collect();
        slow.sort_by_key(|(_, at)| *at);
        // The three oldest a stall counts (a rate or floating limit's wait
        // is its capacity), and the oldest floating-limit job once it has
        // waited 20 s. A job admission already counts as ended (its success
        // answered to a worker this run has not heard back from yet, or
        // failed for good) is not waiting: the next one is shown instead.
        let counted = slow
            .iter()
            .filter(|(job, _)| rate_key_of(*job).is_none() && !is_floating(*job));
        let floating = slow.iter().filter(|(job, at)| is_floating(*job) && now - *at > 20_000);
        let mut shown = Vec::new();
        for (candidates, wanted) in [
            (counted.copied().collect::<Vec<_>>(), 3),
            (floating.copied().collect(), 1),
        ] {
            let mut found = 0;
            for (job, at) in candidates {
                if found == wanted {
                    break;
                }
                let mut client = client.clone();
                let view = client
                    .get_job(pb::GetJobRequest { job_id: job_id(job) })
                    .await
                    .ok()
                    .and_then(|response| response.into_inner().job);
                let Some(view) = view else { continue };
                if is_ended(view.status) {
                    continue;
                }
                found += 1;
                shown.push((job, at, view));
            }
        }
        for (job, at, view) in shown {
            eprintln!(
                "chaos: at {:.1}s chaos-{job} (key k{}) waited {:.1}s: {:?} attempt {} step {} (admitted {:?} s ago); {}; history {:?}",
                (now - started_ms) as f64 / 1000.0,
                job % keys.max(1),
                (now - at) as f64 / 1000.0,
                pb::JobStatus::try_from(view.status).unwrap_or_default(),
                view.attempt,
                view.step,
                view.admitted_at_ms.map(|at| (now - at) as f64 / 1000.0),
                view.reason,
                view.history
                    .iter()
                    .map(|record| record.outcome.as_str())
                    .collect::<Vec<_>>(),
            );
            if is_floating(job) {
                print_floating_holders(&client, &limit_grant).await;
            }
        }
    }
}

/// Who holds the floating key, and what those jobs are doing (a floating
/// job waiting long: is a holder running?).
async fn print_floating_holders(client: &AdmissionClient<tonic::transport::Channel>, limit_grant: &str) {
    let Ok(channel) = connect(limit_grant).await else {
        eprintln!("chaos: the floating key's holders: limit-grant unreachable");
        return;
    };
    let described = sluice_proto::v1::limits_client::LimitsClient::new(channel)
        .describe_key(pb::DescribeKeyRequest {
            key: Some(pb::KeyRef {
                tenant: "chaos".to_string(),
                key: FLOATING_KEY.to_string(),
            }),
            ..Default::default()
        })
        .await;
    let state = match described {
        Ok(response) => response.into_inner().state.unwrap_or_default(),
        Err(status) => {
            eprintln!("chaos: the floating key's holders: {status}");
            return;
        }
    };
    for holder in state.holders {
        let Some(ticket) = holder.ticket else { continue };
        let mut client = client.clone();
        let view = client
            .get_job(pb::GetJobRequest {
                job_id: ticket.job_id.clone(),
            })
            .await
            .ok()
            .and_then(|response| response.into_inner().job);
        eprintln!(
            "chaos:   {FLOATING_KEY} held by {} attempt {} step {} since {} ms (floating max {:?}): {}",
            ticket.job_id,
            ticket.attempt,
            ticket.step,
            holder.granted_at_ms,
            state.floating_max,
            view.map_or("no job".to_string(), |view| format!(
                "{:?} attempt {} step {}; {}",
                pb::JobStatus::try_from(view.status).unwrap_or_default(),
                view.attempt,
                view.step,
                view.reason
            )),
        );
    }
}

/// A worker that only computes floating-limit refreshes: a max from 1 to
/// `FLOATING_CEILING`, at random, reported through `refresh` (any
/// refresh-dispatcher instance).
pub fn start_refresh_worker(
    base: &sluice_common::SluiceConfig,
    admission: &str,
    refresh: &str,
    refreshes: Arc<Mutex<Vec<u32>>>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let options = sluice_client::ClientOptions {
        brokers: base.kafka.brokers.clone(),
        topic_prefix: base.kafka.topic_prefix.clone(),
        admission_endpoint: admission.to_string(),
        refresh_endpoint: refresh.to_string(),
        ..sluice_client::ClientOptions::default()
    };
    let worker = sluice_client::Worker::builder(options, |_job: sluice_client::Job| async {
        Err(sluice_client::JobError::retryable("the refresh worker runs no jobs"))
    })
    .task_group("chaos-refresh-only")
    .transport(sluice_client::Transport::Stream)
    .refresh_handler(move |_task: pb::RefreshTask| {
        let refreshes = refreshes.clone();
        async move {
            let max = rand::rng().random_range(1..=FLOATING_CEILING);
            refreshes
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(max);
            Ok::<u32, sluice_client::RefreshError>(max)
        }
    })
    .build()
    .context("the refresh worker")?;
    Ok(tokio::spawn(async move {
        let _ = worker.run(sluice_client::CancellationToken::new()).await;
    }))
}

/// A status admission counts as ended: nothing of the job waits any more.
fn is_ended(status: i32) -> bool {
    matches!(
        pb::JobStatus::try_from(status),
        Ok(pb::JobStatus::Succeeded | pb::JobStatus::Failed | pb::JobStatus::Cancelled)
    )
}
