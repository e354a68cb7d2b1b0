//! Enqueue: new jobs, duplicates and conflicts, idempotency keys, tenant
//! quotas, re-sending a waiting job's command, and requests handed over
//! through `sluice.jobs`.

use std::collections::BTreeMap;

// Seeded maps: what the core iterates comes out in an order a seed fixes,
// so the simulation replays a history exactly (sluice_common::hash).
use sluice_common::hash::{HashMap, HashSet};

use opentelemetry::KeyValue;
use sluice_common::kafka::Outbox;
use sluice_common::link::Link;
use sluice_common::telemetry::{plan_span, PlannedSpan};

use crate::consumers::Refusal;
use crate::effects::{count_dead_letters, DeadLetterClass};
use crate::jobs::{request_fingerprint, JobRow};
use crate::journal::JobChange;
use crate::transitions::{self, Effect, JobState, Status};

use super::spans::SCOPE;
use super::{
    AdmissionPartition, EnqueueConflict, EnqueueError, EnqueueOutcome, EnqueuePlan, HandOver, Incoming, OnConflict,
    Out, QuotaRefusal,
};

impl AdmissionPartition {
    /// The row of a new job (its state decided at `now_ms`).
    /// With the job's `admission.enqueue` span, recorded once the job is
    /// saved (a duplicate or a refused call records none).
    fn new_row(&mut self, incoming: &Incoming, now_ms: i64) -> (JobRow, Option<PlannedSpan>) {
        let valid = &incoming.valid;
        // The job's own span, under the producer's: every span of the job
        // hangs below it, across services.
        let now = sluice_common::clock::system_time_at_ms(now_ms);
        let (job_trace, span) = plan_span(SCOPE, "admission.enqueue", &incoming.trace, now, now, || {
            vec![
                KeyValue::new("sluice.job_id", incoming.job_id.clone()),
                KeyValue::new("sluice.tenant", valid.request.tenant.clone()),
                KeyValue::new("sluice.task_group", valid.request.task_group.clone()),
                KeyValue::new("sluice.limits", i64::try_from(valid.chain.len()).unwrap_or(i64::MAX)),
            ]
        });
        let mut spec = valid.request.clone();
        spec.payload = Vec::new();
        spec.job_id = Some(incoming.job_id.clone());
        let request_hash = Some(request_fingerprint(&spec, &valid.request.payload));
        let mut state = JobState {
            job_id: incoming.job_id.clone(),
            status: Status::Scheduled,
            attempt: 1,
            attempts_used: 0,
            max_attempts: valid.retry.max_attempts,
            step: 0,
            chain: valid.chain.clone(),
            retry: valid.retry,
            lease_ms: valid.lease_ms,
            run_timeout_ms: valid.run_timeout_ms,
            due_at_ms: None,
            step_started_at_ms: None,
            admitted_at_ms: None,
            claimed_by: None,
            claimed_at_ms: None,
            lease_expires_at_ms: None,
            finished_at_ms: None,
            cancel_reason: None,
            last_error: String::new(),
            history: Default::default(),
            confirmed: false,
            heard_at_ms: None,
            pushed: false,
            stream_ended_at_ms: None,
        };
        match valid.request.run_at_ms {
            Some(run_at) if run_at > now_ms => state.due_at_ms = Some(run_at),
            _ => {
                transitions::start_acquiring(&mut state, now_ms, self.settings.timing);
            }
        }
        let row = JobRow {
            state,
            tenant: valid.request.tenant.clone(),
            task_group: valid.request.task_group.clone(),
            priority: valid.priority,
            spec: crate::jobs::Spec::of(&spec),
            payload: valid.request.payload.clone(),
            job_partition: self.settings.partition,
            enqueued_at_us: self.next_enqueue_time_us(now_ms.saturating_mul(1000)),
            run_at_ms: valid.request.run_at_ms,
            idempotency_key: if valid.request.idempotency_key.is_empty() {
                None
            } else {
                Some(valid.request.idempotency_key.clone())
            },
            trace: job_trace,
            request_hash,
        };
        (row, span)
    }

    /// The job an id already names, if any: active here, or stored.
    fn existing(&self, job_id: &str) -> Option<(Status, Option<Vec<u8>>)> {
        if let Some(active) = self.jobs.get(job_id) {
            return Some((active.row.state.status, active.row.request_hash.clone()));
        }
        self.prepared
            .stored
            .get(job_id)
            .map(|stored| (stored.row.state.status, stored.row.request_hash.clone()))
    }

    /// Enqueue `jobs`: new ones are saved and start acquiring; the same
    /// request again is a duplicate (its pending effect is sent again); a
    /// different request under a saved job id is a conflict.
    pub(super) fn enqueue(
        &mut self,
        now_ms: i64,
        jobs: &[Incoming],
        on_conflict: OnConflict,
        out: &mut Out<'_>,
    ) -> Result<Vec<EnqueueOutcome>, EnqueueError> {
        // Decide every outcome first: a refused call changes nothing.
        let (rows, mut spans): (Vec<JobRow>, Vec<Option<PlannedSpan>>) =
            jobs.iter().map(|incoming| self.new_row(incoming, now_ms)).unzip();
        let plan = self.plan_enqueue(now_ms, &rows, jobs, on_conflict)?;
        self.check_quotas(
            now_ms,
            plan.new_rows.iter().map(|(index, _)| rows[*index].tenant.as_str()),
        )
        .map_err(EnqueueError::Quota)?;
        // Duplicates re-send the effect their job is waiting on.
        for outcome in &plan.outcomes {
            if outcome.deduplicated && !plan.first_in_call.contains_key(&outcome.job_id) {
                self.resend_pending(&outcome.job_id, out);
            }
        }
        let mut rows: Vec<Option<JobRow>> = rows.into_iter().map(Some).collect();
        for (index, expires_at_ms) in plan.new_rows {
            if let Some(row) = rows.get_mut(index).and_then(Option::take) {
                self.insert_new_job(row, expires_at_ms, out);
                self.planned_spans.extend(spans.get_mut(index).and_then(Option::take));
            }
        }
        Ok(plan.outcomes)
    }

    /// The outcome of each job of an Enqueue call, changing nothing: a new
    /// job, a duplicate (of a saved job, of one earlier in the call, or of
    /// the holder of its idempotency key), or a conflict.
    fn plan_enqueue(
        &self,
        now_ms: i64,
        rows: &[JobRow],
        jobs: &[Incoming],
        on_conflict: OnConflict,
    ) -> Result<EnqueuePlan, EnqueueError> {
        let mut plan = EnqueuePlan {
            outcomes: Vec::with_capacity(rows.len()),
            first_in_call: HashMap::default(),
            new_rows: Vec::new(),
        };
        let mut idempotency_in_call: HashMap<(String, String), String> = HashMap::default();
        for (index, (row, incoming)) in rows.iter().zip(jobs).enumerate() {
            let job_id = &row.state.job_id;
            if let Some(holder) = self.idempotency_holder(now_ms, row, incoming, &mut idempotency_in_call) {
                let status = self.existing(&holder).map_or(Status::Unspecified, |(status, _)| status);
                plan.outcomes.push(EnqueueOutcome {
                    job_id: holder,
                    status,
                    deduplicated: true,
                    conflict: false,
                });
                continue;
            }
            // The same id earlier in this call, or already saved.
            let earlier = plan.first_in_call.get(job_id).map(|first| &rows[*first]);
            let existing = match earlier {
                Some(first) => Some((first.state.status, first.request_hash.clone())),
                None => self.existing(job_id),
            };
            let Some((status, saved_hash)) = existing else {
                plan.first_in_call.insert(job_id.clone(), index);
                let expires_at_ms = incoming
                    .valid
                    .idempotency_window_ms
                    .map_or(0, |window_ms| now_ms.saturating_add(window_ms));
                plan.new_rows.push((index, expires_at_ms));
                plan.outcomes.push(EnqueueOutcome {
                    job_id: job_id.clone(),
                    status: row.state.status,
                    deduplicated: false,
                    conflict: false,
                });
                continue;
            };
            let same = match (&saved_hash, &row.request_hash) {
                (Some(saved), Some(ours)) => saved == ours,
                _ => true,
            };
            if !same && on_conflict == OnConflict::Refuse {
                return Err(EnqueueError::Conflict(EnqueueConflict {
                    index,
                    job_id: job_id.clone(),
                }));
            }
            plan.outcomes.push(EnqueueOutcome {
                job_id: job_id.clone(),
                status,
                deduplicated: same,
                conflict: !same,
            });
        }
        Ok(plan)
    }

    /// Another job that holds `row`'s idempotency key inside its window
    /// (saved, or earlier in this call). Takes the key for `row` in
    /// `in_call` when nobody holds it.
    fn idempotency_holder(
        &self,
        now_ms: i64,
        row: &JobRow,
        incoming: &Incoming,
        in_call: &mut HashMap<(String, String), String>,
    ) -> Option<String> {
        let (Some(key), Some(_)) = (&row.idempotency_key, incoming.valid.idempotency_window_ms) else {
            return None;
        };
        let pair = (row.tenant.clone(), key.clone());
        let holder = in_call.get(&pair).cloned().or_else(|| {
            self.prepared
                .idempotency
                .get(&pair)
                .filter(|(_, expires_at_ms)| *expires_at_ms > now_ms)
                .map(|(holder, _)| holder.clone())
        });
        match holder {
            Some(holder) if holder != row.state.job_id => Some(holder),
            Some(_) => None,
            None => {
                in_call.insert(pair, row.state.job_id.clone());
                None
            }
        }
    }

    /// Save a new job and start it: it acquires its limits (or is
    /// admitted at once when it names none).
    fn insert_new_job(&mut self, row: JobRow, idempotency_expires_at_ms: i64, out: &mut Out<'_>) {
        if let Some(key) = &row.idempotency_key {
            out.writes.idempotency.push((
                row.tenant.clone(),
                key.clone(),
                row.state.job_id.clone(),
                idempotency_expires_at_ms,
            ));
            // Later requests of the same batch see the key taken.
            self.prepared.idempotency.insert(
                (row.tenant.clone(), key.clone()),
                (row.state.job_id.clone(), idempotency_expires_at_ms),
            );
        }
        let job_id = row.state.job_id.clone();
        let effects = match row.state.status {
            Status::Waiting => vec![Effect::Acquire],
            Status::Admitted => vec![Effect::Admitted],
            _ => Vec::new(),
        };
        out.writes.inserted.push(row.clone());
        let keep_payload = self.payload_fits(&row.payload);
        let mut kept = row;
        if !keep_payload {
            kept.payload = Vec::new();
        }
        self.put(kept, keep_payload);
        self.changes.insert(
            job_id.clone(),
            JobChange {
                job_id: job_id.clone(),
                created: true,
                ..Default::default()
            },
        );
        self.after_transition(&job_id, &effects, out);
    }

    /// Refuse new jobs of a tenant over its quotas (this partition's share:
    /// `quota::Quotas::share_of`); else take their rate tokens.
    fn check_quotas<'a>(&mut self, now_ms: i64, tenants: impl Iterator<Item = &'a str>) -> Result<(), QuotaRefusal> {
        if self.settings.quotas.unlimited() {
            return Ok(());
        }
        let mut new_by_tenant: BTreeMap<&str, u64> = BTreeMap::new();
        for tenant in tenants {
            *new_by_tenant.entry(tenant).or_default() += 1;
        }
        let quotas = self.settings.quotas.clone();
        let partition = self.settings.partition;
        let mut taken: Vec<(&str, f64)> = Vec::new();
        for (tenant, new) in &new_by_tenant {
            let quota = quotas.of(tenant);
            if let Some(max) = quota.max_waiting {
                let share = quotas.share_of(max, partition);
                let unfinished = self.active_by_tenant.get(*tenant).copied().unwrap_or(0);
                if unfinished + new > share {
                    crate::quota::count_refusal(tenant, "max_waiting", *new);
                    return Err(QuotaRefusal {
                        tenant: tenant.to_string(),
                        quota: "max_waiting",
                        message: format!(
                            "quota: tenant {tenant:?} is over its quota max_waiting ({max} unfinished jobs; job \
                             partition {partition} holds {unfinished} of its share {share}): enqueue again once some \
                             of its jobs finish"
                        ),
                    });
                }
            }
            if let Some(rate) = quota.max_enqueues_per_second {
                let share = quotas.rate_share(rate);
                let bucket = self
                    .buckets
                    .entry(tenant.to_string())
                    .or_insert_with(|| crate::quota::Bucket::full(share, now_ms));
                if !bucket.take(share, *new as f64, now_ms) {
                    crate::quota::count_refusal(tenant, "max_enqueues_per_second", *new);
                    // Give back what this call took from earlier tenants.
                    for (earlier, count) in taken {
                        if let Some(bucket) = self.buckets.get_mut(earlier) {
                            bucket.give_back(count);
                        }
                    }
                    return Err(QuotaRefusal {
                        tenant: tenant.to_string(),
                        quota: "max_enqueues_per_second",
                        message: format!(
                            "quota: tenant {tenant:?} is over its quota max_enqueues_per_second ({rate}/s): slow down \
                             and enqueue again"
                        ),
                    });
                }
                taken.push((tenant, *new as f64));
            }
        }
        Ok(())
    }

    /// Send again the effect an active job is waiting on.
    pub(super) fn resend_pending(&mut self, job_id: &str, out: &mut Out<'_>) {
        let Some(active) = self.jobs.get(job_id) else {
            return;
        };
        match active.row.state.status {
            Status::Waiting => self.settings.routes.push_acquire(out.outbox, &active.row, self.now_ms),
            Status::Admitted => self.publish_admitted(job_id, out),
            _ => {}
        }
    }

    /// Send again the acquire of every waiting job whose current step's owner
    /// is one of `partitions` of `link`'s service (its path changed). Its
    /// timer is left as it is: this is no re-send it waits for.
    pub(super) fn resend_on_path(&self, link: Link, partitions: &[i32], outbox: &mut Outbox) {
        let changed: HashSet<i32> = partitions.iter().copied().collect();
        let routes = &self.settings.routes;
        for active in self.jobs.values() {
            if active.row.state.status != Status::Waiting {
                continue;
            }
            let on_path = routes
                .acquire_route(&active.row)
                .is_some_and(|(to, partition)| to == link && changed.contains(&partition));
            if on_path {
                routes.push_acquire(outbox, &active.row, self.now_ms);
            }
        }
    }

    /// A request handed over through `sluice.jobs`: a new job, a duplicate,
    /// or a conflict (dead-lettered).
    pub(super) fn hand_over(&mut self, now_ms: i64, handover: HandOver, out: &mut Out<'_>) {
        let refusal = match &handover.checked {
            Ok(incoming) => match self.enqueue(now_ms, std::slice::from_ref(incoming), OnConflict::Report, out) {
                Ok(outcomes) if outcomes.iter().any(|outcome| outcome.conflict) => Some(Refusal {
                    class: DeadLetterClass::Conflict,
                    reason: format!(
                        "conflict: job {:?} already exists with a different request (a job id names one request; \
                         send a new id for a new job)",
                        incoming.job_id
                    ),
                }),
                Ok(_) => None,
                Err(EnqueueError::Conflict(conflict)) => Some(Refusal {
                    class: DeadLetterClass::Conflict,
                    reason: format!(
                        "conflict: job {:?} already exists with a different request",
                        conflict.job_id
                    ),
                }),
                Err(EnqueueError::Quota(refusal)) => Some(Refusal {
                    class: DeadLetterClass::Quota,
                    reason: refusal.message,
                }),
            },
            Err(refusal) => Some(refusal.clone()),
        };
        if let Some(refusal) = refusal {
            self.settings.routes.push_deadletter(
                out.outbox,
                &handover.source_topic,
                &handover.source,
                refusal.class,
                &refusal.reason,
            );
            // Logged and counted once it is committed: a batch decided
            // again after a failed commit counts it once.
            let (topic, partition, offset) = (
                handover.source_topic.clone(),
                handover.source.partition,
                handover.source.offset,
            );
            out.outbox.observe(move || {
                tracing::warn!(%topic, partition, offset, reason = %refusal.reason, "dead-lettering a job request");
                count_dead_letters(&topic, refusal.class, 1);
            });
        }
    }
}
