//! The replay cache: done answers served from memory, with no database read.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;

use super::answers::{http_date, stored_response};
use super::EXPIRES_HEADER;
use crate::domain::{RouteName, Tenant, Timestamp};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::record::StoredResponse;

/// Answers of `done` records, kept in memory. A done record never changes until retention
/// deletes it — on every node alike — so its answer can be replayed without reading the
/// database, provided the entry expires no later than the record does.
pub struct Replays {
    cache: quick_cache::sync::Cache<Entry, Arc<Replay>, ByteWeight>,
}

/// A cache entry's key: a key is unique per tenant. Both are shared, so looking one up copies
/// two pointers and allocates nothing.
type Entry = (Tenant, IdempotencyKey);

pub struct Replay {
    pub(super) fingerprint: Fingerprint,
    pub(super) route: RouteName,
    /// The answer as every replay sends it: the stored status, headers and body, marked as a
    /// replay and with the key's end of retention. Built once, when the answer is kept, so that
    /// a replay copies a header table instead of parsing and checking each stored header again.
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    /// No later than the record's own end of retention.
    pub(super) expires_at: Timestamp,
}

impl Replay {
    pub fn new(fingerprint: Fingerprint, route: RouteName, response: &StoredResponse, expires_at: Timestamp) -> Replay {
        let (mut parts, _) = stored_response(response, true).into_parts();
        parts.headers.insert(EXPIRES_HEADER, http_date(expires_at));
        Replay {
            fingerprint,
            route,
            status: parts.status,
            headers: parts.headers,
            body: response.body.clone(),
            expires_at,
        }
    }

    /// The answer to a duplicate.
    pub fn answer(&self) -> Response {
        let mut response = Response::new(Body::from(self.body.clone()));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers.clone();
        response
    }
}

#[derive(Clone)]
pub struct ByteWeight;

/// What the allocator adds to each block it hands out: its header, and rounding to 16 bytes.
const PER_ALLOCATION: usize = 24;

/// An entry's weight is the memory it holds, so that the cache's budget is what it costs: its
/// bytes, and the parts and allocations around them. Measured when entries kept the stored
/// header list (an answer of 60 bytes with two headers: about 660 estimated, against 671 bytes
/// of resident memory per entry over 200,000); the header table is counted the same way, with
/// each entry's name and value, and its slot and index.
impl quick_cache::Weighter<Entry, Arc<Replay>> for ByteWeight {
    fn weight(&self, (tenant, key): &Entry, replay: &Arc<Replay>) -> u64 {
        let headers: usize = replay.headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 2 * PER_ALLOCATION).sum();
        let text = tenant.len() + key.as_str().len() + replay.route.len() + replay.body.len() + headers;
        // The cache's slot, the shared Replay (and its two counts), the header table's slots
        // and index; the key, the Replay, its route, the table's two arrays and the body are an
        // allocation each.
        let slot = size_of::<(HeaderName, HeaderValue)>() + 3 * size_of::<usize>();
        let parts = size_of::<(Entry, Arc<Replay>)>()
            + size_of::<Replay>()
            + 2 * size_of::<usize>()
            + replay.headers.capacity() * (slot + size_of::<u32>());
        (text + parts + 6 * PER_ALLOCATION) as u64
    }
}

impl Replays {
    /// At most `bytes` of answers are kept; the least recently useful go first.
    pub fn new(bytes: u64) -> Replays {
        Replays { cache: quick_cache::sync::Cache::with_weighter(16 * 1024, bytes, ByteWeight) }
    }

    pub(super) fn get(&self, tenant: &Tenant, key: &IdempotencyKey, now: Timestamp) -> Option<Arc<Replay>> {
        self.cache.get(&(tenant.clone(), key.clone())).filter(|r| r.expires_at > now)
    }

    pub(super) fn keep(&self, tenant: &Tenant, key: &IdempotencyKey, replay: Replay) {
        self.cache.insert((tenant.clone(), key.clone()), Arc::new(replay));
    }
}

#[cfg(test)]
mod tests {
    use quick_cache::Weighter;

    use super::*;
    use crate::problem::{SHOULD_RETRY_HEADER, STATUS_HEADER};

    fn stored(body: &'static [u8]) -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into()), ("x-request-id".into(), "req_1".into())],
            body: Bytes::from_static(body),
        }
    }

    fn replay(body: &'static [u8]) -> Replay {
        let fingerprint = Fingerprint::of("payments", "POST", "/payments", "", None, b"{}");
        Replay::new(fingerprint, RouteName::from("payments"), &stored(body), Timestamp::from_millis(1_800_000_000_000))
    }

    #[test]
    fn a_replay_is_the_stored_answer_marked_as_a_replay_until_its_key_expires() {
        let answer = replay(br#"{"id":"ch_1"}"#).answer();
        assert_eq!(answer.status(), StatusCode::CREATED);
        let headers = answer.headers();
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(headers["x-request-id"], "req_1");
        assert_eq!(headers[STATUS_HEADER], "done");
        assert_eq!(headers[SHOULD_RETRY_HEADER], "false");
        assert_eq!(headers[super::super::REPLAYED_HEADER], "true");
        assert_eq!(headers[EXPIRES_HEADER], "Fri, 15 Jan 2027 08:00:00 GMT");
    }

    #[test]
    fn an_entry_weighs_at_least_the_bytes_it_holds_and_each_body_byte_once() {
        let entry: Entry = (Tenant::from("acme"), IdempotencyKey::parse("key-1").unwrap());
        let small = ByteWeight.weight(&entry, &Arc::new(replay(b"{}")));
        let large = ByteWeight.weight(&entry, &Arc::new(replay(&[b'x'; 1002])));
        let replay = replay(b"{}");
        let header_bytes: usize = replay.headers.iter().map(|(n, v)| n.as_str().len() + v.len()).sum();
        assert!(small as usize > header_bytes + "acme".len() + "key-1".len() + "payments".len() + 2);
        assert_eq!(large - small, 1000);
    }
}
