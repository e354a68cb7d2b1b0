//! Placeholder, filled in next.
