//! The `Refresh` gRPC service: validate (errors name the field), then reach
//! the key's owner — this instance's partition task, or one forward.

use std::sync::Arc;

use sluice_common::auth::{principal_of, Action};
use sluice_common::forward::{forwarded_request, is_forwarded, on_owner, owner_endpoint, ChannelCache};
use sluice_common::owner::OwnerRegistry;
use sluice_common::partition::key_partition;
use sluice_common::validate::{check_name, check_text, FieldError, MAX_ID_BYTES, MAX_TEXT_BYTES};
use sluice_proto::v1 as pb;
use sluice_proto::v1::refresh_client::RefreshClient;
use sqlx::PgPool;
use tonic::{Request, Response, Status};

use crate::schedule::RefreshResult;
use crate::state::{KeyId, LocalRequest};

pub struct RefreshApi {
    pub registry: Arc<OwnerRegistry<LocalRequest>>,
    pub pool: PgPool,
    pub refresh_due_partitions: i32,
    pub own_endpoint: String,
    pub channels: ChannelCache,
    pub max_key_bytes: usize,
}

impl RefreshApi {
    async fn owner_client(
        &self,
        partition: i32,
        forwarded: bool,
    ) -> Result<RefreshClient<sluice_common::auth::Channel>, Status> {
        let endpoint = owner_endpoint(&self.pool, partition, forwarded, &self.own_endpoint).await?;
        Ok(RefreshClient::new(self.channels.channel(&endpoint)?))
    }

    fn check_key(&self, key: Option<&pb::KeyRef>) -> Result<(KeyId, i32), FieldError> {
        let Some(key) = key else {
            return Err(FieldError::new("key", "must be set"));
        };
        check_name("key.tenant", &key.tenant, self.max_key_bytes)?;
        check_name("key.key", &key.key, self.max_key_bytes)?;
        let partition = key_partition(&key.tenant, &key.key, self.refresh_due_partitions);
        Ok(((key.tenant.clone(), key.key.clone()), partition))
    }
}

#[tonic::async_trait]
impl pb::refresh_server::Refresh for RefreshApi {
    async fn report_refresh(
        &self,
        request: Request<pb::ReportRefreshRequest>,
    ) -> Result<Response<pb::ReportRefreshResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        if message.task_id.trim().is_empty() {
            return Err(FieldError::new("task_id", "must not be empty").into());
        }
        check_text("task_id", &message.task_id, MAX_ID_BYTES)?;
        if let Some(pb::report_refresh_request::Result::Error(error)) = &message.result {
            check_text("error", error, MAX_TEXT_BYTES)?;
        }
        let (key, partition) = self.check_key(message.key.as_ref())?;
        caller.authorize(&key.0, Action::Work, format_args!("floating key {}/{}", key.0, key.1))?;
        let result = match &message.result {
            Some(pb::report_refresh_request::Result::NewMax(value)) => RefreshResult::NewMax(*value),
            Some(pb::report_refresh_request::Result::Error(error)) => RefreshResult::Error(error.clone()),
            None => return Err(FieldError::new("result", "set new_max or error").into()),
        };
        let task_id = message.task_id.clone();
        on_owner(
            &self.registry,
            partition,
            |reply| LocalRequest::Report {
                key,
                task_id,
                result,
                reply,
            },
            Ok,
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .report_refresh(forwarded_request(message, &caller))
                    .await
            },
        )
        .await
    }

    async fn describe_floating_limit(
        &self,
        request: Request<pb::DescribeFloatingLimitRequest>,
    ) -> Result<Response<pb::DescribeFloatingLimitResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        let (key, partition) = self.check_key(message.key.as_ref())?;
        caller.authorize(&key.0, Action::Read, format_args!("floating key {}/{}", key.0, key.1))?;
        let missing = format!(
            "no refresh has been due for floating key ({:?}, {:?}) yet; limit-grant's DescribeKey shows \
             its current max",
            key.0, key.1
        );
        on_owner(
            &self.registry,
            partition,
            |reply| LocalRequest::Describe { key, reply },
            |described| described.ok_or_else(|| Status::not_found(missing)),
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .describe_floating_limit(forwarded_request(message, &caller))
                    .await
            },
        )
        .await
    }

    async fn delete_floating_limit(
        &self,
        request: Request<pb::DeleteFloatingLimitRequest>,
    ) -> Result<Response<pb::DeleteFloatingLimitResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        let (key, partition) = self.check_key(message.key.as_ref())?;
        caller.authorize(
            &key.0,
            Action::Operate,
            format_args!("floating key {}/{}", key.0, key.1),
        )?;
        on_owner(
            &self.registry,
            partition,
            |reply| LocalRequest::Delete { key, reply },
            Ok,
            async {
                self.owner_client(partition, forwarded)
                    .await?
                    .delete_floating_limit(forwarded_request(message, &caller))
                    .await
            },
        )
        .await
    }
}
