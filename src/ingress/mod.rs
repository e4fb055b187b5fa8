//! The data plane (docs/concepts.md): a request comes in, is matched to a route, authenticated, keyed and
//! fingerprinted, recorded, and answered — by a fresh execution, a replay, or a problem.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State as AxumState};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use tokio::sync::{oneshot, watch};
use tracing::Instrument;

use crate::clock::SharedClock;
use crate::config::{Config, Live, Route};
use crate::credentials;
use crate::derived;
use crate::domain::AnswerKind;
use crate::domain::{Phase, State, Tenant, Timestamp};
use crate::edge::body::BodyBudget;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyError};
use crate::metrics;
use crate::policy::{outcome_eta, Pending};
use crate::prefer::Prefer;
use crate::problem::{Problem, SHOULD_RETRY_HEADER, STATUS_HEADER};
use crate::record::{Record, StoredRequest, StoredResponse};
use crate::runtime::Runtimes;
use crate::store::{Health, NewRecord, Store};
use crate::switch::SwitchAction;
use crate::switchboard::Switches;
use crate::upstream::Upstream;
use crate::worker::{self, Admit, Admitted, Outcome, Refusal, Worker};

/// What a keyed request was read with: the configuration in force when it arrived, its route
/// there, its head, and when it arrived.
struct Read<'a> {
    config: &'a Arc<Config>,
    route: &'a Route,
    parts: &'a http::request::Parts,
    arrival: Timestamp,
}

pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// Until when the answer's key has its result replayed (an HTTP-date).
pub const EXPIRES_HEADER: &str = "idempotency-key-expires";

/// How often a waiting request re-reads its record anyway, should an announcement of its
/// settlement by another node be lost.
const WAIT_POLL: Duration = Duration::from_secs(1);

pub struct Ingress {
    /// The configuration in force: each request reads it once, when it arrives, and is served
    /// by that snapshot to its end.
    config: Arc<Live>,
    store: Arc<dyn Store>,
    worker: Worker,
    upstream: Upstream,
    /// Done answers kept in memory, replayed without the store.
    replays: Replays,
    /// Request bodies held in memory at once, over all requests (`server.max_buffered_bodies`).
    bodies: Arc<BodyBudget>,
    /// The store's health as the checks last found it.
    health: Arc<Health>,
    /// Each route's runtime: its replays and 409s counted, the pace of its attempts.
    runtimes: Arc<Runtimes>,
    /// The operator's emergency switches: an isolated route takes no new key.
    switches: Arc<Switches>,
    /// What time it is: a request's arrival, its deadline, its key's retention.
    clock: SharedClock,
    /// Becomes true when the process begins to shut down: waiting requests are answered then.
    stopping: watch::Receiver<bool>,
}

/// What an [`Ingress`] is built on: the parts of the broker it shares with the others.
pub struct Parts {
    pub config: Arc<Live>,
    pub store: Arc<dyn Store>,
    /// The worker it hands executions to; the routes' runtimes and its shutdown come with it.
    pub worker: Worker,
    pub upstream: Upstream,
    pub bodies: Arc<BodyBudget>,
    pub health: Arc<Health>,
    pub switches: Arc<Switches>,
    pub clock: SharedClock,
    /// Bytes of done answers kept in memory for replays.
    pub replay_cache_bytes: u64,
}

impl Ingress {
    pub fn new(parts: Parts) -> Ingress {
        let Parts { config, store, worker, upstream, bodies, health, switches, clock, replay_cache_bytes } = parts;
        Ingress {
            runtimes: worker.runtimes(),
            stopping: worker.stopping(),
            replays: Replays::new(replay_cache_bytes),
            config,
            store,
            worker,
            upstream,
            bodies,
            health,
            switches,
            clock,
        }
    }
}

mod answers;
mod lifetime;
mod plain;
mod reading;
mod replays;
mod requests;

use answers::{http_date, outcome_response, stored_response, Answer};
use reading::{deadline, read_body, stored_headers};
pub use replays::{ByteWeight, Replay, Replays};
use requests::{cancel_request, list_routes, show_request};

pub fn router(ingress: Arc<Ingress>) -> Router {
    Router::new()
        .route("/_idem/requests/{*key}", get(show_request).delete(cancel_request))
        .route("/_idem/routes", get(list_routes))
        .fallback(handle)
        .with_state(ingress)
}

async fn handle(AxumState(app): AxumState<Arc<Ingress>>, request: Request) -> Response {
    let arrival = app.clock.now();
    let path = request.uri().path().to_string();
    if let Err(why) = crate::path::check(&path) {
        return Problem::invalid_path(&why).into_response();
    }
    let config = app.config.current();
    let Some(route) = config.route_for(&path) else {
        return Problem::no_route(&path).into_response();
    };
    let sent_key = request.headers().get(crate::key::HEADER).cloned();
    let keyed_method = route.methods.contains(request.method());
    let keyed = keyed_method && (sent_key.is_some() || route.require_key || !route.key_from.is_empty());
    if keyed_method && !keyed {
        metrics::unkeyed(&route.name);
    }
    let mut response = match credentials::tenant(&config, request.headers()) {
        Err(problem) if keyed => problem.state(State::NotStarted).into_response(),
        Err(problem) => problem.into_response(),
        Ok(tenant) if keyed => {
            // One span per logical request; its executions and attempts are logged beneath it.
            let span = tracing::info_span!("request", %tenant, route = %route.name, method = %request.method());
            app.keyed(&config, route, tenant, request, arrival).instrument(span).await
        }
        // An isolated route sends nothing upstream, recorded or not.
        Ok(_) => match app.isolation(&route.name) {
            Some(refusal) => {
                metrics::held_by_switch(&route.name, SwitchAction::Isolate);
                app.refused(route, refusal).into_response()
            }
            None => app.plain(route, request).await,
        },
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

impl Ingress {
    /// A request on a keyed route: its key (sent, or derived from the request), then its
    /// answer, which says which key it was for and until when that key's result is replayed.
    async fn keyed(
        &self,
        config: &Arc<Config>,
        route: &Route,
        tenant: Tenant,
        request: Request,
        arrival: Timestamp,
    ) -> Response {
        let (parts, body) = request.into_parts();
        let sent = match IdempotencyKey::from_headers(&parts.headers) {
            Ok(key) => Some(key),
            Err(KeyError::Missing) if !route.key_from.is_empty() => None,
            Err(KeyError::Missing) => return Problem::missing_key().state(State::NotStarted).into_response(),
            Err(KeyError::Invalid(why)) => return Problem::invalid_key(why).state(State::NotStarted).into_response(),
        };
        let query = parts.uri.query().unwrap_or("");
        // A path the upstream would not receive as matched is refused before anything is recorded.
        if let Err(why) = route.upstream_url(parts.uri.path(), query) {
            return self.keyed_answer(route, sent.as_ref(), Err(Problem::invalid_path(&why)));
        }
        // Held until this request is answered: its body lives at least that long.
        let (body, _held) = match read_body(body, route, &self.bodies).await {
            Ok(read) => read,
            Err(problem) => return self.keyed_answer(route, sent.as_ref(), Err(problem)),
        };
        // Fields that change on every retry (a timestamp, a nonce) do not make another request:
        // they count neither in the fingerprint nor in a derived key.
        let kept = derived::without_ignored(&body, &route.fingerprint_ignore);
        let essential = kept.as_deref().unwrap_or(&body);
        let (key, derived) = match sent {
            Some(key) => (key, false),
            None => match derived::key(route, &tenant, &parts.headers, essential) {
                Ok(key) => (key, true),
                Err(missing) => return Problem::missing_key_source(&missing).state(State::NotStarted).into_response(),
            },
        };
        let fingerprint = Fingerprint::of(
            &route.name,
            parts.method.as_str(),
            parts.uri.path(),
            parts.uri.query().unwrap_or(""),
            parts.headers.get(header::CONTENT_TYPE).map(|v| v.as_bytes()),
            essential,
        );
        let read = Read { config, route, parts: &parts, arrival };
        let answer = self.execute_keyed(read, tenant, body, &key, fingerprint).await;
        let mut response = self.keyed_answer(route, Some(&key), answer);
        if derived {
            if let Ok(value) = HeaderValue::from_str(key.as_str()) {
                response.headers_mut().insert(crate::key::HEADER, value);
            }
        }
        response
    }

    /// An answer on a keyed route: a problem names the key and its record; every answer says
    /// until when the key's result is replayed (no earlier than a result made now would be).
    fn keyed_answer(&self, route: &Route, key: Option<&IdempotencyKey>, answer: Result<Response, Problem>) -> Response {
        let mut response = match answer {
            Ok(response) => response,
            Err(mut problem) => {
                problem.idempotency_status.get_or_insert(State::NotStarted);
                match key {
                    Some(key) => problem.for_key(key.as_str()).into_response(),
                    None => problem.into_response(),
                }
            }
        };
        if key.is_some() && !response.headers().contains_key(EXPIRES_HEADER) {
            let until = self.clock.now() + route.retention;
            response.headers_mut().insert(EXPIRES_HEADER, http_date(until));
        }
        response
    }

    /// Keeps a done record's answer in memory, so that its duplicates on this node are replayed
    /// without the database until `expires_at`.
    fn keep_for_replays(&self, record: &Record, response: &StoredResponse, expires_at: Timestamp) {
        let replay = Replay {
            fingerprint: record.fingerprint,
            route: record.route.clone(),
            response: response.clone(),
            expires_at,
        };
        self.replays.keep(&record.tenant, &record.key, replay);
    }

    async fn execute_keyed(
        &self,
        read: Read<'_>,
        tenant: Tenant,
        body: Bytes,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
    ) -> Answer {
        let Read { config, route, parts, arrival } = read;
        // A replay known to this node needs no database at all, nor anything a new record does.
        if let Some(replay) = self.replays.get(&tenant, key, arrival) {
            if replay.fingerprint != fingerprint {
                metrics::answered(&route.name, AnswerKind::KeyReused);
                return Err(Problem::key_reused().state(State::Done));
            }
            metrics::answered(&replay.route, AnswerKind::Replay);
            self.runtimes.count_replay(&replay.route);
            let mut response = stored_response(&replay.response, true);
            response.headers_mut().insert(EXPIRES_HEADER, http_date(replay.expires_at));
            return Ok(response);
        }
        let query = parts.uri.query().unwrap_or("");
        let prefer = Prefer::from_headers(&parts.headers);
        let policy = self.switches.policy(route, &tenant, key.as_str());
        let request = worker::Request {
            tenant,
            key: key.clone(),
            method: parts.method.clone(),
            path: parts.uri.path().to_string(),
            query: query.to_string(),
            fingerprint,
            stored: StoredRequest { headers: stored_headers(route, &parts.headers), body },
            deadline_at: arrival + deadline(policy.retry, route, &parts.headers),
            arrival,
        };

        // A store found down cannot record it: refused at once rather than after the store fails.
        self.health.check().map_err(|e| Problem::store(&e))?;
        // A new execution is shed before anything is recorded if the route is saturated, its
        // upstream's circuit is open or an operator isolated it — unless the key exists: its
        // record answers then.
        let admit = Admit { config, route, policy, request, headers: &parts.headers, awaits: !prefer.respond_async };
        match self.worker.admit(admit).await.map_err(|e| Problem::store(&e))? {
            Admitted::Executing { record, outcome } => {
                metrics::request(&route.name);
                self.executing(&record, outcome).await
            }
            Admitted::Existing(record) => self.answer_record(route, record, fingerprint, prefer).await,
            Admitted::Refused(refusal, new) => self.shed(route, refusal, new, prefer).await,
        }
    }

    /// A request the worker shed before recording it: refused, unless its key has a live record,
    /// which answers it.
    async fn shed(&self, route: &Route, refusal: Refusal, new: NewRecord, prefer: Prefer) -> Answer {
        let existing = self.store.lookup(&new.tenant, &new.key).await.map_err(|e| Problem::store(&e))?;
        match existing {
            Some(record) if !self.expired(&record) && record.phase() != Phase::Free => {
                self.answer_record(route, record, new.fingerprint, prefer).await
            }
            _ => {
                // Counted only when the switch holds something back: a replay is not.
                if self.switches.isolated(&route.name) {
                    metrics::held_by_switch(&route.name, SwitchAction::Isolate);
                }
                Err(self.refused(route, refusal))
            }
        }
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
            metrics::answered(&route.name, AnswerKind::KeyReused);
            return Err(Problem::key_reused().state(record.state));
        }
        if let Some(spent) = self.spent(&record) {
            metrics::answered(&route.name, AnswerKind::ResultExpired);
            return Err(spent);
        }
        self.answer_existing(record, prefer.wait).await
    }

    /// The refusal an operator's `isolate` switch on `route` makes: an open circuit's.
    fn isolation(&self, route: &str) -> Option<Refusal> {
        self.switches.isolation(route).map(Refusal::CircuitOpen)
    }

    fn refused(&self, route: &Route, refusal: Refusal) -> Problem {
        match refusal {
            Refusal::Overloaded => {
                metrics::answered(&route.name, AnswerKind::Overloaded);
                Problem::overloaded()
            }
            Refusal::CircuitOpen(wait) => {
                metrics::answered(&route.name, AnswerKind::CircuitOpen);
                Problem::circuit_open(wait.as_secs_f64().ceil() as u64)
            }
        }
    }

    /// This request owns the record, which a worker executes: answer with the outcome, or at
    /// once when the client asked to be answered asynchronously (`outcome` is `None` then).
    async fn executing(&self, record: &Record, outcome: Option<oneshot::Receiver<Outcome>>) -> Answer {
        let Some(outcome) = outcome else {
            let location = format!("/_idem/requests/{}", crate::key::path_segment(&record.key));
            let mut response = (StatusCode::ACCEPTED, Json(record.to_json(false))).into_response();
            let headers = response.headers_mut();
            headers.insert(STATUS_HEADER, HeaderValue::from_static(record.state.as_str()));
            headers.insert("preference-applied", HeaderValue::from_static("respond-async"));
            if let Ok(v) = HeaderValue::from_str(&location) {
                headers.insert(header::LOCATION, v);
            }
            return Ok(response);
        };
        let id = record.id;
        // The record becomes done after it arrived, so its retention ends later than this entry's.
        let expires_at = record.created_at + self.retention(&record.route);
        let patience = record.deadline_at - self.clock.now() + Duration::from_secs(5);
        match tokio::time::timeout(patience, outcome).await {
            Ok(Ok(outcome)) if !matches!(outcome, Outcome::Lost) => {
                if let Outcome::Done(_, response) = &outcome {
                    self.keep_for_replays(record, response, expires_at);
                }
                outcome_response(outcome)
            }
            // Another worker (of this node or another) runs it: wait for it like a duplicate.
            _ => match self.store.get(id).await {
                Ok(Some(record)) => {
                    let left = record.deadline_at - self.clock.now();
                    // Its outcome answers this request first-hand: it is not a replay.
                    self.answer(record, Some(left + Duration::from_secs(1)), false).await
                }
                Ok(None) => Err(Problem::not_found()),
                Err(e) => Err(Problem::store(&e)),
            },
        }
    }

    /// A request for a key this request does not own (same fingerprint): replay, wait, refuse.
    async fn answer_existing(&self, record: Record, wait: Option<Duration>) -> Answer {
        self.answer(record, wait, true).await
    }

    /// Answers from the record, after waiting up to `wait` for it to settle. A `done` answer is
    /// marked as a replay unless this request is the one whose execution produced it.
    async fn answer(&self, mut record: Record, wait: Option<Duration>, replay: bool) -> Answer {
        if let (Some(wait), Phase::Queued | Phase::InProgress) = (wait, record.phase()) {
            if let Some(attached) = self.attached(&record) {
                return Ok(attached);
            }
            match self.wait_for(&record, wait, true).await {
                Ok(Some(settled)) => record = settled,
                Ok(None) => return Err(Problem::not_found()),
                Err(problem) => return Err(problem),
            }
            if let Some(attached) = self.attached(&record) {
                return Ok(attached);
            }
        }
        let kind = match record.phase() {
            Phase::Done => AnswerKind::Replay,
            Phase::Unknown => AnswerKind::Unknown,
            Phase::Queued | Phase::InProgress => AnswerKind::InProgress,
            Phase::Free => AnswerKind::Freed,
        };
        if replay {
            metrics::answered(&record.route, kind);
            match record.phase() {
                Phase::Done => self.runtimes.count_replay(&record.route),
                Phase::Queued | Phase::InProgress => self.runtimes.count_conflict(&record.route),
                Phase::Unknown | Phase::Free => {}
            }
        }
        if let Some(spent) = self.spent(&record) {
            return Err(spent);
        }
        match record.phase() {
            Phase::Done => match &record.response {
                // Streamed past `max_stored_body`: done, but there is nothing to replay.
                Some(_) if record.stream.as_ref().is_some_and(|s| !s.stored) => Err(Problem::response_not_stored()),
                Some(response) => {
                    // A done record is not updated again: this is when it became done.
                    let expires_at = record.updated_at + self.retention(&record.route);
                    self.keep_for_replays(&record, response, expires_at);
                    let mut answer = stored_response(response, replay);
                    answer.headers_mut().insert(EXPIRES_HEADER, http_date(expires_at));
                    Ok(answer)
                }
                None => Err(Problem::outcome_unknown().state(State::Done)),
            },
            Phase::Unknown => Err(Problem::outcome_unknown().state(State::Unknown)),
            Phase::Queued | Phase::InProgress => {
                let pending = Pending {
                    now: self.clock.now(),
                    in_flight_since: record.in_flight.map(|(_, started)| started),
                    // The limit of the policy the record runs under: a canary's, maybe.
                    attempt_limit: self.config.current().route_named(&record.route).map(|route| {
                        let policy = record.policy_version.as_ref().and_then(|v| route.policy_named(v));
                        policy.map_or(route.retry.per_try_timeout, |p| p.retry.per_try_timeout)
                    }),
                    next_attempt_at: record.not_before,
                    deadline_at: record.deadline_at,
                };
                let eta = outcome_eta(pending, self.runtimes.pace(&record.route));
                Err(Problem::in_progress(eta).state(record.state))
            }
            // Freed while we waited: the client may send it again, and it will execute afresh.
            Phase::Free => Err(answers::freed(record.stop_reason)),
        }
    }

    /// Waits up to `max` for a record to leave `in_progress`/queued, or, when the request can
    /// `attach`, for its answer to start streaming here; `None` if it disappeared.
    pub(super) async fn wait_for(
        &self,
        record: &Record,
        max: Duration,
        attach: bool,
    ) -> Result<Option<Record>, Problem> {
        let id = record.id;
        let until = tokio::time::Instant::now() + max;
        let _counted = metrics::waiting(&record.route);
        // Another node may settle it: have it announced.
        self.store.watch(id).await.map_err(|e| Problem::store(&e))?;
        // At shutdown, waiting ends: the client is answered with where its request stands.
        let mut stopping = self.stopping.clone();
        loop {
            let watch = self.worker.watch(id);
            let notified = watch.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let record = self.store.get(id).await.map_err(|e| Problem::store(&e))?;
            let Some(record) = record else {
                return Ok(None);
            };
            let now = tokio::time::Instant::now();
            let pending = matches!(record.phase(), Phase::Queued | Phase::InProgress);
            // Its answer streaming here: the request attaches to it rather than wait for the end.
            let streaming = attach && pending && self.worker.streaming(id);
            if !pending || streaming || now >= until || *stopping.borrow_and_update() {
                return Ok(Some(record));
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep((until - now).min(WAIT_POLL)) => {}
                _ = stopping.changed() => {}
            }
        }
    }
}
