//! One classification of failures, used by every consumer and owner: a fault
//! that passes (a lost connection, a timeout, a broker or database that is
//! restarting) is retried with backoff while readiness says NOT_SERVING; a
//! failure that comes back every time for the same input (bad content, a
//! constraint, an encoding error, a message too large) is set aside with its
//! bytes and the reason, and processing goes on. Retrying a permanent failure
//! would stop a partition for good; setting a transient one aside would lose
//! input, so this module is the only place that decides.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// Whether doing the same thing again, later, can succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Retry with backoff: the cause is outside the input.
    Transient,
    /// The same input fails every time: set it aside, never retry it.
    Permanent,
}

impl Fault {
    pub fn is_transient(self) -> bool {
        self == Fault::Transient
    }
}

/// PostgreSQL and sqlx errors. SQLSTATE classes: 08 connection, 40
/// serialization and deadlock, 53 insufficient resources, 55P03 lock not
/// available, 57 operator intervention (shutdown, statement timeout), 58 system
/// errors are transient; 22 data exceptions (an invalid byte sequence such as
/// a NUL byte, a value out of range), 23 integrity constraints, 42 syntax and
/// undefined objects, 54 program limits (an index row too large) come back for
/// the same statement and data.
pub fn classify_sql(error: &sqlx::Error) -> Fault {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Fault::Transient,
        sqlx::Error::Database(database) => match database.code() {
            Some(code) => classify_sqlstate(&code),
            None => Fault::Transient,
        },
        sqlx::Error::Encode(_)
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::RowNotFound
        | sqlx::Error::Configuration(_) => Fault::Permanent,
        _ => Fault::Transient,
    }
}

/// A gRPC call's failure between Sluice's own services (a forwarded call,
/// an owner's answer): unreachable, overloaded, timed out, moving owners or
/// an internal fault pass; a refusal of the request itself (invalid, not
/// found, not allowed, unimplemented) comes back every time.
pub fn classify_status(status: &tonic::Status) -> Fault {
    use tonic::Code;
    match status.code() {
        Code::InvalidArgument
        | Code::NotFound
        | Code::AlreadyExists
        | Code::PermissionDenied
        | Code::Unauthenticated
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::Unimplemented => Fault::Permanent,
        _ => Fault::Transient,
    }
}

/// A SQLSTATE code (five characters) as a fault.
pub fn classify_sqlstate(code: &str) -> Fault {
    let class = code.get(..2).unwrap_or_default();
    match class {
        "21" | "22" | "23" | "42" | "54" | "2B" | "2F" | "44" => Fault::Permanent,
        _ => Fault::Transient,
    }
}

/// A Kafka client error for one message (producing) or one request.
/// Errors about the message itself (too large, invalid, refused by the
/// topic's policy) are permanent; everything about brokers, connections,
/// timeouts and a producer that must be rebuilt passes.
pub fn classify_kafka(error: &KafkaError) -> Fault {
    let code = match error {
        KafkaError::MessageProduction(code) => Some(*code),
        other => other.rdkafka_error_code(),
    };
    match code {
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidMessage
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::BadMessage
            | RDKafkaErrorCode::MessageBatchTooLarge
            | RDKafkaErrorCode::PolicyViolation,
        ) => Fault::Permanent,
        _ => Fault::Transient,
    }
}

/// Text safe to store, log and put in a header: at most `max_bytes` (cut at a
/// character boundary, with `…` when cut) and no NUL bytes, which PostgreSQL
/// refuses in text.
pub fn clean_text(text: &str, max_bytes: usize) -> String {
    let without_nul: std::borrow::Cow<'_, str> = if text.contains('\0') {
        std::borrow::Cow::Owned(text.replace('\0', "\u{fffd}"))
    } else {
        std::borrow::Cow::Borrowed(text)
    };
    if without_nul.len() <= max_bytes {
        return without_nul.into_owned();
    }
    let ellipsis = "…";
    let mut end = max_bytes.saturating_sub(ellipsis.len());
    while end > 0 && !without_nul.is_char_boundary(end) {
        end -= 1;
    }
    let mut cut = String::with_capacity(end + ellipsis.len());
    cut.push_str(&without_nul[..end]);
    cut.push_str(ellipsis);
    cut
}

/// The text of a panic payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic without a message".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_refusals_are_permanent_and_unreachable_owners_pass() {
        for code in [
            tonic::Code::Unavailable,
            tonic::Code::DeadlineExceeded,
            tonic::Code::Aborted,
            tonic::Code::Internal,
        ] {
            assert_eq!(
                classify_status(&tonic::Status::new(code, "x")),
                Fault::Transient,
                "{code:?}"
            );
        }
        for code in [
            tonic::Code::InvalidArgument,
            tonic::Code::PermissionDenied,
            tonic::Code::NotFound,
        ] {
            assert_eq!(
                classify_status(&tonic::Status::new(code, "x")),
                Fault::Permanent,
                "{code:?}"
            );
        }
    }

    #[test]
    fn sqlstates_split_into_transient_and_permanent() {
        // invalid byte sequence (a NUL in text), out of range, unique violation,
        // undefined column, index row too large, one statement touching a row
        // twice (ON CONFLICT DO UPDATE)
        for code in ["22021", "22003", "22P05", "23505", "42703", "54000", "21000"] {
            assert_eq!(classify_sqlstate(code), Fault::Permanent, "{code}");
        }
        // connection failure, serialization failure, deadlock, too many
        // connections, admin shutdown, statement timeout, I/O error
        for code in ["08006", "40001", "40P01", "53300", "57P01", "57014", "58030", "55P03"] {
            assert_eq!(classify_sqlstate(code), Fault::Transient, "{code}");
        }
        assert_eq!(classify_sql(&sqlx::Error::PoolTimedOut), Fault::Transient);
        assert_eq!(classify_sql(&sqlx::Error::RowNotFound), Fault::Permanent);
    }

    #[test]
    fn kafka_errors_about_the_message_are_permanent() {
        let too_large = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        assert_eq!(classify_kafka(&too_large), Fault::Permanent);
        let timed_out = KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut);
        assert_eq!(classify_kafka(&timed_out), Fault::Transient);
        let fatal = KafkaError::MessageProduction(RDKafkaErrorCode::Fatal);
        assert_eq!(classify_kafka(&fatal), Fault::Transient);
        assert_eq!(classify_kafka(&KafkaError::Canceled), Fault::Transient);
    }

    #[test]
    fn clean_text_drops_nul_and_cuts_at_a_character_boundary() {
        assert_eq!(clean_text("a\0b", 10), "a\u{fffd}b");
        let long = "é".repeat(100);
        let cut = clean_text(&long, 11);
        assert!(cut.len() <= 11, "{cut}");
        assert!(cut.ends_with('…'));
        assert_eq!(clean_text("short", 5), "short");
    }
}
