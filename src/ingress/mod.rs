//! The data plane (docs/concepts.md): a request comes in, is matched to a route, authenticated, keyed and
//! fingerprinted, recorded, and answered — by a fresh execution, a replay, or a problem.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State as AxumState};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use bytes::Bytes;
use tokio::sync::watch;
use tracing::{info_span, Instrument, Span};

use crate::config::Route;
use crate::domain::clock::SharedClock;
use crate::domain::fingerprint::Fingerprint;
use crate::domain::key::{IdempotencyKey, KeyError};
use crate::domain::switch::SwitchAction;
use crate::domain::AnswerKind;
use crate::domain::{Arrival, RouteName, State, Tenant, Timestamp};
use crate::edge::body::BodyBudget;
use crate::ingress::prefer::Prefer;
use crate::ingress::reader::Records;
use crate::observe::metrics;
use crate::problem::{Problem, SHOULD_RETRY_HEADER};
use crate::record::{Record, StoredRequest, StoredResponse};
use crate::runtime::switches::Switches;
use crate::runtime::{Live, ServedRoute, Snapshot};
use crate::store::Health;
use crate::upstream::Upstream;
use crate::worker::{self, Admitted, Refusal, Submission, Worker};

/// A keyed request as read: whose it is, its key and fingerprint, its head and body, its route
/// as served when it arrived (with the configuration it belongs to), and when it arrived.
struct Read<'a> {
    tenant: Tenant,
    key: &'a IdempotencyKey,
    fingerprint: Fingerprint,
    body: Bytes,
    route: &'a ServedRoute,
    parts: &'a http::request::Parts,
    /// Where its attempts go, as the ingress checked it; `None` when it was not built here.
    url: Option<url::Url>,
    arrival: Arrival,
    /// What the client asked for: its `Prefer` header, or an MCP route's own wait.
    prefer: Prefer,
    /// May an attempt that possibly executed be sent again: the route's, or on an MCP route its
    /// tool's.
    replay_safe: bool,
}

pub const REPLAYED_HEADER: http::HeaderName = http::HeaderName::from_static("idempotent-replayed");
/// Until when the answer's key has its result replayed (an HTTP-date).
pub const EXPIRES_HEADER: http::HeaderName = http::HeaderName::from_static("idempotency-key-expires");

pub(crate) struct Ingress {
    /// What is served: each request reads it once, when it arrives (its route's configuration
    /// and runtime together), and is served by that snapshot to its end.
    config: Arc<Live>,
    /// Where it reads records, with how long each answer lives.
    records: Records,
    worker: Worker,
    upstream: Upstream,
    /// Done answers kept in memory, replayed without the store.
    replays: Replays,
    /// Request bodies held in memory at once, over all requests (`server.max_buffered_bodies`).
    bodies: Arc<BodyBudget>,
    /// The store's health as the checks last found it.
    health: Arc<Health>,
    /// The tools MCP sessions listed through the broker: which of their calls are recorded.
    mcp_tools: Arc<crate::mcp::Catalog>,
    /// The operator's emergency switches: an isolated route takes no new key.
    switches: Arc<Switches>,
    /// What time it is: a request's arrival, its deadline, its key's retention.
    clock: SharedClock,
    /// Becomes true when the process begins to shut down: waiting requests are answered then.
    stopping: watch::Receiver<bool>,
}

/// What an [`Ingress`] is built on: the parts of the broker it shares with the others.
pub(crate) struct Parts {
    pub config: Arc<Live>,
    pub records: Records,
    /// The worker it hands executions to; its shutdown comes with it.
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
    pub(crate) fn new(parts: Parts) -> Ingress {
        let Parts { config, records, worker, upstream, bodies, health, switches, clock, replay_cache_bytes } = parts;
        Ingress {
            stopping: worker.stopping(),
            replays: Replays::new(replay_cache_bytes),
            mcp_tools: Arc::default(),
            config,
            records,
            worker,
            upstream,
            bodies,
            health,
            switches,
            clock,
        }
    }
}

mod access;
mod answers;
pub(crate) mod credentials;
pub(crate) mod derived;
mod mcp;
mod outcomes;

mod intake;
mod plain;
pub(crate) mod prefer;
pub(crate) mod reader;
mod replays;
mod requests;

use answers::{http_date, Answer};
use intake::{deadline, read_body, stored_headers};
pub use replays::Replay;
pub(crate) use replays::Replays;
use requests::{cancel_request, list_routes, show_request};

/// Where the client's own endpoints live (the routes of `data_plane`, and
/// `access::OWN_RECORD`); every other path is a route's.
const OWN_PREFIX: &str = "/_idem/";

/// The data plane as one service: every request under its access line, the client's own
/// endpoints routed by axum, and any other path handed straight to [`handle`], which a router
/// would reach only as its fallback, after a match that cannot succeed and a service boxed and
/// cloned for each request.
#[derive(Clone)]
pub(crate) struct DataPlane {
    ingress: Arc<Ingress>,
    own: Router,
}

pub(crate) fn data_plane(ingress: Arc<Ingress>) -> DataPlane {
    let own =
        Router::new()
            .route("/_idem/requests/{*key}", get(show_request).delete(cancel_request))
            .route("/_idem/routes", get(list_routes))
            .fallback(
                |AxumState(app): AxumState<Arc<Ingress>>,
                 Extension(served): Extension<Arc<Snapshot>>,
                 request: Request| async move { handle(&app, served, request).await },
            )
            .with_state(ingress.clone());
    DataPlane { ingress, own }
}

impl tower_service::Service<Request> for DataPlane {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = futures_util::future::BoxFuture<'static, Result<Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let plane = self.clone();
        Box::pin(async move {
            Ok(access::logged(&plane.ingress, request, |request, served| plane.serve(request, served)).await)
        })
    }
}

impl DataPlane {
    /// `request` under the configuration `served`, which the client's own endpoints read from
    /// its extensions.
    async fn serve(&self, request: Request, served: Arc<Snapshot>) -> Response {
        if request.uri().path().starts_with(OWN_PREFIX) {
            // A Router is always ready (its poll_ready returns at once), so it is called directly.
            let Ok(response) = tower_service::Service::call(&mut self.own.clone(), request).await;
            return response;
        }
        handle(&self.ingress, served, request).await
    }
}

/// A data-plane request, answered under the configuration in force when it arrived (`served`,
/// as the access log read it).
async fn handle(app: &Ingress, served: Arc<Snapshot>, request: Request) -> Response {
    let config = served.config();
    let arrival = Arrival { at: app.clock.now(), monotonic: Instant::now() };
    let path = request.uri().path().to_string();
    if let Err(why) = crate::domain::path::check(&path) {
        return Problem::invalid_path(&why).into_response();
    }
    let Some(route) = served.route_for(&path) else {
        return Problem::no_route(&path).into_response();
    };
    access::route(&route.name);
    if route.mcp.is_some() {
        // Boxed, as an execution is in `Ingress::answer_keyed`: held in place, its state would
        // make every request's future as large, to be moved and copied for a replay as well.
        return Box::pin(app.mcp(&route, request, arrival)).await;
    }
    let sent_key = request.headers().get(crate::domain::key::HEADER).cloned();
    let keyed_method = route.methods.contains(request.method());
    let keyed = keyed_method && (sent_key.is_some() || route.require_key || !route.key_from.is_empty());
    if keyed_method && !keyed {
        metrics::unkeyed(&route.name);
    }
    let mut response = match credentials::tenant(config, request.headers()) {
        Err(problem) if keyed => problem.state(State::NotStarted).into_response(),
        Err(problem) => problem.into_response(),
        Ok(tenant) if keyed => app.keyed(&route, tenant, request, arrival).await,
        // An isolated route sends nothing upstream, recorded or not.
        Ok(_) => match app.isolation(&route.name) {
            Some(refusal) => app.refused(&route, refusal).into_response(),
            None => {
                access::kind(access::Kind::Passed);
                app.plain(config, &route, request).await
            }
        },
    };
    if keyed {
        let headers = response.headers_mut();
        // The key the answer is for, so that a client whose SDK made it up can find its record.
        if let Some(key) = sent_key.filter(|k| IdempotencyKey::parse_header(k.as_bytes()).is_ok()) {
            headers.insert(crate::domain::key::HEADER, key);
        }
        // An answer that says nothing else is final: the upstream's, or the broker's own.
        headers.entry(SHOULD_RETRY_HEADER).or_insert(HeaderValue::from_static("false"));
    }
    response
}

impl Ingress {
    /// A request on a keyed route: its key (sent, or derived from the request), then its
    /// answer, which says which key it was for and until when that key's result is replayed.
    async fn keyed(&self, route: &ServedRoute, tenant: Tenant, request: Request, arrival: Arrival) -> Response {
        let (parts, body) = request.into_parts();
        let sent = match IdempotencyKey::from_headers(&parts.headers) {
            Ok(key) => Some(key),
            Err(KeyError::Missing) if !route.key_from.is_empty() => None,
            Err(KeyError::Missing) => return Problem::missing_key().state(State::NotStarted).into_response(),
            Err(KeyError::Invalid(why)) => return Problem::invalid_key(why).state(State::NotStarted).into_response(),
        };
        let query = parts.uri.query().unwrap_or("");
        // A path the upstream would not receive as matched is refused before anything is recorded.
        // Its URL is built here only when that takes building it; else by the execution, if any.
        let url = match crate::domain::path::sent_as_is(parts.uri.path()) {
            true => None,
            false => match route.upstream_url(parts.uri.path(), query) {
                Ok(url) => Some(url),
                Err(why) => return self.keyed_answer(route, sent.as_ref(), Err(Problem::invalid_path(&why))),
            },
        };
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
        access::key(&key);
        let fingerprint = Fingerprint::of(
            &route.name,
            parts.method.as_str(),
            parts.uri.path(),
            parts.uri.query().unwrap_or(""),
            parts.headers.get(header::CONTENT_TYPE).map(|v| v.as_bytes()),
            essential,
        );
        let prefer = Prefer::from_headers(&parts.headers);
        let replay_safe = route.replay_safe;
        let read =
            Read { tenant, key: &key, fingerprint, body, route, parts: &parts, url, arrival, prefer, replay_safe };
        let span = |tenant: &Tenant| {
            // A SERVER span, with OpenTelemetry's HTTP attributes; its status is recorded once
            // the request is answered.
            let span = info_span!(
                "request",
                otel.kind = "server",
                http.request.method = %parts.method,
                url.path = parts.uri.path(),
                http.route = %route.path_prefix,
                http.response.status_code = tracing::field::Empty,
                %tenant,
                route = %route.name,
                method = %parts.method,
            );
            crate::observe::telemetry::continue_trace(&span, &parts.headers);
            access::trace(&span);
            span
        };
        let answer = self.answer_keyed(read, span).await;
        let mut response = self.keyed_answer(route, Some(&key), answer);
        if derived {
            if let Ok(value) = HeaderValue::from_str(key.as_str()) {
                response.headers_mut().insert(crate::domain::key::HEADER, value);
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
        let replay = Replay::new(record.id, record.fingerprint, record.route.clone(), response, expires_at);
        self.replays.keep(&record.tenant, &record.key, replay);
    }

    /// The answer to a keyed request, read: replayed from memory when this node keeps its key's
    /// answer, else admitted, and executed or answered from its record. One span per logical
    /// request, made by `span`; its executions and attempts are logged beneath it. A replay
    /// logs nothing, and goes without: making the span is most of what it would cost.
    async fn answer_keyed(&self, read: Read<'_>, span: impl FnOnce(&Tenant) -> Span) -> Answer {
        access::tenant(&read.tenant);
        if let Some(replayed) = self.replayed(read.route, &read.tenant, read.key, read.fingerprint, read.arrival.at) {
            return replayed;
        }
        let span = span(&read.tenant);
        // Boxed: an admission and its execution hold several kilobytes of state across their
        // waits, which held in place would be in every keyed request's future, a replay's
        // included, and moved with it.
        let answer = Box::pin(self.execute_keyed(read)).instrument(span.clone()).await;
        let status = match &answer {
            Ok(response) => response.status(),
            Err(problem) => problem.status,
        };
        span.record("http.response.status_code", status.as_u16());
        answer
    }

    /// The answer to a duplicate whose key's answer this node keeps in memory: replayed with no
    /// database at all, nor anything a new record needs; refused if its request differs.
    fn replayed(
        &self,
        route: &ServedRoute,
        tenant: &Tenant,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        now: Timestamp,
    ) -> Option<Answer> {
        let replay = self.replays.get(tenant, key, now)?;
        if replay.fingerprint != fingerprint {
            metrics::answered(&route.name, AnswerKind::KeyReused);
            return Some(Err(Problem::key_reused().state(State::Done)));
        }
        access::record(replay.record);
        // Counted on the route that recorded it, which is almost always the one asked.
        if replay.route == route.name {
            route.count_replay();
            route.counters().replay();
        } else {
            metrics::answered(&replay.route, AnswerKind::Replay);
            if let Some(recorded_on) = route.snapshot().route_named(&replay.route) {
                recorded_on.count_replay();
            }
        }
        Some(Ok(replay.answer()))
    }

    /// A keyed request whose answer is not in memory: admitted, and executed or answered from
    /// its record.
    async fn execute_keyed(&self, read: Read<'_>) -> Answer {
        let Read { tenant, key, fingerprint, body, route, parts, url, arrival, prefer, replay_safe } = read;
        let query = parts.uri.query().unwrap_or("");
        let policy = route.policy_with_replay_safety(self.switches.policy(route, &tenant, key), replay_safe);
        let request = worker::Request {
            tenant,
            key: key.clone(),
            method: parts.method.clone(),
            path: parts.uri.path().to_string(),
            query: query.to_string(),
            fingerprint,
            stored: StoredRequest { headers: stored_headers(route, parts, &route.config().server.forwarded), body },
            deadline_at: arrival.at + deadline(policy.retry, route, &parts.headers),
            arrival,
        };

        // A store found down cannot record it: refused at once rather than after the store fails.
        self.health.check().map_err(|e| Problem::store(&e))?;
        // A new execution is shed before anything is recorded if the route is saturated, its
        // upstream's circuit is open or an operator isolated it — unless the key exists: its
        // record answers then.
        let admit = Submission { route, policy, request, url, headers: &parts.headers, awaits: !prefer.respond_async };
        match self.worker.admit(admit).await.map_err(|e| Problem::store(&e))? {
            Admitted::Executing { record, outcome } => {
                route.counters().request();
                self.executing(route, &record, outcome).await
            }
            Admitted::Existing(record) => self.answer_record(route, record, fingerprint, prefer).await,
            Admitted::Refused(refusal) => Err(self.refused(route, refusal)),
        }
    }

    /// The answer for a request whose key already has a record it does not own.
    async fn answer_record(
        &self,
        route: &ServedRoute,
        record: Record,
        fingerprint: Fingerprint,
        prefer: Prefer,
    ) -> Result<Response, Problem> {
        if record.fingerprint != fingerprint {
            metrics::answered(&route.name, AnswerKind::KeyReused);
            return Err(Problem::key_reused().state(record.state));
        }
        if let Some(spent) = self.records.spent(route.config(), &record) {
            metrics::answered(&route.name, AnswerKind::ResultExpired);
            return Err(spent);
        }
        self.answer_existing(route, record, prefer.wait).await
    }

    /// The refusal an operator's `isolate` switch on `route` makes: an open circuit's.
    fn isolation(&self, route: &RouteName) -> Option<Refusal> {
        self.switches.isolation(route).map(Refusal::Isolated)
    }

    /// The answer to a request shed before anything was recorded; one an operator's switch
    /// held back is counted as such.
    fn refused(&self, route: &Route, refusal: Refusal) -> Problem {
        if let Refusal::Isolated(_) = refusal {
            metrics::held_by_switch(&route.name, SwitchAction::Isolate);
        }
        match refusal {
            Refusal::Overloaded => {
                metrics::answered(&route.name, AnswerKind::Overloaded);
                Problem::overloaded()
            }
            Refusal::CircuitOpen(wait) | Refusal::Isolated(wait) => {
                metrics::answered(&route.name, AnswerKind::CircuitOpen);
                Problem::circuit_open(wait.as_secs_f64().ceil() as u64)
            }
        }
    }
}
