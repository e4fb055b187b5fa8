//! A route's table, validated: its path and upstream, credentials, key rules and policies.

use std::time::Duration;

use http::Method;

use crate::policy::Effective;

use super::mcp::{check_mcp_route, RouteKind, MCP_NOT_PROCESSED};
use super::raw::*;
use super::tls::RawUpstreamTls;
use super::*;

impl RawRoute {
    pub(super) fn validate(
        self,
        key: &str,
        store_retention: Duration,
        upstreams: &[NamedUpstream],
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Route, ConfigError> {
        let name = RouteName::parse(&self.name).map_err(|why| invalid(format!("{key}.name"), why))?;
        if self.name == crate::domain::switch::Scope::ALL {
            return Err(invalid(
                format!("{key}.name"),
                "`all` means every route to an emergency switch: pick another name",
            ));
        }
        if !self.path_prefix.starts_with('/') {
            return Err(invalid(format!("{key}.path_prefix"), "must start with /"));
        }
        if prefix_matches("/_idem", &self.path_prefix) {
            return Err(invalid(format!("{key}.path_prefix"), "/_idem is the broker's own path"));
        }
        crate::domain::path::check(&self.path_prefix)
            .map_err(|e| invalid(format!("{key}.path_prefix"), e.to_string()))?;
        let kind = RouteKind::parse(&format!("{key}.kind"), self.kind.as_deref())?;
        match kind {
            RouteKind::Mcp => check_mcp_route(key, &self)?,
            RouteKind::Http if self.mcp.is_some() => {
                return Err(invalid(format!("{key}.mcp"), "is only for a route with kind = \"mcp\""))
            }
            RouteKind::Http => {}
        }
        // A URL, or the name of an `[[upstreams]]` entry whose URL it calls.
        let upstream_name = match self.upstream.contains("://") {
            true => None,
            false => match upstreams.iter().find(|u| u.name == self.upstream) {
                Some(named) => Some(named),
                None => {
                    return Err(invalid(
                        format!("{key}.upstream"),
                        format!(
                            "is neither an http(s) URL nor the name of an [[upstreams]] entry (`{}`)",
                            self.upstream
                        ),
                    ))
                }
            },
        };
        let upstream = match upstream_name {
            Some(named) => upstream_url(&format!("{key}.upstream"), &named.url)?,
            None => upstream_url(&format!("{key}.upstream"), &self.upstream)?,
        };
        let tls = RawUpstreamTls {
            ca_file: self.ca_file,
            client_cert: self.client_cert,
            client_key: self.client_key,
            server_name: self.server_name,
        };
        let upstream_tls = match upstream_name {
            Some(named) if !tls.is_empty() => {
                return Err(invalid(
                    format!("{key}.upstream"),
                    format!(
                        "names the [[upstreams]] entry `{}`: set its TLS there, for every route that names it",
                        named.name
                    ),
                ))
            }
            Some(named) => named.tls.clone(),
            None => tls.validate(key, &upstream)?,
        };
        let methods = match self.methods {
            // An MCP client POSTs every request; only its `tools/call` is ever recorded.
            None if kind == RouteKind::Mcp => vec![Method::POST],
            None => vec![Method::POST, Method::PATCH],
            Some(list) if list.is_empty() => {
                return Err(invalid(format!("{key}.methods"), "must name at least one method"))
            }
            Some(list) => list.iter().map(|m| method(&format!("{key}.methods"), m)).collect::<Result<_, _>>()?,
        };
        let max_body = size(&format!("{key}.max_body"), self.max_body.as_deref(), "1MiB")?;
        let max_stored_body = size(&format!("{key}.max_stored_body"), self.max_stored_body.as_deref(), "8MiB")?;
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
            .map(|name| broker_header(&format!("{key}.deadline_header"), name, &upstream_headers))
            .transpose()?;
        let attempt_header = attempt_header(
            &format!("{key}.attempt_header"),
            self.attempt_header,
            &upstream_headers,
            deadline_header.as_ref(),
        )?;
        let mut raw_retry = self.retry.unwrap_or_default();
        if kind == RouteKind::Mcp && raw_retry.not_processed.is_none() {
            // An MCP server answers a tool call in JSON-RPC, errors included, with 200: a 400 or
            // 404 (a session it does not know) is the transport's refusal, before any tool ran.
            raw_retry.not_processed = Some(MCP_NOT_PROCESSED.to_vec());
        }
        let retry = raw_retry.clone().validate(&format!("{key}.retry"))?;
        let circuit = self.circuit.unwrap_or_default().validate(&format!("{key}.circuit"))?;
        let replay_safe = self.replay_safe.unwrap_or(false);
        let version = |retry: &RetryPolicy| {
            Effective {
                retry,
                replay_safe,
                deadline_header: deadline_header.as_ref().map(|h| h.as_str()),
                circuit: &circuit,
            }
            .version()
        };
        let policy_version = version(&retry);
        let canary =
            self.canary.map(|c| c.validate(&format!("{key}.canary"), raw_retry, &retry, version)).transpose()?;
        let mcp = match kind {
            RouteKind::Mcp => {
                let replay_safe_version = Effective {
                    retry: &retry,
                    replay_safe: true,
                    deadline_header: deadline_header.as_ref().map(|h| h.as_str()),
                    circuit: &circuit,
                }
                .version();
                Some(self.mcp.unwrap_or_default().validate(&format!("{key}.mcp"), replay_safe_version)?)
            }
            RouteKind::Http => None,
        };
        Ok(Route {
            name,
            path_prefix: self.path_prefix,
            upstream: upstream.as_str().trim_end_matches('/').to_string(),
            upstream_base: upstream,
            upstream_name: upstream_name.map(|u| u.name.clone()),
            methods,
            replay_safe,
            forward_idempotency_key: self.forward_idempotency_key.unwrap_or(true),
            upstream_headers,
            forward_authorization: self.forward_authorization.unwrap_or(false),
            require_key: self.require_key.unwrap_or(true),
            retention,
            tombstone,
            key_from,
            fingerprint_ignore: self.fingerprint_ignore,
            max_body,
            max_stored_body,
            max_concurrency: positive(&format!("{key}.max_concurrency"), self.max_concurrency, 256)?,
            retry,
            circuit,
            probe,
            deadline_header,
            attempt_header,
            upstream_tls,
            policy_version,
            canary,
            mcp,
        })
    }
}

/// A header name the broker may set on every attempt: not one that belongs to the connection,
/// the client's session, the key, or the route's credentials, which it would overwrite.
fn broker_header(key: &str, name: &str, credentials: &http::HeaderMap) -> Result<http::HeaderName, ConfigError> {
    let parsed = http::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| invalid(key, format!("`{name}` is not a valid header name")))?;
    if crate::domain::headers::is_reserved(parsed.as_str()) {
        return Err(invalid(key, format!("`{name}` is a header the broker or the connection already uses")));
    }
    if credentials.contains_key(&parsed) {
        return Err(invalid(key, format!("`{name}` is also one of the route's upstream_headers_env")));
    }
    Ok(parsed)
}

/// The header every attempt carries its claim in: `Idem-Attempt` unless the route names another,
/// none when it says `false`. Like the deadline header, it must not clash with a header the
/// broker, the connection or the route's credentials already set.
fn attempt_header(
    key: &str,
    setting: Option<RawHeaderSetting>,
    credentials: &http::HeaderMap,
    deadline: Option<&http::HeaderName>,
) -> Result<Option<http::HeaderName>, ConfigError> {
    let name = match setting {
        None | Some(RawHeaderSetting::On(true)) => crate::domain::headers::ATTEMPT_HEADER.to_string(),
        Some(RawHeaderSetting::On(false)) => return Ok(None),
        Some(RawHeaderSetting::Name(name)) => name,
    };
    let parsed = broker_header(key, &name, credentials)?;
    if deadline == Some(&parsed) {
        return Err(invalid(key, format!("`{name}` is also the route's deadline_header")));
    }
    Ok(Some(parsed))
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
pub(super) fn upstream_url(key: &str, text: &str) -> Result<url::Url, ConfigError> {
    let url = url::Url::parse(text)
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
    pub(super) fn validate(self, key: &str) -> Result<RetryPolicy, ConfigError> {
        let k = |name: &str| format!("{key}.{name}");
        let max_attempts = positive(&k("max_attempts"), self.max_attempts, 3)?;
        let max_attempts = u32::try_from(max_attempts).map_err(|_| invalid(k("max_attempts"), "is too large"))?;
        let deadline = duration(&k("deadline"), self.deadline.as_deref(), "30s")?;
        let per_try_timeout = duration(&k("per_try_timeout"), self.per_try_timeout.as_deref(), "10s")?;
        let min_try = duration(&k("min_try"), self.min_try.as_deref(), "100ms")?;
        let base = duration(&k("base"), self.base.as_deref(), "100ms")?;
        let cap = duration(&k("cap"), self.cap.as_deref(), "2s")?;
        let stream_idle_timeout = duration(&k("stream_idle_timeout"), self.stream_idle_timeout.as_deref(), "30s")?;
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
            stream_idle_timeout,
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
