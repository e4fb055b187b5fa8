//! The `Prefer` header (RFC 7240): what a client would like, never what it requires. A
//! preference that cannot be read is ignored, and the request is served as if it were absent.

use std::borrow::Cow;
use std::time::Duration;

use http::HeaderMap;

/// The longest `Prefer: wait=N` honoured, in seconds.
pub const MAX_WAIT_SECS: u64 = 300;

/// The preferences the broker acts on.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Prefer {
    /// `respond-async`: answer 202 at once instead of waiting for the execution.
    pub respond_async: bool,
    /// `wait=N`: how long a duplicate may wait for an outcome before it is told to come back.
    pub wait: Option<Duration>,
}

impl Prefer {
    /// Reads every `Prefer` field line, in order, as one list (RFC 9110 §5.3).
    pub fn from_headers(headers: &HeaderMap) -> Prefer {
        Prefer::parse(headers.get_all("prefer").iter().map(|v| v.as_bytes()))
    }

    /// `preference = token [ BWS "=" BWS word ] *( OWS ";" [ OWS parameter ] )`, a comma-separated
    /// list of them. Names are compared without regard to case; as RFC 7240 §2 asks, only the
    /// first instance of a preference counts, so `wait=forever, wait=5` waits for nothing. The
    /// value of `wait` is delta-seconds (digits only: no sign, no fraction), at most
    /// [`MAX_WAIT_SECS`]. A quoted string is one word: a `,`, a `;` or a `wait=1` inside one
    /// never starts a preference of its own.
    pub fn parse<'a>(lines: impl IntoIterator<Item = &'a [u8]>) -> Prefer {
        let mut prefer = Prefer::default();
        let (mut seen_async, mut seen_wait) = (false, false);
        for element in lines.into_iter().flat_map(elements) {
            let Some(Preference { name, value }) = preference(element) else { continue };
            if name.eq_ignore_ascii_case(b"respond-async") && !seen_async {
                seen_async = true;
                prefer.respond_async = true;
            } else if name.eq_ignore_ascii_case(b"wait") && !seen_wait {
                seen_wait = true;
                prefer.wait =
                    value.as_deref().and_then(delta_seconds).map(|s| Duration::from_secs(s.min(MAX_WAIT_SECS)));
            }
        }
        prefer
    }
}

/// RFC 9110's delta-seconds: digits only; a number too long to hold means "as long as allowed".
fn delta_seconds(text: &[u8]) -> Option<u64> {
    if text.is_empty() || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(text.iter().try_fold(0u64, |n, &d| n.checked_mul(10)?.checked_add(u64::from(d - b'0'))).unwrap_or(u64::MAX))
}

/// The elements of a list, split at the commas that are not inside a quoted string.
fn elements(line: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(line);
    std::iter::from_fn(move || {
        let text = rest?;
        let mut quoted = false;
        let mut escaped = false;
        for (i, &b) in text.iter().enumerate() {
            match b {
                _ if escaped => escaped = false,
                b'\\' if quoted => escaped = true,
                b'"' => quoted = !quoted,
                b',' if !quoted => {
                    rest = Some(&text[i + 1..]);
                    return Some(&text[..i]);
                }
                _ => {}
            }
        }
        rest = None;
        Some(text)
    })
}

/// One preference as written; its parameters are not kept, since no preference read here has any.
struct Preference<'a> {
    name: &'a [u8],
    /// Unquoted; `None` also when empty, which RFC 7240 §2 makes the same as no value.
    value: Option<Cow<'a, [u8]>>,
}

/// A preference's name and value, its parameters skipped; `None` when it is not well-formed
/// (or is an empty list element).
fn preference(element: &[u8]) -> Option<Preference<'_>> {
    let element = ows(element);
    let (name, mut rest) = token(element)?;
    let mut value = None;
    if let Some(after) = ows(rest).strip_prefix(b"=") {
        let after = ows(after);
        let (word, after) = if after.first() == Some(&b'"') { quoted_string(after)? } else { unquoted(after) };
        value = (!word.is_empty()).then_some(word);
        rest = after;
    }
    let rest = ows(rest);
    (rest.is_empty() || rest[0] == b';').then_some(Preference { name, value })
}

fn unquoted(text: &[u8]) -> (Cow<'_, [u8]>, &[u8]) {
    let (word, rest) = token(text).unwrap_or((&[], text));
    (Cow::Borrowed(word), rest)
}

/// A non-empty token (RFC 9110 §5.6.2) at the start of `text`, and what follows it.
fn token(text: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = text.iter().position(|&b| !is_tchar(b)).unwrap_or(text.len());
    (len > 0).then(|| text.split_at(len))
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A quoted string (RFC 9110 §5.6.4) at the start of `text`, unescaped, and what follows it.
fn quoted_string(text: &[u8]) -> Option<(Cow<'_, [u8]>, &[u8])> {
    let mut out = Vec::new();
    let mut bytes = text.strip_prefix(b"\"")?.iter().enumerate();
    while let Some((i, &b)) = bytes.next() {
        match b {
            b'"' => return Some((Cow::Owned(out), &text[i + 2..])),
            b'\\' => out.push(*bytes.next()?.1),
            _ => out.push(b),
        }
    }
    None
}

/// `text` without the optional whitespace (spaces and tabs) at either end.
fn ows(text: &[u8]) -> &[u8] {
    let start = text.iter().position(|&b| b != b' ' && b != b'\t').unwrap_or(text.len());
    let end = text.iter().rposition(|&b| b != b' ' && b != b'\t').map_or(start, |n| n + 1);
    &text[start..end.max(start)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefer(values: &[&str]) -> Prefer {
        Prefer::parse(values.iter().map(|v| v.as_bytes()))
    }

    fn wait(values: &[&str]) -> Option<u64> {
        prefer(values).wait.map(|d| d.as_secs())
    }

    #[test]
    fn preferences_are_read_leniently() {
        assert_eq!(prefer(&[]), Prefer::default());
        assert!(prefer(&["respond-async"]).respond_async);
        assert_eq!(wait(&["wait=10"]), Some(10));
        let both = prefer(&["Respond-Async, wait=3"]);
        assert!(both.respond_async && both.wait == Some(Duration::from_secs(3)));
        assert_eq!(wait(&["wait=forever"]), None);
        assert_eq!(wait(&["wait=-1"]), None);
        assert_eq!(wait(&["wait=99999"]), Some(MAX_WAIT_SECS));
    }

    #[test]
    fn wait_is_delta_seconds_and_nothing_else() {
        assert_eq!(wait(&["wait = \"7\""]), Some(7));
        assert_eq!(wait(&["wait=007;foo=bar"]), Some(7));
        assert_eq!(wait(&["wait=99999999999999999999999"]), Some(MAX_WAIT_SECS));
        for bad in ["wait=+5", "wait=5.0", "wait=5s", "wait=", "wait=\"\"", "wait=\"5", "wait=5 6", "wait"] {
            assert_eq!(wait(&[bad]), None, "{bad}");
        }
    }

    #[test]
    fn only_the_first_instance_of_a_preference_counts() {
        assert_eq!(wait(&["wait=2, wait=9"]), Some(2));
        assert_eq!(wait(&["wait=2", "wait=9"]), Some(2));
        assert_eq!(wait(&["wait=soon, wait=9"]), None);
        // A malformed element is no instance at all.
        assert_eq!(wait(&["wait=1 2=3, wait=9"]), Some(9));
        assert_eq!(wait(&["=1, wait=9"]), Some(9));
    }

    #[test]
    fn quoted_strings_hide_commas_semicolons_and_whole_preferences() {
        assert_eq!(prefer(&[r#"foo="a, wait=5, respond-async", bar"#]), Prefer::default());
        assert_eq!(wait(&[r#"foo="x\", wait=5""#]), None);
        assert_eq!(wait(&[r#"foo="a;b", wait=4"#]), Some(4));
        assert_eq!(wait(&[r#"handling=lenient; note="a,b", wait=4"#]), Some(4));
    }

    #[test]
    fn preferences_split_over_lines_or_with_empty_elements_read_alike() {
        assert_eq!(prefer(&["respond-async", "wait=3"]), prefer(&["respond-async, wait=3"]));
        assert_eq!(wait(&[", ,wait=3,"]), Some(3));
        assert!(prefer(&["\trespond-async ;x"]).respond_async);
    }
}
