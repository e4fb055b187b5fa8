//! The access log's line, formatted here rather than by tracing's formatter, byte for byte as
//! that formatter writes it (plain text, or JSON).
//!
//! One line per request is the broker's most frequent work after the request itself: through
//! tracing, each line visits its fields through `dyn` calls, renders the timestamp from
//! the calendar, and runs every part through the terminal styling even with colours off, a tenth
//! of a replay's CPU (docs/performance.md). Here the constant parts are written once per line as
//! they are, the timestamp's date and second once per second and thread, and each field by its
//! own kind. The binary installs this writer when its lines go to a file, a pipe or the journal
//! ([`install`]); a terminal's coloured lines, and a process that installed nothing, go through
//! tracing as before. `RUST_LOG` judges the line the same either way.

use std::cell::RefCell;
use std::fmt::{Display, Write as _};
use std::io::Write as _;
use std::net::IpAddr;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use super::logs::{Batched, ACCESS_TARGET};

/// How the lines read: as tracing-subscriber's plain text (no colours) or its JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Text,
    Json,
}

/// Where the access lines go and how they read, once installed.
pub struct AccessLines {
    writer: Batched,
    shape: Shape,
}

static INSTALLED: OnceLock<AccessLines> = OnceLock::new();

/// 10000-01-01T00:00:00Z, in seconds: from here on tracing writes the year with a sign, and
/// humantime not at all.
const YEAR_10000: u64 = 253_402_300_800;

/// From now on, access lines are formatted here in `shape` and appended to `writer`. Once per
/// process; a second call is ignored.
pub fn install(writer: Batched, shape: Shape) {
    let _ = INSTALLED.set(AccessLines { writer, shape });
}

/// The installed writer, if any. Whether `RUST_LOG` keeps a line is the caller's to ask, of an
/// event with the line's own fields (`tracing::event_enabled!`), so that a filter naming a field
/// judges it as it judges the event tracing would make.
pub(crate) fn installed() -> Option<&'static AccessLines> {
    INSTALLED.get()
}

/// A field's value, by the kind tracing would record it as.
pub(crate) enum Value<'a> {
    /// A `&str`: quoted in text.
    Str(&'a str),
    /// Recorded with `%`: as it displays, unquoted in text, a string in JSON.
    Shown(&'a dyn Display),
    /// Recorded with `%`, its text at hand: as [`Value::Shown`] writes it, with no format call.
    Text(&'a str),
    /// An address recorded with `%`: an IPv4 address written octet by octet, with no format
    /// call; an IPv6 one as it displays.
    Address(IpAddr),
    /// A UUID recorded with `%`: hyphenated, in lower case, with no format call.
    Id(uuid::Uuid),
    Count(u64),
    Real(f64),
    Flag(bool),
}

thread_local! {
    /// The line being formatted, reused: no allocation per line once it has grown.
    static LINE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// The last second this thread wrote, and its date and time up to the second.
    static SECOND: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
}

impl AccessLines {
    /// Writes one line, `message` followed by `fields` in order; a field without a value is
    /// left out, as tracing leaves out a `None`. `false`, and nothing written, when the clock
    /// reads a time this formatter does not write as tracing would (before 1970, after 9999):
    /// the caller hands the line to tracing then.
    pub(crate) fn write(&self, message: &str, fields: &[(&str, Option<Value<'_>>)]) -> bool {
        let now = SystemTime::now();
        if !writable(now) {
            return false;
        }
        LINE.with_borrow_mut(|line| {
            line.clear();
            render(line, self.shape, now, message, fields);
            // An access line gives way to a destination far behind (see `logs`).
            let _ = self.writer.access_line().write_all(line);
        });
        true
    }
}

/// The line as tracing-subscriber writes it at `now`, into `out`.
pub(crate) fn render(
    out: &mut Vec<u8>,
    shape: Shape,
    now: SystemTime,
    message: &str,
    fields: &[(&str, Option<Value<'_>>)],
) {
    match shape {
        Shape::Text => {
            timestamp(out, now);
            out.extend_from_slice(b"  INFO ");
            out.extend_from_slice(ACCESS_TARGET.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(message.as_bytes());
            for (name, value) in fields {
                let Some(value) = value else { continue };
                out.push(b' ');
                out.extend_from_slice(name.as_bytes());
                out.push(b'=');
                match value {
                    Value::Str(text) => quoted(out, text),
                    Value::Shown(shown) => shown_as_is(out, shown),
                    Value::Text(text) => out.extend_from_slice(text.as_bytes()),
                    Value::Address(ip) => address(out, *ip),
                    Value::Id(id) => uuid(out, *id),
                    Value::Count(n) => count(out, *n),
                    Value::Real(x) => {
                        let _ = write!(out, "{x:?}");
                    }
                    Value::Flag(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
                }
            }
        }
        Shape::Json => {
            out.extend_from_slice(b"{\"timestamp\":\"");
            timestamp(out, now);
            out.extend_from_slice(b"\",\"level\":\"INFO\",\"fields\":{\"message\":");
            json_string(out, message);
            for (name, value) in fields {
                let Some(value) = value else { continue };
                out.push(b',');
                json_string(out, name);
                out.push(b':');
                match value {
                    Value::Str(text) => json_string(out, text),
                    Value::Shown(shown) => {
                        let mut text = String::new();
                        let _ = write!(text, "{shown}");
                        json_string(out, &text);
                    }
                    Value::Text(text) => json_string(out, text),
                    // Neither has anything to escape.
                    Value::Address(ip) => {
                        out.push(b'"');
                        address(out, *ip);
                        out.push(b'"');
                    }
                    Value::Id(id) => {
                        out.push(b'"');
                        uuid(out, *id);
                        out.push(b'"');
                    }
                    Value::Count(n) => count(out, *n),
                    Value::Real(x) => {
                        let _ = serde_json::to_writer(&mut *out, x);
                    }
                    Value::Flag(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
                }
            }
            out.extend_from_slice(b"},\"target\":");
            json_string(out, ACCESS_TARGET);
            out.push(b'}');
        }
    }
    out.push(b'\n');
}

/// A time from 1970 to 9999, which [`timestamp`] writes as tracing does.
fn writable(now: SystemTime) -> bool {
    now.duration_since(UNIX_EPOCH).is_ok_and(|since| since.as_secs() < YEAR_10000)
}

/// `2026-12-07T18:58:18.887720Z`: the date and second rendered once per second and thread. For
/// a time from 1970 to 9999 ([`writable`]).
fn timestamp(out: &mut Vec<u8>, now: SystemTime) {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    SECOND.with_borrow_mut(|(second, rendered)| {
        if *second != since.as_secs() {
            let whole = UNIX_EPOCH + std::time::Duration::from_secs(since.as_secs());
            rendered.clear();
            let _ = write!(rendered, "{}", humantime::format_rfc3339_seconds(whole));
            // `…:18Z`: the zone goes after the fraction.
            rendered.pop();
            *second = since.as_secs();
        }
        out.extend_from_slice(rendered.as_bytes());
    });
    let _ = write!(out, ".{:06}Z", since.subsec_micros());
}

fn shown_as_is(out: &mut Vec<u8>, value: &dyn Display) {
    let _ = write!(out, "{value}");
}

fn count(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// As the address displays.
fn address(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (at, octet) in v4.octets().into_iter().enumerate() {
                if at > 0 {
                    out.push(b'.');
                }
                out.extend_from_slice(itoa::Buffer::new().format(octet).as_bytes());
            }
        }
        IpAddr::V6(v6) => shown_as_is(out, &v6),
    }
}

/// As the UUID displays.
fn uuid(out: &mut Vec<u8>, id: uuid::Uuid) {
    let mut text = uuid::Uuid::encode_buffer();
    out.extend_from_slice(id.hyphenated().encode_lower(&mut text).as_bytes());
}

/// As `{:?}` quotes a string; the common case, nothing to escape, copied as it is.
fn quoted(out: &mut Vec<u8>, text: &str) {
    if text.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\' && b != b'\'') {
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
    } else {
        let _ = write!(out, "{text:?}");
    }
}

fn json_string(out: &mut Vec<u8>, text: &str) {
    let _ = serde_json::to_writer(out, text);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt;

    /// What tracing-subscriber's formatter writes, gathered for the test.
    #[derive(Clone, Default)]
    struct Gathered(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Gathered {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// One line through tracing-subscriber's formatter in `shape`, colours off.
    pub(crate) fn by_tracing(shape: Shape, emit: impl FnOnce()) -> String {
        let out = Gathered::default();
        let layer = tracing_subscriber::fmt::layer().with_ansi(false).with_writer({
            let out = out.clone();
            move || out.clone()
        });
        match shape {
            Shape::Text => tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), emit),
            Shape::Json => tracing::subscriber::with_default(tracing_subscriber::registry().with(layer.json()), emit),
        }
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        text
    }

    fn by_hand(shape: Shape, fields: &[(&str, Option<Value<'_>>)]) -> String {
        let mut out = Vec::new();
        render(&mut out, shape, SystemTime::now(), "answered", fields);
        String::from_utf8(out).unwrap()
    }

    /// The line without its timestamp, which the two read at different instants.
    pub(crate) fn untimed(shape: Shape, line: &str) -> String {
        let at = match shape {
            Shape::Text => 0,
            Shape::Json => "{\"timestamp\":\"".len(),
        };
        let stamp = &line[at..at + 27];
        assert!(humantime::parse_rfc3339(stamp).is_ok(), "not a timestamp: {stamp} in {line}");
        format!("{}{}", &line[..at], &line[at + 27..])
    }

    #[test]
    fn each_kind_of_field_reads_as_tracing_writes_it_in_text_and_in_json() {
        let shown = "127.0.0.1";
        for shape in [Shape::Text, Shape::Json] {
            for ((text, count, real, flag, absent), (v4, v6, id)) in [
                (("payments", 201, 0.107643, false, None), ("0.0.0.0", "::1", uuid::Uuid::nil())),
                (
                    ("quote \" back\\slash 'apos' tab\t é ünï", u64::MAX, 67.73366299999999, true, Some(7)),
                    ("255.255.255.255", "2001:db8::ff00:42:8329", uuid::Uuid::max()),
                ),
                (("", 0, 1.0, false, Some(0)), ("10.0.100.9", "::ffff:192.0.2.7", uuid::Uuid::now_v7())),
                (("-", 3, 1e21, true, None), ("192.168.1.1", "fe80::1", uuid::Uuid::new_v4())),
                (
                    ("line\nbreak\u{7f}\u{1b}", 12, 0.0, false, Some(u64::MAX)),
                    ("1.22.133.4", "2001:db8:0:1:1:1:1:1", uuid::Uuid::now_v7()),
                ),
            ] {
                let (v4, v6): (IpAddr, IpAddr) = (v4.parse().unwrap(), v6.parse().unwrap());
                let tracing = by_tracing(shape, || {
                    tracing::event!(
                        target: ACCESS_TARGET,
                        tracing::Level::INFO,
                        client.address = %shown,
                        idem.route = text,
                        http.request.body.size = absent,
                        http.response.status_code = count,
                        duration_ms = real,
                        idem.replay = flag,
                        idem.record = %text,
                        client.port = %text,
                        url.path = %v4,
                        idem.key = %v6,
                        idem.id = %id,
                        "answered"
                    );
                });
                let hand = by_hand(
                    shape,
                    &[
                        ("client.address", Some(Value::Shown(&shown))),
                        ("idem.route", Some(Value::Str(text))),
                        ("http.request.body.size", absent.map(Value::Count)),
                        ("http.response.status_code", Some(Value::Count(count))),
                        ("duration_ms", Some(Value::Real(real))),
                        ("idem.replay", Some(Value::Flag(flag))),
                        ("idem.record", Some(Value::Shown(&text))),
                        ("client.port", Some(Value::Text(text))),
                        ("url.path", Some(Value::Address(v4))),
                        ("idem.key", Some(Value::Address(v6))),
                        ("idem.id", Some(Value::Id(id))),
                    ],
                );
                assert_eq!(untimed(shape, &hand), untimed(shape, &tracing), "{shape:?}, {text:?}");
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn an_address_reads_as_it_displays(v4: std::net::Ipv4Addr, v6: std::net::Ipv6Addr) {
            for ip in [IpAddr::V4(v4), IpAddr::V6(v6)] {
                let mut out = Vec::new();
                address(&mut out, ip);
                proptest::prop_assert_eq!(String::from_utf8(out).unwrap(), ip.to_string());
            }
        }
    }

    #[test]
    fn a_time_before_1970_or_from_the_year_10000_on_is_left_to_tracing() {
        let at = |secs: u64| UNIX_EPOCH + std::time::Duration::from_secs(secs);
        assert!(writable(UNIX_EPOCH) && writable(at(YEAR_10000 - 1)));
        assert!(!writable(at(YEAR_10000)) && !writable(UNIX_EPOCH - std::time::Duration::from_micros(1)));
        let last = humantime::format_rfc3339_seconds(at(YEAR_10000 - 1)).to_string();
        assert_eq!(last, "9999-12-31T23:59:59Z");
    }

    #[test]
    fn the_timestamp_reads_as_tracing_writes_it_across_seconds() {
        for at in [0, 1, 999_999, 1_000_000, 86_399_999_999, 1_796_669_898_887_720] {
            let now = UNIX_EPOCH + std::time::Duration::from_micros(at);
            let mut out = Vec::new();
            timestamp(&mut out, now);
            let expected = humantime::format_rfc3339_micros(now).to_string();
            assert_eq!(String::from_utf8(out).unwrap(), expected);
        }
    }
}
