//! The TOML file's raw shape, and the validation of everything but the routes.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use http::Method;
use serde::Deserialize;

use super::*;

// ---- raw TOML shape -------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) server: Option<RawServer>,
    pub(super) store: Option<RawStore>,
    pub(super) auth: Option<RawAuth>,
    #[serde(default)]
    pub(super) routes: Vec<RawRoute>,
    #[serde(default)]
    pub(super) upstreams: Vec<quotas::RawUpstream>,
    pub(super) worker: Option<RawWorker>,
    pub(super) telemetry: Option<super::telemetry::RawTelemetry>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: Option<String>,
    pub(super) admin_listen: Option<String>,
    pub(super) header_timeout: Option<String>,
    pub(super) body_timeout: Option<String>,
    pub(super) max_connections: Option<i64>,
    pub(super) admin_max_connections: Option<i64>,
    pub(super) max_buffered_bodies: Option<String>,
    pub(super) tls_cert: Option<std::path::PathBuf>,
    pub(super) tls_key: Option<std::path::PathBuf>,
    pub(super) admin_tls_cert: Option<std::path::PathBuf>,
    pub(super) admin_tls_key: Option<std::path::PathBuf>,
    pub(super) drain: Option<String>,
    pub(super) drain_readiness: Option<String>,
    pub(super) access_log: Option<bool>,
    pub(super) forwarded: Option<bool>,
    #[serde(default)]
    pub(super) trusted_proxies: Vec<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub(super) url: Option<String>,
    /// Read as any value, so that one of the wrong type is refused by its key's name.
    pub(super) sync: Option<toml::Value>,
    pub(super) retention: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAuth {
    pub(super) admin_token_env: Option<String>,
    pub(super) token_header: Option<String>,
    #[serde(default)]
    pub(super) tenants: Vec<RawTenant>,
    pub(super) tenant_retry_budget_ratio: Option<f64>,
    pub(super) tenant_retry_budget_min_per_sec: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenant {
    pub(super) name: String,
    token_sha256: String,
    retry_budget_ratio: Option<f64>,
    retry_budget_min_per_sec: Option<f64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWorker {
    pub(super) concurrency: Option<i64>,
    pub(super) lease: Option<String>,
    pub(super) max_takeovers: Option<i64>,
    pub(super) send_window: Option<String>,
    pub(super) clock_margin: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) name: String,
    /// `http` (the default) or `mcp` (docs/mcp.md).
    pub(super) kind: Option<String>,
    pub(super) path_prefix: String,
    pub(super) upstream: String,
    pub(super) methods: Option<Vec<String>>,
    pub(super) replay_safe: Option<bool>,
    pub(super) forward_idempotency_key: Option<bool>,
    #[serde(default)]
    pub(super) upstream_headers_env: std::collections::BTreeMap<String, String>,
    pub(super) forward_authorization: Option<bool>,
    pub(super) require_key: Option<bool>,
    pub(super) retention: Option<String>,
    pub(super) tombstone: Option<String>,
    #[serde(default)]
    pub(super) key_from: Vec<String>,
    #[serde(default)]
    pub(super) fingerprint_ignore: Vec<String>,
    pub(super) max_body: Option<String>,
    pub(super) max_stored_body: Option<String>,
    pub(super) max_concurrency: Option<i64>,
    pub(super) retry: Option<RawRetry>,
    pub(super) circuit: Option<RawCircuit>,
    pub(super) probe: Option<RawProbe>,
    pub(super) deadline_header: Option<String>,
    pub(super) attempt_header: Option<RawHeaderSetting>,
    pub(super) ca_file: Option<std::path::PathBuf>,
    pub(super) client_cert: Option<std::path::PathBuf>,
    pub(super) client_key: Option<std::path::PathBuf>,
    pub(super) server_name: Option<String>,
    pub(super) canary: Option<RawCanary>,
    pub(super) mcp: Option<RawMcp>,
}

/// A header the broker may send, written as its name, or as `true` (its default name) or `false`
/// (not sent).
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub(super) enum RawHeaderSetting {
    Name(String),
    On(bool),
}

/// `[routes.mcp]` as written; validated in `mcp`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMcp {
    pub(super) in_flight_wait: Option<String>,
    #[serde(default)]
    pub(super) tools: std::collections::BTreeMap<String, RawMcpTool>,
}

/// `[routes.mcp.tools."name"]`: what the operator says of one tool, over its annotations.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMcpTool {
    pub(super) recorded: Option<bool>,
    pub(super) replay_safe: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCircuit {
    pub(super) failures: Option<i64>,
    pub(super) open_for: Option<String>,
    pub(super) max_open_for: Option<String>,
    pub(super) trials: Option<i64>,
}

#[derive(Deserialize, Default, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRetry {
    pub(super) max_attempts: Option<i64>,
    pub(super) deadline: Option<String>,
    pub(super) per_try_timeout: Option<String>,
    pub(super) min_try: Option<String>,
    pub(super) base: Option<String>,
    pub(super) cap: Option<String>,
    pub(super) jitter: Option<String>,
    pub(super) not_processed: Option<Vec<i64>>,
    pub(super) ambiguous: Option<Vec<i64>>,
    pub(super) budget_ratio: Option<f64>,
    pub(super) budget_min_per_sec: Option<f64>,
    pub(super) stream_idle_timeout: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
/// `[routes.canary]` as written; validated in `canary`.
pub(super) struct RawCanary {
    pub(super) percent: Option<f64>,
    pub(super) by: Option<String>,
    /// Only the fields that differ from the route's `[retry]`; the rest are inherited.
    #[serde(default)]
    pub(super) retry: RawRetry,
    #[serde(default)]
    pub(super) stop: RawCanaryStop,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCanaryStop {
    pub(super) amplification_over: Option<f64>,
    pub(super) final_success_drop: Option<f64>,
    pub(super) min_requests: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawProbe {
    pub(super) method: Option<String>,
    pub(super) path: String,
    pub(super) settle: Option<String>,
}

// ---- validation -----------------------------------------------------------------------------

/// A size like "1MiB": more than zero, at most [`MAX_BODY`].
pub(super) fn size(key: &str, value: Option<&str>, default: &str) -> Result<usize, ConfigError> {
    let text = value.unwrap_or(default);
    let bytes = text
        .parse::<bytesize::ByteSize>()
        .map_err(|_| invalid(key, format!("`{text}` is not a size like \"1MiB\"")))?
        .as_u64();
    if bytes == 0 {
        return Err(invalid(key, "must be greater than zero"));
    }
    if bytes > MAX_BODY {
        return Err(invalid(key, format!("`{text}` is beyond any sane bound (at most 1GiB)")));
    }
    usize::try_from(bytes).map_err(|_| invalid(key, "is too large"))
}

pub(super) fn duration(key: &str, value: Option<&str>, default: &str) -> Result<Duration, ConfigError> {
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

/// As [`duration`], where zero means "none" (`server.drain_readiness = "0s"`: no readiness phase).
pub(super) fn duration_or_none(key: &str, value: Option<&str>, default: &str) -> Result<Duration, ConfigError> {
    match value.unwrap_or(default).trim() {
        "0" | "0s" | "0ms" => Ok(Duration::ZERO),
        _ => duration(key, value, default),
    }
}

/// No setting is meant to last longer than this; a longer one is a typo (`1000years`) whose
/// arithmetic in milliseconds would overflow.
pub(super) const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// No count is meant to be larger than this.
pub(super) const MAX_COUNT: i64 = 1_000_000;

/// Bodies are held in memory and stored whole: a larger limit is a typo (`100TiB`).
pub(super) const MAX_BODY: u64 = 1024 * 1024 * 1024;

pub(super) fn socket_addr(key: &str, value: Option<&str>, default: &str) -> Result<SocketAddr, ConfigError> {
    let text = value.unwrap_or(default);
    text.parse().map_err(|_| invalid(key, format!("`{text}` is not an address like \"127.0.0.1:8080\"")))
}

pub(super) fn positive(key: &str, value: Option<i64>, default: i64) -> Result<usize, ConfigError> {
    let v = value.unwrap_or(default);
    if v < 1 {
        return Err(invalid(key, format!("must be at least 1, got {v}")));
    }
    if v > MAX_COUNT {
        return Err(invalid(key, format!("{v} is beyond any sane bound (at most {MAX_COUNT})")));
    }
    usize::try_from(v).map_err(|_| invalid(key, "is too large"))
}

pub(super) fn statuses(key: &str, value: Option<&[i64]>, default: &[u16]) -> Result<Vec<u16>, ConfigError> {
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

pub(super) fn method(key: &str, text: &str) -> Result<Method, ConfigError> {
    let valid = !text.is_empty() && text.bytes().all(|b| b.is_ascii_uppercase());
    if !valid {
        return Err(invalid(key, format!("`{text}` is not an upper-case HTTP method")));
    }
    Method::from_bytes(text.as_bytes()).map_err(|_| invalid(key, format!("`{text}` is not an HTTP method")))
}

impl RawConfig {
    pub(super) fn validate(self, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let server = validate_server(self.server.unwrap_or_default())?;
        let telemetry = self.telemetry.unwrap_or_default().validate()?;
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
        if url::Url::parse(&url).is_ok_and(|u| u.password().is_some()) {
            return Err(invalid(
                "store.url",
                "must not carry a password: secrets come from the environment (PGPASSWORD) or a .pgpass file",
            ));
        }
        if !url.starts_with("sqlite:") {
            super::tls::check_postgres_url(&url)?;
        }
        let sync = durability::validate(store.sync.as_ref(), &url)?;
        let store =
            StoreConfig { url, sync, retention: duration("store.retention", store.retention.as_deref(), "24h")? };

        let auth = validate_auth(self.auth.unwrap_or_default(), env)?;

        let worker = validate_worker(self.worker.unwrap_or_default())?;

        let upstreams = quotas::validate_upstreams(self.upstreams)?;
        let mut names = HashSet::new();
        let mut prefixes = HashSet::new();
        let mut routes = Vec::with_capacity(self.routes.len());
        for (i, raw) in self.routes.into_iter().enumerate() {
            let route = raw.validate(&format!("routes[{i}]"), store.retention, &upstreams, env)?;
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

        Ok(Config { server, store, auth, routes, upstreams, worker, telemetry })
    }
}

fn validate_server(server: RawServer) -> Result<ServerConfig, ConfigError> {
    let limits = EdgeLimits::validate(&server)?;
    let tls = ListenerTls::validate(("server.tls_cert", server.tls_cert), ("server.tls_key", server.tls_key))?;
    let admin_tls = ListenerTls::validate(
        ("server.admin_tls_cert", server.admin_tls_cert),
        ("server.admin_tls_key", server.admin_tls_key),
    )?;
    let trusted_proxies = server
        .trusted_proxies
        .iter()
        .map(|text| {
            text.parse::<ipnet::IpNet>().or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from)).map_err(
                |_| {
                    invalid(
                        "server.trusted_proxies",
                        format!("`{text}` is neither an address nor a network like 10.0.0.0/8"),
                    )
                },
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ServerConfig {
        listen: socket_addr("server.listen", server.listen.as_deref(), "127.0.0.1:8080")?,
        admin_listen: socket_addr("server.admin_listen", server.admin_listen.as_deref(), "127.0.0.1:8081")?,
        limits,
        tls,
        admin_tls,
        drain: duration("server.drain", server.drain.as_deref(), "10s")?,
        drain_readiness: duration_or_none("server.drain_readiness", server.drain_readiness.as_deref(), "0s")?,
        access_log: server.access_log.unwrap_or(true),
        forwarded: Forwarding { enabled: server.forwarded.unwrap_or(true), trusted_proxies },
    })
}

fn validate_worker(worker: RawWorker) -> Result<WorkerConfig, ConfigError> {
    let lease = duration("worker.lease", worker.lease.as_deref(), "15s")?;
    // Unless set, each is a second, or a fifth of a short lease.
    let fifth = humantime::format_duration((lease / 5).min(Duration::from_secs(1))).to_string();
    let send_window = duration("worker.send_window", worker.send_window.as_deref(), &fifth)?;
    let clock_margin = duration("worker.clock_margin", worker.clock_margin.as_deref(), &fifth)?;
    // A node trusts its lease for `lease - clock_margin` from the write that granted it, and
    // sends an attempt within `send_window` of the write that marked it: the window must fit in
    // the trust, or no attempt could ever be sent.
    if send_window + clock_margin >= lease {
        return Err(invalid(
            "worker.send_window",
            format!(
                "{} with clock_margin {} leaves nothing of the lease ({}): send_window + clock_margin must be \
                 shorter than lease",
                humantime::format_duration(send_window),
                humantime::format_duration(clock_margin),
                humantime::format_duration(lease)
            ),
        ));
    }
    Ok(WorkerConfig {
        concurrency: positive("worker.concurrency", worker.concurrency, 64)?,
        lease,
        max_takeovers: match worker.max_takeovers.unwrap_or(3) {
            n @ 0..=100 => n as u32,
            n => return Err(invalid("worker.max_takeovers", format!("must be between 0 and 100, got {n}"))),
        },
        send_window,
        clock_margin,
    })
}

pub(super) fn validate_auth(raw: RawAuth, env: &dyn Fn(&str) -> Option<String>) -> Result<AuthConfig, ConfigError> {
    let admin_token = match raw.admin_token_env {
        None => None,
        Some(var) => match env(&var) {
            Some(token) if !token.is_empty() => Some(secrecy::SecretString::from(token)),
            _ => {
                return Err(invalid(
                    "auth.admin_token_env",
                    format!("the environment variable {var} is not set (or empty)"),
                ))
            }
        },
    };
    let tenant_retry_budget =
        quotas::default_tenant_budget(raw.tenant_retry_budget_ratio, raw.tenant_retry_budget_min_per_sec)?;
    let mut seen = HashSet::new();
    let mut tenants = Vec::new();
    for (i, t) in raw.tenants.into_iter().enumerate() {
        let key = format!("auth.tenants[{i}]");
        let name = crate::domain::Tenant::parse(&t.name).map_err(|why| invalid(format!("{key}.name"), why))?;
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
        let retry_budget =
            quotas::tenant_budget(&key, t.retry_budget_ratio, t.retry_budget_min_per_sec, tenant_retry_budget)?;
        tenants.push(Tenant { name, token_sha256: digest, retry_budget });
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
    Ok(AuthConfig { admin_token, tenants, token_header, tenant_retry_budget })
}
