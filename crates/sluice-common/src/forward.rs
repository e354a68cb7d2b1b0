//! Reaching a key's owner: calls that decide on a key run on the owner; a
//! non-owner forwards once (marked with a header so calls never loop) to the
//! endpoint in the owner directory.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tonic::Status;

use crate::auth::{Channel, Principal};

pub const FORWARDED_HEADER: &str = "x-sluice-forwarded";

pub fn is_forwarded(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata.contains_key(FORWARDED_HEADER)
}

/// Mark a request as forwarded, made for `caller` (the owner authorizes
/// the call as the caller's: the forwarding instance authenticates with the
/// internal token), and carry the current trace context.
pub fn forwarded_request<T>(message: T, caller: &Principal) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert(FORWARDED_HEADER, tonic::metadata::MetadataValue::from_static("1"));
    if let Some(principal) = caller.encode() {
        request.metadata_mut().insert(crate::auth::PRINCIPAL_HEADER, principal);
    }
    crate::telemetry::inject_current_into_metadata(request.metadata_mut());
    request
}

/// The status a non-owner answers when it cannot forward.
pub fn not_owner(partition: i32, owner: Option<&str>) -> Status {
    match owner {
        Some(endpoint) => Status::unavailable(format!(
            "NOT_OWNER: partition {partition} is owned by {endpoint}; retry there or through any instance"
        )),
        None => Status::unavailable(format!(
            "NOT_OWNER: partition {partition} has no owner yet (rebalancing); retry shortly"
        )),
    }
}

/// The endpoint of `partition`'s owner to forward a call to, from the owner
/// directory in `pool`'s schema. Refuses to forward twice, or to ourselves
/// (the directory still names us while we give the partition up).
pub async fn owner_endpoint(
    pool: &sqlx::PgPool,
    partition: i32,
    forwarded: bool,
    own_endpoint: &str,
) -> Result<String, Status> {
    match owner_route(pool, partition, forwarded, own_endpoint).await {
        OwnerRoute::Forward(endpoint) => Ok(endpoint),
        OwnerRoute::OwnedElsewhere(status) | OwnerRoute::NotYet(status) => Err(status),
    }
}

/// What the owner directory says about a call for `partition` that this
/// instance does not serve (`owner_endpoint`, told apart).
#[derive(Debug)]
pub enum OwnerRoute {
    /// Forward it there.
    Forward(String),
    /// A forwarded call, and the directory names another instance: the
    /// instance that forwarded it should ask that one (it cannot be
    /// forwarded twice).
    OwnedElsewhere(Status),
    /// No owner yet, the directory unreadable, or it still names this
    /// instance (giving the partition up, or about to serve it): retry
    /// shortly, here or anywhere.
    NotYet(Status),
}

/// Where a call for `partition` goes, from the owner directory
/// (`OwnerRoute`).
pub async fn owner_route(pool: &sqlx::PgPool, partition: i32, forwarded: bool, own_endpoint: &str) -> OwnerRoute {
    let owner = match crate::owner::lookup_owner(pool, partition).await {
        Ok(owner) => owner,
        Err(error) => return OwnerRoute::NotYet(Status::unavailable(format!("owner directory unavailable: {error}"))),
    };
    match owner {
        Some((endpoint, _)) if !forwarded && endpoint != own_endpoint => OwnerRoute::Forward(endpoint),
        // The directory still names this instance, which does not serve the
        // partition: it is giving it up (the next owner has not written its
        // row yet). Retrying here or anywhere is the answer, not "there".
        Some((endpoint, _)) if endpoint == own_endpoint => OwnerRoute::NotYet(Status::unavailable(format!(
            "NOT_OWNER: partition {partition} is changing owners (this instance, {endpoint}, is giving it up); retry shortly"
        ))),
        Some((endpoint, _)) => OwnerRoute::OwnedElsewhere(not_owner(partition, Some(&endpoint))),
        None => OwnerRoute::NotYet(not_owner(partition, None)),
    }
}

/// A call decided by a partition's owner: this instance's partition task
/// when it owns `partition` (`make` builds the request, `answer` turns the
/// task's reply into the response), else `forward`, the same call to the
/// owner named in the directory.
pub async fn on_owner<L, R, T, F>(
    registry: &crate::owner::OwnerRegistry<L>,
    partition: i32,
    make: impl FnOnce(tokio::sync::oneshot::Sender<R>) -> L,
    answer: impl FnOnce(R) -> Result<T, Status>,
    forward: F,
) -> Result<tonic::Response<T>, Status>
where
    L: Send + 'static,
    F: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
{
    match registry.call(partition, make).await {
        Ok(reply) => answer(reply).map(tonic::Response::new),
        Err(crate::owner::LocalCallError::NotOwner(_)) => forward.await,
        Err(error) => Err(Status::unavailable(error.to_string())),
    }
}

/// Lazily connected channels to other instances, by endpoint.
#[derive(Default)]
pub struct ChannelCache {
    channels: Mutex<HashMap<String, Channel>>,
}

impl ChannelCache {
    pub fn channel(&self, endpoint: &str) -> Result<Channel, Status> {
        let mut channels = self.channels.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(channel) = channels.get(endpoint) {
            return Ok(channel.clone());
        }
        let channel = crate::tls::endpoint(endpoint)
            .map_err(|error| Status::internal(format!("bad owner endpoint {endpoint:?}: {error}")))?
            .connect_timeout(Duration::from_secs(3))
            .timeout(Duration::from_secs(30))
            .connect_lazy();
        let channel = crate::auth::with_credentials(channel);
        channels.insert(endpoint.to_string(), channel.clone());
        Ok(channel)
    }
}
