//! Send job requests: over Kafka to `jobs.requested` (fire and forget; the
//! job id is derived from where the message lands unless you set one), or
//! over gRPC to admission (`Enqueue` / `EnqueueBatch`), which answers with
//! the job id, its status and whether an idempotency key matched.

use std::time::Duration;

use prost::Message as _;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sluice_proto::v1 as pb;

use crate::error::{Error, Result};
use crate::grpc::Admission;
use crate::job::check_request;
use crate::options::ClientOptions;
use crate::propagation::{request_with, TraceContext};

/// Where a request sent over Kafka landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sent {
    pub partition: i32,
    pub offset: i64,
}

/// Admission's answer to an enqueue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Enqueued {
    pub job_id: String,
    pub status: pb::JobStatus,
    /// An idempotency key matched a job inside its window; `job_id` is that job's.
    pub deduplicated: bool,
}

/// Sends job requests. Cheap to clone; share one per process.
#[derive(Clone)]
pub struct Producer {
    kafka: Option<FutureProducer>,
    requested_topic: String,
    admission: Admission,
    delivery_timeout: Duration,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Producer")
            .field("kafka", &self.kafka.is_some())
            .field("requested_topic", &self.requested_topic)
            .field("admission", &self.admission.endpoint)
            .finish()
    }
}

impl Producer {
    /// A producer for `options`. Nothing is contacted yet: the Kafka client
    /// connects in the background, the gRPC channel on first use. With empty
    /// `brokers` only the gRPC methods work.
    pub fn new(options: &ClientOptions) -> Result<Self> {
        let kafka = if options.brokers.trim().is_empty() {
            None
        } else {
            let mut config = options.kafka_config();
            config
                .set("enable.idempotence", "true")
                .set("acks", "all")
                .set("linger.ms", options.linger_ms.to_string());
            let producer: FutureProducer = config.create().map_err(|source| Error::Kafka {
                operation: "create producer",
                topic: options.requested_topic(),
                source,
            })?;
            Some(producer)
        };
        Ok(Producer {
            kafka,
            requested_topic: options.requested_topic(),
            admission: Admission::new(&options.admission_endpoint, options)?,
            delivery_timeout: Duration::from_secs(30),
        })
    }

    /// Put one request on `jobs.requested` (protobuf, with the current span's
    /// W3C context in `traceparent`/`tracestate` headers) and wait for the
    /// broker's acknowledgement. Keyed by the job id when it has one.
    pub async fn send(&self, request: &pb::JobRequest) -> Result<Sent> {
        check_request(request)?;
        let Some(kafka) = &self.kafka else {
            return Err(Error::Config {
                field: "brokers",
                message: "no Kafka brokers configured; use enqueue (gRPC) or set brokers".to_string(),
            });
        };
        let payload = request.encode_to_vec();
        let headers = TraceContext::current()
            .add_to_headers(OwnedHeaders::new())
            .insert(Header {
                key: "content-type",
                value: Some("application/x-protobuf".as_bytes()),
            });
        let mut record = FutureRecord::<str, [u8]>::to(&self.requested_topic)
            .payload(&payload)
            .headers(headers);
        if let Some(job_id) = &request.job_id {
            record = record.key(job_id.as_str());
        }
        match kafka.send(record, self.delivery_timeout).await {
            Ok(delivery) => Ok(Sent {
                partition: delivery.partition,
                offset: delivery.offset,
            }),
            Err((source, _)) => Err(Error::Kafka {
                operation: "produce",
                topic: self.requested_topic.clone(),
                source,
            }),
        }
    }

    /// Send several requests over Kafka; all are in flight at once. Returns
    /// where each landed, in order; the first failure ends the call (the
    /// others may have been sent).
    pub async fn send_batch(&self, requests: &[pb::JobRequest]) -> Result<Vec<Sent>> {
        for request in requests {
            check_request(request)?;
        }
        let sends = requests.iter().map(|request| self.send(request));
        futures::future::try_join_all(sends).await
    }

    /// Enqueue one job over gRPC (`Admission.Enqueue`).
    pub async fn enqueue(&self, request: pb::JobRequest) -> Result<Enqueued> {
        check_request(&request)?;
        let mut client = self.admission.client.clone();
        let response = client
            .enqueue(request_with(
                pb::EnqueueRequest { job: Some(request) },
                &TraceContext::current(),
            ))
            .await
            .map_err(|status| Error::rpc("Enqueue", &self.admission.endpoint, status))?
            .into_inner();
        Ok(enqueued(response))
    }

    /// Enqueue several jobs in one call (`Admission.EnqueueBatch`). All or
    /// nothing: one invalid job fails the call, naming `jobs[i].<field>`.
    pub async fn enqueue_batch(&self, requests: Vec<pb::JobRequest>) -> Result<Vec<Enqueued>> {
        for (index, request) in requests.iter().enumerate() {
            check_request(request).map_err(|error| match error {
                Error::InvalidRequest { field, message } => Error::InvalidRequest {
                    field: format!("jobs[{index}].{field}"),
                    message,
                },
                other => other,
            })?;
        }
        let count = requests.len();
        let mut client = self.admission.client.clone();
        let response = client
            .enqueue_batch(request_with(
                pb::EnqueueBatchRequest { jobs: requests },
                &TraceContext::current(),
            ))
            .await
            .map_err(|status| Error::rpc("EnqueueBatch", &self.admission.endpoint, status))?
            .into_inner();
        if response.results.len() != count {
            return Err(Error::Protocol {
                method: "EnqueueBatch",
                message: format!("{} results for {count} jobs", response.results.len()),
            });
        }
        Ok(response.results.into_iter().map(enqueued).collect())
    }

    /// `Admission.GetJob`: status, attempt, limits, why it waits.
    pub async fn get_job(&self, job_id: &str) -> Result<pb::JobView> {
        let mut client = self.admission.client.clone();
        let response = client
            .get_job(pb::GetJobRequest {
                job_id: job_id.to_string(),
            })
            .await
            .map_err(|status| Error::rpc("GetJob", &self.admission.endpoint, status))?
            .into_inner();
        response.job.ok_or(Error::Protocol {
            method: "GetJob",
            message: "no job in the answer".to_string(),
        })
    }

    /// `Admission.CancelJob`: a job not running ends now; a running one is
    /// told by its next heartbeat (status CANCELLING until its worker confirms).
    pub async fn cancel_job(&self, job_id: &str, reason: &str) -> Result<pb::JobStatus> {
        let mut client = self.admission.client.clone();
        let response = client
            .cancel_job(pb::CancelJobRequest {
                job_id: job_id.to_string(),
                reason: reason.to_string(),
            })
            .await
            .map_err(|status| Error::rpc("CancelJob", &self.admission.endpoint, status))?
            .into_inner();
        Ok(pb::JobStatus::try_from(response.status).unwrap_or(pb::JobStatus::Unspecified))
    }
}

fn enqueued(response: pb::EnqueueResponse) -> Enqueued {
    Enqueued {
        job_id: response.job_id,
        status: pb::JobStatus::try_from(response.status).unwrap_or(pb::JobStatus::Unspecified),
        deduplicated: response.deduplicated,
    }
}
