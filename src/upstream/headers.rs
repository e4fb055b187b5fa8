//! The header rules shared by the recorded and the plain proxy paths: which of a client's
//! headers go upstream and are stored, which of an upstream's are kept, and the headers the
//! broker adds at each send (the attempt's claim, its deadline).

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::domain::headers::{CLIENT_ONLY, HOP_BY_HOP};
use crate::record::{header_bytes, header_text};

/// The request headers to send upstream (and to store, so a retry or take-over sends the same).
/// The client's credentials and cookies are never forwarded nor stored; the Idempotency-Key goes
/// along only when the route says so.
pub(crate) fn forwardable_request_headers(headers: &HeaderMap, forward_key: bool) -> Vec<(String, String)> {
    let listed = connection_listed(headers);
    headers
        .iter()
        .filter(|(name, _)| forwardable(name, &listed, forward_key))
        .map(|(name, value)| (name.as_str().to_string(), header_text(value.as_bytes())))
        .collect()
}

/// Whether a client's header named `name` goes upstream, `listed` by its `Connection` or not.
fn forwardable(name: &HeaderName, listed: &[String], forward_key: bool) -> bool {
    let n = name.as_str();
    !HOP_BY_HOP.contains(&n)
        && !CLIENT_ONLY.contains(&n)
        && !listed.iter().any(|l| l == n)
        && (forward_key || n != crate::domain::key::HEADER)
}

/// A call never recorded sends the client's own map with what [`forwardable_request_headers`]
/// keeps left in it, rather than copied out to be stored and back.
pub(crate) fn keep_forwardable(headers: &mut HeaderMap, forward_key: bool) {
    let listed = connection_listed(headers);
    retain(headers, |name| forwardable(name, &listed, forward_key));
}

/// The response headers to store and return: everything end-to-end.
pub(crate) fn storable_response_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    let listed = connection_listed(headers);
    headers
        .iter()
        .filter(|(name, _)| end_to_end(name, &listed))
        .map(|(name, value)| (name.as_str().to_string(), header_text(value.as_bytes())))
        .collect()
}

/// Whether an answer's header named `name` is end-to-end, `listed` by its `Connection` or not.
fn end_to_end(name: &HeaderName, listed: &[String]) -> bool {
    !HOP_BY_HOP.contains(&name.as_str()) && !listed.iter().any(|l| l == name.as_str())
}

/// An upstream's response headers as a call never recorded passes them on: the same end-to-end
/// headers [`storable_response_headers`] keeps, left in hyper's map as they came rather than
/// copied out to be stored and back.
pub(crate) fn keep_end_to_end(headers: &mut HeaderMap) {
    let listed = connection_listed(headers);
    retain(headers, |name| end_to_end(name, &listed));
}

/// Leaves in `headers` the values whose name `keep` accepts, in their order. The map is walked
/// once and what is kept moved to a new one: no header name is parsed, as removing each name
/// that goes would parse it.
fn retain(headers: &mut HeaderMap, keep: impl Fn(&HeaderName) -> bool) {
    let all = std::mem::take(headers);
    headers.reserve(all.len());
    let mut name = None;
    for (named, value) in all {
        // A name's further values come without it.
        if named.is_some() {
            name = named;
        }
        if let Some(name) = name.as_ref().filter(|name| keep(name)) {
            headers.append(name.clone(), value);
        }
    }
}

/// Header names that the `Connection` header marks as hop-by-hop for this message.
fn connection_listed(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
}

/// Headers the broker adds to a map built from stored pairs: its status headers on an answer,
/// credentials and the deadline on a send. Room for them is made at once, since a map that
/// grows rehashes every entry (about 3 % of a replay's CPU time, measured).
const ADDED_HEADERS: usize = 4;

pub fn to_header_map(pairs: &[(String, String)]) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(pairs.len() + ADDED_HEADERS);
    for (name, value) in pairs {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(&header_bytes(value)))
        {
            map.append(n, v);
        }
    }
    map
}

/// Puts an attempt's claim in the route's attempt header: `<record id>; claim=<token>;
/// attempt=<n>`. An upstream that keeps the highest claim it has seen per key can refuse an
/// attempt of an older claim that arrives late (docs/guarantees.md). Added at the send, never
/// stored.
pub(crate) fn tell_attempt(
    headers: &mut HeaderMap,
    name: Option<&HeaderName>,
    record: crate::domain::RecordId,
    claim: crate::domain::ClaimToken,
    attempt: u32,
) {
    if let Some(name) = name {
        let value = format!("{record}; claim={claim}; attempt={attempt}");
        headers.insert(name.clone(), HeaderValue::try_from(value).expect("a uuid and two numbers are a header value"));
    }
}

/// Puts an attempt's limit, in whole milliseconds, in the route's deadline header: added at the
/// send like the credentials, never stored, since every attempt has a limit of its own.
pub(crate) fn tell_deadline(headers: &mut HeaderMap, name: Option<&HeaderName>, limit: Duration) {
    if let Some(name) = name {
        let ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
        headers.insert(name.clone(), HeaderValue::from(ms));
    }
}

/// The time a client gives its request in the route's deadline header: whole milliseconds, as
/// ASCII digits. Anything else (a sign, a fraction, several values) is not understood and is
/// ignored, so a client's typo never shortens its deadline to nothing.
pub(crate) fn client_deadline(headers: &HeaderMap, name: Option<&HeaderName>) -> Option<Duration> {
    let mut values = headers.get_all(name?).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let text = value.to_str().ok()?.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse::<u64>().ok().map(Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Names an upstream's answer may carry: its own, the hop-by-hop ones, and ones its
    /// `Connection` may name.
    const NAMES: [&str; 8] =
        ["x-kept", "x-listed", "keep-alive", "transfer-encoding", "upgrade", "te", "x-other", "date"];

    /// A map of `headers` (indices into `names`), with a `Connection` naming `connection`.
    fn map_of(names: &[&'static str], headers: &[(usize, String)], connection: &[&str]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(names[*name], HeaderValue::from_str(value).unwrap());
        }
        if !connection.is_empty() {
            map.append(http::header::CONNECTION, HeaderValue::from_str(&connection.join(",")).unwrap());
        }
        map
    }

    fn pairs(map: &HeaderMap) -> Vec<(String, String)> {
        map.iter().map(|(n, v)| (n.as_str().to_string(), v.to_str().unwrap().to_string())).collect()
    }

    proptest! {
        /// The same headers, in the same order.
        #[test]
        fn a_passed_answer_keeps_exactly_the_headers_a_stored_one_keeps(
            headers in proptest::collection::vec((0..NAMES.len(), "[a-z0-9 ]{0,8}"), 0..12),
            connection in proptest::collection::vec(prop_oneof![Just("X-Listed"), Just("x-other"), Just("close"), Just(" keep-alive ")], 0..3),
        ) {
            let mut map = map_of(&NAMES, &headers, &connection);
            let stored = storable_response_headers(&map);
            keep_end_to_end(&mut map);
            prop_assert_eq!(pairs(&map), stored);
        }

        /// The same headers, in the same order.
        #[test]
        fn a_passed_request_keeps_exactly_the_headers_a_stored_one_keeps(
            headers in proptest::collection::vec((0..REQUEST_NAMES.len(), "[a-z0-9 ]{0,8}"), 0..12),
            connection in proptest::collection::vec(prop_oneof![Just("X-Listed"), Just("x-other"), Just("close"), Just(" te ")], 0..3),
            forward_key: bool,
        ) {
            let mut map = map_of(&REQUEST_NAMES, &headers, &connection);
            let stored = forwardable_request_headers(&map, forward_key);
            keep_forwardable(&mut map, forward_key);
            prop_assert_eq!(pairs(&map), stored);
        }
    }

    /// Names a client's request may carry: its own, the hop-by-hop ones, the ones never sent
    /// upstream, its key, and ones its `Connection` may name.
    const REQUEST_NAMES: [&str; 10] = [
        "x-kept",
        "x-listed",
        "keep-alive",
        "te",
        "authorization",
        "cookie",
        "prefer",
        "idempotency-key",
        "x-other",
        "accept",
    ];
}
