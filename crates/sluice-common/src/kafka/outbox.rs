//! Effects to publish after a commit (`Outbox`), the messages they become,
//! and the batch message format: internal entries packed into batch
//! messages whose field 1 is the repeated entry.

use std::collections::BTreeMap;
use std::sync::Arc;

/// One message to publish.
#[derive(Clone, Debug)]
pub struct OutMsg {
    pub topic: Arc<str>,
    /// Sluice computes partitions itself for internal topics; `None` lets the
    /// client's partitioner pick from the key (edge topics).
    pub partition: Option<i32>,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

/// A span to record when a message is sent (not when it is decided: a
/// batch decided twice sends once), whose context then replaces the
/// message's trace headers, so that what its consumer does hangs below it.
/// The message's own trace headers are its parent.
#[derive(Clone, Debug, PartialEq)]
pub struct SendSpan {
    /// The tracer scope (the service's crate).
    pub scope: &'static str,
    pub name: &'static str,
    /// When it started and ended (ms since the epoch); a moment.
    pub at_ms: i64,
    pub attributes: Vec<(&'static str, SpanValue)>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum SpanValue {
    Text(String),
    Number(i64),
}

/// Effects to publish after a commit. Internal entries for one (topic,
/// partition) are packed into batch messages whose field 1 is the repeated
/// entry (`LimitCommandBatch`, `GrantEventBatch`, ...). Entries for a link
/// (a gRPC stream of the hot path, `crate::link`) are kept encoded, by
/// (link, partition).
#[derive(Debug, Default)]
pub struct Outbox {
    batches: BTreeMap<(Arc<str>, i32), Vec<Vec<u8>>>,
    messages: Vec<OutMsg>,
    links: crate::link::LinkEntries,
    entries: usize,
    observations: Observations,
    /// Spans to record when single messages are sent: (index in
    /// `messages`, span).
    spans: Vec<(usize, SendSpan)>,
}

/// What a batch decided, as metrics, spans and logs, recorded only once the
/// batch is committed (`Outbox::observe`): a batch that does not commit is
/// decided again from the saved state and observed then, and a re-send of
/// what was decided before (after a takeover, for a duplicate) is never
/// observed. So counters count each decision once.
#[derive(Default)]
pub struct Observations(Vec<Box<dyn FnOnce() + Send>>);

impl Observations {
    /// Record them (the batch is committed).
    pub fn record(self) {
        for observation in self.0 {
            observation();
        }
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Observations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Observations({})", self.0.len())
    }
}

impl Outbox {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add `other`'s entries, messages and observations after this one's.
    pub fn append(&mut self, other: Outbox) {
        for (key, chunks) in other.batches {
            self.batches.entry(key).or_default().extend(chunks);
        }
        let offset = self.messages.len();
        self.spans
            .extend(other.spans.into_iter().map(|(index, span)| (index + offset, span)));
        self.messages.extend(other.messages);
        for (key, entries) in other.links {
            self.links.entry(key).or_default().extend(entries);
        }
        self.entries += other.entries;
        self.observations.0.extend(other.observations.0);
    }

    /// Record `observation` (metrics, spans, logs of a decision) once the
    /// batch is committed; see `Observations`.
    pub fn observe(&mut self, observation: impl FnOnce() + Send + 'static) {
        self.observations.0.push(Box::new(observation));
    }

    /// The batch's observations, to record after its commit.
    pub fn take_observations(&mut self) -> Observations {
        std::mem::take(&mut self.observations)
    }

    /// Add one entry to the batch message for `(topic, partition)`.
    pub fn push_entry<M: prost::Message>(&mut self, topic: &Arc<str>, partition: i32, entry: &M, max_bytes: usize) {
        let chunks = self.batches.entry((topic.clone(), partition)).or_default();
        let needed = entry.encoded_len() + 10;
        let start_new = match chunks.last() {
            None => true,
            Some(chunk) => !chunk.is_empty() && chunk.len() + needed > max_bytes,
        };
        if start_new {
            chunks.push(Vec::with_capacity(needed.max(256)));
        }
        if let Some(chunk) = chunks.last_mut() {
            // Field 1, wire type 2 (length-delimited): the batch's repeated entry.
            chunk.push(0x0a);
            // Writing into a Vec cannot fail.
            let _ = entry.encode_length_delimited(chunk);
        }
        self.entries += 1;
    }

    pub fn push(&mut self, message: OutMsg) {
        self.messages.push(message);
        self.entries += 1;
    }

    /// Add one message whose span is recorded when it is sent
    /// (`SendSpan`).
    pub fn push_with_span(&mut self, message: OutMsg, span: SendSpan) {
        self.spans.push((self.messages.len(), span));
        self.push(message);
    }

    /// The spans of single messages, by their index in `into_messages`
    /// (single messages come first there).
    pub fn take_spans(&mut self) -> Vec<(usize, SendSpan)> {
        std::mem::take(&mut self.spans)
    }

    /// Add one entry for `partition` of `link` (sent on a stream, not Kafka).
    pub fn push_link<M: prost::Message>(&mut self, link: crate::link::Link, partition: i32, entry: &M) {
        self.links
            .entry((link, partition))
            .or_default()
            .push(entry.encode_to_vec());
        self.entries += 1;
    }

    /// The link entries, leaving the Kafka messages.
    pub fn take_links(&mut self) -> crate::link::LinkEntries {
        let links = std::mem::take(&mut self.links);
        let taken: usize = links.values().map(Vec::len).sum();
        self.entries -= taken;
        links
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Entries and single messages pushed so far.
    pub fn len(&self) -> usize {
        self.entries
    }

    /// The Kafka messages. Link entries must have been taken (`take_links`).
    pub fn into_messages(self) -> Vec<OutMsg> {
        debug_assert!(self.links.is_empty(), "link entries left in an outbox sent to Kafka");
        let mut messages = self.messages;
        for ((topic, partition), chunks) in self.batches {
            for payload in chunks {
                messages.push(OutMsg {
                    topic: topic.clone(),
                    partition: Some(partition),
                    key: None,
                    payload,
                    headers: Vec::new(),
                });
            }
        }
        messages
    }
}

/// The entries of a batch message (`LimitCommandBatch`, `GrantEventBatch`,
/// ...: field 1 is the repeated entry), each as its encoded bytes, without
/// decoding them: one bad entry does not hide the others. Other fields are
/// skipped as protobuf says; a payload that is not protobuf is an error.
pub fn batch_entries(payload: &[u8]) -> Result<Vec<&[u8]>, String> {
    fn varint(bytes: &[u8], at: &mut usize) -> Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..70).step_by(7) {
            let Some(byte) = bytes.get(*at) else {
                return Err("truncated varint".to_string());
            };
            *at += 1;
            if shift == 63 && *byte > 1 {
                return Err("varint overflows 64 bits".to_string());
            }
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("varint longer than 10 bytes".to_string())
    }
    let mut entries = Vec::new();
    let mut at = 0;
    while at < payload.len() {
        let key = varint(payload, &mut at)?;
        let field = key >> 3;
        if field == 0 {
            return Err("field number 0".to_string());
        }
        match key & 7 {
            0 => {
                varint(payload, &mut at)?;
            }
            1 => {
                at = at
                    .checked_add(8)
                    .filter(|end| *end <= payload.len())
                    .ok_or("truncated")?
            }
            5 => {
                at = at
                    .checked_add(4)
                    .filter(|end| *end <= payload.len())
                    .ok_or("truncated")?
            }
            2 => {
                let length = usize::try_from(varint(payload, &mut at)?).map_err(|_| "length too large")?;
                let end = at
                    .checked_add(length)
                    .filter(|end| *end <= payload.len())
                    .ok_or("length past the end")?;
                if field == 1 {
                    entries.push(&payload[at..end]);
                }
                at = end;
            }
            other => return Err(format!("unsupported wire type {other}")),
        }
    }
    Ok(entries)
}

/// A batch message holding only `entry` (field 1).
pub fn single_entry_batch(entry: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(entry.len() + 11);
    message.push(0x0a);
    let mut length = u64::try_from(entry.len()).unwrap_or(u64::MAX);
    loop {
        // The low seven bits, with the continuation bit when more follow.
        let byte = u8::try_from(length & 0x7f).unwrap_or(0);
        length >>= 7;
        if length == 0 {
            message.push(byte);
            break;
        }
        message.push(byte | 0x80);
    }
    message.extend_from_slice(entry);
    message
}
