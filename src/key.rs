//! The `Idempotency-Key` header, parsed into a value that can only exist when valid.

use std::fmt;

use http::HeaderMap;

pub const HEADER: &str = "idempotency-key";
pub const MAX_LEN: usize = 255;

/// A client's idempotency key: 1 to 255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

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

    pub fn parse_header(raw: &[u8]) -> Result<IdempotencyKey, KeyError> {
        let raw = raw.trim_ascii();
        match raw.first() {
            Some(b'"') => IdempotencyKey::parse(&unquote(raw)?),
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
        Ok(IdempotencyKey(key.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn not_visible() -> KeyError {
    KeyError::Invalid("the Idempotency-Key must be visible ASCII characters only")
}

/// Decodes an sf-string (RFC 8941 §3.3.3): a quoted string whose only escapes are `\"` and `\\`.
fn unquote(raw: &[u8]) -> Result<String, KeyError> {
    let malformed = KeyError::Invalid("the quoted Idempotency-Key is not a valid structured-field string");
    let inner = raw.strip_prefix(b"\"").and_then(|r| r.strip_suffix(b"\"")).ok_or(malformed.clone())?;
    let mut out = String::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e as char),
                _ => return Err(malformed),
            },
            b'"' => return Err(malformed),
            0x20..=0x7e => out.push(b as char),
            _ => return Err(not_visible()),
        }
    }
    Ok(out)
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
        IdempotencyKey::parse_header(raw.as_bytes()).map(|k| k.0)
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

    #[test]
    fn malformed_sf_strings_are_invalid() {
        for raw in [r#""abc"#, r#""ab"c""#, r#""ab\c""#, r#""abc\""#, r#""abc";param=1"#] {
            assert!(matches!(parse(raw), Err(KeyError::Invalid(_))), "{raw}");
        }
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
