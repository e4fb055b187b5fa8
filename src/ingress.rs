//! The data plane (SPEC §3): a request comes in, is matched to a route, authenticated, keyed and
//! fingerprinted, recorded, and answered — by a fresh execution, a replay, or a problem.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State as AxumState};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use tokio::sync::oneshot;
use tracing::Instrument;
use uuid::Uuid;

use crate::config::{Config, Route};
use crate::credentials;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyError};
use crate::metrics;
use crate::policy::StopReason;
use crate::policy::{outcome_eta, Pending};
use crate::problem::{Problem, SHOULD_RETRY_HEADER, STATUS_HEADER};
use crate::record::{duration_ms, now_ms, HistoryEntry, Millis, Phase, Record, State, StoredRequest, StoredResponse};
use crate::store::{Admission, Cancelled, NewRecord, Store};
use crate::tally::Tally;
use crate::upstream::{self, Upstream};
use crate::worker::{Outcome, Refusal, Reservation, Settled, Slot, Worker};

pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The longest `Prefer: wait=N` honoured, in seconds.
const MAX_WAIT_SECS: u64 = 300;
/// How often a waiting request re-reads its record anyway, should an announcement of its
/// settlement by another node be lost.
const WAIT_POLL: Duration = Duration::from_secs(1);

pub struct Ingress {
    pub config: Arc<Config>,
    pub store: Arc<dyn Store>,
    pub worker: Worker,
    pub settled: Arc<Settled>,
    pub upstream: Upstream,
    pub replays: Replays,
    /// Replays and 409s, counted for `/admin/stats`.
    pub tally: Arc<Tally>,
}

/// Answers of `done` records, kept in memory. A done record never changes until retention
/// deletes it — on every node alike — so its answer can be replayed without reading the
/// database, provided the entry expires no later than the record does.
pub struct Replays {
    cache: quick_cache::sync::Cache<String, Arc<Replay>, ByteWeight>,
}

pub struct Replay {
    fingerprint: Fingerprint,
    route: String,
    response: StoredResponse,
    /// No later than the record's own end of retention.
    expires_at: Millis,
}

#[derive(Clone)]
pub struct ByteWeight;

/// What the allocator adds to each block it hands out: its header, and rounding to 16 bytes.
const PER_ALLOCATION: usize = 24;

/// An entry's weight is the memory it holds, so that the cache's budget is what it costs: its
/// bytes, and the parts and allocations around them. For an answer of 60 bytes with two
/// headers that is 652, against 671 bytes of resident memory per entry measured over 200,000.
impl quick_cache::Weighter<String, Arc<Replay>> for ByteWeight {
    fn weight(&self, key: &String, replay: &Arc<Replay>) -> u64 {
        let response = &replay.response;
        let headers: usize = response.headers.iter().map(|(n, v)| n.len() + v.len() + 2 * PER_ALLOCATION).sum();
        let text = key.len() + replay.route.len() + response.body.len() + headers;
        // The cache's slot, the shared Replay (and its two counts), the header list; the key,
        // the Replay, its route, its header list and its body are an allocation each.
        let parts = size_of::<(String, Arc<Replay>)>()
            + size_of::<Replay>()
            + 2 * size_of::<usize>()
            + response.headers.len() * size_of::<(String, String)>();
        (text + parts + 5 * PER_ALLOCATION) as u64
    }
}

impl Replays {
    /// At most `bytes` of answers are kept; the least recently useful go first.
    pub fn new(bytes: u64) -> Replays {
        Replays { cache: quick_cache::sync::Cache::with_weighter(16 * 1024, bytes, ByteWeight) }
    }

    fn id(tenant: &str, key: &str) -> String {
        format!("{tenant}\u{0}{key}")
    }

    fn get(&self, tenant: &str, key: &str, now: Millis) -> Option<Arc<Replay>> {
        self.cache.get(&Replays::id(tenant, key)).filter(|r| r.expires_at > now)
    }

    fn keep(&self, tenant: &str, key: &str, replay: Replay) {
        self.cache.insert(Replays::id(tenant, key), Arc::new(replay));
    }
}

pub fn router(ingress: Arc<Ingress>) -> Router {
    Router::new()
        .route("/_idem/requests/{*key}", get(show_request).delete(cancel_request))
        .fallback(handle)
        .with_state(ingress)
}

/// A client's preferences (RFC 7240). Unknown or malformed preferences are ignored.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Prefer {
    respond_async: bool,
    wait: Option<Duration>,
}

impl Prefer {
    fn from_headers(headers: &HeaderMap) -> Prefer {
        let mut prefer = Prefer::default();
        for token in headers.get_all("prefer").iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')) {
            let token = token.split(';').next().unwrap_or("").trim();
            let (name, value) = match token.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim().trim_matches('"'))),
                None => (token, None),
            };
            if name.eq_ignore_ascii_case("respond-async") {
                prefer.respond_async = true;
            } else if name.eq_ignore_ascii_case("wait") {
                if let Some(secs) = value.and_then(|v| v.parse::<u64>().ok()) {
                    prefer.wait = Some(Duration::from_secs(secs.min(MAX_WAIT_SECS)));
                }
            }
        }
        prefer
    }
}

async fn handle(AxumState(app): AxumState<Arc<Ingress>>, request: Request) -> Response {
    let arrival = now_ms();
    let path = request.uri().path().to_string();
    if let Err(why) = crate::path::check(&path) {
        return Problem::invalid_path(&why).into_response();
    }
    let Some(route) = app.config.route_for(&path) else {
        return Problem::no_route(&path).into_response();
    };
    let route = route.clone();
    let sent_key = request.headers().get(crate::key::HEADER).cloned();
    let keyed_method = route.methods.contains(request.method());
    let keyed = keyed_method && (sent_key.is_some() || route.require_key);
    if keyed_method && !keyed {
        metrics::unkeyed(&route.name);
    }
    let answer = match credentials::tenant(&app.config, request.headers()) {
        Err(p) => Err(p),
        Ok(tenant) if keyed => {
            // One span per logical request; its executions and attempts are logged beneath it.
            let span = tracing::info_span!("request", %tenant, route = %route.name, method = %request.method());
            app.keyed(route, tenant, request, arrival).instrument(span).await
        }
        Ok(_) => Ok(app.plain(&route, request).await),
    };
    let mut response = match answer {
        Ok(response) => response,
        Err(problem) if keyed && problem.idempotency_status.is_none() => {
            problem.state(State::NotStarted).into_response()
        }
        Err(problem) => problem.into_response(),
    };
    if keyed {
        let headers = response.headers_mut();
        // The key the answer is for, so that a client whose SDK made it up can find its record.
        if let Some(key) = sent_key.filter(|k| IdempotencyKey::parse_header(k.as_bytes()).is_ok()) {
            headers.insert(crate::key::HEADER, key);
        }
        // An answer that says nothing else is final: the upstream's, or the broker's own.
        headers.entry(SHOULD_RETRY_HEADER).or_insert(HeaderValue::from_static("false"));
    }
    response
}

async fn read_body(body: Body, limit: usize) -> Result<Bytes, Problem> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large = std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
        if too_large {
            Problem::too_large(limit)
        } else {
            Problem::bad_request("unreadable-body", "The request body could not be read completely.")
        }
    })
}

impl Ingress {
    async fn keyed(
        &self,
        route: Route,
        tenant: String,
        request: Request,
        arrival: Millis,
    ) -> Result<Response, Problem> {
        let (parts, body) = request.into_parts();
        let key = IdempotencyKey::from_headers(&parts.headers).map_err(|e| match e {
            KeyError::Missing => Problem::missing_key(),
            KeyError::Invalid(why) => Problem::invalid_key(why),
        })?;
        let declared =
            parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > route.max_body as u64) {
            return Err(Problem::too_large(route.max_body));
        }
        let query = parts.uri.query().unwrap_or("");
        // A path the upstream would not receive as matched is refused before anything is recorded.
        route.upstream_url(parts.uri.path(), query).map_err(|why| Problem::invalid_path(&why))?;
        let body = read_body(body, route.max_body).await?;
        let fingerprint = Fingerprint::of(
            &route.name,
            parts.method.as_str(),
            parts.uri.path(),
            query,
            parts.headers.get(header::CONTENT_TYPE).map(|v| v.as_bytes()),
            &body,
        );
        let prefer = Prefer::from_headers(&parts.headers);
        let new = NewRecord {
            // Time-ordered: ids of new records land at the end of the id index, not all over it.
            id: Uuid::now_v7(),
            tenant,
            key: key.as_str().to_string(),
            route: route.name.clone(),
            method: parts.method.as_str().to_string(),
            path: parts.uri.path().to_string(),
            query: query.to_string(),
            fingerprint,
            request: StoredRequest {
                headers: upstream::forwardable_request_headers(&parts.headers, route.forward_idempotency_key),
                body,
            },
            deadline_at: arrival + duration_ms(route.retry.deadline),
            now: arrival,
            claim: None,
        };

        // A replay known to this node needs no database at all.
        if let Some(replay) = self.replays.get(&new.tenant, &new.key, arrival) {
            if replay.fingerprint != fingerprint {
                metrics::answered(&route.name, "key_reused");
                return Err(Problem::key_reused().state(State::Done));
            }
            metrics::answered(&replay.route, "replay");
            self.tally.replay(&replay.route);
            return Ok(stored_response(&replay.response, true));
        }
        // A new execution is shed here, before anything is recorded, if the route is saturated
        // or its upstream's circuit is open — unless the key exists: its record answers then.
        let slot = match self.worker.guards().enter(&route) {
            Ok(slot) => slot,
            Err(refusal) => {
                let existing = self.store.lookup(&new.tenant, &new.key).await.map_err(|e| Problem::store(&e))?;
                match existing {
                    Some(record) if !self.expired(&record) && record.phase() != Phase::Free => {
                        return self.answer_record(&route, record, fingerprint, prefer).await;
                    }
                    _ => return Err(self.refused(&route, refusal)),
                }
            }
        };
        // With a worker free right now, record it already claimed and its first attempt marked:
        // one commit before the send instead of three.
        let reservation = self.worker.reserve(&route.name);
        let new = NewRecord { claim: reservation.as_ref().map(|_| self.worker.claim(now_ms())), ..new };
        let record = match self.store.admit(new, self.retention_cutoff()).await.map_err(|e| Problem::store(&e))? {
            Admission::Created(record) | Admission::Requeued(record) => {
                metrics::request(&route.name);
                if route.forward_authorization {
                    let credential = parts.headers.get(header::AUTHORIZATION).cloned();
                    self.worker.hold_credential(record.id, credential, record.deadline_at);
                }
                return Ok(self.execute(record, slot, reservation, prefer).await);
            }
            Admission::Existing(record) => record,
        };
        drop((slot, reservation));
        self.answer_record(&route, record, fingerprint, prefer).await
    }

    /// The answer for a request whose key already has a record it does not own.
    async fn answer_record(
        &self,
        route: &Route,
        record: Record,
        fingerprint: Fingerprint,
        prefer: Prefer,
    ) -> Result<Response, Problem> {
        if record.fingerprint != fingerprint {
            metrics::answered(&route.name, "key_reused");
            return Err(Problem::key_reused().state(record.state));
        }
        Ok(self.answer_existing(record, prefer.wait).await)
    }

    fn refused(&self, route: &Route, refusal: Refusal) -> Problem {
        match refusal {
            Refusal::Overloaded => {
                metrics::answered(&route.name, "overloaded");
                Problem::overloaded()
            }
            Refusal::CircuitOpen(wait) => {
                metrics::answered(&route.name, "circuit_open");
                Problem::circuit_open(wait.as_secs_f64().ceil() as u64)
            }
        }
    }

    fn retention_cutoff(&self) -> Millis {
        now_ms() - duration_ms(self.config.store.retention)
    }

    fn expired(&self, record: &Record) -> bool {
        record.state == State::Done && record.updated_at < self.retention_cutoff()
    }

    /// This request owns the record: hand it to a worker and answer with the outcome.
    async fn execute(&self, record: Record, slot: Slot, reservation: Option<Reservation>, prefer: Prefer) -> Response {
        // Admitted claimed only when the insert was fresh; a requeued record waits its turn.
        let reservation = reservation.filter(|_| record.state == State::InProgress);
        let start = |record: Record, reply| match reservation {
            Some(reservation) => self.worker.start(record, slot, reservation, reply),
            None => self.worker.submit(record, Some(slot), reply),
        };
        if prefer.respond_async {
            let location = format!("/_idem/requests/{}", crate::key::path_segment(&record.key));
            let body = record.to_json(false);
            let state = record.state;
            start(record, None);
            let mut response = (StatusCode::ACCEPTED, Json(body)).into_response();
            let headers = response.headers_mut();
            headers.insert(STATUS_HEADER, HeaderValue::from_static(state.as_str()));
            headers.insert("preference-applied", HeaderValue::from_static("respond-async"));
            if let Ok(v) = HeaderValue::from_str(&location) {
                headers.insert(header::LOCATION, v);
            }
            return response;
        }
        let (tx, rx) = oneshot::channel();
        let id = record.id;
        // What a replay of the outcome needs, taken before the record moves to the worker. The
        // record becomes done after it arrived, so its retention ends later than this entry's.
        let (tenant, key, route) = (record.tenant.clone(), record.key.clone(), record.route.clone());
        let fingerprint = record.fingerprint;
        let expires_at = record.created_at + duration_ms(self.config.store.retention);
        let patience = Duration::from_millis((record.deadline_at - now_ms()).max(0) as u64) + Duration::from_secs(5);
        start(record, Some(tx));
        match tokio::time::timeout(patience, rx).await {
            Ok(Ok(outcome)) if !matches!(outcome, Outcome::Lost) => {
                if let Outcome::Done(_, response) = &outcome {
                    let replay = Replay { fingerprint, route, response: response.clone(), expires_at };
                    self.replays.keep(&tenant, &key, replay);
                }
                outcome_response(outcome)
            }
            // Another worker (of this node or another) runs it: wait for it like a duplicate.
            _ => match self.store.get(id).await {
                Ok(Some(record)) => {
                    let left = Duration::from_millis((record.deadline_at - now_ms()).max(0) as u64);
                    // Its outcome answers this request first-hand: it is not a replay.
                    self.answer(record, Some(left + Duration::from_secs(1)), false).await
                }
                Ok(None) => Problem::not_found().into_response(),
                Err(e) => Problem::store(&e).into_response(),
            },
        }
    }

    /// A request for a key this request does not own (same fingerprint): replay, wait, refuse.
    async fn answer_existing(&self, record: Record, wait: Option<Duration>) -> Response {
        self.answer(record, wait, true).await
    }

    /// Answers from the record, after waiting up to `wait` for it to settle. A `done` answer is
    /// marked as a replay unless this request is the one whose execution produced it.
    async fn answer(&self, mut record: Record, wait: Option<Duration>, replay: bool) -> Response {
        if let (Some(wait), Phase::Queued | Phase::InProgress) = (wait, record.phase()) {
            match self.wait_for(record.id, wait).await {
                Ok(Some(settled)) => record = settled,
                Ok(None) => return Problem::not_found().into_response(),
                Err(problem) => return problem.into_response(),
            }
        }
        let kind = match record.phase() {
            Phase::Done => "replay",
            Phase::Unknown => "unknown",
            Phase::Queued | Phase::InProgress => "in_progress",
            Phase::Free => "freed",
        };
        if replay {
            metrics::answered(&record.route, kind);
            match record.phase() {
                Phase::Done => self.tally.replay(&record.route),
                Phase::Queued | Phase::InProgress => self.tally.conflict(&record.route),
                Phase::Unknown | Phase::Free => {}
            }
        }
        match record.phase() {
            Phase::Done => match &record.response {
                Some(response) => {
                    let kept = Replay {
                        fingerprint: record.fingerprint,
                        route: record.route.clone(),
                        response: response.clone(),
                        // A done record is not updated again: this is when it became done.
                        expires_at: record.updated_at + duration_ms(self.config.store.retention),
                    };
                    self.replays.keep(&record.tenant, &record.key, kept);
                    stored_response(response, replay)
                }
                None => Problem::outcome_unknown().state(State::Done).into_response(),
            },
            Phase::Unknown => Problem::outcome_unknown().state(State::Unknown).into_response(),
            Phase::Queued | Phase::InProgress => {
                let pending = Pending {
                    now: now_ms(),
                    in_flight_since: record.in_flight.map(|(_, started)| started),
                    next_attempt_at: record.not_before,
                    deadline_at: record.deadline_at,
                };
                let eta = outcome_eta(pending, self.worker.pace().typical(&record.route));
                Problem::in_progress(eta).state(record.state).into_response()
            }
            // Freed while we waited: the client may send it again, and it will execute afresh.
            Phase::Free => match record.stop_reason {
                Some(StopReason::Cancelled) => Problem::cancelled().state(State::NotStarted).into_response(),
                Some(StopReason::Deadline) => Problem::deadline_exceeded().state(State::NotStarted).into_response(),
                _ => Problem::upstream_unavailable("the upstream did not execute it")
                    .retry_after(1)
                    .state(State::NotStarted)
                    .into_response(),
            },
        }
    }

    /// Waits up to `max` for a record to leave `in_progress`/queued; `None` if it disappeared.
    async fn wait_for(&self, id: Uuid, max: Duration) -> Result<Option<Record>, Problem> {
        let until = tokio::time::Instant::now() + max;
        // Another node may settle it: have it announced.
        self.store.watch(id).await.map_err(|e| Problem::store(&e))?;
        // At shutdown, waiting ends: the client is answered with where its request stands.
        let mut stopping = self.worker.stopping();
        loop {
            let watch = self.settled.watch(id);
            let notified = watch.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let record = self.store.get(id).await.map_err(|e| Problem::store(&e))?;
            let Some(record) = record else {
                return Ok(None);
            };
            let now = tokio::time::Instant::now();
            let pending = matches!(record.phase(), Phase::Queued | Phase::InProgress);
            if !pending || now >= until || *stopping.borrow_and_update() {
                return Ok(Some(record));
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep((until - now).min(WAIT_POLL)) => {}
                _ = stopping.changed() => {}
            }
        }
    }

    /// Methods that need no key are proxied as they are: nothing is recorded.
    async fn plain(&self, route: &Route, request: Request) -> Response {
        let (parts, body) = request.into_parts();
        let url = match route.upstream_url(parts.uri.path(), parts.uri.query().unwrap_or("")) {
            Ok(url) => url,
            Err(why) => return Problem::invalid_path(&why).into_response(),
        };
        let body = match read_body(body, route.max_body).await {
            Ok(body) => body,
            Err(problem) => return problem.into_response(),
        };
        let headers = upstream::forwardable_request_headers(&parts.headers, true);
        let mut credentials = route.upstream_headers.clone();
        if let Some(credential) = parts.headers.get(header::AUTHORIZATION).filter(|_| route.forward_authorization) {
            credentials.insert(header::AUTHORIZATION, credential.clone());
        }
        match self.upstream.send(parts.method.as_str(), url, &headers, &credentials, body, route.retry.deadline).await {
            Ok(answer) => response_of(&answer.response),
            Err(crate::policy::Observed::TimedOut) => Problem::deadline_exceeded().into_response(),
            Err(_) => Problem::upstream_unavailable("it could not be reached").retry_after(1).into_response(),
        }
    }
}

/// The answer for the request that drove an execution.
fn outcome_response(outcome: Outcome) -> Response {
    match outcome {
        Outcome::Done(StopReason::Deadline, _) => Problem::deadline_exceeded().state(State::Done).into_response(),
        Outcome::Done(_, response) => stored_response(&response, false),
        Outcome::Unknown(_) => Problem::outcome_unknown().state(State::Unknown).into_response(),
        Outcome::Free(stop, Some(last)) => {
            let mut response = response_of(&last);
            let headers = response.headers_mut();
            headers.insert(STATUS_HEADER, HeaderValue::from_static(State::NotStarted.as_str()));
            // The broker has retried already; only an upstream that asked for more time than the
            // deadline left is worth asking again, later.
            let again = stop == StopReason::RetryAfterBeyondDeadline;
            headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static(if again { "true" } else { "false" }));
            response
        }
        Outcome::Free(stop, None) => {
            let problem = match stop {
                StopReason::Deadline => Problem::deadline_exceeded(),
                StopReason::Cancelled => Problem::cancelled(),
                StopReason::CircuitOpen => Problem::upstream_unavailable("its circuit breaker is open").retry_after(1),
                StopReason::RetryBudget => {
                    Problem::upstream_unavailable("the route's retry budget is spent").retry_after(1)
                }
                StopReason::RetryAfterBeyondDeadline => {
                    Problem::upstream_unavailable("it asked to be called again later than the deadline allowed")
                        .retry_after(1)
                        .retryable()
                }
                _ => Problem::upstream_unavailable("it could not be reached").retry_after(1),
            };
            problem.state(State::NotStarted).into_response()
        }
        Outcome::Lost => Problem::in_progress(Duration::from_secs(1)).state(State::InProgress).into_response(),
    }
}

/// A stored response, as the upstream gave it; replays are marked.
fn stored_response(stored: &StoredResponse, replayed: bool) -> Response {
    let mut response = response_of(stored);
    let headers = response.headers_mut();
    headers.insert(STATUS_HEADER, HeaderValue::from_static(State::Done.as_str()));
    headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static("false"));
    if replayed {
        headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    response
}

fn response_of(stored: &StoredResponse) -> Response {
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    *response.headers_mut() = upstream::to_header_map(&stored.headers);
    response
}

// ---- /_idem/requests/{key} -----------------------------------------------------------------

async fn find(app: &Ingress, headers: &HeaderMap, key: &str) -> Result<Record, Problem> {
    let tenant = credentials::tenant(&app.config, headers)?;
    let key = IdempotencyKey::parse(key).map_err(|e| match e {
        KeyError::Missing => Problem::missing_key(),
        KeyError::Invalid(why) => Problem::invalid_key(why),
    })?;
    match app.store.lookup(&tenant, key.as_str()).await {
        Ok(Some(record)) if !app.expired(&record) => Ok(record),
        Ok(_) => Err(Problem::not_found()),
        Err(e) => Err(Problem::store(&e)),
    }
}

fn record_response(status: StatusCode, record: &Record) -> Response {
    let mut response = (status, Json(record.to_json(true))).into_response();
    response.headers_mut().insert(STATUS_HEADER, HeaderValue::from_static(record.state.as_str()));
    response
}

async fn show_request(
    AxumState(app): AxumState<Arc<Ingress>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    match find(&app, &headers, &key).await {
        Ok(record) => record_response(StatusCode::OK, &record),
        Err(problem) => problem.into_response(),
    }
}

async fn cancel_request(
    AxumState(app): AxumState<Arc<Ingress>>,
    Path(key): Path<String>,
    headers: HeaderMap,
) -> Response {
    let record = match find(&app, &headers, &key).await {
        Ok(record) => record,
        Err(problem) => return problem.into_response(),
    };
    let entry =
        HistoryEntry { at: now_ms(), actor: format!("client:{}", record.tenant), action: "cancel".into(), note: None };
    match app.store.cancel(record.id, entry).await {
        Ok(Cancelled::Dequeued(record)) => {
            app.settled.settled(record.id);
            record_response(StatusCode::OK, &record)
        }
        Ok(Cancelled::Flagged(record)) => {
            app.worker.cancel(record.id);
            record_response(StatusCode::ACCEPTED, &record)
        }
        Ok(Cancelled::Refused(record)) => Problem::not_cancellable(record.state).into_response(),
        Ok(Cancelled::Missing) => Problem::not_found().into_response(),
        Err(e) => Problem::store(&e).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefer(values: &[&str]) -> Prefer {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("prefer", v.parse().unwrap());
        }
        Prefer::from_headers(&h)
    }

    #[test]
    fn preferences_are_read_leniently() {
        assert_eq!(prefer(&[]), Prefer::default());
        assert!(prefer(&["respond-async"]).respond_async);
        assert_eq!(prefer(&["wait=10"]).wait, Some(Duration::from_secs(10)));
        let both = prefer(&["Respond-Async, wait=3"]);
        assert!(both.respond_async && both.wait == Some(Duration::from_secs(3)));
        assert_eq!(prefer(&["wait=forever"]).wait, None);
        assert_eq!(prefer(&["wait=-1"]).wait, None);
        assert_eq!(prefer(&["wait=99999"]).wait, Some(Duration::from_secs(MAX_WAIT_SECS)));
    }
}
