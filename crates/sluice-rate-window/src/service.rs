//! The `RateLimits` gRPC service: validate (errors name the field), then
//! reach the key's owner — this instance's partition task, or one forward.

use std::sync::Arc;

use sluice_common::auth::{principal_of, Action};
use sluice_common::forward::{forwarded_request, is_forwarded, on_owner, owner_endpoint, ChannelCache};
use sluice_common::owner::OwnerRegistry;
use sluice_common::partition::rate_key_partition;
use sluice_common::validate::{
    check_i64, check_name, check_rate_key, check_rate_window, check_text, check_unique_key, FieldError, MAX_RATE_LIMIT,
    MAX_RATE_WINDOW_SECONDS,
};
use sluice_proto::v1 as pb;
use sluice_proto::v1::rate_limits_client::RateLimitsClient;
use sqlx::PgPool;
use tonic::{Request, Response, Status};

use crate::state::{LocalRequest, TicketKey};

pub struct RateLimitsApi {
    pub registry: Arc<OwnerRegistry<LocalRequest>>,
    pub pool: PgPool,
    pub rate_partitions: i32,
    pub own_endpoint: String,
    pub channels: ChannelCache,
    pub max_key_bytes: usize,
}

fn resource_ref(tenant: &str, resource_key: &str) -> pb::RateKeyRef {
    pb::RateKeyRef {
        tenant: tenant.to_string(),
        kind: Some(pb::rate_key_ref::Kind::ResourceKey(resource_key.to_string())),
    }
}

impl RateLimitsApi {
    async fn owner_client(
        &self,
        partition: i32,
        forwarded: bool,
    ) -> Result<RateLimitsClient<sluice_common::auth::Channel>, Status> {
        let endpoint = owner_endpoint(&self.pool, partition, forwarded, &self.own_endpoint).await?;
        Ok(RateLimitsClient::new(self.channels.channel(&endpoint)?))
    }

    fn check_key(&self, field: &str, key: Option<&pb::RateKeyRef>) -> Result<pb::RateKeyRef, FieldError> {
        check_rate_key(field, key, self.max_key_bytes)?;
        key.cloned().ok_or_else(|| FieldError::new(field, "must be set"))
    }

    fn check_resource(&self, resource: Option<&pb::RateLimitResource>) -> Result<pb::RateLimitResource, FieldError> {
        let Some(resource) = resource else {
            return Err(FieldError::new("resource", "must be set"));
        };
        check_name("resource.tenant", &resource.tenant, self.max_key_bytes)?;
        check_name("resource.resource_key", &resource.resource_key, self.max_key_bytes)?;
        check_i64("resource.max_count", resource.max_count, 1, MAX_RATE_LIMIT)?;
        check_i64(
            "resource.window_seconds",
            resource.window_seconds,
            1,
            MAX_RATE_WINDOW_SECONDS,
        )?;
        Ok(resource.clone())
    }
}

#[tonic::async_trait]
impl pb::rate_limits_server::RateLimits for RateLimitsApi {
    async fn put_rate_limit(
        &self,
        request: Request<pb::PutRateLimitRequest>,
    ) -> Result<Response<pb::PutRateLimitResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        let resource = self.check_resource(message.resource.as_ref())?;
        caller.authorize(
            &resource.tenant,
            Action::Operate,
            format_args!("rate limit {}/{}", resource.tenant, resource.resource_key),
        )?;
        let partition = rate_key_partition(
            &resource_ref(&resource.tenant, &resource.resource_key),
            self.rate_partitions,
        );
        on_owner(
            &self.registry,
            partition,
            |reply| LocalRequest::PutResource {
                resource: resource.clone(),
                reply,
            },
            |answer| {
                tracing::info!(tenant = %resource.tenant, key = %resource.resource_key, max_count = resource.max_count, window_seconds = resource.window_seconds, "rate limit resource put");
                answer
            },
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .put_rate_limit(forwarded_request(message, &caller))
                    .await
            },
        )
        .await
    }

    async fn list_rate_limits(
        &self,
        request: Request<pb::ListRateLimitsRequest>,
    ) -> Result<Response<pb::ListRateLimitsResponse>, Status> {
        let caller = principal_of(&request);
        let message = request.into_inner();
        check_name("tenant", &message.tenant, self.max_key_bytes)?;
        caller.authorize(&message.tenant, Action::Read, format_args!("tenant {}", message.tenant))?;
        check_text("page_token", &message.page_token, self.max_key_bytes)?;
        let page_size = match message.page_size {
            0 => 100,
            size => size.min(1000),
        };
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT resource_key, max_count, window_seconds FROM resources
             WHERE tenant = $1 AND resource_key > $2 ORDER BY resource_key LIMIT $3",
        )
        .bind(&message.tenant)
        .bind(&message.page_token)
        .bind(i64::from(page_size))
        .fetch_all(&self.pool)
        .await
        .map_err(|error| Status::unavailable(format!("listing rate limits failed: {error}")))?;
        let full_page = rows.len() == usize::try_from(page_size).unwrap_or(usize::MAX);
        let resources: Vec<pb::RateLimitResource> = rows
            .into_iter()
            .map(|(resource_key, max_count, window_seconds)| pb::RateLimitResource {
                tenant: message.tenant.clone(),
                resource_key,
                max_count,
                window_seconds,
            })
            .collect();
        let next_page_token = if full_page {
            resources
                .last()
                .map(|resource| resource.resource_key.clone())
                .unwrap_or_default()
        } else {
            String::new()
        };
        Ok(Response::new(pb::ListRateLimitsResponse {
            resources,
            next_page_token,
        }))
    }

    async fn delete_rate_limit(
        &self,
        request: Request<pb::DeleteRateLimitRequest>,
    ) -> Result<Response<pb::DeleteRateLimitResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        check_name("tenant", &message.tenant, self.max_key_bytes)?;
        caller.authorize(
            &message.tenant,
            Action::Operate,
            format_args!("rate limit {}/{}", message.tenant, message.resource_key),
        )?;
        check_name("resource_key", &message.resource_key, self.max_key_bytes)?;
        let partition = rate_key_partition(
            &resource_ref(&message.tenant, &message.resource_key),
            self.rate_partitions,
        );
        let (tenant, resource_key) = (message.tenant.clone(), message.resource_key.clone());
        on_owner(
            &self.registry,
            partition,
            |reply| LocalRequest::DeleteResource {
                tenant,
                resource_key,
                reply,
            },
            |answer| answer,
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .delete_rate_limit(forwarded_request(message, &caller))
                    .await
            },
        )
        .await
    }

    async fn try_acquire(
        &self,
        request: Request<pb::TryAcquireRequest>,
    ) -> Result<Response<pb::TryAcquireResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        check_name("tenant", &message.tenant, self.max_key_bytes)?;
        caller.authorize(&message.tenant, Action::Work, format_args!("tenant {}", message.tenant))?;
        let Some(spec) = message.limit.as_ref().and_then(|limit| limit.spec.as_ref()) else {
            return Err(FieldError::new("limit", "set inline or rate_limit_key").into());
        };
        check_i64("cost", message.cost, 0, MAX_RATE_LIMIT)?;
        let (key, limit, window_ms, cost) = match spec {
            pb::rate_limit::Spec::Inline(inline) => {
                check_name("limit.inline.name", &inline.name, self.max_key_bytes)?;
                check_unique_key("limit.inline.unique_key", &inline.unique_key, self.max_key_bytes)?;
                let cost = match (message.cost, inline.cost) {
                    (0, 0) => 1,
                    (0, inline_cost) => inline_cost,
                    (cost, _) => cost,
                };
                check_rate_window("limit.inline", inline.limit, inline.duration_ms, 0)?;
                let cost_field = if message.cost != 0 { "cost" } else { "limit.inline.cost" };
                check_i64(cost_field, cost, 0, MAX_RATE_LIMIT)?;
                if cost > inline.limit {
                    return Err(FieldError::new(
                        cost_field,
                        format!("{cost} is above the limit {}; it could never be allowed", inline.limit),
                    )
                    .into());
                }
                let key = pb::RateKeyRef {
                    tenant: message.tenant.clone(),
                    kind: Some(pb::rate_key_ref::Kind::Inline(pb::InlineKey {
                        name: inline.name.clone(),
                        unique_key: inline.unique_key.clone(),
                    })),
                };
                (key, inline.limit, inline.duration_ms, cost)
            }
            pb::rate_limit::Spec::RateLimitKey(resource_key) => {
                check_name("limit.rate_limit_key", resource_key, self.max_key_bytes)?;
                (resource_ref(&message.tenant, resource_key), 1, 1, message.cost.max(1))
            }
        };
        let partition = rate_key_partition(&key, self.rate_partitions);
        let to_u64 = |value: i64| u64::try_from(value).unwrap_or(1);
        on_owner(
            &self.registry,
            partition,
            |reply| LocalRequest::TryAcquire {
                key,
                limit: to_u64(limit),
                window_ms: to_u64(window_ms),
                cost: to_u64(cost),
                reply,
            },
            |answer| answer,
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .try_acquire(forwarded_request(message, &caller))
                    .await
            },
        )
        .await
    }

    async fn describe_rate_key(
        &self,
        request: Request<pb::DescribeRateKeyRequest>,
    ) -> Result<Response<pb::DescribeRateKeyResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        let key = self.check_key("key", message.key.as_ref())?;
        caller.authorize(&key.tenant, Action::Read, format_args!("rate key {}", key.tenant))?;
        let partition = rate_key_partition(&key, self.rate_partitions);
        let ticket = message.ticket.as_ref().map(TicketKey::from_proto);
        on_owner(
            &self.registry,
            partition,
            |reply| LocalRequest::Describe { key, ticket, reply },
            |answer| answer,
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .describe_rate_key(forwarded_request(message, &caller))
                    .await
            },
        )
        .await
    }
}
