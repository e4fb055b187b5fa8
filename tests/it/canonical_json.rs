//! The JSON canonicaliser, tested against serde_json as the reference reader of RFC 8259.
//!
//! What is proven, over generated values written in many ways and over mutated and random text:
//! - the canonicaliser accepts exactly the texts that `serde_json::from_slice::<Value>` accepts,
//!   and those it refuses only for a number beyond `f64` (`1e400` is JSON, kept as written);
//! - a canonical form reads back (with serde_json) as the value of the text it came from, so two
//!   texts that serde_json reads as different values never share a canonical form;
//! - every way of writing one value (whitespace, key order, escapes) has one canonical form,
//!   and that form is exactly the compact, key-sorted, one-way-escaped text expected.
//!
//! Numbers are compared as written, not as serde_json's `f64`: `1.0` and `1.00` are one value to
//! serde_json but two requests to the fingerprint, so the generator writes each number one way.
//! Generated values nest at most a few levels; the depth limit is tested at its edge separately.

use std::collections::{HashMap, VecDeque};

use idem::domain::fingerprint::{canonical_json, Fingerprint, MAX_DEPTH};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::Value;

/// A JSON value as the generator builds it: numbers as text, members in order, duplicates allowed.
#[derive(Debug, Clone)]
enum Json {
    Null,
    Bool(bool),
    Num(String),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => "-?(0|[1-9][0-9]{0,20})(\\.[0-9]{1,12})?([eE][+-]?[0-9]{1,2})?",
        // Around the edge of f64's range and past it, where serde_json starts refusing.
        1 => "-?(0|[1-9][0-9]{0,3})(\\.[0-9]{1,3})?[eE][+-]?(30[0-9]|31[0-9]|[0-9]{4})",
        1 => "[1-9][0-9]{300,315}",
        1 => "-?[1-9](\\.[0-9]{1,3})?[eE]\\+?[0-9]{3,9}",
    ]
}

fn text_char() -> impl Strategy<Value = char> {
    prop_oneof![
        6 => proptest::char::range(' ', '~'),
        2 => proptest::char::range('\0', '\u{1f}'),
        2 => proptest::sample::select(vec!['"', '\\', '/', '\u{7f}', 'é', '\u{2028}', '\u{feff}', '😀', '\u{10ffff}']),
        1 => any::<char>(),
    ]
}

fn text() -> impl Strategy<Value = String> {
    proptest::collection::vec(text_char(), 0..8).prop_map(String::from_iter)
}

/// Keys from a small alphabet as well, so that objects get duplicate keys.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![2 => "[ab]{0,2}", 1 => text()]
}

fn json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        number().prop_map(Json::Num),
        text().prop_map(Json::Str),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Json::Arr),
            proptest::collection::vec((key(), inner), 0..6).prop_map(Json::Obj),
        ]
    })
}

/// splitmix64: the choices of one way of writing a value, drawn from a generated seed.
struct Choices(u64);

impl Choices {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Writes `j` one of the many ways RFC 8259 allows.
fn write(j: &Json, c: &mut Choices, out: &mut String) {
    space(c, out);
    match j {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Num(n) => out.push_str(n),
        Json::Str(s) => write_str(s, c, out),
        Json::Arr(items) => {
            out.push('[');
            for (n, item) in items.iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                write(item, c, out);
            }
            space(c, out);
            out.push(']');
        }
        Json::Obj(members) => {
            out.push('{');
            for (n, (k, v)) in reordered(members, c).into_iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                space(c, out);
                write_str(k, c, out);
                space(c, out);
                out.push(':');
                write(v, c, out);
            }
            space(c, out);
            out.push('}');
        }
    }
    space(c, out);
}

fn space(c: &mut Choices, out: &mut String) {
    out.push_str(["", "", "", " ", "\n", "\t", "\r\n  "][c.below(7)]);
}

/// The members shuffled, except that members with the same key keep their order: which one
/// comes last is what serde_json's value holds.
fn reordered<'j>(members: &'j [(String, Json)], c: &mut Choices) -> Vec<&'j (String, Json)> {
    let mut order: Vec<usize> = (0..members.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, c.below(i + 1));
    }
    let mut same_key: HashMap<&str, VecDeque<&(String, Json)>> = HashMap::new();
    for m in members {
        same_key.entry(&m.0).or_default().push_back(m);
    }
    order.iter().map(|&i| same_key.get_mut(members[i].0.as_str()).unwrap().pop_front().unwrap()).collect()
}

fn write_str(s: &str, c: &mut Choices, out: &mut String) {
    out.push('"');
    for ch in s.chars() {
        let short = match ch {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            _ => None,
        };
        let must_escape = matches!(ch, '"' | '\\' | '\0'..='\u{1f}');
        match (c.below(4), short) {
            (0, _) => escape_utf16(ch, c, out),
            (1 | 2, Some(short)) => out.push_str(short),
            _ if must_escape => escape_utf16(ch, c, out),
            _ => out.push(ch),
        }
    }
    out.push('"');
}

fn escape_utf16(ch: char, c: &mut Choices, out: &mut String) {
    for unit in ch.encode_utf16(&mut [0; 2]) {
        let hex = format!("\\u{unit:04x}");
        out.push_str(&if c.below(2) == 0 { hex } else { hex.to_uppercase().replace("\\U", "\\u") });
    }
}

/// The canonical form expected, written independently of the canonicaliser: compact, keys
/// sorted by their UTF-8 bytes (stably), `"` `\` and control characters escaped one way.
fn expected(j: &Json, out: &mut String) {
    match j {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Num(n) => out.push_str(n),
        Json::Str(s) => expected_str(s, out),
        Json::Arr(items) => {
            out.push('[');
            for (n, item) in items.iter().enumerate() {
                out.push_str(if n > 0 { "," } else { "" });
                expected(item, out);
            }
            out.push(']');
        }
        Json::Obj(members) => {
            let mut sorted: Vec<_> = members.iter().collect();
            sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (n, (k, v)) in sorted.into_iter().enumerate() {
                out.push_str(if n > 0 { "," } else { "" });
                expected_str(k, out);
                out.push(':');
                expected(v, out);
            }
            out.push('}');
        }
    }
}

fn expected_str(s: &str, out: &mut String) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\0'..='\u{1f}' => out.push_str(&format!("\\u{:04x}", ch as u32)),
            _ => out.push(ch),
        }
    }
    out.push('"');
}

fn written(j: &Json, seed: u64) -> String {
    let mut out = String::new();
    write(j, &mut Choices(seed), &mut out);
    out
}

fn serde(text: &[u8]) -> Option<Value> {
    serde_json::from_slice::<Value>(text).ok()
}

/// serde_json's verdict on whether `text` is JSON, where a number beyond `f64` counts as a number:
/// serde_json refuses it (rather than read it as infinity), so each one it points at is read
/// again as `0 ` (the space ends the token, as the number's own end did), until it accepts the
/// text or refuses it for another reason.
fn is_json(text: &[u8]) -> bool {
    let mut text = text.to_vec();
    loop {
        let Err(e) = serde_json::from_slice::<Value>(&text) else { return true };
        if !e.to_string().starts_with("number out of range") {
            return false;
        }
        // The error names a byte of the number by line and 1-based column: its last, or for an
        // exponent past i32, the digit where serde_json stopped reading.
        let line_start: usize = text.split(|&b| b == b'\n').take(e.line() - 1).map(|l| l.len() + 1).sum();
        let at = line_start + e.column();
        let end = at + text[at..].iter().take_while(|b| b.is_ascii_digit()).count();
        let start = text[..at].iter().rposition(|b| !b"0123456789.eE+-".contains(b)).map_or(0, |i| i + 1);
        text.splice(start..end, *b"0 ");
    }
}

fn fingerprint(body: &[u8]) -> Fingerprint {
    Fingerprint::of("r", "POST", "/r", "", Some(b"application/json"), body)
}

/// The differential check every input goes through; returns the canonical form.
fn agrees_with_serde(text: &[u8]) -> Result<Option<Vec<u8>>, TestCaseError> {
    let canonical = canonical_json(text);
    prop_assert_eq!(canonical.is_some(), is_json(text), "accepted differently: {:?}", String::from_utf8_lossy(text));
    if let Some(canonical) = &canonical {
        // Faithful: the canonical form is JSON of the same value, and already canonical.
        prop_assert_eq!(serde(canonical), serde(text), "canonical form of {:?}", String::from_utf8_lossy(text));
        prop_assert_eq!(&canonical_json(canonical), &Some(canonical.clone()));
    }
    Ok(canonical)
}

/// A mutation of a text: (what, where, which byte, how far past a backslash).
type Edit = (u8, Index, u8, usize);

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let byte = prop_oneof![
        3 => proptest::sample::select(b"{}[]\",:\\/ \t\n\r0123456789abcdefABCDEF-+.eEtrufalsnu".to_vec()),
        1 => any::<u8>(),
    ];
    proptest::collection::vec((0..6u8, any::<Index>(), byte, 1..7usize), 1..4)
}

/// Edits 0–2 insert, delete or replace a byte anywhere; 3–5 do the same within an escape (the
/// few bytes after a backslash), where a lenient reader is most tempted to guess.
fn mutated(text: &str, edits: &[Edit]) -> Vec<u8> {
    let mut bytes = text.as_bytes().to_vec();
    for &(what, at, byte, past_backslash) in edits {
        let position = if what < 3 {
            at.index(bytes.len() + 1)
        } else {
            let backslashes: Vec<usize> = (0..bytes.len()).filter(|&i| bytes[i] == b'\\').collect();
            if backslashes.is_empty() {
                continue;
            }
            (backslashes[at.index(backslashes.len())] + past_backslash).min(bytes.len())
        };
        match what % 3 {
            0 => bytes.insert(position, byte),
            1 if position < bytes.len() => {
                bytes.remove(position);
            }
            2 if position < bytes.len() => bytes[position] = byte,
            _ => {}
        }
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_way_of_writing_a_value_has_the_one_expected_canonical_form(j in json(), a: u64, b: u64) {
        let (first, second) = (written(&j, a), written(&j, b));
        let canonical = agrees_with_serde(first.as_bytes())?;
        prop_assert_eq!(agrees_with_serde(second.as_bytes())?, canonical.clone());
        if let Some(canonical) = canonical {
            let mut want = String::new();
            expected(&j, &mut want);
            prop_assert_eq!(String::from_utf8(canonical).unwrap(), want);
            prop_assert_eq!(fingerprint(first.as_bytes()), fingerprint(second.as_bytes()));
        }
    }

    #[test]
    fn values_that_serde_json_tells_apart_never_share_a_canonical_form(x in json(), y in json(), a: u64, b: u64) {
        let (x, y) = (written(&x, a), written(&y, b));
        if let (Some(cx), Some(cy)) = (agrees_with_serde(x.as_bytes())?, agrees_with_serde(y.as_bytes())?) {
            if serde(x.as_bytes()) != serde(y.as_bytes()) {
                prop_assert_ne!(cx, cy);
                prop_assert_ne!(fingerprint(x.as_bytes()), fingerprint(y.as_bytes()));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn mutated_json_is_canonicalised_exactly_when_serde_json_reads_it(j in json(), seed: u64, edits in edits()) {
        let original = written(&j, seed);
        let text = mutated(&original, &edits);
        let canonical = agrees_with_serde(&text)?;
        // A mutation that changed the value changed the canonical form and the fingerprint.
        if let (Some(before), Some(after)) = (canonical_json(original.as_bytes()), canonical) {
            if serde(original.as_bytes()) != serde(&text) {
                prop_assert_ne!(before, after);
                prop_assert_ne!(fingerprint(original.as_bytes()), fingerprint(&text));
            }
        }
    }

    #[test]
    fn random_text_is_canonicalised_exactly_when_serde_json_reads_it(
        text in prop_oneof![
            3 => proptest::collection::vec(
                proptest::sample::select(b"{}[]\",:\\/ \t0123456789-+.eEtrufalsnux".to_vec()), 0..24),
            1 => proptest::collection::vec(any::<u8>(), 0..24),
            1 => "\\PC{0,24}".prop_map(String::into_bytes),
            // Strings full of escapes, well-formed or nearly.
            2 => "\"(\\\\u[0-9a-fA-F+ x-]{4}|\\\\[u\"\\\\/bfnrtx+-]?[0-9a-fA-F+ -]{0,5}|[a-zé]){0,5}\"".prop_map(String::into_bytes),
        ]
    ) {
        agrees_with_serde(&text)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Generated values stay shallow, so the depth limit is probed here, on both sides of it.
    #[test]
    fn nesting_is_refused_at_the_depth_serde_json_refuses(
        opens in proptest::collection::vec(prop_oneof![Just("["), Just("{\"k\":")], MAX_DEPTH - 3..MAX_DEPTH + 3),
        closed in any::<bool>(),
    ) {
        let mut text: String = opens.concat();
        text.push('1');
        if closed {
            for open in opens.iter().rev() {
                text.push(if *open == "[" { ']' } else { '}' });
            }
        }
        agrees_with_serde(text.as_bytes())?;
    }
}
