//! The `Idempotency-Key` header, parsed into a value that can only exist when valid.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use http::HeaderMap;
use serde::{Serialize, Serializer};

pub const HEADER: http::HeaderName = http::HeaderName::from_static("idempotency-key");
pub const MAX_LEN: usize = 255;
/// Keys a route derives for clients that send none (docs/agents.md) carry this prefix, so they
/// can never be mistaken for a client's own.
pub const DERIVED_PREFIX: &str = "derived:";

/// A source of a route's `key_from` that the request lacks: it has no key, and none can be
/// derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the request has no Idempotency-Key, and its key cannot be derived: `{0}` is missing")]
pub struct MissingSource(pub String);

/// A client's idempotency key: 1 to 255 visible ASCII characters. Parsed once by the ingress,
/// then shared, not copied, by the record, its lookups and its logs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Arc<str>);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the request has no Idempotency-Key header")]
    Missing,
    #[error("{0}")]
    Invalid(&'static str),
}

impl IdempotencyKey {
    /// Reads the key from a request's headers. The key may be a bare token (`abc`) or a
    /// structured-field string (`"abc"`, with `\"` and `\\` escapes), per the IETF draft.
    pub fn from_headers(headers: &HeaderMap) -> Result<IdempotencyKey, KeyError> {
        let mut values = headers.get_all(HEADER).iter();
        let value = values.next().ok_or(KeyError::Missing)?;
        if values.next().is_some() {
            return Err(KeyError::Invalid("the request carries more than one Idempotency-Key header"));
        }
        IdempotencyKey::parse_header(value.as_bytes())
    }

    /// The header's value is one structured-field item (RFC 8941 §3.3): an sf-string, whose
    /// parameters (`"abc";x=1`) must be well-formed and are ignored. A bare key is a leniency
    /// beyond the draft, taken literally as long as it cannot be read as something else: a `,`
    /// or a leading `(` make a list, and a `;` would make the key before it carry parameters, so
    /// such keys are refused rather than guessed at. Two different keys never become one.
    pub fn parse_header(raw: &[u8]) -> Result<IdempotencyKey, KeyError> {
        let raw = raw.trim_ascii();
        match raw.first() {
            Some(b'"') => {
                let (key, rest) = sf_string(raw).ok_or_else(|| malformed_string(raw))?;
                let rest = skip_parameters(rest).ok_or(KeyError::Invalid(
                    "the Idempotency-Key's parameters are malformed: each is ';', a lower-case name, \
                     and optionally '=' and a structured-field value",
                ))?;
                match rest.trim_ascii_start().first() {
                    None => IdempotencyKey::parse(&key),
                    Some(b',') => Err(list()),
                    Some(_) => Err(KeyError::Invalid(
                        "the Idempotency-Key has characters after its quoted string that are not parameters",
                    )),
                }
            }
            Some(b'(') => Err(KeyError::Invalid(
                "the Idempotency-Key is an inner list (it starts with '('): send one key, as a string",
            )),
            _ if raw.contains(&b',') => Err(list()),
            _ if raw.contains(&b';') => Err(KeyError::Invalid(
                "the Idempotency-Key has a ';' outside quotes, which would start parameters: \
                 send a key that contains ';' as a quoted string",
            )),
            _ => IdempotencyKey::parse(std::str::from_utf8(raw).map_err(|_| not_visible())?),
        }
    }

    /// Validates a key as it is stored and shown (already unquoted).
    pub fn parse(key: &str) -> Result<IdempotencyKey, KeyError> {
        if key.is_empty() {
            return Err(KeyError::Invalid("the Idempotency-Key is empty"));
        }
        if key.len() > MAX_LEN {
            return Err(KeyError::Invalid("the Idempotency-Key is longer than 255 characters"));
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(not_visible());
        }
        Ok(IdempotencyKey(key.into()))
    }

    /// A key as read back from the store, which only ever holds keys that were validated when
    /// their request was recorded: not checked again.
    pub fn from_stored(key: String) -> IdempotencyKey {
        IdempotencyKey(key.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for IdempotencyKey {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for IdempotencyKey {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for IdempotencyKey {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl Serialize for IdempotencyKey {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

fn not_visible() -> KeyError {
    KeyError::Invalid("the Idempotency-Key must be visible ASCII characters only")
}

fn list() -> KeyError {
    KeyError::Invalid("the Idempotency-Key is a list (a ',' separates several values): send one key")
}

/// Why an sf-string could not be read: an invisible character, or its quoting.
fn malformed_string(raw: &[u8]) -> KeyError {
    if raw.iter().any(|b| !(0x20..=0x7e).contains(b)) {
        return not_visible();
    }
    KeyError::Invalid(
        "the quoted Idempotency-Key is not a valid structured-field string: it must end with '\"' \
         and may escape only '\"' and '\\'",
    )
}

// ---- RFC 8941 §4.2, as much as one item with parameters needs --------------------------------

/// Decodes an sf-string at the start of `raw` (§4.2.5): printable ASCII whose only escapes are
/// `\"` and `\\`. Returns the text and what follows the closing quote.
fn sf_string(raw: &[u8]) -> Option<(String, &[u8])> {
    let mut rest = raw.strip_prefix(b"\"")?;
    let mut out = String::new();
    loop {
        let (&b, after) = rest.split_first()?;
        rest = after;
        match b {
            b'\\' => {
                let (&e, after) = rest.split_first()?;
                if e != b'"' && e != b'\\' {
                    return None;
                }
                out.push(char::from(e));
                rest = after;
            }
            b'"' => return Some((out, rest)),
            0x20..=0x7e => out.push(char::from(b)),
            _ => return None,
        }
    }
}

/// Skips the parameters at the start of `rest` (§4.2.3.2); what follows them is returned.
fn skip_parameters(mut rest: &[u8]) -> Option<&[u8]> {
    while let Some(after) = rest.strip_prefix(b";") {
        rest = sf_key(skip_sp(after))?;
        if let Some(after) = rest.strip_prefix(b"=") {
            rest = bare_item(after)?;
        }
    }
    Some(rest)
}

/// A parameter's name (§4.2.3.3): `( lcalpha / "*" ) *( lcalpha / DIGIT / "_" / "-" / "." / "*" )`.
fn sf_key(rest: &[u8]) -> Option<&[u8]> {
    let (&first, _) = rest.split_first()?;
    if !(first.is_ascii_lowercase() || first == b'*') {
        return None;
    }
    let len = rest
        .iter()
        .position(|&b| !(b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-' | b'.' | b'*')))
        .unwrap_or(rest.len());
    Some(&rest[len..])
}

/// Skips one bare item (§4.2.3.1): an integer or decimal, a string, a token, a byte sequence
/// or a boolean.
fn bare_item(rest: &[u8]) -> Option<&[u8]> {
    match *rest.first()? {
        b'-' | b'0'..=b'9' => sf_number(rest),
        b'"' => sf_string(rest).map(|(_, rest)| rest),
        b if b.is_ascii_alphabetic() || b == b'*' => {
            let len = rest[1..].iter().position(|&b| !is_token_char(b)).map_or(rest.len(), |n| n + 1);
            Some(&rest[len..])
        }
        b':' => sf_binary(&rest[1..]),
        b'?' => match rest.get(1)? {
            b'0' | b'1' => Some(&rest[2..]),
            _ => None,
        },
        _ => None,
    }
}

/// tchar (RFC 9110 §5.6.2), ':' or '/'.
fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&b)
}

/// An integer of at most 15 digits, or a decimal of at most 12 integer and 3 fraction digits
/// (§4.2.4).
fn sf_number(rest: &[u8]) -> Option<&[u8]> {
    let unsigned = rest.strip_prefix(b"-").unwrap_or(rest);
    let int = unsigned.iter().position(|b| !b.is_ascii_digit()).unwrap_or(unsigned.len());
    if int == 0 {
        return None;
    }
    let Some(after_point) = unsigned[int..].strip_prefix(b".") else {
        return (int <= 15).then_some(&unsigned[int..]);
    };
    let frac = after_point.iter().position(|b| !b.is_ascii_digit()).unwrap_or(after_point.len());
    (int <= 12 && (1..=3).contains(&frac)).then_some(&after_point[frac..])
}

/// A byte sequence after its opening ':' (§4.2.7): base64 up to the closing ':'. Padding and
/// pad bits are not insisted on, as the RFC asks of parsers.
fn sf_binary(rest: &[u8]) -> Option<&[u8]> {
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    use base64::Engine;
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new()
            .with_decode_padding_mode(DecodePaddingMode::Indifferent)
            .with_decode_allow_trailing_bits(true),
    );
    let end = rest.iter().position(|&b| b == b':')?;
    let content = &rest[..end];
    if !content.iter().all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=')) {
        return None;
    }
    LENIENT.decode(content).ok()?;
    Some(&rest[end + 1..])
}

/// Parameters allow spaces after ';', and only spaces (not tabs).
fn skip_sp(rest: &[u8]) -> &[u8] {
    let n = rest.iter().position(|&b| b != b' ').unwrap_or(rest.len());
    &rest[n..]
}

/// Everything but RFC 3986's unreserved characters is percent-encoded when a key goes in a path.
const PATH_SEGMENT: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// A key as one path segment (`/_idem/requests/{key}`, a probe's `{idempotency_key}`).
pub fn path_segment(key: &str) -> String {
    percent_encoding::utf8_percent_encode(key, PATH_SEGMENT).to_string()
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str) -> Result<String, KeyError> {
        IdempotencyKey::parse_header(raw.as_bytes()).map(|k| k.as_str().to_string())
    }

    #[test]
    fn bare_and_quoted_keys_mean_the_same_key() {
        assert_eq!(parse("8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
        assert_eq!(parse("\"8e03978e\"").unwrap(), "8e03978e");
        assert_eq!(parse("  abc  ").unwrap(), "abc");
        assert_eq!(parse(r#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        assert_eq!(parse("a/b?c#d%e").unwrap(), "a/b?c#d%e");
    }

    #[test]
    fn empty_long_and_invisible_keys_are_invalid() {
        assert!(matches!(parse(""), Err(KeyError::Invalid(_))));
        assert!(matches!(parse("\"\""), Err(KeyError::Invalid(_))));
        assert!(parse(&"k".repeat(255)).is_ok());
        assert!(matches!(parse(&"k".repeat(256)), Err(KeyError::Invalid(m)) if m.contains("255")));
        assert!(matches!(parse("a b"), Err(KeyError::Invalid(_))));
        assert!(matches!(parse("\"a b\""), Err(KeyError::Invalid(_))));
        assert!(IdempotencyKey::parse_header("ключ".as_bytes()).is_err());
        assert!(IdempotencyKey::parse_header(b"k\x01ey").is_err());
        assert!(IdempotencyKey::parse_header(b"k\xffey").is_err());
    }

    fn refusal(raw: &str) -> &'static str {
        match parse(raw) {
            Err(KeyError::Invalid(why)) => why,
            other => panic!("{raw:?} gave {other:?}"),
        }
    }

    #[test]
    fn malformed_sf_strings_are_invalid() {
        for raw in [r#""abc"#, r#""ab"c""#, r#""ab\c""#, r#""abc\""#, "\"a\u{e9}\""] {
            assert!(matches!(parse(raw), Err(KeyError::Invalid(_))), "{raw}");
        }
        assert!(refusal(r#""ab\c""#).contains("structured-field string"));
    }

    #[test]
    fn a_list_is_not_a_key() {
        for raw in ["a,b", "a, b", r#""a", "b""#, r#""a";x=1,"b""#, ","] {
            assert!(refusal(raw).contains("is a list"), "{raw}");
        }
        for raw in [r#"("a")"#, "(a b)", "()"] {
            assert!(refusal(raw).contains("inner list"), "{raw}");
        }
        // Inside quotes a comma or a parenthesis is just a character of the key.
        assert_eq!(parse(r#""a,b""#).unwrap(), "a,b");
        assert_eq!(parse(r#""(a)""#).unwrap(), "(a)");
    }

    #[test]
    fn parameters_of_a_quoted_key_are_checked_and_ignored() {
        for raw in [
            r#""abc";x=1"#,
            r#""abc"; a; b=?0"#,
            r#""abc";a;a=?1"#,
            r#""abc";*k.1-_=tok/en:x"#,
            r#""abc";b=:aGVsbG8=:;c=:aGVsbG8:"#,
            r#""abc";d=-123456789012.123;e=999999999999999"#,
            r#""abc";s="q\"x;y=1""#,
            r#""abc";x=1   "#,
        ] {
            assert_eq!(parse(raw).unwrap(), "abc", "{raw}");
        }
        for raw in [
            r#""abc";"#,
            r#""abc";X=1"#,
            r#""abc";1x=1"#,
            r#""abc";x="#,
            r#""abc";x==1"#,
            r#""abc";x=1."#,
            r#""abc";x=1.2345"#,
            r#""abc";x=1234567890123.1"#,
            r#""abc";x=1234567890123456"#,
            r#""abc";x=--1"#,
            r#""abc";x=?2"#,
            r#""abc";x=:a*b:"#,
            r#""abc";x=:abc"#,
            r#""abc";x="open"#,
            r#""abc";x=(1)"#,
        ] {
            assert!(refusal(raw).contains("parameters are malformed"), "{raw}");
        }
        for raw in [r#""abc" ;x=1"#, r#""abc";x=1 y"#, r#""abc""def""#, r#""abc"x"#] {
            assert!(refusal(raw).contains("after its quoted string"), "{raw}");
        }
    }

    #[test]
    fn a_bare_key_is_taken_whole_unless_it_could_mean_something_else() {
        for raw in ["a(b", r#"ab"c"#, "a)b", "*", "?0", ":abc:"] {
            assert_eq!(parse(raw).unwrap(), raw);
        }
        // As a structured field `abc;x=1` is the token `abc` with a parameter; taken whole it is
        // another key. Neither reading is safe to pick, so the client is told to quote it.
        for raw in ["abc;x=1", "a;b", ";"] {
            assert!(refusal(raw).contains("';' outside quotes"), "{raw}");
        }
        assert_eq!(parse(r#""a;b""#).unwrap(), "a;b");
    }

    #[test]
    fn keys_in_paths_keep_unreserved_characters_and_encode_the_rest() {
        assert_eq!(path_segment("order-1_a.b~c"), "order-1_a.b~c");
        assert_eq!(path_segment("a/b?c#d%e f"), "a%2Fb%3Fc%23d%25e%20f");
    }

    #[test]
    fn a_missing_or_repeated_header_is_refused() {
        let mut headers = HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&headers), Err(KeyError::Missing));
        headers.append(HEADER, "one".parse().unwrap());
        assert_eq!(IdempotencyKey::from_headers(&headers).unwrap().as_str(), "one");
        headers.append(HEADER, "two".parse().unwrap());
        assert!(matches!(IdempotencyKey::from_headers(&headers), Err(KeyError::Invalid(_))));
    }
}
