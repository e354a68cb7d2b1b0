//! Admission side, the streams themselves: opening one to an owner
//! instance and reading what comes down it, and reading the service's
//! directory.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sluice_proto::v1 as pb;
use sluice_proto::v1::owner_link_client::OwnerLinkClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::client::ClientEvent;
use super::{Downlink, STREAM_BUFFER};

pub(super) async fn read_directory(seed: &str) -> Result<HashMap<i32, Arc<str>>, String> {
    let channel = stream_channel(seed)
        .map_err(|error| error.to_string())?
        .connect()
        .await
        .map_err(|error| format!("connecting to {seed}: {error}"))?;
    let response = OwnerLinkClient::new(crate::auth::with_credentials(channel))
        .directory(pb::DirectoryRequest {})
        .await
        .map_err(|status| format!("{seed} answered {status}"))?;
    Ok(response
        .into_inner()
        .partitions
        .into_iter()
        .filter_map(|entry| Some((i32::try_from(entry.partition).ok()?, Arc::from(entry.endpoint.as_str()))))
        .collect())
}

/// A channel for long-lived streams: no per-request timeout, keep-alives to
/// notice a peer that went away.
fn stream_channel(endpoint: &str) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    Ok(crate::tls::endpoint(endpoint)?
        .connect_timeout(Duration::from_secs(3))
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .tcp_nodelay(true))
}

pub(super) async fn run_connection(
    endpoint: Arc<str>,
    generation: u64,
    events: mpsc::UnboundedSender<ClientEvent>,
    grants: mpsc::Sender<Downlink>,
) {
    let error = match open_and_read(&endpoint, generation, &events, &grants).await {
        Ok(()) => "the owner ended the stream".to_string(),
        Err(error) => error,
    };
    let _ = events.send(ClientEvent::Closed {
        endpoint,
        generation,
        error,
    });
}

async fn open_and_read(
    endpoint: &Arc<str>,
    generation: u64,
    events: &mpsc::UnboundedSender<ClientEvent>,
    grants: &mpsc::Sender<Downlink>,
) -> Result<(), String> {
    let channel = stream_channel(endpoint)
        .map_err(|error| error.to_string())?
        .connect()
        .await
        .map_err(|error| format!("connecting: {error}"))?;
    let (sender, receiver) = mpsc::channel(STREAM_BUFFER);
    let response = OwnerLinkClient::new(crate::auth::with_credentials(channel))
        .link(ReceiverStream::new(receiver))
        .await
        .map_err(|status| format!("opening the stream: {status}"))?;
    events
        .send(ClientEvent::Opened {
            endpoint: endpoint.clone(),
            generation,
            sender,
        })
        .map_err(|_| "client stopped".to_string())?;
    let mut inbound = response.into_inner();
    while let Some(message) = inbound.message().await.map_err(|status| status.to_string())? {
        match message.message {
            Some(pb::link_down::Message::Grants(batch)) => {
                let taken = grants.send(Downlink::Grants(batch.events)).await;
                taken.map_err(|_| "admission stopped taking grants".to_string())?;
            }
            Some(pb::link_down::Message::Applied(applied)) => {
                let _ = events.send(ClientEvent::Applied(applied.seqs));
            }
            Some(pb::link_down::Message::Refused(refused)) => {
                let _ = events.send(ClientEvent::Refused(refused));
            }
            None => {}
        }
    }
    Ok(())
}
