//! Text a worker reports (a failure's error, a hand-back reason, a refresh
//! error) as admission takes it: no NUL bytes (PostgreSQL refuses them in
//! text) and at most 16 KiB. A handler's long stack trace must not make the
//! report itself fail with `INVALID_ARGUMENT`.

/// The most bytes admission takes in a reported error or reason.
pub(crate) const MAX_REPORTED_TEXT_BYTES: usize = 16 * 1024;

/// `text` with NUL bytes replaced and cut at a character boundary to fit.
pub(crate) fn reported_text(text: &str) -> String {
    let without_nul = text.replace('\0', "\u{fffd}");
    if without_nul.len() <= MAX_REPORTED_TEXT_BYTES {
        return without_nul;
    }
    let ellipsis = "…";
    let mut end = MAX_REPORTED_TEXT_BYTES - ellipsis.len();
    while !without_nul.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ellipsis}", &without_nul[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_bytes_go_and_long_text_is_cut_inside_the_limit() {
        assert_eq!(reported_text("a\0b"), "a\u{fffd}b");
        let long = "é".repeat(MAX_REPORTED_TEXT_BYTES);
        let cut = reported_text(&long);
        assert!(cut.len() <= MAX_REPORTED_TEXT_BYTES);
        assert!(cut.ends_with('…'));
        assert_eq!(reported_text("short"), "short");
    }
}
