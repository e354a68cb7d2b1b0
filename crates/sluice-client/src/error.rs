//! The SDK's errors. Each says what failed and whether trying again can help.

use rdkafka::error::KafkaError;

/// Everything the producer, the worker and the refresh handler can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A job request the SDK refuses before sending it (the service would
    /// refuse it too). Retrying the same request cannot help.
    #[error("invalid job request: {field}: {message}")]
    InvalidRequest { field: String, message: String },

    /// A setting is missing or malformed (no brokers, a bad endpoint URL, ...).
    #[error("invalid configuration: {field}: {message}")]
    Config { field: &'static str, message: String },

    /// The Kafka client failed. Producing again may help for transient
    /// broker errors.
    #[error("kafka {operation} on {topic}: {source}")]
    Kafka {
        operation: &'static str,
        topic: String,
        #[source]
        source: KafkaError,
    },

    /// A gRPC call failed. `UNAVAILABLE`, `DEADLINE_EXCEEDED` and the like
    /// may pass on retry; `INVALID_ARGUMENT` names the field and will not.
    #[error("{method} at {endpoint}: {status}")]
    Rpc {
        method: &'static str,
        endpoint: String,
        status: Box<tonic::Status>,
    },

    /// The service answered something the protocol does not allow (e.g. fewer
    /// results than requests).
    #[error("{method}: unexpected answer: {message}")]
    Protocol { method: &'static str, message: String },
}

impl Error {
    /// Whether the same call can succeed later.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::InvalidRequest { .. } | Error::Config { .. } | Error::Protocol { .. } => false,
            Error::Kafka { source, .. } => !matches!(source, KafkaError::ClientCreation(_)),
            Error::Rpc { status, .. } => matches!(
                status.code(),
                tonic::Code::Unavailable
                    | tonic::Code::DeadlineExceeded
                    | tonic::Code::ResourceExhausted
                    | tonic::Code::Aborted
                    | tonic::Code::Internal
                    | tonic::Code::Unknown
                    | tonic::Code::Cancelled
            ),
        }
    }

    pub(crate) fn rpc(method: &'static str, endpoint: &str, status: tonic::Status) -> Self {
        Error::Rpc {
            method,
            endpoint: endpoint.to_string(),
            status: Box::new(status),
        }
    }

    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidRequest {
            field: field.into(),
            message: message.into(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
