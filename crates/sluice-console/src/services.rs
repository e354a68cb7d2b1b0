//! The services, reached only through their public gRPC APIs: admission
//! (jobs), limit-grant (keys and overrides), rate-window (rate limits),
//! refresh-dispatcher (floating refresh state), and the owner directory and
//! grant watch every owner serves.

use std::time::Duration;

use sluice_common::auth::Channel;
use sluice_common::config::ConsoleConfig;
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;
use sluice_proto::v1::limits_client::LimitsClient;
use sluice_proto::v1::owner_link_client::OwnerLinkClient;
use sluice_proto::v1::rate_limits_client::RateLimitsClient;
use sluice_proto::v1::refresh_client::RefreshClient;

/// How long one call may take before the page says the service is slow.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A service's answer that was not the one asked for.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{service} at {endpoint} answered {code:?}: {message}")]
pub struct ApiError {
    pub service: &'static str,
    pub endpoint: String,
    pub code: tonic::Code,
    pub message: String,
}

impl ApiError {
    pub fn is_not_found(&self) -> bool {
        self.code == tonic::Code::NotFound
    }
}

/// A configured endpoint that is not a URI.
#[derive(Debug, thiserror::Error)]
#[error("console.{field}: {endpoint:?} is not an endpoint URI ({message})")]
pub struct EndpointError {
    pub field: &'static str,
    pub endpoint: String,
    pub message: String,
}

/// One service's client and where it points (error messages name it).
#[derive(Clone)]
struct Target<C> {
    client: C,
    endpoint: String,
    service: &'static str,
}

impl<C> Target<C> {
    fn failed(&self) -> impl Fn(tonic::Status) -> ApiError + '_ {
        move |status| ApiError {
            service: self.service,
            endpoint: self.endpoint.clone(),
            code: status.code(),
            message: status.message().to_string(),
        }
    }
}

fn lazy_channel(field: &'static str, endpoint: &str) -> Result<Channel, EndpointError> {
    sluice_common::tls::endpoint(endpoint)
        .map(|endpoint| {
            sluice_common::auth::with_credentials(
                endpoint
                    .connect_timeout(CONNECT_TIMEOUT)
                    .timeout(CALL_TIMEOUT)
                    .connect_lazy(),
            )
        })
        .map_err(|error| EndpointError {
            field,
            endpoint: endpoint.to_string(),
            message: error.to_string(),
        })
}

/// Which owner service's directory and grants to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OwnerService {
    LimitGrant,
    RateWindow,
}

/// Clients of the four services. Channels connect lazily: the console starts
/// (and shows what it can) while a service is down.
#[derive(Clone)]
pub struct Services {
    admission: Target<AdmissionClient<Channel>>,
    limits: Target<LimitsClient<Channel>>,
    limits_directory: Target<OwnerLinkClient<Channel>>,
    rates: Target<RateLimitsClient<Channel>>,
    rates_directory: Target<OwnerLinkClient<Channel>>,
    refresh: Target<RefreshClient<Channel>>,
}

impl Services {
    pub fn new(config: &ConsoleConfig) -> Result<Self, EndpointError> {
        let admission = lazy_channel("admission_endpoint", &config.admission_endpoint)?;
        let limits = lazy_channel("limit_grant_endpoint", &config.limit_grant_endpoint)?;
        let rates = lazy_channel("rate_window_endpoint", &config.rate_window_endpoint)?;
        let refresh = lazy_channel("refresh_dispatcher_endpoint", &config.refresh_dispatcher_endpoint)?;
        Ok(Services {
            admission: Target {
                client: AdmissionClient::new(admission),
                endpoint: config.admission_endpoint.clone(),
                service: "admission",
            },
            limits: Target {
                client: LimitsClient::new(limits.clone()),
                endpoint: config.limit_grant_endpoint.clone(),
                service: "limit-grant",
            },
            limits_directory: Target {
                client: OwnerLinkClient::new(limits),
                endpoint: config.limit_grant_endpoint.clone(),
                service: "limit-grant",
            },
            rates: Target {
                client: RateLimitsClient::new(rates.clone()),
                endpoint: config.rate_window_endpoint.clone(),
                service: "rate-window",
            },
            rates_directory: Target {
                client: OwnerLinkClient::new(rates),
                endpoint: config.rate_window_endpoint.clone(),
                service: "rate-window",
            },
            refresh: Target {
                client: RefreshClient::new(refresh),
                endpoint: config.refresh_dispatcher_endpoint.clone(),
                service: "refresh-dispatcher",
            },
        })
    }

    pub async fn get_job(&self, job_id: &str) -> Result<pb::JobView, ApiError> {
        let target = &self.admission;
        let response = target
            .client
            .clone()
            .get_job(pb::GetJobRequest {
                job_id: job_id.to_string(),
            })
            .await
            .map_err(target.failed())?;
        response.into_inner().job.ok_or_else(|| ApiError {
            service: target.service,
            endpoint: target.endpoint.clone(),
            code: tonic::Code::Internal,
            message: "GetJob answered without a job".to_string(),
        })
    }

    pub async fn cancel_job(&self, job_id: &str, reason: &str) -> Result<i32, ApiError> {
        let target = &self.admission;
        let response = target
            .client
            .clone()
            .cancel_job(pb::CancelJobRequest {
                job_id: job_id.to_string(),
                reason: reason.to_string(),
            })
            .await
            .map_err(target.failed())?;
        Ok(response.into_inner().status)
    }

    pub async fn describe_key(&self, tenant: &str, key: &str, first_waiters: u32) -> Result<pb::KeyState, ApiError> {
        let target = &self.limits;
        let response = target
            .client
            .clone()
            .describe_key(pb::DescribeKeyRequest {
                key: Some(key_ref(tenant, key)),
                ticket: None,
                first_waiters,
            })
            .await
            .map_err(target.failed())?;
        Ok(response.into_inner().state.unwrap_or_default())
    }

    pub async fn list_keys(
        &self,
        tenant: &str,
        prefix: &str,
        page_size: u32,
        page_token: &str,
    ) -> Result<pb::ListKeysResponse, ApiError> {
        let target = &self.limits;
        let response = target
            .client
            .clone()
            .list_keys(pb::ListKeysRequest {
                tenant: tenant.to_string(),
                prefix: prefix.to_string(),
                page_size,
                page_token: page_token.to_string(),
            })
            .await
            .map_err(target.failed())?;
        Ok(response.into_inner())
    }

    /// `Some(max)` sets the override (0 pauses), `None` clears it.
    pub async fn set_limit(&self, tenant: &str, key: &str, max: Option<u32>) -> Result<pb::KeyState, ApiError> {
        let target = &self.limits;
        let change = match max {
            Some(max) => pb::set_limit_request::Change::Max(max),
            None => pb::set_limit_request::Change::Clear(true),
        };
        let response = target
            .client
            .clone()
            .set_limit(pb::SetLimitRequest {
                key: Some(key_ref(tenant, key)),
                change: Some(change),
            })
            .await
            .map_err(target.failed())?;
        Ok(response.into_inner().state.unwrap_or_default())
    }

    /// The refresh state of a floating key; `None` when the dispatcher has
    /// none (no refresh was ever due).
    pub async fn describe_floating(
        &self,
        tenant: &str,
        key: &str,
    ) -> Result<Option<pb::DescribeFloatingLimitResponse>, ApiError> {
        let target = &self.refresh;
        let answer = target
            .client
            .clone()
            .describe_floating_limit(pb::DescribeFloatingLimitRequest {
                key: Some(key_ref(tenant, key)),
            })
            .await
            .map_err(target.failed());
        match answer {
            Ok(response) => Ok(Some(response.into_inner())),
            Err(error) if error.is_not_found() => Ok(None),
            Err(error) => Err(error),
        }
    }

    pub async fn list_rate_limits(
        &self,
        tenant: &str,
        page_size: u32,
        page_token: &str,
    ) -> Result<pb::ListRateLimitsResponse, ApiError> {
        let target = &self.rates;
        let response = target
            .client
            .clone()
            .list_rate_limits(pb::ListRateLimitsRequest {
                tenant: tenant.to_string(),
                page_size,
                page_token: page_token.to_string(),
            })
            .await
            .map_err(target.failed())?;
        Ok(response.into_inner())
    }

    pub async fn describe_rate_key(&self, key: pb::RateKeyRef) -> Result<pb::DescribeRateKeyResponse, ApiError> {
        let target = &self.rates;
        let response = target
            .client
            .clone()
            .describe_rate_key(pb::DescribeRateKeyRequest {
                key: Some(key),
                ticket: None,
            })
            .await
            .map_err(target.failed())?;
        Ok(response.into_inner())
    }

    pub async fn put_rate_limit(&self, resource: pb::RateLimitResource) -> Result<pb::PutRateLimitResponse, ApiError> {
        let target = &self.rates;
        let response = target
            .client
            .clone()
            .put_rate_limit(pb::PutRateLimitRequest {
                resource: Some(resource),
            })
            .await
            .map_err(target.failed())?;
        Ok(response.into_inner())
    }

    pub async fn delete_rate_limit(
        &self,
        tenant: &str,
        resource_key: &str,
    ) -> Result<pb::DeleteRateLimitResponse, ApiError> {
        let target = &self.rates;
        let response = target
            .client
            .clone()
            .delete_rate_limit(pb::DeleteRateLimitRequest {
                tenant: tenant.to_string(),
                resource_key: resource_key.to_string(),
            })
            .await
            .map_err(target.failed())?;
        Ok(response.into_inner())
    }

    /// The distinct endpoints of the instances that own partitions of
    /// `service` (its owner directory, answered by any instance).
    pub async fn owner_endpoints(&self, service: OwnerService) -> Result<Vec<String>, ApiError> {
        let target = match service {
            OwnerService::LimitGrant => &self.limits_directory,
            OwnerService::RateWindow => &self.rates_directory,
        };
        let response = target
            .client
            .clone()
            .directory(pb::DirectoryRequest {})
            .await
            .map_err(target.failed())?;
        let mut endpoints: Vec<String> = response
            .into_inner()
            .partitions
            .into_iter()
            .map(|entry| entry.endpoint)
            .filter(|endpoint| !endpoint.is_empty())
            .collect();
        endpoints.sort();
        endpoints.dedup();
        Ok(endpoints)
    }
}

/// Every grant one owner instance sends from now on (`WatchGrants`).
pub async fn watch_grants(service: OwnerService, endpoint: &str) -> Result<tonic::Streaming<pb::LinkGrants>, ApiError> {
    let name = match service {
        OwnerService::LimitGrant => "limit-grant",
        OwnerService::RateWindow => "rate-window",
    };
    let failed = |code: tonic::Code, message: String| ApiError {
        service: name,
        endpoint: endpoint.to_string(),
        code,
        message,
    };
    let channel = sluice_common::tls::endpoint(endpoint)
        .map_err(|error| failed(tonic::Code::InvalidArgument, error.to_string()))?
        .connect_timeout(CONNECT_TIMEOUT)
        .connect()
        .await
        .map_err(|error| failed(tonic::Code::Unavailable, error.to_string()))?;
    let response = OwnerLinkClient::new(sluice_common::auth::with_credentials(channel))
        .watch_grants(pb::WatchGrantsRequest {})
        .await
        .map_err(|status| failed(status.code(), status.message().to_string()))?;
    Ok(response.into_inner())
}

pub fn key_ref(tenant: &str, key: &str) -> pb::KeyRef {
    pb::KeyRef {
        tenant: tenant.to_string(),
        key: key.to_string(),
    }
}
