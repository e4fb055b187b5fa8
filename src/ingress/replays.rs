//! The replay cache: done answers served from memory, with no database read.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;

use super::answers::{http_date, mark_done, response_of};
use super::EXPIRES_HEADER;
use crate::domain::fingerprint::Fingerprint;
use crate::domain::key::IdempotencyKey;
use crate::domain::{RecordId, RouteName, Tenant, Timestamp};
use crate::record::StoredResponse;

/// Answers of `done` records, kept in memory. A done record never changes until retention
/// deletes it — on every node alike — so its answer can be replayed without reading the
/// database, provided the entry expires no later than the record does.
pub(crate) struct Replays {
    cache: quick_cache::sync::Cache<Entry, Arc<Replay>, ByteWeight>,
}

/// A cache entry's key: a key is unique per tenant. Both are shared, so looking one up copies
/// two pointers and allocates nothing.
type Entry = (Tenant, IdempotencyKey);

pub struct Replay {
    /// The record whose answer it is, for the access log.
    pub(super) record: RecordId,
    pub(super) fingerprint: Fingerprint,
    pub(super) route: RouteName,
    /// The stored answer, its headers checked once, when it is kept: a replay copies them
    /// instead of parsing each one again. They are kept as a list, not as the header table a
    /// response holds, whose slots and index would cost an entry more memory than a replay
    /// saves time.
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Bytes,
    /// No later than the record's own end of retention.
    pub(super) expires_at: Timestamp,
    /// The same, as the answer tells it.
    expires: HeaderValue,
}

impl Replay {
    /// The answer `response` of the request fingerprinted `fingerprint` on `route`, replayed
    /// until `expires_at`.
    pub fn new(
        record: RecordId,
        fingerprint: Fingerprint,
        route: RouteName,
        response: &StoredResponse,
        expires_at: Timestamp,
    ) -> Replay {
        let (parts, _) = response_of(response).into_parts();
        let mut headers = Vec::with_capacity(parts.headers.len());
        // A name's further values come without it.
        let mut name = None;
        headers.extend(parts.headers.into_iter().filter_map(|(named, value)| {
            name = named.or(name.take());
            Some((name.clone()?, value))
        }));
        let (status, body, expires) = (parts.status, response.body.clone(), http_date(expires_at));
        Replay { record, fingerprint, route, status, headers, body, expires_at, expires }
    }

    /// The answer to a duplicate: the stored one, marked as a replay, with the key's end of
    /// retention.
    pub fn answer(&self) -> Response {
        let mut response = Response::new(Body::from(self.body.clone()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.reserve(self.headers.len() + 4);
        for (name, value) in &self.headers {
            headers.append(name, value.clone());
        }
        mark_done(headers, true);
        headers.insert(EXPIRES_HEADER, self.expires.clone());
        response
    }
}

#[derive(Clone)]
pub(crate) struct ByteWeight;

/// What the allocator adds to each block it hands out: its header, and rounding to 16 bytes.
const PER_ALLOCATION: usize = 24;

/// An entry's weight is the memory it holds, so that the cache's budget is what it costs: its
/// bytes, and the parts and allocations around them. For an answer of 60 bytes with two
/// headers that came to about 660, against 671 bytes of resident memory per entry measured over
/// 200,000, when entries kept the stored header text. A checked header is counted the same way,
/// in a slot of its own size; that was not measured again.
impl quick_cache::Weighter<Entry, Arc<Replay>> for ByteWeight {
    fn weight(&self, (tenant, key): &Entry, replay: &Arc<Replay>) -> u64 {
        let headers: usize = replay.headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 2 * PER_ALLOCATION).sum();
        let text = tenant.len() + key.as_str().len() + replay.route.len() + replay.body.len() + headers;
        // The cache's slot, the shared Replay (and its two counts), the header list; the key,
        // the Replay, its route, its header list, its body and its expiry's text are an
        // allocation each.
        let parts = size_of::<(Entry, Arc<Replay>)>()
            + size_of::<Replay>()
            + 2 * size_of::<usize>()
            + replay.headers.capacity() * size_of::<(HeaderName, HeaderValue)>()
            + replay.expires.len();
        (text + parts + 6 * PER_ALLOCATION) as u64
    }
}

impl Replays {
    /// At most `bytes` of answers are kept; the least recently useful go first.
    pub(crate) fn new(bytes: u64) -> Replays {
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
            headers: vec![
                ("content-type".into(), "application/json".into()),
                ("set-cookie".into(), "a=1".into()),
                ("x-request-id".into(), "req_1".into()),
                ("set-cookie".into(), "b=2".into()),
            ],
            body: Bytes::from_static(body),
        }
    }

    fn replay(body: &'static [u8]) -> Replay {
        let fingerprint = Fingerprint::of("payments", "POST", "/payments", "", None, b"{}");
        let record = RecordId(uuid::Uuid::nil());
        Replay::new(
            record,
            fingerprint,
            RouteName::from("payments"),
            &stored(body),
            Timestamp::from_millis(1_800_000_000_000),
        )
    }

    #[test]
    fn a_replay_is_the_stored_answer_marked_as_a_replay_until_its_key_expires() {
        let answer = replay(br#"{"id":"ch_1"}"#).answer();
        assert_eq!(answer.status(), StatusCode::CREATED);
        let headers = answer.headers();
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(headers["x-request-id"], "req_1");
        let cookies: Vec<_> = headers.get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"], "every value of a repeated header, in order");
        assert_eq!(headers[STATUS_HEADER], "done");
        assert_eq!(headers[SHOULD_RETRY_HEADER], "false");
        assert_eq!(headers[crate::ingress::REPLAYED_HEADER], "true");
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
