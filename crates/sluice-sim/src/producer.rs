//! The producer: one enqueue per job, retried until Sluice accepts it.

use rand::Rng;
use sluice_admission::chain;
use sluice_admission::partition::{Incoming, Local, OnConflict};
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::calls::{Answer, CallKind};
use crate::world::{job_name, Event, World};

impl World {
    pub(crate) fn produce(&mut self, job: usize) {
        let job_id = job_name(job);
        let key = format!("k{}", job % self.config.keys);
        let request = pb::JobRequest {
            job_id: Some(job_id.clone()),
            tenant: "acme".to_string(),
            task_group: "default".to_string(),
            payload: format!("job {job}").into_bytes(),
            retry: Some(pb::RetryPolicy {
                max_attempts: 8,
                initial_backoff: "100ms".to_string(),
                max_backoff: "1s".to_string(),
                ..pb::RetryPolicy::default()
            }),
            limits: vec![pb::Limit {
                kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                    key,
                    max_concurrency: self.config.max,
                    shadow: false,
                })),
            }],
            ..pb::JobRequest::default()
        };
        let Ok(valid) = chain::validate(&self.sluice, request) else {
            self.checks.violation = Some(format!("job {job_id}: the simulation's request is invalid"));
            return;
        };
        let incoming = Incoming {
            job_id: job_id.clone(),
            valid,
            trace: pb::TraceContext::default(),
        };
        let token = self.call(None, &job_id, move || {
            let (reply, receiver) = oneshot::channel();
            (
                Local::Enqueue {
                    jobs: vec![incoming],
                    on_conflict: OnConflict::Refuse,
                    reply,
                },
                CallKind::Enqueue(receiver),
            )
        });
        self.producing.insert(token, job);
    }

    pub(crate) fn producer_answer(&mut self, token: u64, answer: Answer) {
        let Some(job) = self.producing.remove(&token) else {
            return;
        };
        match answer {
            Answer::Enqueued => self.checks.enqueued(job, self.now),
            _ => {
                let retry = self.rng.random_range(100..600);
                self.at(retry, Event::Produce { job });
            }
        }
    }
}
