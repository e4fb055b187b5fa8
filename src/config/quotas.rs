//! Retry budgets beyond the route's (docs/configuration.md, `[[upstreams]]` and tenant quotas):
//! the named upstreams that routes share, and each tenant's retry quota.

use serde::Deserialize;

use super::*;

/// A retry budget's limits: over a 10 s window, retries may add `ratio` of the first attempts,
/// plus `min_per_sec` retries a second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetLimits {
    pub ratio: f64,
    pub min_per_sec: f64,
}

/// An upstream (a provider) that routes name instead of a URL: they share its retry budget and
/// its circuit breaker.
#[derive(Debug, Clone, PartialEq)]
pub struct Upstream {
    pub name: String,
    /// Its base URL, as validated for a route's `upstream`.
    pub url: String,
    pub budget: BudgetLimits,
}

/// What a tenant's quota is when only one of its two keys is given: a tenant's share is meant
/// to be a slice of a route's (whose defaults are 0.1 and 10/s), so its floor is smaller.
const TENANT_DEFAULT: BudgetLimits = BudgetLimits { ratio: 0.1, min_per_sec: 1.0 };
/// A named upstream's budget, unless given: the same as a route's.
const UPSTREAM_DEFAULT: BudgetLimits = BudgetLimits { ratio: 0.1, min_per_sec: 10.0 };

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    name: String,
    url: String,
    budget_ratio: Option<f64>,
    budget_min_per_sec: Option<f64>,
}

/// A budget's two keys, validated; `None` when neither is given and there is no `default`.
pub(super) fn budget_limits(
    key: &str,
    (ratio_key, min_key): (&str, &str),
    (ratio, min_per_sec): (Option<f64>, Option<f64>),
    default: Option<BudgetLimits>,
    fallback: BudgetLimits,
) -> Result<Option<BudgetLimits>, ConfigError> {
    if ratio.is_none() && min_per_sec.is_none() {
        return Ok(default);
    }
    let base = default.unwrap_or(fallback);
    let ratio = ratio.unwrap_or(base.ratio);
    if !ratio.is_finite() || !(0.0..=1.0).contains(&ratio) {
        return Err(invalid(format!("{key}{ratio_key}"), "must be a fraction between 0 and 1"));
    }
    let min_per_sec = min_per_sec.unwrap_or(base.min_per_sec);
    if !min_per_sec.is_finite() || min_per_sec < 0.0 {
        return Err(invalid(format!("{key}{min_key}"), "must be zero or more"));
    }
    Ok(Some(BudgetLimits { ratio, min_per_sec }))
}

pub(super) fn validate_upstreams(raw: Vec<RawUpstream>) -> Result<Vec<Upstream>, ConfigError> {
    let mut upstreams: Vec<Upstream> = Vec::with_capacity(raw.len());
    for (i, u) in raw.into_iter().enumerate() {
        let key = format!("upstreams[{i}]");
        if u.name.is_empty() || !u.name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
            return Err(invalid(format!("{key}.name"), "must be non-empty and use only letters, digits, - _ ."));
        }
        if upstreams.iter().any(|other| other.name == u.name) {
            return Err(invalid(format!("{key}.name"), format!("upstream `{}` is listed twice", u.name)));
        }
        let url = route::upstream_url(&format!("{key}.url"), &u.url)?;
        let budget = budget_limits(
            &format!("{key}."),
            ("budget_ratio", "budget_min_per_sec"),
            (u.budget_ratio, u.budget_min_per_sec),
            None,
            UPSTREAM_DEFAULT,
        )?
        .unwrap_or(UPSTREAM_DEFAULT);
        upstreams.push(Upstream { name: u.name, url: url.as_str().to_string(), budget });
    }
    Ok(upstreams)
}

/// The quota every tenant has unless its own entry sets one: `[auth] tenant_retry_budget_*`.
pub(super) fn default_tenant_budget(
    ratio: Option<f64>,
    min_per_sec: Option<f64>,
) -> Result<Option<BudgetLimits>, ConfigError> {
    budget_limits(
        "auth.",
        ("tenant_retry_budget_ratio", "tenant_retry_budget_min_per_sec"),
        (ratio, min_per_sec),
        None,
        TENANT_DEFAULT,
    )
}

/// A listed tenant's quota: its own keys, each falling back to the default's.
pub(super) fn tenant_budget(
    key: &str,
    ratio: Option<f64>,
    min_per_sec: Option<f64>,
    default: Option<BudgetLimits>,
) -> Result<Option<BudgetLimits>, ConfigError> {
    budget_limits(
        &format!("{key}."),
        ("retry_budget_ratio", "retry_budget_min_per_sec"),
        (ratio, min_per_sec),
        default,
        TENANT_DEFAULT,
    )
}

impl Config {
    /// The retry quota of `tenant`: its own, or every tenant's default; `None`: no quota.
    pub fn tenant_budget(&self, tenant: &str) -> Option<BudgetLimits> {
        match self.auth.tenants.iter().find(|t| t.name.as_str() == tenant) {
            Some(listed) => listed.retry_budget,
            None => self.auth.tenant_retry_budget,
        }
    }

    pub fn upstream_named(&self, name: &str) -> Option<&Upstream> {
        self.upstreams.iter().find(|u| u.name == name)
    }
}

impl Route {
    /// What its upstream is known by at run time: the `[[upstreams]]` name it calls through, or
    /// its URL. Routes with the same one share a breaker (and, when named, a retry budget).
    pub fn upstream_key(&self) -> &str {
        self.upstream_name.as_deref().unwrap_or(&self.upstream)
    }

    /// Whether an upstream answer of `status` is one tenant's own rather than the upstream's
    /// failure: on a route that forwards the client's credential, a refused credential or a rate
    /// limit is that credential's. The breaker does not count it against everyone: the upstream
    /// answered (docs/concepts.md, circuit breaker).
    pub fn refuses_the_tenant(&self, status: u16) -> bool {
        self.forward_authorization && matches!(status, 401 | 403 | 429)
    }
}
