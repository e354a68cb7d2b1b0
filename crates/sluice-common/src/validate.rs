//! Input validation shared by every service: an error names the field, so a
//! gRPC caller gets `INVALID_ARGUMENT: limits[1].concurrency.key: must not be
//! empty` and a Kafka producer gets the same text in the dead-letter header.

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError {
            field: field.into(),
            message: message.into(),
        }
    }

    /// Prefix the field with its parent, e.g. `jobs[3]`.
    pub fn within(self, parent: &str) -> Self {
        FieldError {
            field: format!("{parent}.{}", self.field),
            message: self.message,
        }
    }
}

impl From<FieldError> for tonic::Status {
    fn from(error: FieldError) -> Self {
        tonic::Status::invalid_argument(error.to_string())
    }
}

/// A tenant or key: non-empty, at most `max_bytes`, no control characters.
pub fn check_name(field: &str, value: &str, max_bytes: usize) -> Result<(), FieldError> {
    if value.is_empty() {
        return Err(FieldError::new(field, "must not be empty"));
    }
    if value.len() > max_bytes {
        return Err(FieldError::new(field, format!("must be at most {max_bytes} bytes")));
    }
    if value.chars().any(char::is_control) {
        return Err(FieldError::new(field, "must not contain control characters"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_with_the_field() {
        assert!(check_name("tenant", "acme", 10).is_ok());
        assert_eq!(
            check_name("tenant", "", 10).unwrap_err().to_string(),
            "tenant: must not be empty"
        );
        assert!(check_name("key", "a\u{0}b", 10).is_err());
        assert!(check_name("key", "abcdefghijk", 10).is_err());
        let nested = check_name("key", "", 10).unwrap_err().within("limits[2]");
        assert_eq!(nested.field, "limits[2].key");
    }
}
