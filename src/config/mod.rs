//! The broker's configuration (docs/configuration.md): a TOML file parsed into raw serde structs, then
//! validated into typed values. Anything wrong is refused at start with an error that names the
//! key and the problem, so a bad deploy fails before it serves a single request.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::Method;

use crate::domain::PolicyVersion;
use crate::domain::RouteName;
use crate::policy::{BreakerSettings, Jitter, RetryPolicy};
use crate::record::Lifetime;

mod canary;
mod candidate;
mod described;
mod diff;
mod durability;
pub use durability::Durability;
pub(crate) use durability::{split_synchronous, Synchronous};
mod limits;
mod mcp;
mod overrides;
mod postgres_url;
pub(crate) use postgres_url::{PostgresUrl, Target};
mod quotas;
mod raw;
use raw::RawConfig;
mod route;
mod telemetry;
#[cfg(test)]
mod tests;
mod tls;
pub use canary::{Canary, CanaryBy, Policy};
pub use candidate::Candidate;
pub use described::describe;
pub use diff::{changes, Changes, RouteChange, RouteVersion, RESTART_ONLY};
pub use limits::EdgeLimits;
pub use mcp::{McpSettings, RouteKind, ToolRule};
pub use quotas::{BudgetLimits, NamedUpstream, TenantQuotas};
pub use telemetry::TelemetryConfig;
pub use tls::{default_upstream_tls, ListenerTls, UpstreamTls};

/// A configuration error. `key` is the dotted path of the offending key, as the user wrote it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The reason is the error's source, so that a report of the whole chain states it once.
    #[error("cannot read {path}")]
    Read { path: String, source: std::io::Error },
    /// Not TOML, or not the config's shape: where (the file, when read from one; the line and
    /// column) and what, in one line.
    #[error("{0}")]
    Syntax(String),
    #[error("config key `{key}`: {problem}")]
    Invalid { key: String, problem: String },
}

/// The file at `path` with the environment's overrides applied: what every command reads.
pub fn read(path: &Path) -> Result<String, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
    overridden(&text, path)
}

/// `text`, read from `path`, with the environment's overrides applied (`IDEM_STORE__URL`).
pub fn overridden(text: &str, path: &Path) -> Result<String, ConfigError> {
    overrides::apply(text, std::env::vars()).map_err(|e| e.in_file(path))
}

/// A TOML error of `text` in one line: `line L, column C: what` (the `toml` crate's own words
/// span several lines, with a drawing of the spot).
pub(crate) fn syntax(text: &str, error: &toml::de::Error) -> ConfigError {
    let message = error.message().trim().replace('\n', " ");
    match error.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |at| at + 1) + 1;
            // The line itself, which names the key (`replay_safe = "yes"`) or the table.
            let said: String = text.lines().nth(line - 1).unwrap_or_default().trim().chars().take(80).collect();
            ConfigError::Syntax(format!("line {line}, column {column} (`{said}`): {message}"))
        }
        None => ConfigError::Syntax(message),
    }
}

impl ConfigError {
    /// This error as read from the file at `path`: a syntax error names it.
    pub fn in_file(self, path: &Path) -> ConfigError {
        match self {
            ConfigError::Syntax(said) => ConfigError::Syntax(format!("{}: {said}", path.display())),
            other => other,
        }
    }

    /// The key at fault, when there is one: the key of an invalid value, or an unknown one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { key, .. } => Some(key),
            ConfigError::Syntax(said) => said.split("unknown field `").nth(1).and_then(|rest| rest.split('`').next()),
            ConfigError::Read { .. } => None,
        }
    }
}

fn invalid(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), problem: problem.into() }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub auth: AuthConfig,
    pub routes: Vec<Route>,
    /// `[[upstreams]]`: providers that routes name, sharing their retry budget and breaker.
    pub upstreams: Vec<NamedUpstream>,
    pub worker: WorkerConfig,
    pub telemetry: TelemetryConfig,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub limits: EdgeLimits,
    /// The data listener's certificate and key: it speaks TLS when set. Read again on reload.
    pub tls: Option<ListenerTls>,
    /// The admin listener's, set apart from the data listener's (the same files may be named).
    pub admin_tls: Option<ListenerTls>,
    /// How long a shutdown (SIGTERM) lets attempts in flight finish and be stored.
    pub drain: Duration,
    /// How long a node leaving on SIGTERM keeps serving with `/readyz` failing, before its
    /// listeners close and the drain begins: the time a load balancer takes to see it go.
    pub drain_readiness: Duration,
    /// A log line per answered request on the data plane (docs/operations.md#logs).
    pub access_log: bool,
    /// How the client's address is passed upstream.
    pub forwarded: Forwarding,
}

/// `X-Forwarded-For` and `Forwarded` on what goes upstream: the address of the client that sent
/// the request, after what a trusted proxy in front of Idem says it forwarded.
#[derive(Debug, Clone, PartialEq)]
pub struct Forwarding {
    /// Add them at all (`[server] forwarded`).
    pub enabled: bool,
    /// Proxies in front of Idem whose own `X-Forwarded-For` and `Forwarded` are kept and
    /// extended; from anyone else, they are replaced (a client cannot pose as another address).
    pub trusted_proxies: Vec<ipnet::IpNet>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    /// `sqlite://…` or `postgres://…`; the scheme picks the backend.
    pub url: String,
    /// What a commit survives before it counts: `store.sync`, or else a SQLite url's own
    /// `synchronous=`.
    pub sync: crate::config::Durability,
    /// How long `done` records are kept and replayed.
    pub retention: Duration,
}

#[derive(Debug, Clone, Default)]
pub struct AuthConfig {
    /// The admin bearer token, read from the environment variable the config names; a secret,
    /// so that no debug print or log line shows it. `None` means the admin API takes no token.
    pub admin_token: Option<secrecy::SecretString>,
    /// Empty means every caller is tenant "default" — or, when a route forwards the client's
    /// `Authorization`, the tenant of that credential's digest.
    pub tenants: Vec<Tenant>,
    /// A header that carries the tenant token (e.g. `x-api-key`), read before `Authorization`.
    pub token_header: Option<http::HeaderName>,
    /// Every tenant's retry quota unless its entry sets its own; `None`: tenants have none.
    pub tenant_retry_budget: Option<BudgetLimits>,
}

/// Whether a reload changes the auth settings (see [`changes`]).
impl PartialEq for AuthConfig {
    fn eq(&self, other: &AuthConfig) -> bool {
        use secrecy::ExposeSecret;
        let token = |a: &AuthConfig| a.admin_token.as_ref().map(|t| t.expose_secret().to_string());
        token(self) == token(other)
            && self.tenants == other.tenants
            && self.token_header == other.token_header
            && self.tenant_retry_budget == other.tenant_retry_budget
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    /// Held as the records name it, so that a request's tenant is this one, shared.
    pub name: crate::domain::Tenant,
    /// SHA-256 of the tenant's bearer token; the token itself is never stored.
    pub token_sha256: [u8; 32],
    /// Its retry quota (or the default every tenant has); `None`: none.
    pub retry_budget: Option<BudgetLimits>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// Records executed at once by this process.
    pub concurrency: usize,
    /// An `in_progress` record whose lease is not renewed within this is taken over.
    pub lease: Duration,
    /// Take-overs after which a record is stopped instead of continued: a record whose worker
    /// keeps dying on it (one that crashes the process, say) must not do so forever.
    pub max_takeovers: u32,
    /// An attempt is sent within this of the write that marked it being sent, or not at all:
    /// every marked attempt has a bounded life (docs/guarantees.md).
    pub send_window: Duration,
    /// What clocks may disagree by: a node trusts its lease for `lease - clock_margin`, and an
    /// attempt's bound is its mark + `send_window` + its time limit + `clock_margin`.
    pub clock_margin: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub name: RouteName,
    pub path_prefix: String,
    /// Base URL of the upstream, without a trailing slash; the request path is appended.
    pub upstream: String,
    /// The `[[upstreams]]` entry the route calls through, when it names one instead of a URL.
    pub upstream_name: Option<String>,
    /// The upstream URL as parsed once: each request's URL is a copy with its path and query
    /// set, rather than a whole URL parsed again (its host is the costly part). Every path sent
    /// upstream is this URL's own path, without its trailing slash, followed by the request's.
    pub upstream_base: url::Url,
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
    /// Answers longer than this are passed to the client but not stored: their duplicates get
    /// 409 `response-not-stored` (docs/concepts.md).
    pub max_stored_body: usize,
    pub max_concurrency: usize,
    pub retry: RetryPolicy,
    pub circuit: BreakerSettings,
    pub probe: Option<Probe>,
    /// The header that tells the upstream, on every attempt, how many milliseconds that attempt
    /// has; a client sending it on a keyed request may shorten the record's deadline with it.
    pub deadline_header: Option<http::HeaderName>,
    /// The header that carries each attempt's claim upstream (`Idem-Attempt` unless renamed, or
    /// none), so that the upstream can refuse a stale attempt (docs/guarantees.md).
    pub attempt_header: Option<http::HeaderName>,
    /// TLS towards the upstream beyond the defaults: extra roots, a client certificate, a
    /// server name (the route's own, or its `[[upstreams]]` entry's).
    pub upstream_tls: Option<UpstreamTls>,
    /// The digest of the policy above (`retry`, `replay_safe`, `deadline_header`, `circuit`),
    /// computed once here: every attempt is stored and counted with it.
    pub policy_version: PolicyVersion,
    /// A candidate retry policy tried on a stable slice of the route's traffic.
    pub canary: Option<Canary>,
    /// Set on a route of `kind = "mcp"` (docs/mcp.md): only its `tools/call` requests are recorded.
    pub mcp: Option<McpSettings>,
}

/// One source of a derived key (docs/agents.md `key_from`).
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

#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    pub method: Method,
    /// A path template; `{idempotency_key}` is replaced by the record's key.
    pub path: String,
    /// How long after the outcome became unknown the first probe is sent.
    pub settle: Duration,
}

/// What stands in for a secret a command that does not serve could not read.
const UNSET_SECRET: &str = "unset";

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = read(path)?;
        Config::parse(&text).map_err(|e| e.in_file(path))
    }

    /// Parses and validates a config, reading secrets from the process environment.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse_with_env(text, |name| std::env::var(name).ok())
    }

    /// Reads a config for a command that does not serve (`check`, `simulate`, `migrate`). The
    /// secrets it names are read from the environment where set; one that is missing is no error
    /// here, since nothing is served with it: a placeholder stands in, and the variables missing
    /// are returned so that `idem check` can warn that `idem serve` would refuse the config.
    pub fn load_offline(path: &Path) -> Result<(Config, Vec<String>), ConfigError> {
        let text = read(path)?;
        Config::parse_offline(&text, |name| std::env::var(name).ok()).map_err(|e| e.in_file(path))
    }

    /// [`Config::load_offline`] on a text, with `env` as the environment.
    pub fn parse_offline(
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(Config, Vec<String>), ConfigError> {
        let missing = std::cell::RefCell::new(Vec::new());
        let config = Config::parse_with_env(text, |name| {
            env(name).filter(|value| !value.is_empty()).or_else(|| {
                missing.borrow_mut().push(name.to_string());
                Some(UNSET_SECRET.into())
            })
        })?;
        Ok((config, missing.into_inner()))
    }

    pub fn parse_with_env(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| syntax(text, &e))?;
        raw.validate(&env)
    }

    pub fn route_named(&self, name: &str) -> Option<&Route> {
        self.position_named(name).map(|i| &self.routes[i])
    }

    /// The longest an attempt marked under this configuration may still reach the upstream after
    /// its mark: the send window, the longest attempt limit of any route's policies (a canary's
    /// included), and the clock margin.
    pub fn longest_reach(&self) -> Duration {
        let limit = self
            .routes
            .iter()
            .flat_map(|r| [Some(r.retry.per_try_timeout), r.canary.as_ref().map(|c| c.retry.per_try_timeout)])
            .flatten()
            .max()
            .unwrap_or_default();
        self.worker.send_window + limit + self.worker.clock_margin
    }

    /// How long the done records of the route called `route` live: its own lifetime, or for a
    /// route no longer configured the store's retention, and no tombstone.
    pub fn lifetime_of(&self, route: &str) -> Lifetime {
        self.route_named(route)
            .map_or(Lifetime { retention: self.store.retention, tombstone: Duration::ZERO }, Route::lifetime)
    }

    /// Where in `routes` the route for `path` is: the one whose `path_prefix` is the longest
    /// prefix of `path`, on a segment boundary.
    pub fn position_for(&self, path: &str) -> Option<usize> {
        (self.routes.iter().enumerate())
            .filter(|(_, r)| prefix_matches(&r.path_prefix, path))
            .max_by_key(|(_, r)| r.path_prefix.len())
            .map(|(i, _)| i)
    }

    /// Where in `routes` the route called `name` is.
    pub fn position_named(&self, name: &str) -> Option<usize> {
        self.routes.iter().position(|r| r.name == name)
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
    /// How long its done records live: its `retention`, then its `tombstone`.
    pub fn lifetime(&self) -> Lifetime {
        Lifetime { retention: self.retention, tombstone: self.tombstone }
    }

    pub fn kind(&self) -> RouteKind {
        if self.mcp.is_some() {
            RouteKind::Mcp
        } else {
            RouteKind::Http
        }
    }

    /// Where a request with this path and query goes upstream; refused unless the URL sent
    /// has exactly the path matched (see [`crate::domain::path`]).
    pub fn upstream_url(&self, path: &str, query: &str) -> Result<url::Url, crate::domain::path::InvalidPath> {
        crate::domain::path::upstream_url(&self.upstream_base, path, query)
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
