//! The access log (docs/operations.md#logs): one line per answered request on the data plane,
//! the client's own `/_idem` endpoints included, at the moment its head is ready. Target
//! `idem::access`, so that `RUST_LOG` can keep or drop it apart from the rest; `[server]
//! access_log = false` turns it off. Its fields are named as OpenTelemetry's semantic
//! conventions name them (`http.request.method`, `url.path`, `http.response.status_code`,
//! `client.address`, …), Idem's own under `idem.`: a JSON log (`--log-format json`) is read by a
//! collector as it is.
//!
//! What the line says beyond the request's head is noted while the request is served, in a
//! task-local [`Note`]: its route and tenant, a hash of its key (never the key, which may carry
//! what a client would not log), its record, the attempts of the execution it drove, its trace.
//! Everything else is read from the request and the answer.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::Request;
use axum::response::Response;
use sha2::{Digest, Sha256};

use super::{Ingress, REPLAYED_HEADER};
use crate::domain::key::IdempotencyKey;
use crate::domain::{Origin, RecordId, RouteName, Tenant};
use crate::observe::access_line::Value;
use crate::runtime::Snapshot;

tokio::task_local! {
    static NOTE: Note;
}

/// What the serving of one request tells its access line.
#[derive(Default)]
pub(super) struct Note {
    route: RefCell<Option<RouteName>>,
    tenant: RefCell<Option<Tenant>>,
    key: Cell<Option<[u8; 8]>>,
    record: Cell<Option<RecordId>>,
    attempts: Cell<u32>,
    trace: RefCell<Option<String>>,
    kind: Cell<Option<Kind>>,
}

/// What answered the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// The upstream's answer, by the execution this request drove.
    Executed,
    /// A stored answer, replayed.
    Replay,
    /// The broker's own answer: a refusal, a key in progress, an unknown outcome.
    Problem,
    /// `202 Accepted`: recorded, executing, and asked for later (`Prefer: respond-async`).
    Accepted,
    /// Proxied without a key, nothing recorded.
    Passed,
    /// The client's own endpoints (`/_idem/…`): a record, the routes, a cancel.
    Own,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Executed => "executed",
            Kind::Replay => "replay",
            Kind::Problem => "problem",
            Kind::Accepted => "accepted",
            Kind::Passed => "passed",
            Kind::Own => "own",
        }
    }
}

/// Serves `request` and logs its access line, unless `[server] access_log` is off.
/// The configuration in force when the request arrived is read here, once, and handed to
/// `serve` with the request (and in its extensions, for the client's own endpoints): the line
/// and the answer are made under the same one.
pub(super) async fn logged<F: std::future::Future<Output = Response>>(
    app: &Ingress,
    mut request: Request,
    serve: impl FnOnce(Request, Arc<Snapshot>) -> F,
) -> Response {
    let served = app.config.served();
    request.extensions_mut().insert(served.clone());
    let config = served.config();
    if !config.server.access_log {
        return serve(request, served).await;
    }
    let started = Instant::now();
    let method = request.method().clone();
    // Kept as they are (a reference count, no copy) and written out only if the line is.
    let uri = request.uri().clone();
    let client = request
        .extensions()
        .get::<Origin>()
        .map(|origin| crate::upstream::forwarded::client_address(request.headers(), origin, &config.server.forwarded));
    let bytes_in = body_size(request.headers());
    // For a request whose serving makes no span of its own.
    let client_trace = crate::observe::telemetry::client_trace_id(request.headers()).map(str::to_string);
    let (response, note) = NOTE
        .scope(Note::default(), async {
            let response = serve(request, served.clone()).await;
            (response, NOTE.with(Note::moved_out))
        })
        .await;
    // The broker's own answer is a problem whatever the serving was about to be (a pass-through
    // whose upstream could not be reached, a record not found).
    let kind = match response.extensions().get::<crate::problem::Made>() {
        Some(_) => Kind::Problem,
        None => note.kind.get().unwrap_or_else(|| read_kind(&response)),
    };
    let route = note.route.into_inner();
    let tenant = note.tenant.into_inner();
    let trace = note.trace.into_inner().or(client_trace);
    // The answer to a HEAD says the length a GET's would have, and sends no body.
    let bytes_out = match method == axum::http::Method::HEAD {
        true => Some(0),
        false => body_size(response.headers()).or_else(|| axum::body::HttpBody::size_hint(response.body()).exact()),
    };
    let line = Line {
        client: OrDash(client),
        method: &method,
        path: LoggedPath(&uri),
        status: response.status().as_u16(),
        bytes_in,
        bytes_out,
        duration_ms: started.elapsed().as_secs_f64() * 1000.0,
        route: route.as_ref().map(RouteName::as_str).unwrap_or("-"),
        tenant: tenant.as_ref().map(Tenant::as_str).unwrap_or("-"),
        key: OrDash(note.key.get().map(Hex::of)),
        record: OrDash(note.record.get()),
        kind,
        attempts: note.attempts.get(),
        trace: trace.as_deref().unwrap_or("-"),
    };
    line.log();
    response
}

/// What an access line says.
const MESSAGE: &str = "answered";

/// One access line's fields.
struct Line<'a> {
    client: OrDash<crate::upstream::forwarded::ClientAddress>,
    method: &'a axum::http::Method,
    path: LoggedPath<'a>,
    status: u16,
    bytes_in: Option<u64>,
    /// A streamed answer's size is not known when its head goes: absent then.
    bytes_out: Option<u64>,
    duration_ms: f64,
    route: &'a str,
    tenant: &'a str,
    key: OrDash<Hex>,
    record: OrDash<RecordId>,
    kind: Kind,
    attempts: u32,
    trace: &'a str,
}

impl Line<'_> {
    /// Writes the line through the access log's own formatter when the binary installed one and
    /// `RUST_LOG` keeps the line, else through tracing.
    fn log(&self) {
        if let Some(lines) = crate::observe::access_line::installed() {
            if !Line::kept() || lines.write(MESSAGE, &self.fields()) {
                return;
            }
        }
        self.by_tracing();
    }

    /// Whether `RUST_LOG` keeps the line, asked of an event with the line's own fields: a filter
    /// that names a field judges it as it judges the event [`Line::by_tracing`] makes.
    fn kept() -> bool {
        tracing::event_enabled!(
            target: crate::observe::logs::ACCESS_TARGET,
            tracing::Level::INFO,
            {
                message,
                client.address,
                http.request.method,
                url.path,
                http.response.status_code,
                http.request.body.size,
                http.response.body.size,
                duration_ms,
                idem.route,
                idem.tenant,
                idem.key,
                idem.record,
                idem.answer,
                idem.replay,
                idem.attempts,
                trace_id
            }
        )
    }

    /// Its fields for the access log's own formatter, in the order, and of the kind, that
    /// [`Line::by_tracing`] records them; what it can, written without a format call.
    fn fields(&self) -> [(&'static str, Option<Value<'_>>); 15] {
        const DASH: Value = Value::Text("-");
        let client = match &self.client.0 {
            Some(client) => client.peer_only().map_or(Value::Shown(client), Value::Address),
            None => DASH,
        };
        [
            ("client.address", Some(client)),
            ("http.request.method", Some(Value::Text(self.method.as_str()))),
            ("url.path", Some(self.path.as_is().map_or(Value::Shown(&self.path), Value::Text))),
            ("http.response.status_code", Some(Value::Count(self.status.into()))),
            ("http.request.body.size", self.bytes_in.map(Value::Count)),
            ("http.response.body.size", self.bytes_out.map(Value::Count)),
            ("duration_ms", Some(Value::Real(self.duration_ms))),
            ("idem.route", Some(Value::Str(self.route))),
            ("idem.tenant", Some(Value::Str(self.tenant))),
            ("idem.key", Some(self.key.0.as_ref().map_or(DASH, |key| Value::Text(key.as_str())))),
            ("idem.record", Some(self.record.0.map_or(DASH, |record| Value::Id(record.0)))),
            ("idem.answer", Some(Value::Str(self.kind.as_str()))),
            ("idem.replay", Some(Value::Flag(self.kind == Kind::Replay))),
            ("idem.attempts", Some(Value::Count(self.attempts.into()))),
            ("trace_id", Some(Value::Str(self.trace))),
        ]
    }

    /// The line as a tracing event, for whatever subscriber the process has: a terminal's
    /// coloured lines, a process that installed no writer of its own.
    fn by_tracing(&self) {
        tracing::event!(
            target: crate::observe::logs::ACCESS_TARGET,
            tracing::Level::INFO,
            client.address = %self.client,
            http.request.method = %self.method,
            url.path = %self.path,
            http.response.status_code = self.status,
            http.request.body.size = self.bytes_in,
            http.response.body.size = self.bytes_out,
            duration_ms = self.duration_ms,
            idem.route = self.route,
            idem.tenant = self.tenant,
            idem.key = %self.key,
            idem.record = %self.record,
            idem.answer = self.kind.as_str(),
            idem.replay = self.kind == Kind::Replay,
            idem.attempts = self.attempts,
            trace_id = self.trace,
            "answered"
        );
    }
}

/// A value, or `-` without one.
struct OrDash<T>(Option<T>);

impl<T: std::fmt::Display> std::fmt::Display for OrDash<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(value) => value.fmt(f),
            None => f.write_str("-"),
        }
    }
}

/// A request's path as the line says it: the client's own endpoints name a key in theirs,
/// which is never logged as it is.
struct LoggedPath<'a>(&'a axum::http::Uri);

impl LoggedPath<'_> {
    /// The path, when the line says it as it came.
    fn as_is(&self) -> Option<&str> {
        let path = self.0.path();
        (!path.starts_with(OWN_RECORD)).then_some(path)
    }
}

impl std::fmt::Display for LoggedPath<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = self.0.path();
        match path.strip_prefix(OWN_RECORD) {
            Some(rest) => {
                let after_key = rest.find('/').map_or("", |at| &rest[at..]);
                write!(f, "{OWN_RECORD}{{key}}{after_key}")
            }
            None => f.write_str(path),
        }
    }
}

/// Where the client's own endpoint of a key starts: the key follows (routed in
/// `ingress::data_plane`).
const OWN_RECORD: &str = "/_idem/requests/";

/// A body's size, where its `Content-Length` says it.
fn body_size(headers: &axum::http::HeaderMap) -> Option<u64> {
    headers.get(axum::http::header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

impl Note {
    /// What was noted, taken before the task-local's scope ends with it.
    fn moved_out(&self) -> Note {
        Note {
            route: RefCell::new(self.route.take()),
            tenant: RefCell::new(self.tenant.take()),
            key: Cell::new(self.key.get()),
            record: Cell::new(self.record.get()),
            attempts: Cell::new(self.attempts.get()),
            trace: RefCell::new(self.trace.take()),
            kind: Cell::new(self.kind.get()),
        }
    }
}

/// An answer that is no problem and that the serving did not name: a replay says so, anything
/// else came from the upstream.
fn read_kind(response: &Response) -> Kind {
    match response.headers().get(REPLAYED_HEADER).is_some_and(|v| v == "true") {
        true => Kind::Replay,
        false => Kind::Executed,
    }
}

/// Each of these notes what it knows, when the line is being kept.
fn note(with: impl FnOnce(&Note)) {
    let _ = NOTE.try_with(with);
}

pub(super) fn route(route: &RouteName) {
    note(|n| *n.route.borrow_mut() = Some(route.clone()));
}

/// The first 8 bytes of the key's SHA-256: enough to find a key's lines together, nothing to
/// read the key back from.
pub(super) fn key(key: &IdempotencyKey) {
    note(|n| {
        let digest = Sha256::digest(key.as_str().as_bytes());
        n.key.set(Some(digest[..8].try_into().expect("a SHA-256 is 32 bytes")));
    });
}

pub(super) fn tenant(tenant: &Tenant) {
    note(|n| *n.tenant.borrow_mut() = Some(tenant.clone()));
}

/// The record that answered the request: the one it created, or the one it was a duplicate of.
pub(super) fn record(id: RecordId) {
    note(|n| n.record.set(Some(id)));
}

pub(super) fn attempts(attempts: u32) {
    note(|n| n.attempts.set(attempts));
}

pub(super) fn kind(kind: Kind) {
    note(|n| n.kind.set(Some(kind)));
}

/// The trace of the request's span, when spans are exported.
pub(super) fn trace(span: &tracing::Span) {
    note(|n| {
        if let Some(id) = crate::observe::telemetry::trace_id(span) {
            *n.trace.borrow_mut() = Some(id);
        }
    });
}

/// A key's hash, in hex.
#[derive(Clone, Copy)]
struct Hex([u8; 16]);

impl Hex {
    fn of(hash: [u8; 8]) -> Hex {
        let mut text = [0; 16];
        hex::encode_to_slice(hash, &mut text).expect("16 digits for 8 bytes");
        Hex(text)
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

impl std::fmt::Display for Hex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::access_line::{render, tests::by_tracing, tests::untimed, Shape};

    #[test]
    fn a_keys_hash_reads_as_its_first_eight_bytes_in_hex() {
        assert_eq!(Hex::of([0x6a, 0xb9, 0xf1, 0xeb, 0x8f, 0x7d, 0x33, 0x08]).to_string(), "6ab9f1eb8f7d3308");
    }

    #[test]
    fn the_access_lines_own_formatter_writes_the_line_tracing_would() {
        let forwarding =
            crate::config::Forwarding { enabled: true, trusted_proxies: vec!["192.0.2.0/24".parse().unwrap()] };
        let mut forwarded = axum::http::HeaderMap::new();
        forwarded.insert("x-forwarded-for", "203.0.113.9, 192.0.2.1".parse().unwrap());
        let method = axum::http::Method::POST;
        // A client told by a trusted proxy, and a peer: one that speaks IPv4, and one IPv6.
        let told = Origin { peer: "[::ffff:192.0.2.7]:4711".parse().unwrap(), tls: false };
        let v4 = Origin { peer: "198.51.100.23:4711".parse().unwrap(), tls: false };
        let v6 = Origin { peer: "[2001:db8::17]:4711".parse().unwrap(), tls: false };
        let lines = [
            (Some(told), "/_idem/requests/a-key/cancel?x=1", Some(645), Kind::Replay, "-", true),
            (Some(v4), "/payments/42?x=1", None, Kind::Executed, "4bf92f35", false),
            (Some(v6), "/payments", Some(0), Kind::Problem, "-", true),
            // Made in-process: no client.
            (None, "/payments", None, Kind::Passed, "-", false),
        ];
        for (origin, uri, bytes_out, kind, trace, noted) in lines {
            let uri = uri.parse().unwrap();
            let client =
                origin.map(|origin| crate::upstream::forwarded::client_address(&forwarded, &origin, &forwarding));
            let line = Line {
                client: OrDash(client),
                method: &method,
                path: LoggedPath(&uri),
                status: 201,
                bytes_in: Some(2),
                bytes_out,
                duration_ms: 67.73366299999999,
                route: "payments",
                tenant: "default",
                key: OrDash(noted.then(|| Hex::of([0x6a, 0xb9, 0xf1, 0xeb, 0x8f, 0x7d, 0x33, 0x88]))),
                record: OrDash(noted.then(|| RecordId(uuid::Uuid::now_v7()))),
                kind,
                attempts: 3,
                trace,
            };
            for shape in [Shape::Text, Shape::Json] {
                let mut hand = Vec::new();
                render(&mut hand, shape, std::time::SystemTime::now(), MESSAGE, &line.fields());
                let hand = String::from_utf8(hand).unwrap();
                let tracing = by_tracing(shape, || line.by_tracing());
                assert_eq!(untimed(shape, &hand), untimed(shape, &tracing), "{shape:?}");
            }
        }
    }

    /// `RUST_LOG` is asked about the line with the fields the formatter writes: a filter that
    /// names any one of them judges the line.
    #[test]
    fn a_filter_naming_any_field_of_the_line_judges_it() {
        use tracing_subscriber::layer::SubscriberExt;
        let kept_under = |filter: &str| {
            let subscriber = tracing_subscriber::registry()
                .with(tracing_subscriber::EnvFilter::new(filter))
                .with(tracing_subscriber::fmt::layer().with_writer(std::io::sink));
            tracing::subscriber::with_default(subscriber, Line::kept)
        };
        assert!(kept_under("info"));
        assert!(kept_under("info,idem::access[{user}]=off"), "a field the line does not have");
        let (method, uri) = (axum::http::Method::GET, "/".parse().unwrap());
        let line = Line {
            client: OrDash(None),
            method: &method,
            path: LoggedPath(&uri),
            status: 200,
            bytes_in: None,
            bytes_out: None,
            duration_ms: 0.0,
            route: "-",
            tenant: "-",
            key: OrDash(None),
            record: OrDash(None),
            kind: Kind::Own,
            attempts: 0,
            trace: "-",
        };
        for (name, _) in line.fields() {
            assert!(!kept_under(&format!("info,idem::access[{{{name}}}]=off")), "{name}");
        }
    }
}
