//! The `Limits` gRPC service: a thin adapter. Validate, route to the key's
//! owner (this instance's partition task, or forward once), map errors.

use std::sync::Arc;

use sluice_common::forward::{forwarded_request, is_forwarded, on_owner, owner_endpoint, ChannelCache};
use sluice_common::owner::OwnerRegistry;
use sluice_common::partition::key_partition;
use sluice_common::validate::{check_name, check_text, check_u32, FieldError, MAX_CONCURRENCY, MAX_ID_BYTES};
use sluice_proto::v1 as pb;
use sluice_proto::v1::limits_client::LimitsClient;
use sqlx::{PgPool, Row};
use tonic::{Request, Response, Status};

use crate::state::{LocalRequest, TicketKey};

pub struct LimitsApi {
    pub registry: Arc<OwnerRegistry<LocalRequest>>,
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

impl LimitsApi {
    /// A client for the partition's owner (see `owner_endpoint`).
    async fn owner_client(
        &self,
        partition: i32,
        forwarded: bool,
    ) -> Result<LimitsClient<tonic::transport::Channel>, Status> {
        let endpoint = owner_endpoint(&self.pool, partition, forwarded, &self.own_endpoint).await?;
        Ok(LimitsClient::new(self.channels.channel(&endpoint)?))
    }
}

#[tonic::async_trait]
impl pb::limits_server::Limits for LimitsApi {
    async fn set_limit(&self, request: Request<pb::SetLimitRequest>) -> Result<Response<pb::SetLimitResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let message = request.into_inner();
        let (tenant, key) = checked_key(message.key.as_ref(), self.max_key_bytes)?;
        let max = match message.change {
            Some(pb::set_limit_request::Change::Max(max)) => {
                check_u32("max", max, 0, MAX_CONCURRENCY)?;
                Some(max)
            }
            Some(pb::set_limit_request::Change::Clear(true)) => None,
            _ => return Err(FieldError::new("change", "set `max` (0 pauses) or `clear: true`").into()),
        };
        let partition = key_partition(&tenant, &key, self.limit_partitions);
        on_owner(
            &self.registry,
            partition,
            |reply| LocalRequest::SetLimit {
                tenant: tenant.clone(),
                key: key.clone(),
                max,
                reply,
            },
            |state| {
                tracing::info!(%tenant, %key, ?max, "limit override set");
                Ok(pb::SetLimitResponse { state: Some(state) })
            },
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .set_limit(forwarded_request(message))
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
        let message = request.into_inner();
        let (tenant, key) = checked_key(message.key.as_ref(), self.max_key_bytes)?;
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
            |reply| LocalRequest::DescribeKey {
                tenant,
                key,
                ticket,
                first_waiters,
                reply,
            },
            Ok,
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .describe_key(forwarded_request(message))
                    .await
            },
        )
        .await
    }

    /// Answered from committed state by any instance: keys span partitions.
    async fn list_keys(&self, request: Request<pb::ListKeysRequest>) -> Result<Response<pb::ListKeysResponse>, Status> {
        let message = request.into_inner();
        check_name("tenant", &message.tenant, self.max_key_bytes)?;
        check_text("prefix", &message.prefix, self.max_key_bytes)?;
        check_text("page_token", &message.page_token, self.max_key_bytes)?;
        let page_size = match message.page_size {
            0 => 100,
            size => size.min(1000),
        };
        let rows = sqlx::query(
            "WITH t AS (
                SELECT key, count(*) FILTER (WHERE held) AS holders, count(*) FILTER (WHERE NOT held) AS waiting,
                       bool_or(floating) AS floating
                FROM tickets WHERE tenant = $1 AND starts_with(key, $2) AND key > $3 GROUP BY key),
             k AS (SELECT key, override_max, floating_max FROM keys
                   WHERE tenant = $1 AND starts_with(key, $2) AND key > $3)
             SELECT coalesce(t.key, k.key) AS key, coalesce(t.holders, 0), coalesce(t.waiting, 0),
                    k.override_max, k.floating_max, coalesce(t.floating, false)
             FROM t FULL JOIN k ON t.key = k.key
             ORDER BY 1 LIMIT $4",
        )
        .bind(&message.tenant)
        .bind(&message.prefix)
        .bind(&message.page_token)
        .bind(i64::from(page_size))
        .fetch_all(&self.pool)
        .await
        .map_err(|error| Status::unavailable(format!("listing keys failed: {error}")))?;
        let mut keys = Vec::with_capacity(rows.len());
        for row in rows {
            let read = |error: sqlx::Error| Status::internal(format!("listing keys: {error}"));
            let key: String = row.try_get(0).map_err(read)?;
            let holders: i64 = row.try_get(1).map_err(read)?;
            let waiting: i64 = row.try_get(2).map_err(read)?;
            let override_max: Option<i32> = row.try_get(3).map_err(read)?;
            let floating_max: Option<i32> = row.try_get(4).map_err(read)?;
            let floating: bool = row.try_get(5).map_err(read)?;
            keys.push(pb::KeySummary {
                key: Some(pb::KeyRef {
                    tenant: message.tenant.clone(),
                    key,
                }),
                kind: if floating || floating_max.is_some() {
                    pb::LimitKind::Floating as i32
                } else {
                    pb::LimitKind::Concurrency as i32
                },
                holders: u32::try_from(holders).unwrap_or(u32::MAX),
                waiting: u32::try_from(waiting).unwrap_or(u32::MAX),
                override_max: override_max.and_then(|max| u32::try_from(max).ok()),
                floating_max: floating_max.and_then(|max| u32::try_from(max).ok()),
            });
        }
        let next_page_token = if keys.len() == usize::try_from(page_size).unwrap_or(usize::MAX) {
            keys.last()
                .and_then(|summary| summary.key.as_ref())
                .map(|key| key.key.clone())
                .unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListKeysResponse { keys, next_page_token }))
    }
}
