//! Test harness: a real broker on port 0 in front of a real fake upstream on port 0.
pub mod backend;
pub mod faulty;
pub mod pki;
pub mod process;
pub mod sse;
pub mod wire;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idem::config::Config;
use idem::domain::clock::{ManualClock, SharedClock};
use idem::server::{self, Running};
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::net::TcpListener;

/// A JSON `POST` to `base` + `path` under an Idempotency-Key: what every client here sends.
pub fn keyed_post(http: &reqwest::Client, base: &str, path: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
    http.post(format!("{base}{path}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_string())
}

/// One scripted upstream answer.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub delay: Duration,
    /// Held until the test opens this gate (after the delay), so a test decides when the
    /// upstream answers instead of racing a timer.
    pub gate: Option<Gate>,
}

/// A gate a scripted reply waits on until the test opens it.
#[derive(Clone, Debug)]
pub struct Gate(Arc<tokio::sync::Semaphore>);

impl Gate {
    pub fn closed() -> Gate {
        Gate(Arc::new(tokio::sync::Semaphore::new(0)))
    }

    /// Lets every reply held on this gate, now and later, answer.
    pub fn open(&self) {
        self.0.add_permits(tokio::sync::Semaphore::MAX_PERMITS / 2);
    }

    async fn pass(&self) {
        self.0.acquire().await.expect("the gate is never closed").forget();
    }
}

impl Reply {
    pub fn status(status: u16) -> Reply {
        Reply { status, headers: vec![], body: format!("{{\"status\":{status}}}"), delay: Duration::ZERO, gate: None }
    }

    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn delay(mut self, d: Duration) -> Reply {
        self.delay = d;
        self
    }

    /// Answers only once `gate` is open.
    pub fn held_by(mut self, gate: &Gate) -> Reply {
        self.gate = Some(gate.clone());
        self
    }

    /// Never answers within any test's patience.
    pub fn hang() -> Reply {
        Reply::status(200).delay(Duration::from_secs(3600))
    }
}

#[derive(Default)]
struct Seen {
    /// Requests that reached the upstream, per Idempotency-Key (or path for unkeyed calls).
    hits: HashMap<String, u32>,
    arrivals: HashMap<String, Vec<Instant>>,
    /// The headers of each of an operation's requests, in order of arrival.
    headers: HashMap<String, Vec<HeaderMap>>,
    /// Every `Idem-Attempt` that came with an operation, in order of arrival.
    attempts: HashMap<String, Vec<String>>,
    /// The answer of each operation's first execution that succeeded: what `GET
    /// /<route>/by-key/<key>` tells, and what a deduplicating upstream answers again.
    answers: HashMap<String, (u16, String)>,
    /// The record and the highest claim of it a deduplicating upstream has seen per operation.
    claims: HashMap<String, (String, i64)>,
    scripts: HashMap<String, VecDeque<Reply>>,
    /// Every request's method and path (with its query), in order of arrival.
    received: Vec<String>,
    /// While set, a probe's answer is decided as the probe arrives and given only once the
    /// gate opens: an upstream slow to answer what it already knows.
    probe_gate: Option<Gate>,
    /// Requests that arrived with `?queue_ms=`, per operation, whether or not they have left
    /// the queue to execute yet.
    queued: HashMap<String, u32>,
    /// Every `n`-th probe's answer is held this long after it is decided: an upstream slow to
    /// answer what it already knows.
    late_probes: Option<(u32, Duration)>,
    probes_asked: u32,
}

/// A fake upstream that counts every request per operation. By default it answers
/// `201 {"key":…,"n":<hit number>,"echo":<body>}`, so a second execution is visible in the body;
/// `?delay_ms=N` and `?status=N` change that; scripts set answers per key. Knobs of a real
/// upstream: `?queue_ms=N` holds the request in its own queue for N ms before it executes (a
/// client that leaves meanwhile executes nothing); `?dedupe=1` makes it deduplicate by key, as a
/// replay-safe route's upstream must (a key executed before gets that answer again, not a second
/// execution), and fence by the broker's claim (`Idem-Attempt`: an attempt of an older claim of
/// the record than one seen is refused 409, not executed); `?gateway_ms=N` is a gateway in
/// front of it that answers 504 at once while the service behind it executes the request N ms
/// later all the same. `GET /<route>/by-key/<key>` answers what that key's first execution
/// answered, or 404: what a probe asks.
#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    /// `https` for one started with [`Upstream::start_tls`].
    scheme: &'static str,
    seen: Arc<Mutex<Seen>>,
}

#[derive(serde::Deserialize, Default)]
struct Knobs {
    delay_ms: Option<u64>,
    status: Option<u16>,
    queue_ms: Option<u64>,
    dedupe: Option<u8>,
    gateway_ms: Option<u64>,
}

/// The record and claim an `Idem-Attempt` header names: `<record>; claim=<n>; attempt=<m>`.
fn claim_of(headers: &HeaderMap) -> Option<(String, i64)> {
    let value = headers.get("idem-attempt")?.to_str().ok()?;
    let mut parts = value.split(';').map(str::trim);
    let record = parts.next()?.to_string();
    let claim = parts.find_map(|part| part.strip_prefix("claim=")?.parse().ok())?;
    Some((record, claim))
}

fn operation(headers: &HeaderMap, path: &str) -> String {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(|k| k.trim_matches('"').to_string())
        .unwrap_or_else(|| path.to_string())
}

async fn answer(
    State(seen): State<Arc<Mutex<Seen>>>,
    Query(knobs): Query<Knobs>,
    method: axum::http::Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let op = operation(&headers, uri.path());
    let asked = format!("{method} {}", uri.path_and_query().map_or("", |p| p.as_str()));
    if method == axum::http::Method::GET {
        if let Some((_, key)) = uri.path().trim_start_matches('/').split_once("/by-key/") {
            let (answer, gate, late) = {
                let mut seen = seen.lock().unwrap();
                seen.received.push(asked);
                seen.probes_asked += 1;
                let late = seen.late_probes.filter(|(every, _)| seen.probes_asked % every == 0).map(|(_, by)| by);
                (seen.answers.get(key).cloned(), seen.probe_gate.clone(), late)
            };
            if let Some(gate) = gate {
                gate.pass().await;
            }
            if let Some(late) = late {
                tokio::time::sleep(late).await;
            }
            return match answer {
                Some((status, body)) => (StatusCode::from_u16(status).unwrap(), body).into_response(),
                None => StatusCode::NOT_FOUND.into_response(),
            };
        }
    }
    if let Some(ms) = knobs.queue_ms {
        *seen.lock().unwrap().queued.entry(op.clone()).or_default() += 1;
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(ms) = knobs.gateway_ms {
        // The gateway gives up on the service at once and says so; the service executes the
        // request later all the same, as a 201 the probe will find.
        let seen = seen.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            let mut seen = seen.lock().unwrap();
            seen.received.push(asked);
            let n = {
                let hits = seen.hits.entry(op.clone()).or_default();
                *hits += 1;
                *hits
            };
            let body = json!({"key": op, "n": n, "echo": String::from_utf8_lossy(&body)}).to_string();
            seen.answers.entry(op).or_insert((201, body));
        });
        return (StatusCode::GATEWAY_TIMEOUT, "the gateway gave up on the service").into_response();
    }
    if knobs.dedupe == Some(1) {
        let mut seen = seen.lock().unwrap();
        let (record, claim) = claim_of(&headers).unwrap_or_default();
        let highest = seen.claims.entry(op.clone()).or_insert_with(|| (record.clone(), claim));
        if highest.0 == record && claim < highest.1 {
            return (StatusCode::CONFLICT, "an attempt of an older claim").into_response();
        }
        *highest = (record, claim);
        if let Some((status, body)) = seen.answers.get(&op).cloned() {
            return (StatusCode::from_u16(status).unwrap(), body).into_response();
        }
    }
    let (n, scripted) = {
        let mut seen = seen.lock().unwrap();
        seen.received.push(asked);
        let n = {
            let hits = seen.hits.entry(op.clone()).or_default();
            *hits += 1;
            *hits
        };
        seen.arrivals.entry(op.clone()).or_default().push(Instant::now());
        seen.headers.entry(op.clone()).or_default().push(headers.clone());
        if let Some(attempt) = headers.get("idem-attempt").and_then(|v| v.to_str().ok()) {
            seen.attempts.entry(op.clone()).or_default().push(attempt.to_string());
        }
        let scripted = seen.scripts.get_mut(&op).and_then(|q| q.pop_front());
        (n, scripted)
    };
    let reply = scripted.unwrap_or_else(|| {
        let status = knobs.status.unwrap_or(201);
        Reply {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            body: json!({"key": op, "n": n, "echo": String::from_utf8_lossy(&body)}).to_string(),
            delay: Duration::from_millis(knobs.delay_ms.unwrap_or(0)),
            gate: None,
        }
    });
    if (200..300).contains(&reply.status) {
        seen.lock().unwrap().answers.entry(op.clone()).or_insert_with(|| (reply.status, reply.body.clone()));
    }
    tokio::time::sleep(reply.delay).await;
    if let Some(gate) = &reply.gate {
        gate.pass().await;
    }
    let mut response = (StatusCode::from_u16(reply.status).unwrap(), reply.body).into_response();
    response.headers_mut().insert("x-upstream", "fake".parse().unwrap());
    response.headers_mut().insert("connection", "keep-alive".parse().unwrap());
    for (name, _) in &reply.headers {
        response.headers_mut().remove(name.as_str());
    }
    for (name, value) in reply.headers {
        response
            .headers_mut()
            .append(axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
    }
    response
}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Upstream::serve(listener).await
    }

    pub async fn serve(listener: TcpListener) -> Upstream {
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let app = axum::Router::new().fallback(answer).with_state(seen.clone());
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Upstream { addr, scheme: "http", seen }
    }

    /// The same upstream over TLS, on 127.0.0.1: its certificate must name that address. A
    /// handshake it refuses reaches no handler, so it counts no hit.
    pub async fn start_tls(tls: rustls::ServerConfig) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let app = axum::Router::new().fallback(answer).with_state(seen.clone());
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let (acceptor, app) = (acceptor.clone(), app.clone());
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(stream).await else { return };
                    let service = hyper_util::service::TowerToHyperService::new(app);
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
                });
            }
        });
        Upstream { addr, scheme: "https", seen }
    }

    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
    }

    pub fn hits(&self, op: &str) -> u32 {
        self.seen.lock().unwrap().hits.get(op).copied().unwrap_or(0)
    }

    /// Waits until the upstream has seen `op` `n` times; fails after 10 s.
    pub async fn await_hits(&self, op: &str, n: u32) {
        let until = Instant::now() + Duration::from_secs(10);
        while self.hits(op) < n {
            assert!(Instant::now() < until, "the upstream saw {op} {} times, never {n}", self.hits(op));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// How many requests of `op` arrived in its own queue (`?queue_ms=`), executed or not yet.
    pub fn queued(&self, op: &str) -> u32 {
        self.seen.lock().unwrap().queued.get(op).copied().unwrap_or(0)
    }

    /// Every request that reached it, as `METHOD /path?query`.
    pub fn received(&self) -> Vec<String> {
        self.seen.lock().unwrap().received.clone()
    }

    pub fn arrivals(&self, op: &str) -> Vec<Instant> {
        self.seen.lock().unwrap().arrivals.get(op).cloned().unwrap_or_default()
    }

    /// The headers of the last request of `op`.
    pub fn headers(&self, op: &str) -> Option<HeaderMap> {
        self.seen.lock().unwrap().headers.get(op).and_then(|all| all.last().cloned())
    }

    /// The headers of every request of `op`, in order of arrival.
    pub fn every_headers(&self, op: &str) -> Vec<HeaderMap> {
        self.seen.lock().unwrap().headers.get(op).cloned().unwrap_or_default()
    }

    /// The `Idem-Attempt` of every request of `op` that carried one, in order of arrival.
    pub fn attempts(&self, op: &str) -> Vec<String> {
        self.seen.lock().unwrap().attempts.get(op).cloned().unwrap_or_default()
    }

    /// From now on, every `every`-th probe (`GET /<route>/by-key/<key>`) is answered as things
    /// stand when it arrives, but `by` later.
    #[allow(dead_code)] // the soak's
    pub fn answer_probes_late(&self, every: u32, by: Duration) {
        self.seen.lock().unwrap().late_probes = Some((every, by));
    }

    /// From now on, a probe (`GET /<route>/by-key/<key>`) is answered as things stand when it
    /// arrives, but only once `gate` opens.
    pub fn hold_probe_answers(&self, gate: &Gate) {
        self.seen.lock().unwrap().probe_gate = Some(gate.clone());
    }

    pub fn script(&self, op: &str, replies: Vec<Reply>) {
        self.seen.lock().unwrap().scripts.insert(op.to_string(), replies.into());
    }
}

pub use backend::Backend;

/// An empty database for one test, on either backend; every broker the test starts on it (a
/// restart, several nodes) shares it. A PostgreSQL database is dropped when the last handle goes.
#[derive(Clone)]
pub struct Db {
    pub url: String,
    _guard: Arc<DbGuard>,
}

struct DbGuard {
    backend: Backend,
    url: String,
    _dir: Option<TempDir>,
}

impl Drop for DbGuard {
    fn drop(&mut self) {
        if self.backend == Backend::Postgres {
            let url = self.url.clone();
            // Drop runs inside the test's runtime: do the async clean-up on a thread of its own.
            let _ = std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(backend::drop_postgres_db(&url))
            })
            .join();
        }
    }
}

impl Db {
    /// A new empty database. On PostgreSQL this needs `IDEM_TEST_POSTGRES_URL`; the
    /// `both_stores!` wrappers skip the PostgreSQL variant before calling a test without it.
    pub async fn new(backend: Backend) -> Db {
        let (url, dir) = match backend {
            Backend::Sqlite => {
                let dir = TempDir::new().unwrap();
                (format!("sqlite://{}", dir.path().join("idem.db").display()), Some(dir))
            }
            Backend::Postgres => {
                (backend::postgres_url_for_new_db().await.expect("IDEM_TEST_POSTGRES_URL is not set"), None)
            }
        };
        Db { url: url.clone(), _guard: Arc::new(DbGuard { backend, url, _dir: dir }) }
    }

    /// The store on this database, migrations applied, keeping its leases in the time each
    /// write carries (as SQLite always does): the store's contract is run with every time an
    /// argument, on both backends.
    #[allow(dead_code)]
    pub async fn store(&self) -> Arc<dyn idem::store::Store> {
        idem::store::open_with(&self.url, idem::store::LeaseClock::Node)
            .await
            .unwrap_or_else(|e| panic!("cannot open {}: {e}", self.url))
    }

    /// The store on this database as a broker opens it: PostgreSQL keeps leases in its own clock.
    #[allow(dead_code)]
    pub async fn deployed_store(&self) -> Arc<dyn idem::store::Store> {
        idem::store::open(&self.url).await.unwrap_or_else(|e| panic!("cannot open {}: {e}", self.url))
    }
}

/// How long one store's case of [`both_stores!`] may run: a case that hangs (a lost wake-up, a
/// poll whose condition never comes) fails with its name instead of holding the run.
pub const CASE_LIMIT: Duration = Duration::from_secs(180);

#[allow(dead_code)]
pub async fn within_case_limit(case: impl std::future::Future<Output = ()>) {
    if tokio::time::timeout(CASE_LIMIT, case).await.is_err() {
        panic!("the case did not finish within {CASE_LIMIT:?}");
    }
}

/// Runs each listed `async fn case(backend: Backend)` twice, as `sqlite::case` and
/// `postgres::case`: the same black-box test against each store. The PostgreSQL variant is
/// skipped (loudly, and never under CI) when no server is configured.
#[allow(unused_macros)]
macro_rules! both_stores {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    crate::common::within_case_limit(super::$case(crate::common::Backend::Sqlite)).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    if crate::common::backend::postgres_server_url().is_none() {
                        crate::common::backend::skipped(concat!("postgres::", stringify!($case)));
                        return;
                    }
                    crate::common::within_case_limit(super::$case(crate::common::Backend::Postgres)).await
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use both_stores;

/// A fresh upstream, and a broker in front of it on a fresh database of `backend`: `route` adds
/// lines to the `payments` route, `tables` whole tables after it.
#[allow(dead_code)]
pub async fn setup(backend: Backend, route: &str, tables: &str) -> (Upstream, Broker) {
    let upstream = Upstream::start().await;
    let config = TestConfig::new(&upstream.url()).route(route).tables(tables);
    let broker = Broker::start(&Db::new(backend).await, config).await;
    (upstream, broker)
}

/// A broker on port 0 with one route, `payments` at `/payments`, in front of `upstream`.
pub struct Broker {
    pub url: String,
    pub admin: String,
    pub http: reqwest::Client,
    running: Option<Running>,
    /// Held so that the database outlives the broker.
    _db: Db,
    pub config_text: String,
    /// The file the broker was started from, which a reload reads again.
    pub config_file: std::path::PathBuf,
    _config_dir: Arc<TempDir>,
}

/// A test's config, said by name rather than by position: the upstream the one route
/// (`payments` at `/payments`) calls, the lines of that route's table, the tables after it (its
/// `[routes.retry]`, more routes, `[auth]`), and the `[worker]` and `[server]` lines (the
/// listeners' addresses are set by whoever starts the broker). The store is the test's
/// database, set by whoever starts the broker on it; the `[store]` table's other lines are the
/// test's.
#[derive(Debug, Clone, Default)]
pub struct TestConfig {
    server: String,
    store: String,
    store_lines: String,
    upstream: String,
    worker: String,
    route: String,
    tables: String,
}

impl TestConfig {
    pub fn new(upstream: &str) -> TestConfig {
        TestConfig { upstream: upstream.to_string(), ..TestConfig::default() }
    }

    /// The upstream the route calls.
    pub fn upstream(mut self, url: &str) -> TestConfig {
        self.upstream = url.to_string();
        self
    }

    /// The store's URL (a broker started on a [`Db`] sets it).
    pub fn store(mut self, url: &str) -> TestConfig {
        self.store = url.to_string();
        self
    }

    /// Lines of the `[store]` table besides its URL (`sync = "normal"`).
    pub fn store_lines(mut self, lines: &str) -> TestConfig {
        self.store_lines.push_str(lines);
        self.store_lines.push('\n');
        self
    }

    /// Lines of the `[server]` table besides its listeners (`drain = "1s"`).
    pub fn server(mut self, lines: &str) -> TestConfig {
        self.server.push_str(lines);
        self.server.push('\n');
        self
    }

    /// Lines of the `[worker]` table.
    pub fn worker(mut self, lines: &str) -> TestConfig {
        self.worker.push_str(lines);
        self.worker.push('\n');
        self
    }

    /// Lines of the route's own table (`max_concurrency = 1`, `replay_safe = true`).
    pub fn route(mut self, lines: &str) -> TestConfig {
        self.route.push_str(lines);
        self.route.push('\n');
        self
    }

    /// Tables after the route: its `[routes.retry]`, more routes, `[auth]`.
    pub fn tables(mut self, text: &str) -> TestConfig {
        self.tables.push_str(text);
        self.tables.push('\n');
        self
    }

    /// Everything but `[server]`'s header and listeners: it starts with the table's other
    /// lines, so that it follows them.
    pub fn body(&self) -> String {
        let TestConfig { server, store, store_lines, upstream, worker, route, tables } = self;
        let worker = if worker.is_empty() { String::new() } else { format!("[worker]\n{worker}") };
        format!(
            "{server}\n[store]\nurl = \"{store}\"\n{store_lines}\n{worker}\n\n[[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\n\
             upstream = \"{upstream}\"\n{route}\n{tables}\n"
        )
    }

    /// The whole file, its listeners on port 0.
    pub fn text(&self) -> String {
        format!("\n[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}", self.body())
    }
}

impl Broker {
    /// Starts a broker on `db` (a restart when one ran there before).
    pub async fn start(db: &Db, config: TestConfig) -> Broker {
        Broker::start_with(db, config.store(&db.url).text()).await
    }

    pub async fn start_with(db: &Db, config_text: String) -> Broker {
        Broker::start_on_clock(db, config_text, None).await
    }

    /// Starts a broker on `db` that reads the time from `clock`: a test holding a
    /// [`ManualClock`] moves the broker's time on by hand (a retention, a lease, a probe's settle
    /// passed at once), where it would otherwise sleep for it.
    pub async fn start_with_clock(db: &Db, config: TestConfig, clock: Arc<ManualClock>) -> Broker {
        Broker::start_on_clock(db, config.store(&db.url).text(), Some(clock)).await
    }

    /// A broker on the system's clock as a deployment runs it, or on a test's `clock` (the
    /// store's leases kept in it too).
    async fn start_on_clock(db: &Db, config_text: String, clock: Option<SharedClock>) -> Broker {
        let config = Config::parse_with_env(&config_text, |name| std::env::var(name).ok()).unwrap();
        let dir = TempDir::new().unwrap();
        let config_file = dir.path().join("idem.toml");
        std::fs::write(&config_file, &config_text).unwrap();
        let scheme = |tls: bool| if tls { "https" } else { "http" };
        let (data, admin) = (scheme(config.server.tls.is_some()), scheme(config.server.admin_tls.is_some()));
        let running = match clock {
            Some(clock) => server::start_with_clock(config, Some(config_file.clone()), clock).await,
            None => server::start_reloadable(config, config_file.clone()).await,
        }
        .unwrap();
        Broker {
            url: format!("{data}://{}", running.listen),
            admin: format!("{admin}://{}", running.admin_listen),
            http: reqwest::Client::builder().no_proxy().build().unwrap(),
            running: Some(running),
            _db: db.clone(),
            config_text,
            config_file,
            _config_dir: Arc::new(dir),
        }
    }

    /// Replaces the text of the broker's config file; `reload` applies it.
    pub fn write_config(&self, text: &str) {
        std::fs::write(&self.config_file, text).unwrap();
    }

    /// `POST /admin/config/reload`, with `token` if the config asks for one.
    pub async fn reload(&self, token: Option<&str>) -> Answer {
        let mut request = self.http.post(format!("{}/admin/config/reload", self.admin));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        send(request).await
    }

    pub async fn stop(mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown().await;
        }
    }

    pub fn post(&self, path: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
        keyed_post(&self.http, &self.url, path, key, body)
    }

    pub async fn record(&self, key: &str) -> reqwest::Response {
        // A pooled connection may have been closed by the server after an answer that left the
        // request body unread (413): such a send fails before reaching it, so try once more.
        let url = format!("{}/_idem/requests/{}", self.url, key);
        match self.http.get(&url).send().await {
            Ok(r) => r,
            Err(_) => self.http.get(&url).send().await.unwrap(),
        }
    }

    pub async fn record_json(&self, key: &str) -> Value {
        let r = self.record(key).await;
        assert_eq!(r.status(), 200, "no record for {key}");
        r.json().await.unwrap()
    }

    /// `/metrics` as the admin listener renders it.
    pub async fn metrics(&self) -> String {
        let body = send(self.http.get(format!("{}/metrics", self.admin))).await.body;
        String::from_utf8_lossy(&body).into_owned()
    }

    /// The request body bytes this broker holds (`idem_buffered_body_bytes`): a request's share
    /// is held until it is answered, or until its future is dropped (its client left).
    pub async fn buffered_body_bytes(&self) -> u64 {
        let text = self.metrics().await;
        text.lines()
            .find_map(|l| l.strip_prefix("idem_buffered_body_bytes "))
            .and_then(|v| v.trim().parse().ok())
            .expect("/metrics shows idem_buffered_body_bytes")
    }

    /// Polls `/metrics` until it has `line` (a series and its value, as rendered); fails after
    /// 15 s. The metrics are the process's: a series a test waits on should be its own.
    pub async fn await_metric(&self, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let text = self.metrics().await;
            if text.lines().any(|l| l == line) {
                return;
            }
            assert!(Instant::now() < deadline, "/metrics never showed `{line}`:\n{text}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Polls the record until `pred` holds; fails after `within`.
    pub async fn await_record(&self, key: &str, within: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let until = Instant::now() + within;
        loop {
            let r = self.record(key).await;
            if r.status() == 200 {
                let v: Value = r.json().await.unwrap();
                if pred(&v) {
                    return v;
                }
                if Instant::now() > until {
                    panic!("record {key} never reached the expected state: {v:#}");
                }
            } else if Instant::now() > until {
                panic!("record {key} never appeared");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A request sent, and its answer's JSON: what a test reads a record or a listing with.
pub trait JsonOf {
    async fn json_of(self) -> Value;
}

impl JsonOf for reqwest::RequestBuilder {
    async fn json_of(self) -> Value {
        self.send().await.unwrap().json().await.unwrap()
    }
}

/// A response read fully: what tests compare.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub async fn of(r: reqwest::Response) -> Answer {
        Answer { status: r.status().as_u16(), headers: r.headers().clone(), body: r.bytes().await.unwrap() }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("not JSON: {:?}", self.body))
    }

    /// Asserts a problem+json answer of the given status and name.
    pub fn assert_problem(&self, status: u16, name: &str) {
        assert_eq!(self.status, status, "body: {:?}", self.body);
        assert_eq!(self.header("content-type"), Some("application/problem+json"));
        let p = self.json();
        assert_eq!(p["type"], format!("urn:idem:problem:{name}"), "{p}");
        assert_eq!(p["status"], status);
        assert!(p["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(p["detail"].as_str().is_some_and(|t| !t.is_empty()));
    }
}

pub async fn send(r: reqwest::RequestBuilder) -> Answer {
    Answer::of(r.send().await.unwrap()).await
}
