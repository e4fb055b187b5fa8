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

/// The canonical form of a JSON text: object members sorted by key (duplicates kept, in the order
/// written), no insignificant whitespace, strings re-escaped one way, numbers kept exactly as
/// written. `None` when the body is not JSON; it is then hashed as bytes.
///
/// A body is canonicalised exactly when `serde_json` would accept it as a value (but for
/// numbers beyond `f64`, below), so that nothing outside RFC 8259 (a `\u+041`, a `.5`, a lone
/// surrogate) can be read as some valid text and share its fingerprint. Where RFC 8259 leaves a
/// choice, serde_json's is followed:
/// - a byte order mark is not whitespace: a body that starts with one is not JSON;
/// - a `\u` escape of a lone or unpaired surrogate is refused (the text must be Unicode);
/// - at most 127 arrays and objects may be open at once ([`MAX_DEPTH`]);
/// - a number is kept as written, every digit, whatever its magnitude: the fingerprint compares
///   numbers as written, never as rounded, so `1e400` (which serde_json refuses rather than read
///   as infinity) is JSON like any other number and canonicalises the same in any member order;
/// - duplicate keys are accepted, and kept: a reader that takes the first and one that takes the
///   last would see different requests in `{"a":1,"a":2}`, so it must not share `{"a":2}`'s
///   fingerprint. The canonical form is still faithful to serde_json's last-wins value, because
///   the sort is stable.
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut p = Parser { text, s: text.as_bytes(), i: 0, depth: 0, members: Vec::new() };
    let mut out = Vec::with_capacity(body.len());
    p.skip_ws();
    p.value(&mut out)?;
    p.skip_ws();
    (p.i == p.s.len()).then_some(out)
}

/// The deepest nesting accepted: serde_json's recursion limit refuses the 128th open bracket.
pub const MAX_DEPTH: usize = 127;

struct Parser<'a> {
    text: &'a str,
    /// `text` as bytes: the grammar is ASCII, and every position it stops at is a char boundary.
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

    /// RFC 8259 §6: `-? (0 | [1-9][0-9]*) (\.[0-9]+)? ([eE][+-]?[0-9]+)?`, kept as written.
    fn number(&mut self, out: &mut Vec<u8>) -> Option<()> {
        let start = self.i;
        let _ = self.eat(b'-');
        match self.peek()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => self.digits()?,
            _ => return None,
        }
        if self.eat(b'.').is_some() {
            self.digits()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            self.digits()?;
        }
        out.extend_from_slice(&self.s[start..self.i]);
        Some(())
    }

    /// One or more ASCII digits.
    fn digits(&mut self) -> Option<()> {
        let from = self.i;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
        (self.i > from).then_some(())
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
                if self.peek()? != b'"' {
                    return None;
                }
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
            // Stable: duplicate keys stay in the order written (see `canonical_json`).
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

    /// Decodes a JSON string. A string without escapes, the common case, is borrowed from the
    /// input as it is.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        self.eat(b'"')?;
        let mut decoded = String::new();
        loop {
            let run = self.i;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.i += 1;
            }
            let text = &self.text[run..self.i];
            match self.peek()? {
                b'"' if decoded.is_empty() => {
                    self.i += 1;
                    return Some(Cow::Borrowed(text));
                }
                b'"' => {
                    decoded.push_str(text);
                    self.i += 1;
                    return Some(Cow::Owned(decoded));
                }
                b'\\' => {
                    decoded.push_str(text);
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
                            decoded.push(self.unicode_escape()?);
                            continue;
                        }
                        _ => return None,
                    };
                    self.i += 1;
                    decoded.push(c);
                }
                _ => return None, // a raw control character
            }
        }
    }

    /// Exactly four hex digits: `from_str_radix` would also take a sign (`\u+041`).
    fn hex4(&mut self) -> Option<u32> {
        let digits = self.s.get(self.i..self.i + 4)?;
        let mut v = 0;
        for &d in digits {
            v = v << 4 | char::from(d).to_digit(16)?;
        }
        self.i += 4;
        Some(v)
    }

    /// After `\u`: one code point, joining a surrogate pair; a lone surrogate is not Unicode text.
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
mod tests;
