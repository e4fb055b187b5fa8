//! The broker's configuration (SPEC §2): a TOML file parsed into raw serde structs, then
//! validated into typed values. Anything wrong is refused at start with an error that names the
//! key and the problem, so a bad deploy fails before it serves a single request.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::Method;
use serde::Deserialize;

use crate::policy::{BreakerSettings, Jitter, RetryPolicy};

mod limits;
pub use limits::EdgeLimits;

/// A configuration error. `key` is the dotted path of the offending key, as the user wrote it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The reason is the error's source, so that a report of the whole chain states it once.
    #[error("cannot read {path}")]
    Read { path: String, source: std::io::Error },
    #[error("{0}")]
    Syntax(String),
    #[error("config key `{key}`: {problem}")]
    Invalid { key: String, problem: String },
}

fn invalid(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), problem: problem.into() }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub auth: AuthConfig,
    pub routes: Vec<Route>,
    pub worker: WorkerConfig,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub limits: EdgeLimits,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// `sqlite://…` or `postgres://…`; the scheme picks the backend.
    pub url: String,
    /// How long `done` records are kept and replayed.
    pub retention: Duration,
}

#[derive(Debug, Clone, Default)]
pub struct AuthConfig {
    /// The admin bearer token, read from the environment variable the config names.
    /// `None` means the admin API takes no token.
    pub admin_token: Option<String>,
    /// Empty means every caller is tenant "default" — or, when a route forwards the client's
    /// `Authorization`, the tenant of that credential's digest.
    pub tenants: Vec<Tenant>,
    /// A header that carries the tenant token (e.g. `x-api-key`), read before `Authorization`.
    pub token_header: Option<http::HeaderName>,
}

#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: String,
    /// SHA-256 of the tenant's bearer token; the token itself is never stored.
    pub token_sha256: [u8; 32],
}

#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Records executed at once by this process.
    pub concurrency: usize,
    /// An `in_progress` record whose lease is not renewed within this is taken over.
    pub lease: Duration,
    /// Take-overs after which a record is stopped instead of continued: a record whose worker
    /// keeps dying on it (one that crashes the process, say) must not do so forever.
    pub max_takeovers: u32,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    pub path_prefix: String,
    /// Base URL of the upstream, without a trailing slash; the request path is appended.
    pub upstream: String,
    /// The upstream URL's own path without its trailing slash (`/orders-api`, or empty): every
    /// path sent upstream is this followed by the request's path, and nothing else.
    pub upstream_path: String,
    /// Methods that require an `Idempotency-Key`; any other method is proxied unrecorded.
    pub methods: Vec<Method>,
    /// May an attempt that possibly executed be sent again?
    pub replay_safe: bool,
    pub forward_idempotency_key: bool,
    /// Headers sent upstream on every attempt and probe (credentials), read from the
    /// environment at start; marked sensitive, so `Debug` shows their names only.
    pub upstream_headers: http::HeaderMap,
    /// Send the client's own `Authorization` upstream. It is held in memory only, so an
    /// attempt that would need it after its process is gone is not sent.
    pub forward_authorization: bool,
    /// Refuse a request on a keyed method that has no key (400), or proxy it unrecorded.
    pub require_key: bool,
    /// How long this route's `done` records are replayed (the store's `retention` unless set).
    pub retention: Duration,
    /// How long, after retention, a done record's key is remembered as spent (410); zero: not at all.
    pub tombstone: Duration,
    /// Where a key comes from when the client sends none: headers and JSON pointers into the body.
    pub key_from: Vec<KeySource>,
    /// JSON pointers removed from the body before it is fingerprinted (timestamps, nonces).
    pub fingerprint_ignore: Vec<String>,
    pub max_body: usize,
    pub max_concurrency: usize,
    pub retry: RetryPolicy,
    pub circuit: BreakerSettings,
    pub probe: Option<Probe>,
    /// The header that tells the upstream, on every attempt, how many milliseconds that attempt
    /// has; a client sending it on a keyed request may shorten the record's deadline with it.
    pub deadline_header: Option<http::HeaderName>,
}

/// One source of a derived key (SPEC §9 `key_from`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    Header(http::HeaderName),
    /// An RFC 6901 pointer into the JSON body.
    Json(String),
}

impl std::fmt::Display for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeySource::Header(name) => write!(f, "header:{name}"),
            KeySource::Json(pointer) => write!(f, "json:{pointer}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Probe {
    pub method: Method,
    /// A path template; `{idempotency_key}` is replaced by the record's key.
    pub path: String,
    /// How long after the outcome became unknown the first probe is sent.
    pub settle: Duration,
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
        Config::parse(&text)
    }

    /// Parses and validates a config, reading secrets from the process environment.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse_with_env(text, |name| std::env::var(name).ok())
    }

    pub fn parse_with_env(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        raw.validate(&env)
    }

    /// The route whose `path_prefix` is the longest prefix of `path`, on a segment boundary.
    pub fn route_for(&self, path: &str) -> Option<&Route> {
        self.routes.iter().filter(|r| prefix_matches(&r.path_prefix, path)).max_by_key(|r| r.path_prefix.len())
    }

    pub fn route_named(&self, name: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.name == name)
    }

    pub fn uses_tenants(&self) -> bool {
        !self.auth.tenants.is_empty()
    }

    /// Keys are scoped by the client's credential: no tenants, and a route that forwards the
    /// client's `Authorization` (each credential is an account of the upstream's).
    pub fn scopes_by_credential(&self) -> bool {
        !self.uses_tenants() && self.routes.iter().any(|r| r.forward_authorization)
    }
}

impl Route {
    /// Where a request with this path and query goes upstream; refused unless the URL sent
    /// has exactly the path matched (see [`crate::path`]).
    pub fn upstream_url(&self, path: &str, query: &str) -> Result<reqwest::Url, crate::path::InvalidPath> {
        crate::path::upstream_url(&self.upstream, &self.upstream_path, path, query)
    }
}

/// `/payments` matches `/payments`, `/payments/1` and `/payments?x`, but not `/paymentsX`.
fn prefix_matches(prefix: &str, path: &str) -> bool {
    if prefix == "/" {
        return true;
    }
    match path.strip_prefix(prefix.trim_end_matches('/')) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// The effective configuration, as `idem check` prints it.
pub fn describe(c: &Config) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let h = humantime::format_duration;
    let _ = writeln!(out, "config ok");
    let _ = writeln!(out, "listen        {}", c.server.listen);
    let _ = writeln!(out, "admin_listen  {}", c.server.admin_listen);
    let _ = writeln!(out, "limits        {}", c.server.limits.describe());
    let _ = writeln!(out, "store         {} (retention {})", c.store.url, h(c.store.retention));
    let _ = writeln!(
        out,
        "auth          {} tenant(s); admin token {}",
        c.auth.tenants.len(),
        if c.auth.admin_token.is_some() { "set" } else { "not required" }
    );
    let _ = writeln!(
        out,
        "worker        concurrency {}, lease {}, max_takeovers {}",
        c.worker.concurrency,
        h(c.worker.lease),
        c.worker.max_takeovers
    );
    for r in &c.routes {
        let p = &r.retry;
        let methods: Vec<&str> = r.methods.iter().map(Method::as_str).collect();
        let _ = writeln!(out, "\nroute {}  {} -> {}", r.name, r.path_prefix, r.upstream);
        let _ = writeln!(
            out,
            "  keyed methods {}; replay_safe {}; forward key {}; max_body {} B; max_concurrency {}",
            methods.join(","),
            r.replay_safe,
            r.forward_idempotency_key,
            r.max_body,
            r.max_concurrency
        );
        let _ = writeln!(
            out,
            "  retry: {} attempts within {} (per try {}, min {}); backoff {:?} jitter, base {}, cap {}",
            p.max_attempts,
            h(p.deadline),
            h(p.per_try_timeout),
            h(p.min_try),
            p.jitter,
            h(p.base),
            h(p.cap)
        );
        let _ = writeln!(
            out,
            "  not_processed {:?}; ambiguous {:?}; budget {}% of first attempts + {}/s",
            p.not_processed,
            p.ambiguous,
            p.budget_ratio * 100.0,
            p.budget_min_per_sec
        );
        let c = &r.circuit;
        let _ = writeln!(
            out,
            "  circuit: opens after {} failures in a row for {} (up to {}), {} trial(s) half-open",
            c.failures,
            h(c.open_for),
            h(c.max_open_for),
            c.trials
        );
        let credentials: Vec<&str> = r.upstream_headers.keys().map(|n| n.as_str()).collect();
        let _ = writeln!(
            out,
            "  upstream credentials: headers [{}] (values from the environment); client's Authorization {}; key {}",
            credentials.join(", "),
            if r.forward_authorization { "forwarded" } else { "not forwarded" },
            if r.require_key { "required" } else { "optional (keyless requests proxied unrecorded)" }
        );
        if let Some(probe) = &r.probe {
            let _ = writeln!(out, "  probe {} {} after {}", probe.method, probe.path, h(probe.settle));
        }
        if let Some(name) = &r.deadline_header {
            let _ = writeln!(
                out,
                "  deadline header: {name} (each attempt's milliseconds sent upstream; a client's may shorten the deadline)"
            );
        }
    }
    out
}

// ---- raw TOML shape -------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: Option<RawServer>,
    store: Option<RawStore>,
    auth: Option<RawAuth>,
    #[serde(default)]
    routes: Vec<RawRoute>,
    worker: Option<RawWorker>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    admin_listen: Option<String>,
    header_timeout: Option<String>,
    body_timeout: Option<String>,
    max_connections: Option<i64>,
    admin_max_connections: Option<i64>,
    max_buffered_bodies: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawStore {
    url: Option<String>,
    retention: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAuth {
    admin_token_env: Option<String>,
    token_header: Option<String>,
    #[serde(default)]
    tenants: Vec<RawTenant>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    name: String,
    token_sha256: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawWorker {
    concurrency: Option<i64>,
    lease: Option<String>,
    max_takeovers: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    name: String,
    path_prefix: String,
    upstream: String,
    methods: Option<Vec<String>>,
    replay_safe: Option<bool>,
    forward_idempotency_key: Option<bool>,
    #[serde(default)]
    upstream_headers_env: std::collections::BTreeMap<String, String>,
    forward_authorization: Option<bool>,
    require_key: Option<bool>,
    retention: Option<String>,
    tombstone: Option<String>,
    #[serde(default)]
    key_from: Vec<String>,
    #[serde(default)]
    fingerprint_ignore: Vec<String>,
    max_body: Option<String>,
    max_concurrency: Option<i64>,
    retry: Option<RawRetry>,
    circuit: Option<RawCircuit>,
    probe: Option<RawProbe>,
    deadline_header: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawCircuit {
    failures: Option<i64>,
    open_for: Option<String>,
    max_open_for: Option<String>,
    trials: Option<i64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawRetry {
    max_attempts: Option<i64>,
    deadline: Option<String>,
    per_try_timeout: Option<String>,
    min_try: Option<String>,
    base: Option<String>,
    cap: Option<String>,
    jitter: Option<String>,
    not_processed: Option<Vec<i64>>,
    ambiguous: Option<Vec<i64>>,
    budget_ratio: Option<f64>,
    budget_min_per_sec: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProbe {
    method: Option<String>,
    path: String,
    settle: Option<String>,
}

// ---- validation -----------------------------------------------------------------------------

fn duration(key: &str, value: Option<&str>, default: &str) -> Result<Duration, ConfigError> {
    let text = value.unwrap_or(default);
    let d = humantime::parse_duration(text)
        .map_err(|e| invalid(key, format!("`{text}` is not a duration like \"250ms\" or \"30s\": {e}")))?;
    if d.is_zero() {
        return Err(invalid(key, "must be greater than zero"));
    }
    if d > MAX_DURATION {
        return Err(invalid(key, format!("`{text}` is beyond any sane bound (at most 366 days)")));
    }
    Ok(d)
}

/// No setting is meant to last longer than this; a longer one is a typo (`1000years`) whose
/// arithmetic in milliseconds would overflow.
const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// No count is meant to be larger than this.
const MAX_COUNT: i64 = 1_000_000;

/// Bodies are held in memory and stored whole: a larger limit is a typo (`100TiB`).
const MAX_BODY: u64 = 1024 * 1024 * 1024;

fn socket_addr(key: &str, value: Option<&str>, default: &str) -> Result<SocketAddr, ConfigError> {
    let text = value.unwrap_or(default);
    text.parse().map_err(|_| invalid(key, format!("`{text}` is not an address like \"127.0.0.1:8080\"")))
}

fn positive(key: &str, value: Option<i64>, default: i64) -> Result<usize, ConfigError> {
    let v = value.unwrap_or(default);
    if v < 1 {
        return Err(invalid(key, format!("must be at least 1, got {v}")));
    }
    if v > MAX_COUNT {
        return Err(invalid(key, format!("{v} is beyond any sane bound (at most {MAX_COUNT})")));
    }
    usize::try_from(v).map_err(|_| invalid(key, "is too large"))
}

fn statuses(key: &str, value: Option<&[i64]>, default: &[u16]) -> Result<Vec<u16>, ConfigError> {
    match value {
        None => Ok(default.to_vec()),
        Some(list) => list
            .iter()
            .map(|&s| {
                if (100..=599).contains(&s) {
                    Ok(s as u16)
                } else {
                    Err(invalid(key, format!("{s} is not an HTTP status (100-599)")))
                }
            })
            .collect(),
    }
}

fn method(key: &str, text: &str) -> Result<Method, ConfigError> {
    let valid = !text.is_empty() && text.bytes().all(|b| b.is_ascii_uppercase());
    if !valid {
        return Err(invalid(key, format!("`{text}` is not an upper-case HTTP method")));
    }
    Method::from_bytes(text.as_bytes()).map_err(|_| invalid(key, format!("`{text}` is not an HTTP method")))
}

impl RawConfig {
    fn validate(self, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let server = self.server.unwrap_or_default();
        let server = ServerConfig {
            listen: socket_addr("server.listen", server.listen.as_deref(), "127.0.0.1:8080")?,
            admin_listen: socket_addr("server.admin_listen", server.admin_listen.as_deref(), "127.0.0.1:8081")?,
            limits: EdgeLimits::validate(&server)?,
        };
        // Port 0 asks for any free port: two of them never collide.
        let (data, admin) = (server.listen, server.admin_listen);
        let same_host = data.ip() == admin.ip() || data.ip().is_unspecified() || admin.ip().is_unspecified();
        if data.port() == admin.port() && data.port() != 0 && same_host {
            return Err(invalid(
                "server.admin_listen",
                "must differ from server.listen: the admin API needs a listener of its own",
            ));
        }

        let store = self.store.unwrap_or_default();
        let url = store.url.unwrap_or_else(|| "sqlite://idem.db".into());
        if !(url.starts_with("sqlite:") || url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(invalid("store.url", format!("`{url}` must start with sqlite: or postgres://")));
        }
        if reqwest::Url::parse(&url).is_ok_and(|u| u.password().is_some()) {
            return Err(invalid(
                "store.url",
                "must not carry a password: secrets come from the environment (PGPASSWORD) or a .pgpass file",
            ));
        }
        let store = StoreConfig { url, retention: duration("store.retention", store.retention.as_deref(), "24h")? };

        let auth = validate_auth(self.auth.unwrap_or_default(), env)?;

        let worker = self.worker.unwrap_or_default();
        let worker = WorkerConfig {
            concurrency: positive("worker.concurrency", worker.concurrency, 64)?,
            lease: duration("worker.lease", worker.lease.as_deref(), "15s")?,
            max_takeovers: match worker.max_takeovers.unwrap_or(3) {
                n @ 0..=100 => n as u32,
                n => return Err(invalid("worker.max_takeovers", format!("must be between 0 and 100, got {n}"))),
            },
        };

        let mut names = HashSet::new();
        let mut prefixes = HashSet::new();
        let mut routes = Vec::with_capacity(self.routes.len());
        for (i, raw) in self.routes.into_iter().enumerate() {
            let route = raw.validate(&format!("routes[{i}]"), store.retention, env)?;
            if !names.insert(route.name.clone()) {
                return Err(invalid(format!("routes[{i}].name"), format!("`{}` is used by two routes", route.name)));
            }
            // `/payments` and `/payments/` match the same requests.
            if !prefixes.insert(route.path_prefix.trim_end_matches('/').to_string()) {
                return Err(invalid(
                    format!("routes[{i}].path_prefix"),
                    format!("`{}` is used by two routes", route.path_prefix),
                ));
            }
            routes.push(route);
        }
        if let Some(i) = routes.iter().position(|r| r.forward_authorization) {
            if !auth.tenants.is_empty() && auth.token_header.is_none() {
                return Err(invalid(
                    format!("routes[{i}].forward_authorization"),
                    "with tenants, set [auth] token_header: the client's Authorization goes upstream, so the \
                     tenant token must come in a header of its own",
                ));
            }
        }
        if routes.is_empty() {
            return Err(invalid(
                "routes",
                "no route is configured: add a [[routes]] table, or the broker would answer every request with 404",
            ));
        }
        server.limits.check_routes(&routes)?;

        Ok(Config { server, store, auth, routes, worker })
    }
}

fn validate_auth(raw: RawAuth, env: &dyn Fn(&str) -> Option<String>) -> Result<AuthConfig, ConfigError> {
    let admin_token = match raw.admin_token_env {
        None => None,
        Some(var) => match env(&var) {
            Some(token) if !token.is_empty() => Some(token),
            _ => {
                return Err(invalid(
                    "auth.admin_token_env",
                    format!("the environment variable {var} is not set (or empty)"),
                ))
            }
        },
    };
    let mut seen = HashSet::new();
    let mut tenants = Vec::new();
    for (i, t) in raw.tenants.into_iter().enumerate() {
        let key = format!("auth.tenants[{i}]");
        if t.name.is_empty() || !t.name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid(format!("{key}.name"), "must be non-empty visible ASCII"));
        }
        if !seen.insert(t.name.clone()) {
            return Err(invalid(format!("{key}.name"), format!("tenant `{}` is listed twice", t.name)));
        }
        let mut digest = [0u8; 32];
        hex::decode_to_slice(t.token_sha256.trim(), &mut digest).map_err(|_| {
            invalid(
                format!("{key}.token_sha256"),
                "must be the 64 hex digits of the token's SHA-256 (the token itself is never configured)",
            )
        })?;
        tenants.push(Tenant { name: t.name, token_sha256: digest });
    }
    let token_header = raw
        .token_header
        .map(|name| {
            http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| invalid("auth.token_header", format!("`{name}` is not a header name")))
        })
        .transpose()?;
    if !tenants.is_empty() && admin_token.is_none() {
        return Err(invalid(
            "auth.admin_token_env",
            "must be set when tenants are configured: without it the admin API would show every tenant's records to anyone",
        ));
    }
    Ok(AuthConfig { admin_token, tenants, token_header })
}

impl RawRoute {
    fn validate(
        self,
        key: &str,
        store_retention: Duration,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Route, ConfigError> {
        if self.name.is_empty() || !self.name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
            return Err(invalid(format!("{key}.name"), "must be non-empty and use only letters, digits, - _ ."));
        }
        if !self.path_prefix.starts_with('/') {
            return Err(invalid(format!("{key}.path_prefix"), "must start with /"));
        }
        if prefix_matches("/_idem", &self.path_prefix) {
            return Err(invalid(format!("{key}.path_prefix"), "/_idem is the broker's own path"));
        }
        crate::path::check(&self.path_prefix).map_err(|e| invalid(format!("{key}.path_prefix"), e.to_string()))?;
        let upstream = upstream_url(&format!("{key}.upstream"), &self.upstream)?;
        let methods = match self.methods {
            None => vec![Method::POST, Method::PATCH],
            Some(list) if list.is_empty() => {
                return Err(invalid(format!("{key}.methods"), "must name at least one method"))
            }
            Some(list) => list.iter().map(|m| method(&format!("{key}.methods"), m)).collect::<Result<_, _>>()?,
        };
        let max_body_text = self.max_body.unwrap_or_else(|| "1MiB".into());
        let max_body = max_body_text
            .parse::<bytesize::ByteSize>()
            .map_err(|_| invalid(format!("{key}.max_body"), format!("`{max_body_text}` is not a size like \"1MiB\"")))?
            .as_u64();
        if max_body == 0 {
            return Err(invalid(format!("{key}.max_body"), "must be greater than zero"));
        }
        if max_body > MAX_BODY {
            return Err(invalid(
                format!("{key}.max_body"),
                format!("`{max_body_text}` is beyond any sane bound (at most 1GiB)"),
            ));
        }
        let probe = self.probe.map(|p| p.validate(&format!("{key}.probe"))).transpose()?;
        let upstream_headers =
            upstream_headers(&format!("{key}.upstream_headers_env"), &self.upstream_headers_env, env)?;
        let retention = match self.retention.as_deref() {
            Some(text) => duration(&format!("{key}.retention"), Some(text), "")?,
            None => store_retention,
        };
        let tombstone = match self.tombstone.as_deref() {
            // Zero turns tombstones off: a late retry after retention executes again.
            Some(text) if humantime::parse_duration(text).is_ok_and(|d| d.is_zero()) => Duration::ZERO,
            text => duration(&format!("{key}.tombstone"), text, "30d")?,
        };
        let key_from = self
            .key_from
            .iter()
            .map(|source| key_source(&format!("{key}.key_from"), source))
            .collect::<Result<Vec<_>, _>>()?;
        for pointer in &self.fingerprint_ignore {
            json_pointer(&format!("{key}.fingerprint_ignore"), pointer)?;
        }
        let deadline_header = self
            .deadline_header
            .as_deref()
            .map(|name| deadline_header(&format!("{key}.deadline_header"), name, &upstream_headers))
            .transpose()?;
        Ok(Route {
            name: self.name,
            path_prefix: self.path_prefix,
            upstream: upstream.as_str().trim_end_matches('/').to_string(),
            upstream_path: upstream.path().trim_end_matches('/').to_string(),
            methods,
            replay_safe: self.replay_safe.unwrap_or(false),
            forward_idempotency_key: self.forward_idempotency_key.unwrap_or(true),
            upstream_headers,
            forward_authorization: self.forward_authorization.unwrap_or(false),
            require_key: self.require_key.unwrap_or(true),
            retention,
            tombstone,
            key_from,
            fingerprint_ignore: self.fingerprint_ignore,
            max_body: usize::try_from(max_body).map_err(|_| invalid(format!("{key}.max_body"), "is too large"))?,
            max_concurrency: positive(&format!("{key}.max_concurrency"), self.max_concurrency, 256)?,
            retry: self.retry.unwrap_or_default().validate(&format!("{key}.retry"))?,
            circuit: self.circuit.unwrap_or_default().validate(&format!("{key}.circuit"))?,
            probe,
            deadline_header,
        })
    }
}

/// A header name the broker may set on every attempt: not one that belongs to the connection,
/// the client's session, the key, or the route's credentials, which it would overwrite.
fn deadline_header(key: &str, name: &str, credentials: &http::HeaderMap) -> Result<http::HeaderName, ConfigError> {
    let parsed = http::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| invalid(key, format!("`{name}` is not a valid header name")))?;
    const TAKEN: [&str; 16] = [
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "authorization",
        "cookie",
        "host",
        "prefer",
        "content-type",
        crate::key::HEADER,
    ];
    if TAKEN.contains(&parsed.as_str()) {
        return Err(invalid(key, format!("`{name}` is a header the broker or the connection already uses")));
    }
    if credentials.contains_key(&parsed) {
        return Err(invalid(key, format!("`{name}` is also one of the route's upstream_headers_env")));
    }
    Ok(parsed)
}

/// `header:NAME` or `json:/pointer`.
fn key_source(key: &str, text: &str) -> Result<KeySource, ConfigError> {
    if let Some(name) = text.strip_prefix("header:") {
        let name = http::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| invalid(key, format!("`{text}`: `{name}` is not a header name")))?;
        return Ok(KeySource::Header(name));
    }
    if let Some(pointer) = text.strip_prefix("json:") {
        json_pointer(key, pointer)?;
        return Ok(KeySource::Json(pointer.to_string()));
    }
    Err(invalid(key, format!("`{text}` is neither `header:NAME` nor `json:/pointer`")))
}

/// An RFC 6901 pointer: empty (the whole document) or `/`-separated tokens, where `~` is only
/// ever `~0` or `~1`.
fn json_pointer(key: &str, pointer: &str) -> Result<(), ConfigError> {
    let escapes_ok = pointer.split('~').skip(1).all(|rest| rest.starts_with('0') || rest.starts_with('1'));
    if !(pointer.is_empty() || pointer.starts_with('/')) || !escapes_ok {
        return Err(invalid(key, format!("`{pointer}` is not a JSON pointer like \"/arguments/order_id\"")));
    }
    Ok(())
}

/// Header name → the environment variable holding its value. The value is never echoed.
fn upstream_headers(
    key: &str,
    names: &std::collections::BTreeMap<String, String>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<http::HeaderMap, ConfigError> {
    let mut headers = http::HeaderMap::new();
    for (name, var) in names {
        let header = http::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| invalid(key, format!("`{name}` is not a header name")))?;
        let value = env(var)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| invalid(key, format!("{name}: the environment variable {var} is not set (or empty)")))?;
        let mut value = http::HeaderValue::from_str(&value)
            .map_err(|_| invalid(key, format!("{name}: the value of {var} is not a valid header value")))?;
        value.set_sensitive(true);
        headers.insert(header, value);
    }
    Ok(headers)
}

/// An upstream base URL: http(s) with a host, nothing after its path, and no credentials —
/// those come from the environment. The text is never echoed, since it may hold a password.
fn upstream_url(key: &str, text: &str) -> Result<reqwest::Url, ConfigError> {
    let url = reqwest::Url::parse(text)
        .ok()
        .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
        .ok_or_else(|| invalid(key, "is not an http(s) URL with a host, like \"http://127.0.0.1:9000\""))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(key, "must not carry user-info (`user:password@`): credentials in a URL end up in logs"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid(key, "must not carry a query or fragment"));
    }
    // The parser resolves dot-segments and encodes some characters: the path must come through as written.
    let after_scheme = text.split_once("://").map_or(text, |(_, rest)| rest);
    let written_path = after_scheme.find('/').map_or("", |i| &after_scheme[i..]);
    if written_path.trim_end_matches('/') != url.path().trim_end_matches('/') {
        return Err(invalid(
            key,
            "has a path that a URL parser rewrites (a `.` or `..` segment, or unencoded characters)",
        ));
    }
    Ok(url)
}

impl RawRetry {
    fn validate(self, key: &str) -> Result<RetryPolicy, ConfigError> {
        let k = |name: &str| format!("{key}.{name}");
        let max_attempts = positive(&k("max_attempts"), self.max_attempts, 3)?;
        let max_attempts = u32::try_from(max_attempts).map_err(|_| invalid(k("max_attempts"), "is too large"))?;
        let deadline = duration(&k("deadline"), self.deadline.as_deref(), "30s")?;
        let per_try_timeout = duration(&k("per_try_timeout"), self.per_try_timeout.as_deref(), "10s")?;
        let min_try = duration(&k("min_try"), self.min_try.as_deref(), "100ms")?;
        let base = duration(&k("base"), self.base.as_deref(), "100ms")?;
        let cap = duration(&k("cap"), self.cap.as_deref(), "2s")?;
        if min_try > per_try_timeout {
            return Err(invalid(k("min_try"), "must not exceed per_try_timeout: no attempt could ever start"));
        }
        if min_try > deadline {
            return Err(invalid(k("min_try"), "must not exceed deadline: no attempt could ever start"));
        }
        if base > cap {
            return Err(invalid(k("base"), "must not exceed cap"));
        }
        let jitter = match self.jitter.as_deref().unwrap_or("full") {
            "full" => Jitter::Full,
            "equal" => Jitter::Equal,
            "decorrelated" => Jitter::Decorrelated,
            "none" => Jitter::None,
            other => {
                return Err(invalid(k("jitter"), format!("`{other}` is not one of full, equal, decorrelated, none")))
            }
        };
        let not_processed = statuses(&k("not_processed"), self.not_processed.as_deref(), &[429, 503])?;
        let ambiguous = statuses(&k("ambiguous"), self.ambiguous.as_deref(), &[502, 504])?;
        if let Some(s) = not_processed.iter().find(|s| ambiguous.contains(s)) {
            return Err(invalid(k("ambiguous"), format!("{s} is also listed in not_processed")));
        }
        if let Some(s) = not_processed.iter().chain(&ambiguous).find(|s| (200..300).contains(*s)) {
            return Err(invalid(k("not_processed"), format!("{s} is a success status and cannot be retried")));
        }
        let budget_ratio = self.budget_ratio.unwrap_or(0.1);
        if !budget_ratio.is_finite() || !(0.0..=1.0).contains(&budget_ratio) {
            return Err(invalid(k("budget_ratio"), "must be a fraction between 0 and 1"));
        }
        let budget_min_per_sec = self.budget_min_per_sec.unwrap_or(10.0);
        if !budget_min_per_sec.is_finite() || budget_min_per_sec < 0.0 {
            return Err(invalid(k("budget_min_per_sec"), "must be zero or more"));
        }
        Ok(RetryPolicy {
            max_attempts,
            deadline,
            per_try_timeout,
            min_try,
            base,
            cap,
            jitter,
            not_processed,
            ambiguous,
            budget_ratio,
            budget_min_per_sec,
        })
    }
}

impl RawCircuit {
    fn validate(self, key: &str) -> Result<BreakerSettings, ConfigError> {
        let k = |name: &str| format!("{key}.{name}");
        let failures = positive(&k("failures"), self.failures, 5)?;
        let trials = positive(&k("trials"), self.trials, 1)?;
        let open_for = duration(&k("open_for"), self.open_for.as_deref(), "5s")?;
        let max_open_for = duration(&k("max_open_for"), self.max_open_for.as_deref(), "60s")?;
        if open_for > max_open_for {
            return Err(invalid(k("open_for"), "must not exceed max_open_for"));
        }
        Ok(BreakerSettings {
            failures: u32::try_from(failures).map_err(|_| invalid(k("failures"), "is too large"))?,
            open_for,
            max_open_for,
            trials: u32::try_from(trials).map_err(|_| invalid(k("trials"), "is too large"))?,
        })
    }
}

impl RawProbe {
    fn validate(self, key: &str) -> Result<Probe, ConfigError> {
        if !self.path.starts_with('/') {
            return Err(invalid(format!("{key}.path"), "must start with /"));
        }
        if !self.path.contains("{idempotency_key}") {
            return Err(invalid(
                format!("{key}.path"),
                "must contain {idempotency_key}: without it every probe asks about the same thing",
            ));
        }
        Ok(Probe {
            method: method(&format!("{key}.method"), self.method.as_deref().unwrap_or("GET"))?,
            path: self.path,
            settle: duration(&format!("{key}.settle"), self.settle.as_deref(), "5s")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        [[routes]]
        name = "payments"
        path_prefix = "/payments"
        upstream = "http://127.0.0.1:9000"
    "#;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn error_of(text: &str) -> String {
        Config::parse_with_env(text, no_env).unwrap_err().to_string()
    }

    fn with_route_line(line: &str) -> String {
        format!("{MINIMAL}{line}\n")
    }

    fn with_retry_line(line: &str) -> String {
        format!("{MINIMAL}[routes.retry]\n{line}\n")
    }

    #[test]
    fn a_deadline_header_must_be_a_header_name_the_broker_does_not_use() {
        let c = Config::parse_with_env(&with_route_line("deadline_header = \"Request-Timeout-Ms\""), no_env).unwrap();
        assert_eq!(c.routes[0].deadline_header.as_ref().map(|h| h.as_str()), Some("request-timeout-ms"));
        assert!(Config::parse_with_env(MINIMAL, no_env).unwrap().routes[0].deadline_header.is_none());
        assert!(describe(&c).contains("deadline header: request-timeout-ms"), "{}", describe(&c));
        for bad in ["bad header", "", "Idempotency-Key", "Connection"] {
            let e = error_of(&with_route_line(&format!("deadline_header = \"{bad}\"")));
            assert!(e.contains("routes[0].deadline_header"), "{e}");
        }
    }

    #[test]
    fn a_minimal_config_gets_the_documented_defaults() {
        let c = Config::parse_with_env(MINIMAL, no_env).unwrap();
        assert_eq!(c.server.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(c.server.admin_listen.to_string(), "127.0.0.1:8081");
        assert_eq!(c.store.url, "sqlite://idem.db");
        assert_eq!(c.store.retention, Duration::from_secs(86400));
        let r = &c.routes[0];
        assert_eq!(r.methods, vec![Method::POST, Method::PATCH]);
        assert!(!r.replay_safe);
        assert!(r.forward_idempotency_key);
        assert_eq!(r.max_body, 1024 * 1024);
        assert_eq!(r.max_concurrency, 256);
        assert_eq!(r.retry.max_attempts, 3);
        assert_eq!(r.retry.deadline, Duration::from_secs(30));
        assert_eq!(r.retry.not_processed, vec![429, 503]);
        assert_eq!(r.retry.ambiguous, vec![502, 504]);
        assert_eq!(r.retry.jitter, Jitter::Full);
        assert_eq!(c.worker.concurrency, 64);
        assert_eq!(c.worker.lease, Duration::from_secs(15));
        assert_eq!(c.worker.max_takeovers, 3);
        assert!(c.auth.admin_token.is_none() && c.auth.tenants.is_empty());
    }

    #[test]
    fn bad_durations_name_their_key() {
        let e = error_of(&with_retry_line("deadline = \"soon\""));
        assert!(e.contains("routes[0].retry.deadline") && e.contains("soon"), "{e}");
        let e = error_of(&with_retry_line("per_try_timeout = \"0s\""));
        assert!(e.contains("routes[0].retry.per_try_timeout") && e.contains("greater than zero"), "{e}");
        let e = error_of(&format!("[store]\nretention = \"-1h\"\n{MINIMAL}"));
        assert!(e.contains("store.retention"), "{e}");
    }

    #[test]
    fn contradictory_retry_settings_are_refused() {
        let e = error_of(&with_retry_line("min_try = \"2s\"\nper_try_timeout = \"1s\""));
        assert!(e.contains("routes[0].retry.min_try"), "{e}");
        let e = error_of(&with_retry_line("max_attempts = 0"));
        assert!(e.contains("routes[0].retry.max_attempts") && e.contains("at least 1"), "{e}");
        let e = error_of(&with_retry_line("max_attempts = -2"));
        assert!(e.contains("max_attempts"), "{e}");
        let e = error_of(&with_retry_line("base = \"5s\"\ncap = \"1s\""));
        assert!(e.contains("routes[0].retry.base"), "{e}");
        let e = error_of(&with_retry_line("jitter = \"random\""));
        assert!(e.contains("routes[0].retry.jitter") && e.contains("random"), "{e}");
        let e = error_of(&with_retry_line("not_processed = [503]\nambiguous = [503]"));
        assert!(e.contains("routes[0].retry.ambiguous"), "{e}");
        let e = error_of(&with_retry_line("ambiguous = [700]"));
        assert!(e.contains("routes[0].retry.ambiguous") && e.contains("700"), "{e}");
        let e = error_of(&with_retry_line("budget_ratio = 1.5"));
        assert!(e.contains("budget_ratio"), "{e}");
        let e = error_of(&with_retry_line("budget_ratio = nan"));
        assert!(e.contains("budget_ratio"), "{e}");
        let e = error_of(&with_retry_line("budget_min_per_sec = -1"));
        assert!(e.contains("budget_min_per_sec"), "{e}");
    }

    #[test]
    fn bad_route_fields_name_their_key() {
        let e = error_of(&with_route_line("max_body = \"lots\""));
        assert!(e.contains("routes[0].max_body"), "{e}");
        let e = error_of(&with_route_line("methods = [\"post\"]"));
        assert!(e.contains("routes[0].methods"), "{e}");
        let e = error_of(&with_route_line("max_concurrency = 0"));
        assert!(e.contains("routes[0].max_concurrency"), "{e}");
        let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"ftp://x\"\n");
        assert!(e.contains("routes[0].upstream"), "{e}");
        let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"p\"\nupstream = \"http://x\"\n");
        assert!(e.contains("routes[0].path_prefix"), "{e}");
        let e = error_of(&format!("{MINIMAL}{MINIMAL}"));
        assert!(e.contains("routes[1].name"), "{e}");
        let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/_idem/x\"\nupstream = \"http://x\"\n");
        assert!(e.contains("routes[0].path_prefix") && e.contains("/_idem"), "{e}");
        let e = error_of(&format!("{MINIMAL}[routes.circuit]\nopen_for = \"2m\"\n"));
        assert!(e.contains("routes[0].circuit.open_for"), "{e}");
        let e = error_of(&format!("{MINIMAL}[routes.circuit]\nfailures = 0\n"));
        assert!(e.contains("routes[0].circuit.failures"), "{e}");
    }

    #[test]
    fn unknown_keys_and_wrong_types_are_refused() {
        let e = error_of(&with_route_line("replay_safe = \"yes\""));
        assert!(e.contains("replay_safe"), "{e}");
        let e = error_of(&with_route_line("retries = 3"));
        assert!(e.contains("retries"), "{e}");
        let e = error_of("[server]\nlisten = \"localhost\"\n");
        assert!(e.contains("server.listen"), "{e}");
        for bad in ["-1", "101", "\"3\""] {
            let e = error_of(&format!("[worker]\nmax_takeovers = {bad}\n{MINIMAL}"));
            assert!(e.contains("max_takeovers"), "{e}");
        }
        let c = Config::parse_with_env(&format!("[worker]\nmax_takeovers = 0\n{MINIMAL}"), no_env).unwrap();
        assert_eq!(c.worker.max_takeovers, 0, "never continued after a take-over");
        let e = error_of("[store]\nurl = \"mysql://x\"\n");
        assert!(e.contains("store.url"), "{e}");
        let e = error_of("[store]\nurl = \"postgres://idem:hunter2@db/idem\"\n");
        assert!(e.contains("store.url") && e.contains("PGPASSWORD") && !e.contains("hunter2"), "{e}");
    }

    #[test]
    fn configs_that_cannot_be_right_are_refused_without_echoing_secrets() {
        let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"http://user:hunter2@up\"\n");
        assert!(e.contains("routes[0].upstream") && e.contains("user-info") && !e.contains("hunter2"), "{e}");
        let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"ftp://u:hunter2@up\"\n");
        assert!(e.contains("routes[0].upstream") && !e.contains("hunter2"), "{e}");
        let tenants = format!("{MINIMAL}[[auth.tenants]]\nname = \"acme\"\ntoken_sha256 = \"{}\"\n", "ab".repeat(32));
        let e = error_of(&tenants);
        assert!(e.contains("auth.admin_token_env") && e.contains("tenant"), "{e}");
        let twins =
            format!("{MINIMAL}[[routes]]\nname = \"p2\"\npath_prefix = \"/payments/\"\nupstream = \"http://x\"\n");
        let e = error_of(&twins);
        assert!(e.contains("routes[1].path_prefix"), "{e}");
        let e =
            error_of(&format!("[server]\nlisten = \"127.0.0.1:9000\"\nadmin_listen = \"127.0.0.1:9000\"\n{MINIMAL}"));
        assert!(e.contains("server.admin_listen"), "{e}");
        let e = error_of(&format!("[server]\nlisten = \"0.0.0.0:9000\"\nadmin_listen = \"127.0.0.1:9000\"\n{MINIMAL}"));
        assert!(e.contains("server.admin_listen"), "{e}");
        // Port 0 is any free port: two of them are fine.
        let any = format!("[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{MINIMAL}");
        assert!(Config::parse_with_env(&any, no_env).is_ok());
        let e = error_of(&format!("[store]\nretention = \"0s\"\n{MINIMAL}"));
        assert!(e.contains("store.retention") && e.contains("greater than zero"), "{e}");
        let e = error_of(&format!("[store]\nretention = \"1000years\"\n{MINIMAL}"));
        assert!(e.contains("store.retention") && e.contains("bound"), "{e}");
        let e = error_of(&with_retry_line("deadline = \"1000years\""));
        assert!(e.contains("routes[0].retry.deadline") && e.contains("bound"), "{e}");
        let e = error_of(&with_route_line("max_body = \"100TiB\""));
        assert!(e.contains("routes[0].max_body") && e.contains("bound"), "{e}");
        let e = error_of(&with_route_line("max_concurrency = 100000000000"));
        assert!(e.contains("routes[0].max_concurrency") && e.contains("bound"), "{e}");
        let e = error_of(&format!("{MINIMAL}[routes.probe]\npath = \"/payments/status\"\n"));
        assert!(e.contains("routes[0].probe.path") && e.contains("{idempotency_key}"), "{e}");
        for empty in ["", "[server]\n", "[store]\nurl = \"sqlite://x.db\"\n"] {
            let e = error_of(empty);
            assert!(e.contains("config key `routes`") && e.contains("no route"), "{e}");
        }
    }

    #[test]
    fn paths_that_a_parser_would_rewrite_are_refused_in_prefixes_and_upstreams() {
        let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/p/../admin\"\nupstream = \"http://x\"\n");
        assert!(e.contains("routes[0].path_prefix") && e.contains(".."), "{e}");
        let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"http://x/api/../admin\"\n");
        assert!(e.contains("routes[0].upstream") && e.contains("rewrites"), "{e}");
        let c = Config::parse_with_env(
            "[[routes]]\nname = \"o\"\npath_prefix = \"/orders\"\nupstream = \"http://x:1/orders-api/\"\n",
            no_env,
        )
        .unwrap();
        let route = &c.routes[0];
        assert_eq!((route.upstream.as_str(), route.upstream_path.as_str()), ("http://x:1/orders-api", "/orders-api"));
        assert_eq!(route.upstream_url("/orders/7", "").unwrap().as_str(), "http://x:1/orders-api/orders/7");
    }

    #[test]
    fn a_read_error_states_its_reason_once() {
        let e = Config::load(Path::new("/nonexistent/idem.toml")).unwrap_err();
        let chain = format!("{:#}", anyhow::Error::new(e));
        assert_eq!(chain.matches("No such file or directory").count(), 1, "{chain}");
        assert!(chain.contains("/nonexistent/idem.toml"), "{chain}");
    }

    #[test]
    fn secrets_come_from_the_environment() {
        let text = &format!("[auth]\nadmin_token_env = \"IDEM_TEST_TOKEN\"\n{MINIMAL}");
        let e = error_of(text);
        assert!(e.contains("auth.admin_token_env") && e.contains("IDEM_TEST_TOKEN"), "{e}");
        let c = Config::parse_with_env(text, |v| (v == "IDEM_TEST_TOKEN").then(|| "s3cret".into())).unwrap();
        assert_eq!(c.auth.admin_token.as_deref(), Some("s3cret"));
    }

    #[test]
    fn tenant_tokens_are_configured_as_digests() {
        let admin = "[auth]\nadmin_token_env = \"IDEM_TEST_TOKEN\"\n";
        let env = |v: &str| (v == "IDEM_TEST_TOKEN").then(|| "s3cret".to_string());
        let ok = format!("{admin}[[auth.tenants]]\nname = \"acme\"\ntoken_sha256 = \"{}\"\n{MINIMAL}", "ab".repeat(32));
        let c = Config::parse_with_env(&ok, env).unwrap();
        assert_eq!(c.auth.tenants[0].token_sha256, [0xab; 32]);
        let e = error_of("[[auth.tenants]]\nname = \"acme\"\ntoken_sha256 = \"plain-token\"\n");
        assert!(e.contains("auth.tenants[0].token_sha256"), "{e}");
    }

    #[test]
    fn check_prints_the_effective_policy_of_every_route() {
        let text = format!("{MINIMAL}[routes.retry]\nmax_attempts = 5\njitter = \"equal\"\n[routes.probe]\npath = \"/p/{{idempotency_key}}\"\n");
        let out = describe(&Config::parse_with_env(&text, no_env).unwrap());
        assert!(out.starts_with("config ok"), "{out}");
        assert!(out.contains("route payments  /payments -> http://127.0.0.1:9000"), "{out}");
        assert!(out.contains("5 attempts within 30s") && out.contains("Equal jitter"), "{out}");
        assert!(out.contains("circuit: opens after 5 failures"), "{out}");
        assert!(out.contains("probe GET /p/{idempotency_key} after 5s"), "{out}");
        assert!(out.contains("lease 15s, max_takeovers 3"), "{out}");
    }

    #[test]
    fn the_longest_prefix_wins_on_segment_boundaries() {
        let text = r#"
            [[routes]]
            name = "all"
            path_prefix = "/"
            upstream = "http://127.0.0.1:1"
            [[routes]]
            name = "payments"
            path_prefix = "/payments"
            upstream = "http://127.0.0.1:2"
            [[routes]]
            name = "refunds"
            path_prefix = "/payments/refunds/"
            upstream = "http://127.0.0.1:3"
        "#;
        let c = Config::parse_with_env(text, no_env).unwrap();
        let name = |p: &str| c.route_for(p).map(|r| r.name.as_str());
        assert_eq!(name("/payments"), Some("payments"));
        assert_eq!(name("/payments/42"), Some("payments"));
        assert_eq!(name("/payments/refunds/9"), Some("refunds"));
        assert_eq!(name("/paymentsX"), Some("all"));
        assert_eq!(name("/other"), Some("all"));
        let c = Config::parse_with_env(MINIMAL, no_env).unwrap();
        assert!(c.route_for("/other").is_none());
    }
}
