//! The `Refresh` gRPC service: validate (errors name the field), then reach
//! the key's owner — this instance's partition task, or one forward.

use std::sync::Arc;

use sluice_common::forward::{forwarded_request, is_forwarded, owner_endpoint, ChannelCache};
use sluice_common::owner::{LocalCallError, OwnerRegistry};
use sluice_common::partition::key_partition;
use sluice_common::validate::{check_name, FieldError};
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
    ) -> Result<RefreshClient<tonic::transport::Channel>, Status> {
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

fn local_error(error: LocalCallError) -> Status {
    Status::unavailable(error.to_string())
}

#[tonic::async_trait]
impl pb::refresh_server::Refresh for RefreshApi {
    async fn report_refresh(
        &self,
        request: Request<pb::ReportRefreshRequest>,
    ) -> Result<Response<pb::ReportRefreshResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let message = request.into_inner();
        if message.task_id.trim().is_empty() {
            return Err(FieldError::new("task_id", "must not be empty").into());
        }
        let (key, partition) = self.check_key(message.key.as_ref())?;
        let result = match &message.result {
            Some(pb::report_refresh_request::Result::NewMax(value)) => RefreshResult::NewMax(*value),
            Some(pb::report_refresh_request::Result::Error(error)) => RefreshResult::Error(error.clone()),
            None => return Err(FieldError::new("result", "set new_max or error").into()),
        };
        let outcome = self
            .registry
            .call(partition, |reply| LocalRequest::Report {
                key: key.clone(),
                task_id: message.task_id.clone(),
                result,
                reply,
            })
            .await;
        match outcome {
            Ok(answer) => Ok(Response::new(answer)),
            Err(LocalCallError::NotOwner(_)) => {
                self.owner_client(partition, forwarded)
                    .await?
                    .report_refresh(forwarded_request(message))
                    .await
            }
            Err(error) => Err(local_error(error)),
        }
    }

    async fn describe_floating_limit(
        &self,
        request: Request<pb::DescribeFloatingLimitRequest>,
    ) -> Result<Response<pb::DescribeFloatingLimitResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let message = request.into_inner();
        let (key, partition) = self.check_key(message.key.as_ref())?;
        let outcome = self
            .registry
            .call(partition, |reply| LocalRequest::Describe {
                key: key.clone(),
                reply,
            })
            .await;
        match outcome {
            Ok(Some(described)) => Ok(Response::new(described)),
            Ok(None) => Err(Status::not_found(format!(
                "no refresh has been due for floating key ({:?}, {:?}) yet; limit-grant's DescribeKey shows \
                 its current max",
                key.0, key.1
            ))),
            Err(LocalCallError::NotOwner(_)) => {
                self.owner_client(partition, forwarded)
                    .await?
                    .describe_floating_limit(forwarded_request(message))
                    .await
            }
            Err(error) => Err(local_error(error)),
        }
    }

    async fn delete_floating_limit(
        &self,
        request: Request<pb::DeleteFloatingLimitRequest>,
    ) -> Result<Response<pb::DeleteFloatingLimitResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let message = request.into_inner();
        let (key, partition) = self.check_key(message.key.as_ref())?;
        let outcome = self
            .registry
            .call(partition, |reply| LocalRequest::Delete {
                key: key.clone(),
                reply,
            })
            .await;
        match outcome {
            Ok(answer) => Ok(Response::new(answer)),
            Err(LocalCallError::NotOwner(_)) => {
                self.owner_client(partition, forwarded)
                    .await?
                    .delete_floating_limit(forwarded_request(message))
                    .await
            }
            Err(error) => Err(local_error(error)),
        }
    }
}
