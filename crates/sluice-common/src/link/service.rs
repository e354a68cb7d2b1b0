//! Owner side, commands in: `LinkService` (`OwnerLink`) reads commands
//! from a stream into the partition tasks and answers `LinkApplied` once
//! they are committed.

use std::sync::Arc;

use sluice_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::owner::OwnerRegistry;
use crate::shutdown::Shutdown;

use super::router::{open_grants, StreamGrants};
use super::{GrantRouter, STREAM_BUFFER};

/// What a link hands a partition task.
pub enum LinkInput {
    /// Commands, with what to call once the batch holding them is committed.
    Commands(LinkBatch),
    /// A stream now takes the grants of these job partitions: send again
    /// the grants of every ticket held for their jobs (one committed while
    /// no stream took them was dropped).
    ResendGrants { job_partitions: Vec<i32> },
}

/// Commands from a link for one partition task, with what to call once
/// the batch holding them is committed.
pub struct LinkBatch {
    pub commands: Vec<Vec<u8>>,
    /// The admission instance that sent them (quarantine reasons, logs).
    pub client: Arc<str>,
    pub applied: oneshot::Sender<()>,
}

/// `OwnerLink` for one owner service: commands into its partition tasks
/// (`make_local` wraps them in the service's local request), grants out
/// through `router`, and the service's owner directory.
pub struct LinkService<L> {
    pub service: &'static str,
    pub registry: Arc<OwnerRegistry<L>>,
    pub router: Arc<GrantRouter>,
    pub pool: sqlx::PgPool,
    pub make_local: fn(LinkInput) -> L,
    pub shutdown: Shutdown,
}

/// `OwnerLink` is the services' own API: only a caller with the internal
/// token (or any caller, with auth off) may use it.
fn services_only<T>(request: &Request<T>) -> Result<(), Status> {
    if crate::auth::principal_of(request).service {
        return Ok(());
    }
    Err(Status::permission_denied(
        "OwnerLink is the Sluice services' own API (callers authenticate with auth.internal_token_file)",
    ))
}

#[tonic::async_trait]
impl<L: Send + 'static> pb::owner_link_server::OwnerLink for LinkService<L> {
    type LinkStream = ReceiverStream<Result<pb::LinkDown, Status>>;

    async fn link(&self, request: Request<Streaming<pb::LinkUp>>) -> Result<Response<Self::LinkStream>, Status> {
        services_only(&request)?;
        let mut inbound = request.into_inner();
        let (down, down_receiver) = mpsc::channel(STREAM_BUFFER);
        let stream = self.router.new_stream_id();
        let grants = open_grants(down);
        let reader = LinkReader {
            service: self.service,
            registry: self.registry.clone(),
            router: self.router.clone(),
            pool: self.pool.clone(),
            make_local: self.make_local,
            stream,
            grants,
            client: Arc::from("unknown"),
        };
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let mut reader = reader;
            loop {
                let message = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    message = inbound.message() => message,
                };
                match message {
                    Ok(Some(message)) => reader.handle(message).await,
                    Ok(None) => break,
                    // A message this end cannot read (over gRPC's size
                    // limit) comes again on the next link: said at warn, as
                    // nothing else would show the loop. A client that went
                    // away is ordinary.
                    Err(status) if status.code() == tonic::Code::OutOfRange => {
                        tracing::warn!(service = reader.service, client = %reader.client, %status, "link closed: a message from the client could not be read");
                        break;
                    }
                    Err(status) => {
                        tracing::debug!(service = reader.service, client = %reader.client, %status, "link closed by an error");
                        break;
                    }
                }
            }
            reader.router.forget(reader.stream);
            tracing::debug!(service = reader.service, client = %reader.client, "link closed");
        });
        Ok(Response::new(ReceiverStream::new(down_receiver)))
    }

    type WatchGrantsStream = futures::stream::BoxStream<'static, Result<pb::LinkGrants, Status>>;

    async fn watch_grants(
        &self,
        request: Request<pb::WatchGrantsRequest>,
    ) -> Result<Response<Self::WatchGrantsStream>, Status> {
        services_only(&request)?;
        use futures::StreamExt as _;
        let watched = tokio_stream::wrappers::BroadcastStream::new(self.router.watchers.subscribe());
        let service = self.service;
        let shutdown = self.shutdown.clone();
        let stream = watched
            .filter_map(move |received| async move {
                match received {
                    Ok(events) => Some(Ok(pb::LinkGrants {
                        events: events.as_ref().clone(),
                    })),
                    Err(tokio_stream::wrappers::errors::BroadcastStreamRecvError::Lagged(missed)) => {
                        tracing::warn!(service, missed, "a grant watcher fell behind and missed grant batches");
                        None
                    }
                }
            })
            .take_until(async move { shutdown.cancelled().await })
            .boxed();
        Ok(Response::new(stream))
    }

    async fn directory(
        &self,
        request: Request<pb::DirectoryRequest>,
    ) -> Result<Response<pb::DirectoryResponse>, Status> {
        services_only(&request)?;
        let rows: Vec<(i32, String, i64)> = sqlx::query_as("SELECT partition, endpoint, epoch FROM owners")
            .fetch_all(&self.pool)
            .await
            .map_err(|error| Status::unavailable(format!("owner directory unavailable: {error}")))?;
        Ok(Response::new(pb::DirectoryResponse {
            partitions: rows
                .into_iter()
                .filter_map(|(partition, endpoint, epoch)| {
                    Some(pb::DirectoryEntry {
                        partition: u32::try_from(partition).ok()?,
                        endpoint,
                        epoch,
                    })
                })
                .collect(),
        }))
    }
}

struct LinkReader<L> {
    service: &'static str,
    registry: Arc<OwnerRegistry<L>>,
    router: Arc<GrantRouter>,
    pool: sqlx::PgPool,
    make_local: fn(LinkInput) -> L,
    stream: u64,
    /// Everything written down the stream goes through its queue, in order.
    grants: StreamGrants,
    client: Arc<str>,
}

impl<L: Send + 'static> LinkReader<L> {
    async fn handle(&mut self, message: pb::LinkUp) {
        match message.message {
            Some(pb::link_up::Message::Hello(hello)) => {
                self.client = Arc::from(crate::fault::clean_text(&hello.client_id, 200).as_str());
                let newly_routed = self.router.claim(self.stream, &self.grants, &hello.job_partitions);
                tracing::debug!(service = self.service, client = %self.client, partitions = hello.job_partitions.len(), newly_routed = newly_routed.len(), "link claims job partitions");
                if !newly_routed.is_empty() {
                    for partition in self.registry.owned() {
                        let input = LinkInput::ResendGrants {
                            job_partitions: newly_routed.clone(),
                        };
                        let _ = self.registry.submit(partition, (self.make_local)(input)).await;
                    }
                }
            }
            Some(pb::link_up::Message::Commands(commands)) => self.submit(commands).await,
            None => {}
        }
    }

    /// Hand the commands to the partition task without waiting for the
    /// commit (the next message is read at once); `LinkApplied` follows it.
    async fn submit(&self, commands: pb::LinkCommands) {
        let seq = commands.seq;
        let partition_number = commands.partition;
        let Ok(partition) = i32::try_from(commands.partition) else {
            self.refuse(seq, commands.partition, "partition out of range".to_string())
                .await;
            return;
        };
        let (applied, applied_receiver) = oneshot::channel();
        let batch = LinkBatch {
            commands: commands.commands,
            client: self.client.clone(),
            applied,
        };
        let make_local = self.make_local;
        let submitted = if self
            .router
            .faults
            .hit(crate::faults::FaultPoint::LinkCommandsDroppedBeforeCommit)
        {
            tracing::warn!(
                partition,
                seq,
                "fault hook: the partition stops before these commands are committed"
            );
            drop(batch);
            Ok(())
        } else {
            self.registry
                .submit(partition, make_local(LinkInput::Commands(batch)))
                .await
        };
        match submitted {
            Ok(()) => {
                let grants = self.grants.clone();
                tokio::spawn(async move {
                    let message = if applied_receiver.await.is_ok() {
                        pb::link_down::Message::Applied(pb::LinkApplied { seqs: vec![seq] })
                    } else {
                        // Dropped unanswered: the partition stopped before
                        // the commit (released, revoked). Refused, owner
                        // unknown: the client reads the directory again
                        // and sends them to the new owner at once (they
                        // would wait on this open stream for ever).
                        pb::link_down::Message::Refused(pb::LinkRefused {
                            seq,
                            partition: partition_number,
                            owner_endpoint: String::new(),
                            reason: "the partition stopped before the commands were committed".to_string(),
                        })
                    };
                    grants.send_control(message);
                });
            }
            Err(_not_owner) => {
                self.refuse(seq, commands.partition, "not the owner of this partition".to_string())
                    .await;
            }
        }
    }

    async fn refuse(&self, seq: u64, partition: u32, reason: String) {
        let owner = match i32::try_from(partition) {
            Ok(partition) => crate::owner::lookup_owner(&self.pool, partition)
                .await
                .ok()
                .flatten()
                .map(|(endpoint, _)| endpoint)
                .unwrap_or_default(),
            Err(_) => String::new(),
        };
        tracing::debug!(service = self.service, partition, %owner, %reason, "refusing link commands");
        self.grants
            .send_control(pb::link_down::Message::Refused(pb::LinkRefused {
                seq,
                partition,
                owner_endpoint: owner,
                reason,
            }));
    }
}
