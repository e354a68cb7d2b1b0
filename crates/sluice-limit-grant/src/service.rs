//! The `Limits` gRPC service: a thin adapter. Validate, route to the key's
//! owner (this instance's partition task, or forward once), map errors.

use std::sync::Arc;
use std::time::Duration;

use sluice_common::auth::{principal_of, Action};
use sluice_common::core::Ask;
use sluice_common::forward::{forwarded_request, is_forwarded, on_owner, owner_endpoint, ChannelCache};
use sluice_common::owner::{LocalCallError, OwnerRegistry};
use sluice_common::partition::key_partition;
use sluice_common::validate::{check_name, check_text, check_u32, FieldError, MAX_CONCURRENCY, MAX_ID_BYTES};
use sluice_proto::v1 as pb;
use sluice_proto::v1::limits_client::LimitsClient;
use sqlx::PgPool;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use crate::core::{LimitAnswer, LimitChange, LimitPartition, LimitQuery, TicketKey};

/// What the partition tasks take.
pub type LimitAsk = Ask<LimitPartition>;

pub struct LimitsApi {
    pub registry: Arc<OwnerRegistry<LimitAsk>>,
    pub pool: PgPool,
    pub limit_partitions: i32,
    pub own_endpoint: String,
    pub channels: ChannelCache,
    pub max_key_bytes: usize,
}

fn checked_key(key: Option<&pb::KeyRef>, max_key_bytes: usize) -> Result<(String, String), FieldError> {
    let Some(key) = key else {
        return Err(FieldError::new("key", "must be set"));
    };
    check_name("key.tenant", &key.tenant, max_key_bytes)?;
    check_name("key.key", &key.key, max_key_bytes)?;
    Ok((key.tenant.clone(), key.key.clone()))
}

/// An answer of another kind than the query's: a bug, reported as such.
fn unexpected(answer: &LimitAnswer) -> Status {
    Status::internal(format!(
        "limit-grant answered with the wrong kind of answer: {answer:?}"
    ))
}

/// How long a call waits for a partition that has no running owner (its
/// task is loading here, or the directory names nobody yet).
const OWNER_WAIT: Duration = Duration::from_secs(5);
/// How often a waiting call looks at the owner directory again.
const OWNER_RECHECK: Duration = Duration::from_millis(100);

/// One partition's part of `ListKeys`.
enum ListPart {
    /// Answered by this instance's partition task.
    Here(Vec<pb::KeySummary>),
    /// Owned by the instance at this endpoint.
    At(String),
}

impl LimitsApi {
    /// Ask `partition`'s task when this instance runs it, else name its
    /// owner. While the partition has no owner, or the directory names this
    /// instance but its task is not running yet (loading), waits up to
    /// `OWNER_WAIT`, woken when a partition task starts here.
    #[allow(clippy::disallowed_methods, reason = "the runtime reads the clock here, not a core")]
    async fn part_of_list(
        &self,
        partition: i32,
        ask: &impl Fn(oneshot::Sender<LimitAnswer>) -> LimitAsk,
    ) -> Result<ListPart, Status> {
        let deadline = tokio::time::Instant::now() + OWNER_WAIT;
        loop {
            let started_here = self.registry.partition_started();
            let unavailable = match self.registry.call(partition, ask).await {
                Ok(LimitAnswer::Keys(keys)) => return Ok(ListPart::Here(keys)),
                Ok(other) => return Err(unexpected(&other)),
                Err(LocalCallError::NotOwner(_)) => {
                    match owner_endpoint(&self.pool, partition, false, &self.own_endpoint).await {
                        Ok(endpoint) => return Ok(ListPart::At(endpoint)),
                        Err(status) => status,
                    }
                }
                Err(error) => Status::unavailable(error.to_string()),
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(unavailable);
            }
            tokio::select! {
                () = started_here => {}
                () = tokio::time::sleep(OWNER_RECHECK) => {}
            }
        }
    }

    /// A client for the partition's owner (see `owner_endpoint`).
    async fn owner_client(
        &self,
        partition: i32,
        forwarded: bool,
    ) -> Result<LimitsClient<sluice_common::auth::Channel>, Status> {
        let endpoint = owner_endpoint(&self.pool, partition, forwarded, &self.own_endpoint).await?;
        Ok(LimitsClient::new(self.channels.channel(&endpoint)?))
    }
}

#[tonic::async_trait]
impl pb::limits_server::Limits for LimitsApi {
    async fn set_limit(&self, request: Request<pb::SetLimitRequest>) -> Result<Response<pb::SetLimitResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        let (tenant, key) = checked_key(message.key.as_ref(), self.max_key_bytes)?;
        caller.authorize(&tenant, Action::Operate, format_args!("key {tenant}/{key}"))?;
        let change = match &message.change {
            Some(pb::set_limit_request::Change::Max(max)) => {
                check_u32("max", *max, 0, MAX_CONCURRENCY)?;
                LimitChange::Max(Some(*max))
            }
            Some(pb::set_limit_request::Change::Clear(true)) => LimitChange::Max(None),
            Some(pb::set_limit_request::Change::FlowWeight(flow)) => {
                check_text("flow_weight.fairness_key", &flow.fairness_key, self.max_key_bytes)?;
                if let Some(weight) = flow.weight {
                    check_u32("flow_weight.weight", weight, 1, crate::core::flows::MAX_WEIGHT)?;
                }
                LimitChange::FlowWeight {
                    fairness_key: flow.fairness_key.clone(),
                    weight: flow.weight,
                }
            }
            Some(pb::set_limit_request::Change::Mode(mode)) => match pb::LimitMode::try_from(*mode) {
                Ok(pb::LimitMode::Unspecified) => LimitChange::Mode(None),
                Ok(mode) => LimitChange::Mode(Some(mode)),
                Err(_) => return Err(FieldError::new("mode", format!("unknown mode {mode}")).into()),
            },
            _ => {
                return Err(
                    FieldError::new("change", "set `max` (0 pauses), `clear: true`, `flow_weight` or `mode`").into(),
                )
            }
        };
        let partition = key_partition(&tenant, &key, self.limit_partitions);
        on_owner(
            &self.registry,
            partition,
            |reply| Ask::Query {
                query: LimitQuery::SetLimit {
                    tenant: tenant.clone(),
                    key: key.clone(),
                    change: change.clone(),
                },
                reply,
            },
            |answer| match answer {
                LimitAnswer::KeyState(state) => {
                    tracing::info!(%tenant, %key, ?change, "key setting changed");
                    Ok(pb::SetLimitResponse { state: Some(state) })
                }
                other => Err(unexpected(&other)),
            },
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .set_limit(forwarded_request(message, &caller))
                    .await
            },
        )
        .await
    }

    async fn describe_key(
        &self,
        request: Request<pb::DescribeKeyRequest>,
    ) -> Result<Response<pb::DescribeKeyResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        let (tenant, key) = checked_key(message.key.as_ref(), self.max_key_bytes)?;
        caller.authorize(&tenant, Action::Read, format_args!("key {tenant}/{key}"))?;
        let partition = key_partition(&tenant, &key, self.limit_partitions);
        let first_waiters = if message.first_waiters == 0 {
            10
        } else {
            usize::try_from(message.first_waiters.min(1000)).unwrap_or(10)
        };
        if let Some(ticket) = &message.ticket {
            check_text("ticket.job_id", &ticket.job_id, MAX_ID_BYTES)?;
        }
        let ticket = message.ticket.as_ref().map(TicketKey::from_proto);
        on_owner(
            &self.registry,
            partition,
            |reply| Ask::Query {
                query: LimitQuery::DescribeKey {
                    tenant,
                    key,
                    ticket,
                    first_waiters,
                },
                reply,
            },
            |answer| match answer {
                LimitAnswer::Described(described) => Ok(described),
                other => Err(unexpected(&other)),
            },
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .describe_key(forwarded_request(message, &caller))
                    .await
            },
        )
        .await
    }

    /// Keys span partitions and live in their owners' memory: each
    /// partition this instance owns answers here, and every other owner
    /// once, forwarded (a forwarded call answers for its own partitions only).
    async fn list_keys(&self, request: Request<pb::ListKeysRequest>) -> Result<Response<pb::ListKeysResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        check_name("tenant", &message.tenant, self.max_key_bytes)?;
        caller.authorize(&message.tenant, Action::Read, format_args!("tenant {}", message.tenant))?;
        check_text("prefix", &message.prefix, self.max_key_bytes)?;
        check_text("page_token", &message.page_token, self.max_key_bytes)?;
        let page_size = match message.page_size {
            0 => 100,
            size => size.min(1000),
        };
        let limit = usize::try_from(page_size).unwrap_or(100);
        let partitions: Vec<i32> = if forwarded {
            self.registry.owned()
        } else {
            (0..self.limit_partitions).collect()
        };
        let ask = |reply| Ask::Query {
            query: LimitQuery::ListKeys {
                tenant: message.tenant.clone(),
                prefix: message.prefix.clone(),
                after: message.page_token.clone(),
                limit,
            },
            reply,
        };
        let mut found: Vec<pb::KeySummary> = Vec::new();
        let mut endpoints: Vec<String> = Vec::new();
        for partition in partitions {
            if forwarded {
                // Given up since `owned()`: its new owner answers the
                // caller's next call.
                if let Ok(LimitAnswer::Keys(keys)) = self.registry.call(partition, &ask).await {
                    found.extend(keys);
                }
                continue;
            }
            match self.part_of_list(partition, &ask).await? {
                ListPart::Here(keys) => found.extend(keys),
                ListPart::At(endpoint) if !endpoints.contains(&endpoint) => endpoints.push(endpoint),
                ListPart::At(_) => {}
            }
        }
        // The other owners at once: a page costs one round trip, not one
        // per instance.
        let answers = futures::future::try_join_all(endpoints.iter().map(|endpoint| {
            let request = forwarded_request(message.clone(), &caller);
            async move {
                let answer = LimitsClient::new(self.channels.channel(endpoint)?)
                    .list_keys(request)
                    .await?;
                Ok::<_, Status>(answer.into_inner().keys)
            }
        }))
        .await?;
        found.extend(answers.into_iter().flatten());
        let key_of = |summary: &pb::KeySummary| summary.key.as_ref().map(|key| key.key.clone()).unwrap_or_default();
        found.sort_by_key(key_of);
        found.dedup_by_key(|summary| key_of(summary));
        found.truncate(limit);
        let next_page_token = if found.len() == limit {
            found.last().map(key_of).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListKeysResponse {
            keys: found,
            next_page_token,
        }))
    }
}
