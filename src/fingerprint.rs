//! The request fingerprint: SHA-256 over route, method, path, query and body. A duplicate with a
//! different fingerprint is a different request reusing the key (422), so the fingerprint must
//! ignore what does not change meaning (JSON key order and whitespace) and keep everything that
//! does (every digit of a number, every character of a string).

use std::borrow::Cow;
use std::fmt;

use sha2::{Digest, Sha256};

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    pub fn of(route: &str, method: &str, path: &str, query: &str, content_type: Option<&[u8]>, body: &[u8]) -> Self {
        let mut h = Sha256::new();
        for field in [route.as_bytes(), method.as_bytes(), path.as_bytes(), query.as_bytes()] {
            h.update((field.len() as u64).to_le_bytes());
            h.update(field);
        }
        match is_json(content_type).then(|| canonical_json(body)).flatten() {
            Some(canonical) => {
                h.update(b"json");
                h.update(&canonical);
            }
            None => {
                h.update(b"body");
                h.update(body);
            }
        }
        Fingerprint(h.finalize().into())
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<Fingerprint> {
        bytes.try_into().ok().map(Fingerprint)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

/// A body is canonicalised as JSON when it says it is JSON, or says nothing at all.
fn is_json(content_type: Option<&[u8]>) -> bool {
    let Some(ct) = content_type else { return true };
    let Ok(ct) = std::str::from_utf8(ct) else {
        return false;
    };
    let media = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    media == "application/json" || media.ends_with("+json")
}

/// The canonical form of a JSON text: object members sorted by key (duplicates kept in order),
/// no insignificant whitespace, strings re-escaped one way, numbers kept exactly as written.
/// `None` when the body is not JSON; it is then hashed as bytes.
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut p = Parser { s: text.as_bytes(), i: 0, depth: 0, members: Vec::new() };
    let mut out = Vec::with_capacity(body.len());
    p.skip_ws();
    p.value(&mut out)?;
    p.skip_ws();
    (p.i == p.s.len()).then_some(out)
}

const MAX_DEPTH: usize = 128;

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    depth: usize,
    /// The members of the objects being parsed, innermost last: one allocation for the body.
    members: Vec<(Cow<'a, str>, std::ops::Range<usize>)>,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.peek()? == b).then(|| self.i += 1)
    }

    fn value(&mut self, out: &mut Vec<u8>) -> Option<()> {
        match self.peek()? {
            b'{' => self.nested(out, Parser::object),
            b'[' => self.nested(out, Parser::array),
            b'"' => {
                let s = self.string()?;
                write_string(out, &s);
                Some(())
            }
            b't' => self.literal(out, b"true"),
            b'f' => self.literal(out, b"false"),
            b'n' => self.literal(out, b"null"),
            _ => self.number(out),
        }
    }

    fn nested(&mut self, out: &mut Vec<u8>, f: fn(&mut Self, &mut Vec<u8>) -> Option<()>) -> Option<()> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return None;
        }
        f(self, out)?;
        self.depth -= 1;
        Some(())
    }

    fn literal(&mut self, out: &mut Vec<u8>, word: &[u8]) -> Option<()> {
        self.s[self.i..].starts_with(word).then_some(())?;
        self.i += word.len();
        out.extend_from_slice(word);
        Some(())
    }

    fn number(&mut self, out: &mut Vec<u8>) -> Option<()> {
        let start = self.i;
        let digits = |p: &mut Self| {
            let from = p.i;
            while matches!(p.peek(), Some(b'0'..=b'9')) {
                p.i += 1;
            }
            (p.i > from).then_some(())
        };
        let _ = self.eat(b'-');
        match self.peek()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => digits(self)?,
            _ => return None,
        }
        if self.eat(b'.').is_some() {
            digits(self)?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            digits(self)?;
        }
        out.extend_from_slice(&self.s[start..self.i]);
        Some(())
    }

    fn array(&mut self, out: &mut Vec<u8>) -> Option<()> {
        self.eat(b'[')?;
        out.push(b'[');
        self.skip_ws();
        if self.eat(b']').is_some() {
            out.push(b']');
            return Some(());
        }
        loop {
            self.skip_ws();
            self.value(out)?;
            self.skip_ws();
            match self.peek()? {
                b',' => {
                    self.i += 1;
                    out.push(b',');
                }
                b']' => {
                    self.i += 1;
                    out.push(b']');
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// Members are written into `out` as they come; only when they are out of order (rare for
    /// bodies produced by one serializer) are they copied aside and written again, sorted.
    fn object(&mut self, out: &mut Vec<u8>) -> Option<()> {
        self.eat(b'{')?;
        out.push(b'{');
        self.skip_ws();
        let start = out.len();
        let base = self.members.len();
        if self.eat(b'}').is_none() {
            loop {
                self.skip_ws();
                let key = self.string()?;
                if self.members.len() > base {
                    out.push(b',');
                }
                let from = out.len();
                write_string(out, &key);
                self.skip_ws();
                self.eat(b':')?;
                out.push(b':');
                self.skip_ws();
                self.value(out)?;
                self.members.push((key, from..out.len()));
                self.skip_ws();
                match self.peek()? {
                    b',' => self.i += 1,
                    b'}' => {
                        self.i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        let members = &mut self.members[base..];
        if !members.is_sorted_by(|a, b| a.0 <= b.0) {
            let written = out.split_off(start);
            members.sort_by(|a, b| a.0.cmp(&b.0));
            for (n, (_, r)) in members.iter().enumerate() {
                if n > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(&written[r.start - start..r.end - start]);
            }
        }
        self.members.truncate(base);
        out.push(b'}');
        Some(())
    }

    /// Decodes a JSON string (the input is already known to be UTF-8). A string without
    /// escapes, the common case, is borrowed from the input as it is.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        self.eat(b'"')?;
        let mut buf = Vec::new();
        loop {
            let run = self.i;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.i += 1;
            }
            let text = &self.s[run..self.i];
            match self.peek()? {
                b'"' if buf.is_empty() => {
                    self.i += 1;
                    return std::str::from_utf8(text).ok().map(Cow::Borrowed);
                }
                b'"' => {
                    buf.extend_from_slice(text);
                    self.i += 1;
                    return String::from_utf8(buf).ok().map(Cow::Owned);
                }
                b'\\' => {
                    buf.extend_from_slice(text);
                    self.i += 1;
                    let c = match self.peek()? {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            self.i += 1;
                            let c = self.unicode_escape()?;
                            let mut tmp = [0u8; 4];
                            buf.extend_from_slice(c.encode_utf8(&mut tmp).as_bytes());
                            continue;
                        }
                        _ => return None,
                    };
                    self.i += 1;
                    buf.push(c as u8);
                }
                _ => return None, // a raw control character
            }
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self.s.get(self.i..self.i + 4)?;
        let text = std::str::from_utf8(digits).ok()?;
        let v = u32::from_str_radix(text, 16).ok()?;
        self.i += 4;
        Some(v)
    }

    /// After `\u`: one code point, joining a surrogate pair; a lone surrogate is not JSON we accept.
    fn unicode_escape(&mut self) -> Option<char> {
        let first = self.hex4()?;
        if (0xD800..0xDC00).contains(&first) {
            self.eat(b'\\')?;
            self.eat(b'u')?;
            let second = self.hex4()?;
            if !(0xDC00..0xE000).contains(&second) {
                return None;
            }
            return char::from_u32(0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00));
        }
        char::from_u32(first)
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escaped: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[run..i]);
        run = i + 1;
        if escaped.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(b"\\u00");
            out.push(HEX[(b >> 4) as usize]);
            out.push(HEX[(b & 0xf) as usize]);
        } else {
            out.extend_from_slice(escaped);
        }
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(text: &str) -> Option<String> {
        canonical_json(text.as_bytes()).map(|v| String::from_utf8(v).unwrap())
    }

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::of("payments", "POST", "/payments", "", Some(b"application/json"), body.as_bytes())
    }

    #[test]
    fn reserialised_json_has_the_same_fingerprint() {
        assert_eq!(fp(r#"{"a":1,"b":2}"#), fp("{ \"b\": 2,\n  \"a\": 1 }"));
        assert_eq!(
            fp(r#"{"x":{"z":[1,{"q":true,"p":null}],"y":"\u00e9"}}"#),
            fp(r#"{"x":{"y":"é","z":[1,{"p":null,"q":true}]}}"#)
        );
        assert_eq!(fp(r#"{"s":"a\/b"}"#), fp(r#"{"s":"a/b"}"#));
    }

    #[test]
    fn any_change_in_meaning_changes_the_fingerprint() {
        let base = fp(r#"{"amount":100,"currency":"eur"}"#);
        assert_ne!(base, fp(r#"{"amount":101,"currency":"eur"}"#));
        assert_ne!(base, fp(r#"{"amount":100,"currency":"EUR"}"#));
        assert_ne!(base, fp(r#"{"amount":100}"#));
        assert_ne!(base, fp(r#"[{"amount":100,"currency":"eur"}]"#));
        // Numbers are compared as written: no float rounding can merge two different amounts.
        assert_ne!(fp(r#"{"n":12345678901234567890123}"#), fp(r#"{"n":12345678901234567890124}"#));
        assert_ne!(fp(r#"{"n":1.0}"#), fp(r#"{"n":1}"#));
        // Duplicate keys are kept, so a last-wins and a first-wins reading are not confused.
        assert_ne!(fp(r#"{"a":1,"a":2}"#), fp(r#"{"a":2}"#));
    }

    #[test]
    fn route_method_path_and_query_are_part_of_the_fingerprint() {
        let f = |route, method, path, query| Fingerprint::of(route, method, path, query, None, b"{}");
        let base = f("payments", "POST", "/payments", "");
        assert_ne!(base, f("refunds", "POST", "/payments", ""));
        assert_ne!(base, f("payments", "PATCH", "/payments", ""));
        assert_ne!(base, f("payments", "POST", "/payments/1", ""));
        assert_ne!(base, f("payments", "POST", "/payments", "x=1"));
        // Length prefixes keep field boundaries: moving a character between fields matters.
        assert_ne!(f("a", "POST", "/bc", ""), f("ab", "POST", "/c", ""));
    }

    #[test]
    fn non_json_bodies_are_hashed_as_bytes() {
        let text = |body: &str| Fingerprint::of("r", "POST", "/", "", Some(b"text/plain"), body.as_bytes());
        assert_ne!(text(r#"{"a":1,"b":2}"#), text(r#"{"b":2,"a":1}"#));
        assert_eq!(text("hello"), text("hello"));
        // Invalid JSON under a JSON content type falls back to bytes instead of failing.
        assert_ne!(fp("{not json"), fp("{not  json"));
        assert_eq!(fp("{not json"), fp("{not json"));
    }

    #[test]
    fn json_content_types_are_recognised() {
        assert!(is_json(None));
        assert!(is_json(Some(b"application/json")));
        assert!(is_json(Some(b"Application/JSON; charset=utf-8")));
        assert!(is_json(Some(b"application/merge-patch+json")));
        assert!(!is_json(Some(b"text/plain")));
        assert!(!is_json(Some(b"application/x-www-form-urlencoded")));
    }

    #[test]
    fn the_canonical_form_is_compact_sorted_and_escaped_one_way() {
        assert_eq!(
            canon(" { \"b\" : [ 1 , 2.50e+3 ] , \"a\" : \"x\\ty\" } ").unwrap(),
            r#"{"a":"x\ty","b":[1,2.50e+3]}"#
        );
        assert_eq!(canon(r#""\u0001\ud83d\ude00""#).unwrap(), "\"\\u0001😀\"");
        assert_eq!(canon("[]").unwrap(), "[]");
        assert_eq!(canon("{}").unwrap(), "{}");
        assert_eq!(canon("-0.5E-2").unwrap(), "-0.5E-2");
    }

    #[test]
    fn malformed_json_is_not_canonicalised() {
        for bad in [
            "",
            "{",
            "[1,]",
            "{\"a\"}",
            "{\"a\":1,}",
            "01",
            "1.",
            "-",
            "+1",
            ".5",
            "1e",
            "tru",
            "nul",
            "\"abc",
            "\"\\x\"",
            "\"\\ud800\"",
            "\"\t\"",
            "[1] 2",
            "{\"a\":1}}",
        ] {
            assert_eq!(canon(bad), None, "{bad:?}");
        }
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert_eq!(canon(&deep), None);
        let ok = "[".repeat(100) + &"]".repeat(100);
        assert!(canon(&ok).is_some());
    }
}
