//! Per-tenant quotas: how many unfinished jobs a tenant may have and how
//! fast it may enqueue.
//!
//! Defaults come from the configuration (`admission.default_max_waiting`,
//! `admission.default_max_enqueues_per_second`); per-tenant overrides are
//! stored in the `tenant_quotas` table, changed with `SetTenantQuota` and
//! read again by every instance every `admission.quota_refresh_interval`.
//!
//! A tenant's jobs spread over the job partitions by job id, and each
//! partition's owner decides alone: it holds an even share of each quota
//! (`share_of`), so the shares add up to the quota and no coordination sits
//! on the enqueue path. A tenant whose jobs hash unevenly may be refused a
//! little below its quota, never above it.

use std::collections::HashMap;
use std::sync::RwLock;

use sluice_proto::v1 as pb;
use sqlx::PgPool;

/// A tenant's quotas; `None`: unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Quota {
    /// Jobs enqueued and not yet finished (waiting for their limits,
    /// admitted, or running).
    pub max_waiting: Option<u64>,
    /// New jobs per second.
    pub max_enqueues_per_second: Option<f64>,
}

/// A tenant's stored override: a field left `None` falls back to the
/// configured default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QuotaOverride {
    pub max_waiting: Option<u64>,
    pub max_enqueues_per_second: Option<f64>,
}

/// The quotas every partition of this instance enforces.
#[derive(Debug)]
pub struct Quotas {
    defaults: Quota,
    overrides: RwLock<HashMap<String, QuotaOverride>>,
    /// How many `set`s were applied (changed under the `overrides` lock): a
    /// refresh whose read started before one must not undo it.
    sets: std::sync::atomic::AtomicU64,
    partitions: u32,
}

fn positive(value: f64) -> Option<f64> {
    (value.is_finite() && value > 0.0).then_some(value)
}

impl Quotas {
    pub fn from_config(config: &sluice_common::SluiceConfig) -> Quotas {
        let admission = &config.admission;
        Quotas {
            defaults: Quota {
                max_waiting: (admission.default_max_waiting > 0).then_some(admission.default_max_waiting),
                max_enqueues_per_second: positive(admission.default_max_enqueues_per_second),
            },
            overrides: RwLock::new(HashMap::new()),
            sets: std::sync::atomic::AtomicU64::new(0),
            partitions: u32::try_from(config.kafka.partitions.jobs.max(1)).unwrap_or(1),
        }
    }

    pub fn defaults(&self) -> Quota {
        self.defaults
    }

    /// No tenant has any quota (no default, no override): nothing to check.
    pub fn unlimited(&self) -> bool {
        self.defaults == Quota::default()
            && self
                .overrides
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .is_empty()
    }

    /// The quotas `tenant` has now.
    pub fn of(&self, tenant: &str) -> Quota {
        let overrides = self.overrides.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        match overrides.get(tenant) {
            None => self.defaults,
            Some(stored) => Quota {
                max_waiting: stored.max_waiting.or(self.defaults.max_waiting),
                max_enqueues_per_second: stored.max_enqueues_per_second.or(self.defaults.max_enqueues_per_second),
            },
        }
    }

    /// Whether `tenant` has an override.
    pub fn overridden(&self, tenant: &str) -> Option<QuotaOverride> {
        let overrides = self.overrides.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        overrides.get(tenant).copied()
    }

    pub fn set(&self, tenant: &str, stored: Option<QuotaOverride>) {
        {
            let mut overrides = self.overrides.write().unwrap_or_else(|poisoned| poisoned.into_inner());
            match stored {
                Some(stored) => overrides.insert(tenant.to_string(), stored),
                None => overrides.remove(tenant),
            };
            self.sets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        record_quota_gauges(tenant, self.of(tenant));
    }

    /// How many `set`s were applied so far: take it before reading the
    /// stored table, and give it to `replace`.
    pub fn sets_so_far(&self) -> u64 {
        self.sets.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Replace every override with the stored table, read again after
    /// `sets_so_far` was `sets_before_read`. A `set` applied since (its row
    /// stored after the read began, maybe) wins: the table is not applied,
    /// and the next refresh reads it. Returns whether it was applied.
    /// (Before, a refresh that read the table just before a `SetTenantQuota`
    /// stored its row and applied it just after undid the new quota until
    /// the next refresh.)
    pub fn replace(&self, stored: HashMap<String, QuotaOverride>, sets_before_read: u64) -> bool {
        let changed: Vec<String> = {
            let mut overrides = self.overrides.write().unwrap_or_else(|poisoned| poisoned.into_inner());
            if self.sets_so_far() != sets_before_read {
                return false;
            }
            let changed = overrides
                .keys()
                .chain(stored.keys())
                .filter(|tenant| overrides.get(*tenant) != stored.get(*tenant))
                .cloned()
                .collect();
            *overrides = stored;
            changed
        };
        for tenant in changed {
            record_quota_gauges(&tenant, self.of(&tenant));
        }
        true
    }

    /// Partition `partition`'s share of `quota`: an even split whose parts
    /// add up to `quota` (the first `quota % partitions` partitions hold one
    /// more).
    pub fn share_of(&self, quota: u64, partition: i32) -> u64 {
        let partitions = u64::from(self.partitions);
        let index = u64::try_from(partition.max(0)).unwrap_or(0) % partitions;
        quota / partitions + u64::from(index < quota % partitions)
    }

    /// One partition's share of a rate.
    pub fn rate_share(&self, rate: f64) -> f64 {
        rate / f64::from(self.partitions)
    }
}

fn record_quota_gauges(tenant: &str, quota: Quota) {
    let metrics = sluice_common::metrics::metrics();
    let tenant = opentelemetry::KeyValue::new("tenant", tenant.to_string());
    metrics.tenant_quota.record(
        quota.max_waiting.map_or(-1.0, |max| max as f64),
        &[tenant.clone(), opentelemetry::KeyValue::new("quota", "max_waiting")],
    );
    metrics.tenant_quota.record(
        quota.max_enqueues_per_second.unwrap_or(-1.0),
        &[tenant, opentelemetry::KeyValue::new("quota", "max_enqueues_per_second")],
    );
}

/// Count a refusal for a quota.
pub fn count_refusal(tenant: &str, quota: &'static str, jobs: u64) {
    sluice_common::metrics::metrics().quota_refusals.add(
        jobs,
        &[
            opentelemetry::KeyValue::new("tenant", tenant.to_string()),
            opentelemetry::KeyValue::new("quota", quota),
        ],
    );
}

/// A token bucket of one tenant in one partition: `rate` tokens a second,
/// holding at most a second's worth (at least one).
#[derive(Clone, Copy, Debug)]
pub struct Bucket {
    tokens: f64,
    at_ms: i64,
}

impl Bucket {
    pub fn full(rate: f64, now_ms: i64) -> Bucket {
        Bucket {
            tokens: rate.max(1.0),
            at_ms: now_ms,
        }
    }

    /// Return tokens taken for a call that was refused after all.
    pub fn give_back(&mut self, count: f64) {
        self.tokens += count;
    }

    /// Take `count` tokens at `now_ms` if there are that many.
    pub fn take(&mut self, rate: f64, count: f64, now_ms: i64) -> bool {
        let elapsed_s = (now_ms - self.at_ms).max(0) as f64 / 1000.0;
        self.tokens = (self.tokens + elapsed_s * rate).min(rate.max(1.0));
        self.at_ms = now_ms.max(self.at_ms);
        if self.tokens + 1e-9 >= count {
            self.tokens -= count;
            return true;
        }
        false
    }
}

/// The stored overrides.
pub async fn load(pool: &PgPool) -> Result<HashMap<String, QuotaOverride>, sqlx::Error> {
    let rows: Vec<(String, Option<i64>, Option<f64>)> =
        sqlx::query_as("SELECT tenant, max_waiting, max_enqueues_per_second FROM tenant_quotas")
            .fetch_all(pool)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(tenant, max_waiting, rate)| {
            (
                tenant,
                QuotaOverride {
                    max_waiting: max_waiting.and_then(|max| u64::try_from(max).ok()),
                    max_enqueues_per_second: rate,
                },
            )
        })
        .collect())
}

/// Store `tenant`'s override (`None`: delete it).
pub async fn store(pool: &PgPool, tenant: &str, stored: Option<QuotaOverride>) -> Result<(), sqlx::Error> {
    match stored {
        Some(stored) => {
            sqlx::query(
                "INSERT INTO tenant_quotas (tenant, max_waiting, max_enqueues_per_second, updated_at)
                 VALUES ($1, $2, $3, now())
                 ON CONFLICT (tenant) DO UPDATE SET max_waiting = EXCLUDED.max_waiting,
                     max_enqueues_per_second = EXCLUDED.max_enqueues_per_second, updated_at = now()",
            )
            .bind(tenant)
            .bind(stored.max_waiting.map(|max| i64::try_from(max).unwrap_or(i64::MAX)))
            .bind(stored.max_enqueues_per_second)
            .execute(pool)
            .await?;
        }
        None => {
            sqlx::query("DELETE FROM tenant_quotas WHERE tenant = $1")
                .bind(tenant)
                .execute(pool)
                .await?;
        }
    }
    Ok(())
}

/// Read the stored overrides every `every` until `shutdown`: a quota set
/// through another instance applies here within that interval.
pub async fn refresh(
    quotas: std::sync::Arc<Quotas>,
    pool: PgPool,
    every: std::time::Duration,
    shutdown: sluice_common::Shutdown,
) -> Result<(), std::convert::Infallible> {
    let every = every.max(std::time::Duration::from_millis(100));
    loop {
        let sets_before_read = quotas.sets_so_far();
        match load(&pool).await {
            Ok(stored) => {
                quotas.replace(stored, sets_before_read);
            }
            Err(error) => tracing::warn!(%error, "reading tenant quotas failed; keeping the last ones read"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// A quota as the API shows it.
pub fn to_proto(tenant: &str, quota: Quota, stored: Option<QuotaOverride>) -> pb::TenantQuota {
    pb::TenantQuota {
        tenant: tenant.to_string(),
        max_waiting: quota.max_waiting,
        max_enqueues_per_second: quota.max_enqueues_per_second,
        overridden: stored.is_some(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quotas(partitions: u32) -> Quotas {
        Quotas {
            defaults: Quota::default(),
            overrides: RwLock::new(HashMap::new()),
            sets: std::sync::atomic::AtomicU64::new(0),
            partitions,
        }
    }

    /// A refresh that read the table before a `SetTenantQuota` stored its
    /// row, and applies what it read after the set, does not undo the set
    /// (the race that let a tenant's second job through a new rate quota in
    /// `quota::quotas_hold_on_grpc_and_kafka_and_leave_other_tenants_alone`).
    #[test]
    fn a_refresh_read_before_a_set_does_not_undo_it() {
        let quotas = quotas(1);
        let rate = QuotaOverride {
            max_waiting: None,
            max_enqueues_per_second: Some(0.001),
        };
        let sets_before_read = quotas.sets_so_far();
        let read_before_the_set: HashMap<String, QuotaOverride> = HashMap::new();
        quotas.set("globex", Some(rate));
        assert!(!quotas.replace(read_before_the_set, sets_before_read));
        assert_eq!(quotas.overridden("globex"), Some(rate), "the refresh undid the set");
        // The next refresh reads the row the set stored, and applies.
        let sets_before_read = quotas.sets_so_far();
        let read_after: HashMap<String, QuotaOverride> = [("globex".to_string(), rate)].into_iter().collect();
        assert!(quotas.replace(read_after, sets_before_read));
        assert_eq!(quotas.overridden("globex"), Some(rate));
        // A row removed through another instance goes at the next refresh.
        let sets_before_read = quotas.sets_so_far();
        assert!(quotas.replace(HashMap::new(), sets_before_read));
        assert_eq!(quotas.overridden("globex"), None);
    }

    #[test]
    fn shares_add_up_to_the_quota() {
        for partitions in [1, 2, 3, 8] {
            let quotas = quotas(partitions);
            for quota in [0, 1, 5, 7, 100, 1001] {
                let total: u64 = (0..i32::try_from(partitions).unwrap())
                    .map(|partition| quotas.share_of(quota, partition))
                    .sum();
                assert_eq!(total, quota, "{quota} over {partitions} partitions");
            }
        }
    }

    #[test]
    fn an_override_falls_back_to_the_default_field_by_field() {
        let quotas = Quotas {
            defaults: Quota {
                max_waiting: Some(100),
                max_enqueues_per_second: Some(10.0),
            },
            ..quotas(1)
        };
        quotas.set(
            "acme",
            Some(QuotaOverride {
                max_waiting: Some(5),
                max_enqueues_per_second: None,
            }),
        );
        assert_eq!(
            quotas.of("acme"),
            Quota {
                max_waiting: Some(5),
                max_enqueues_per_second: Some(10.0)
            }
        );
        assert_eq!(quotas.of("globex"), quotas.defaults());
        quotas.set("acme", None);
        assert_eq!(quotas.of("acme"), quotas.defaults());
    }

    #[test]
    fn a_bucket_allows_its_rate_and_refills_with_time() {
        let mut bucket = Bucket::full(2.0, 0);
        assert!(bucket.take(2.0, 1.0, 0));
        assert!(bucket.take(2.0, 1.0, 0));
        assert!(!bucket.take(2.0, 1.0, 0), "a third job in the same instant");
        assert!(!bucket.take(2.0, 1.0, 400), "0.8 of a token after 400 ms");
        assert!(bucket.take(2.0, 1.0, 500));
        assert!(bucket.take(2.0, 2.0, 10_000), "refilled, up to a second's worth");
        assert!(!bucket.take(2.0, 1.0, 10_000));
    }
}
