//! Hostile job requests for tests: generated and mutated producer messages,
//! protobuf and JSON, valid, nearly valid and garbage — long multibyte
//! names, NUL bytes, control characters, integers at and past every type's
//! range, absurd durations, unknown and mistyped JSON fields, flipped and
//! truncated bytes, broken headers. Seeded, so a failure reproduces. Used
//! by admission's fuzz test and by the end-to-end test that sends thousands
//! of them through a real stack.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};
use sluice_proto::v1 as pb;

use crate::kafka::InMsg;

const MULTIBYTE: &[&str] = &["é", "日本", "🦀", "ǅ", "\u{feff}", "\u{10ffff}", "ß"];

pub struct HostileRequests {
    rng: StdRng,
    max_payload_bytes: usize,
    /// This request's values are ordinary ones (about half of them, so both
    /// jobs and dead letters are common).
    sane: bool,
    /// Give every request its own job id and idempotency key (still hostile
    /// text after a unique prefix), so each message is one job or one dead
    /// letter and none is a duplicate of another.
    unique: Option<u64>,
}

impl HostileRequests {
    fn one_in(&mut self, n: u32) -> bool {
        self.rng.random_range(0..n) == 0
    }

    fn text(&mut self) -> String {
        if self.sane && !self.one_in(40) {
            return match self.rng.random_range(0..4) {
                0 => "acme".to_string(),
                1 => format!("key-{}", self.rng.random_range(0..50)),
                2 => format!(
                    "{}-{}",
                    MULTIBYTE[self.rng.random_range(0..MULTIBYTE.len())],
                    self.rng.random::<u16>()
                ),
                _ => format!("name{}", self.rng.random::<u32>()),
            };
        }
        match self.rng.random_range(0..14) {
            0 => String::new(),
            1 | 2 => "acme".to_string(),
            3 => "default".to_string(),
            4 => {
                let length = self.rng.random_range(1..24);
                (0..length)
                    .map(|_| char::from(self.rng.random_range(b'a'..=b'z')))
                    .collect()
            }
            5 => {
                let piece = MULTIBYTE[self.rng.random_range(0..MULTIBYTE.len())];
                piece.repeat(self.rng.random_range(1..400))
            }
            6 => format!("k\0{}", self.rng.random::<u16>()),
            7 => format!("tab\there{}", char::from(self.rng.random_range(0u8..32))),
            8 => "x".repeat(self.rng.random_range(200..3000)),
            9 => "cap:queue".to_string(),
            10 => "*".to_string(),
            11 => format!("key-{}", self.rng.random_range(0..50)),
            12 => " ".to_string(),
            _ => format!(
                "{}-{}",
                MULTIBYTE[self.rng.random_range(0..MULTIBYTE.len())],
                self.rng.random::<u32>()
            ),
        }
    }

    fn u32(&mut self) -> u32 {
        if self.sane && !self.one_in(40) {
            return self.rng.random_range(1..10);
        }
        match self.rng.random_range(0..10) {
            0 => 0,
            1 => 1,
            2 => self.rng.random_range(2..10),
            3 => 99,
            4 => 100,
            5 => 2_147_483_647,
            6 => 2_147_483_648,
            7 => u32::MAX,
            8 => u32::MAX - 1,
            _ => self.rng.random(),
        }
    }

    fn i64(&mut self) -> i64 {
        if self.sane && !self.one_in(40) {
            return self.rng.random_range(1..100_000);
        }
        match self.rng.random_range(0..12) {
            0 => 0,
            1 => 1,
            2 => -1,
            3 => i64::MIN,
            4 => i64::MAX,
            5 => self.rng.random_range(1..100_000),
            6 => 3_153_600_000_000,
            7 => 3_153_600_000_001,
            8 => 1_000_000_000_000_000,
            9 => 1_000_000_000_000_001,
            10 => 1_800_000_000_000,
            _ => self.rng.random(),
        }
    }

    /// A ratio: in range when sane, else NaN, infinities, negatives, huge.
    fn ratio(&mut self) -> f64 {
        if self.sane && !self.one_in(40) {
            return f64::from(self.rng.random_range(0..=100u32)) / 100.0;
        }
        match self.rng.random_range(0..7) {
            0 => f64::NAN,
            1 => f64::INFINITY,
            2 => f64::NEG_INFINITY,
            3 => -0.5,
            4 => 1.5,
            5 => f64::MAX,
            _ => f64::MIN_POSITIVE,
        }
    }

    fn u64(&mut self) -> u64 {
        if self.sane && !self.one_in(40) {
            return self.rng.random_range(1..100_000);
        }
        match self.rng.random_range(0..6) {
            0 => 0,
            1 => self.rng.random_range(1..100_000),
            2 => u64::MAX,
            3 => 3_153_600_000_000,
            4 => 3_153_600_000_001,
            _ => self.rng.random(),
        }
    }

    fn duration(&mut self) -> String {
        let choices = [
            "",
            "1s",
            "90s",
            "15m",
            "1h",
            "7d",
            "300000000000d",
            "3650d",
            "3700d",
            "-1s",
            "soon",
            "0s",
            "1e9s",
            "500ms",
            "1h30m",
            "30d",
            "31d",
        ];
        if self.sane && !self.one_in(40) {
            return ["1s", "90s", "15m", "1h", "7d"][self.rng.random_range(0..5)].to_string();
        }
        if self.one_in(10) {
            return self.text();
        }
        choices[self.rng.random_range(0..choices.len())].to_string()
    }

    fn limit(&mut self) -> pb::Limit {
        let kind = match self.rng.random_range(0..10) {
            0 => None,
            1..=3 => Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                key: self.text(),
                max_concurrency: self.u32(),
                shadow: false,
            })),
            4 | 5 => {
                let mut metadata = std::collections::HashMap::new();
                for _ in 0..self.rng.random_range(0..4) {
                    metadata.insert(self.text(), self.text());
                }
                Some(pb::limit::Kind::Floating(pb::FloatingConcurrencyLimit {
                    key: self.text(),
                    default_max: self.u32(),
                    refresh_interval_ms: self.u64(),
                    metadata,
                }))
            }
            6 | 7 => Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::Inline(pb::InlineRateLimit {
                    name: self.text(),
                    unique_key: if self.one_in(2) { String::new() } else { self.text() },
                    limit: self.i64(),
                    duration_ms: self.i64(),
                    cost: if self.one_in(2) { 0 } else { self.i64() },
                })),
            })),
            8 => Some(pb::limit::Kind::Adaptive(pb::AdaptiveConcurrencyLimit {
                key: self.text(),
                min: self.u32(),
                max: self.u32(),
                initial: if self.one_in(2) { 0 } else { self.u32() },
                target_latency_ms: self.u64(),
                max_error_ratio: self.ratio(),
                smoothing: self.ratio(),
            })),
            _ => Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: if self.one_in(8) {
                    None
                } else {
                    Some(pb::rate_limit::Spec::RateLimitKey(self.text()))
                },
            })),
        };
        pb::Limit { kind }
    }

    fn request(&mut self) -> pb::JobRequest {
        let mut request = self.any_request();
        if let Some(counter) = self.unique.as_mut() {
            *counter += 1;
            let prefix = format!("u{counter}-");
            if let Some(job_id) = &mut request.job_id {
                job_id.insert_str(0, &prefix);
            }
            if !request.idempotency_key.is_empty() {
                request.idempotency_key.insert_str(0, &prefix);
            }
        }
        request
    }

    fn any_request(&mut self) -> pb::JobRequest {
        let payload_length = match self.rng.random_range(0..20_000) {
            0 => self.max_payload_bytes,
            1 => self.max_payload_bytes + 1,
            n => usize::try_from(n % 64).unwrap_or(0),
        };
        let limit_count = if self.one_in(50) {
            20
        } else {
            self.rng.random_range(0..4)
        };
        pb::JobRequest {
            job_id: if self.one_in(2) { Some(self.text()) } else { None },
            tenant: if self.one_in(4) {
                self.text()
            } else {
                "acme".to_string()
            },
            task_group: if self.one_in(8) {
                self.text()
            } else {
                "default".to_string()
            },
            priority: if self.one_in(2) { Some(self.u32()) } else { None },
            payload: vec![b'p'; payload_length],
            run_at_ms: if self.one_in(4) { Some(self.i64()) } else { None },
            idempotency_key: if self.one_in(4) { self.text() } else { String::new() },
            idempotency_window: if self.one_in(4) { self.duration() } else { String::new() },
            retry: if self.one_in(3) {
                Some(pb::RetryPolicy {
                    max_attempts: self.u32(),
                    initial_backoff: self.duration(),
                    max_backoff: self.duration(),
                    backoff_multiplier: match self.rng.random_range(0..6) {
                        0 => f64::NAN,
                        1 => f64::INFINITY,
                        2 => -1.0,
                        3 => 1.5,
                        4 => 0.0,
                        _ => self.rng.random_range(0.0..200.0),
                    },
                    on_lease_expiry: self.rng.random_range(-1..4),
                })
            } else {
                None
            },
            limits: (0..limit_count).map(|_| self.limit()).collect(),
            fairness_key: if self.one_in(6) { self.text() } else { String::new() },
        }
    }

    /// The request as JSON, in the schema's field names, with JSON-level
    /// damage now and then: unknown fields (long, multibyte names), wrong
    /// types, numbers as text, nulls.
    fn json(&mut self, request: &pb::JobRequest) -> Value {
        let mut object = Map::new();
        if let Some(job_id) = &request.job_id {
            object.insert("job_id".into(), json!(job_id));
        }
        object.insert("tenant".into(), json!(request.tenant));
        object.insert("task_group".into(), json!(request.task_group));
        if let Some(priority) = request.priority {
            object.insert("priority".into(), json!(priority));
        }
        if !request.payload.is_empty() {
            object.insert("payload".into(), json!(String::from_utf8_lossy(&request.payload)));
        }
        if let Some(run_at_ms) = request.run_at_ms {
            object.insert("run_at_ms".into(), json!(run_at_ms.to_string()));
        }
        if !request.idempotency_key.is_empty() {
            object.insert("idempotency_key".into(), json!(request.idempotency_key));
            object.insert("idempotency_window".into(), json!(request.idempotency_window));
        }
        let limits: Vec<Value> = request
            .limits
            .iter()
            .map(|limit| match &limit.kind {
                Some(pb::limit::Kind::Concurrency(c)) => {
                    json!({"concurrency": {"key": c.key, "max_concurrency": c.max_concurrency}})
                }
                Some(pb::limit::Kind::Floating(f)) => json!({"floating": {
                    "key": f.key, "default_max": f.default_max,
                    "refresh_interval_ms": f.refresh_interval_ms, "metadata": f.metadata}}),
                Some(pb::limit::Kind::Rate(pb::RateLimit {
                    spec: Some(pb::rate_limit::Spec::Inline(i)),
                })) => json!({"rate": {"inline": {"name": i.name, "unique_key": i.unique_key,
                    "limit": i.limit, "duration_ms": i.duration_ms, "cost": i.cost}}}),
                Some(pb::limit::Kind::Rate(pb::RateLimit {
                    spec: Some(pb::rate_limit::Spec::RateLimitKey(key)),
                })) => json!({"rate": {"rate_limit_key": key}}),
                // NaN and the infinities become null (JSON has no such numbers).
                Some(pb::limit::Kind::Adaptive(a)) => json!({"adaptive": {
                    "key": a.key, "min": a.min, "max": a.max, "initial": a.initial,
                    "target_latency_ms": a.target_latency_ms,
                    "max_error_ratio": a.max_error_ratio, "smoothing": a.smoothing}}),
                _ => json!({}),
            })
            .collect();
        object.insert("limits".into(), Value::Array(limits));
        let mut document = Value::Object(object);
        let damages = if self.sane && !self.one_in(10) {
            0
        } else {
            self.rng.random_range(0..3)
        };
        for _ in 0..damages {
            self.damage_json(&mut document);
        }
        document
    }

    fn damage_json(&mut self, document: &mut Value) {
        let Value::Object(object) = document else {
            return;
        };
        match self.rng.random_range(0..8) {
            0 => {
                // The panic of issue 12: a long unknown field of multibyte characters.
                let name = MULTIBYTE[self.rng.random_range(0..MULTIBYTE.len())].repeat(self.rng.random_range(1..200));
                object.insert(name, json!(1));
            }
            1 => {
                let names: Vec<String> = object.keys().cloned().collect();
                if let Some(name) = names.get(self.rng.random_range(0..names.len().max(1))) {
                    let replacement = match self.rng.random_range(0..6) {
                        0 => json!(null),
                        1 => json!(-1),
                        2 => json!("99999999999999999999999"),
                        3 => json!(1.5),
                        4 => json!([1, 2]),
                        _ => json!({"nested": true}),
                    };
                    object.insert(name.clone(), replacement);
                }
            }
            2 => {
                object.insert("payload_base64".into(), json!("%%% not base64"));
            }
            3 => {
                object.insert("run_at".into(), json!(self.text()));
            }
            4 => {
                object.insert(
                    "retry".into(),
                    json!({"on_lease_expiry": self.text(), "max_attempts": "7"}),
                );
            }
            5 => {
                if let Some(Value::Array(limits)) = object.get_mut("limits") {
                    limits.push(json!({"concurrency": {"key": "k", "max_concurency": 1}}));
                }
            }
            6 => {
                object.insert(self.text(), Value::Null);
            }
            _ => {
                object.remove("tenant");
            }
        }
    }

    fn mutate_bytes(&mut self, bytes: &mut Vec<u8>) {
        for _ in 0..self.rng.random_range(1..4) {
            match self.rng.random_range(0..5) {
                0 if !bytes.is_empty() => {
                    let at = self.rng.random_range(0..bytes.len());
                    bytes[at] ^= 1 << self.rng.random_range(0..8);
                }
                1 if !bytes.is_empty() => {
                    let keep = self.rng.random_range(0..bytes.len());
                    bytes.truncate(keep);
                }
                2 => {
                    let at = self.rng.random_range(0..=bytes.len());
                    let inserted: Vec<u8> = (0..self.rng.random_range(1..8)).map(|_| self.rng.random()).collect();
                    bytes.splice(at..at, inserted);
                }
                3 if bytes.len() > 4 => {
                    let start = self.rng.random_range(0..bytes.len() - 2);
                    let end = self.rng.random_range(start + 1..bytes.len());
                    let copy = bytes[start..end].to_vec();
                    let at = self.rng.random_range(0..=bytes.len());
                    bytes.splice(at..at, copy);
                }
                _ => {
                    let at = self.rng.random_range(0..=bytes.len());
                    bytes.insert(at, 0);
                }
            }
        }
    }

    fn headers(&mut self, json: bool) -> Vec<(String, Vec<u8>)> {
        let mut headers = Vec::new();
        if json {
            let content_type: &[u8] = match self.rng.random_range(0..4) {
                0 => b"application/JSON; charset=utf-8",
                _ => b"application/json",
            };
            headers.push(("content-type".to_string(), content_type.to_vec()));
        } else if self.one_in(10) {
            headers.push(("content-type".to_string(), vec![0xff, 0xfe, b'x']));
        }
        match self.rng.random_range(0..6) {
            0 => headers.push((
                "traceparent".to_string(),
                b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_vec(),
            )),
            1 => headers.push((
                "traceparent".to_string(),
                b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\0".to_vec(),
            )),
            2 => headers.push(("traceparent".to_string(), self.text().into_bytes())),
            3 => headers.push(("tracestate".to_string(), vec![0, 159, 146, 150])),
            _ => {}
        }
        headers
    }

    /// One message for `jobs.requested`, at `offset`.
    pub fn message(&mut self, offset: i64) -> InMsg {
        self.sane = self.one_in(2);
        let request = self.request();
        let json = self.one_in(2);
        let mut payload = if json {
            let document = self.json(&request);
            serde_json::to_vec(&document).unwrap_or_default()
        } else {
            prost::Message::encode_to_vec(&request)
        };
        if self.one_in(if self.sane { 10 } else { 3 }) {
            self.mutate_bytes(&mut payload);
        }
        if self.one_in(200) {
            payload = (0..self.rng.random_range(0..64)).map(|_| self.rng.random()).collect();
        }
        InMsg {
            partition: 0,
            offset,
            key: if self.one_in(4) {
                None
            } else {
                Some(self.text().into_bytes())
            },
            payload: if self.one_in(100) { None } else { Some(payload) },
            headers: self.headers(json),
            timestamp_ms: Some(1_800_000_000_000 + offset),
        }
    }
}

impl HostileRequests {
    /// A generator seeded with `seed`; payloads of `max_payload_bytes` and
    /// one byte more appear now and then.
    pub fn new(seed: u64, max_payload_bytes: usize) -> Self {
        HostileRequests {
            rng: StdRng::seed_from_u64(seed),
            max_payload_bytes,
            sane: false,
            unique: None,
        }
    }

    /// See `unique`.
    pub fn unique_ids(mut self) -> Self {
        self.unique = Some(0);
        self
    }
}
