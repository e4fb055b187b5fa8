//! Retry budgets beyond the route's (docs/configuration.md, `[[upstreams]]` and tenant quotas):
//! the named upstreams that routes share, and each tenant's retry quota.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::tls::RawUpstreamTls;
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
pub struct NamedUpstream {
    pub name: String,
    /// Its base URL, as validated for a route's `upstream`.
    pub url: String,
    pub budget: BudgetLimits,
    /// TLS towards it, for the routes that name it: its `ca_file`, `client_cert`, `client_key`
    /// and `server_name`.
    pub tls: Option<super::UpstreamTls>,
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
    ca_file: Option<std::path::PathBuf>,
    client_cert: Option<std::path::PathBuf>,
    client_key: Option<std::path::PathBuf>,
    server_name: Option<String>,
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

pub(super) fn validate_upstreams(raw: Vec<RawUpstream>) -> Result<Vec<NamedUpstream>, ConfigError> {
    let mut upstreams: Vec<NamedUpstream> = Vec::with_capacity(raw.len());
    for (i, u) in raw.into_iter().enumerate() {
        let key = format!("upstreams[{i}]");
        RouteName::parse(&u.name).map_err(|why| invalid(format!("{key}.name"), why))?;
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
        let tls = RawUpstreamTls {
            ca_file: u.ca_file,
            client_cert: u.client_cert,
            client_key: u.client_key,
            server_name: u.server_name,
        }
        .validate(&key, &url)?;
        upstreams.push(NamedUpstream { name: u.name, url: url.as_str().to_string(), budget, tls });
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

/// Every tenant's retry quota: the listed tenants' own, and the default of every other.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantQuotas {
    pub default: Option<BudgetLimits>,
    pub listed: BTreeMap<String, Option<BudgetLimits>>,
}

impl TenantQuotas {
    /// The quota of `tenant`; `None`: it has none.
    pub fn of(&self, tenant: &crate::domain::Tenant) -> Option<BudgetLimits> {
        self.listed.get(tenant.as_str()).copied().unwrap_or(self.default)
    }

    /// These quotas with `changes` applied: a tenant's keys left out keep its current value.
    pub(super) fn changed(&self, changes: BTreeMap<String, RawQuota>) -> Result<TenantQuotas, ConfigError> {
        let mut quotas = self.clone();
        for (name, change) in changes {
            let current = if name == "default" { self.default } else { self.of(&name.as_str().into()) };
            let quota = budget_limits(
                &format!("tenants.{name}."),
                ("retry_budget_ratio", "retry_budget_min_per_sec"),
                (change.retry_budget_ratio, change.retry_budget_min_per_sec),
                current,
                TENANT_DEFAULT,
            )?;
            match name.as_str() {
                "default" => quotas.default = quota,
                _ => _ = quotas.listed.insert(name, quota),
            }
        }
        Ok(quotas)
    }
}

/// A candidate's change to one tenant's quota (`idem simulate --history`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawQuota {
    retry_budget_ratio: Option<f64>,
    retry_budget_min_per_sec: Option<f64>,
}

impl Config {
    /// Every tenant's retry quota.
    pub fn tenant_quotas(&self) -> TenantQuotas {
        TenantQuotas {
            default: self.auth.tenant_retry_budget,
            listed: self.auth.tenants.iter().map(|t| (t.name.to_string(), t.retry_budget)).collect(),
        }
    }

    pub fn upstream_named(&self, name: &str) -> Option<&NamedUpstream> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTE: &str =
        "[[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"http://127.0.0.1:9000\"\n";

    fn parse(text: &str) -> Result<Config, String> {
        std::env::set_var("IDEM_QUOTA_TEST_TOKEN", "secret");
        Config::parse_with_env(text, |name| std::env::var(name).ok()).map_err(|e| e.to_string())
    }

    fn tenants(extra: &str) -> String {
        let digest = "0".repeat(64);
        format!(
            "[auth]\nadmin_token_env = \"IDEM_QUOTA_TEST_TOKEN\"\n{extra}\n\
             [[auth.tenants]]\nname = \"acme\"\ntoken_sha256 = \"{digest}\"\nretry_budget_min_per_sec = 0.5\n\
             [[auth.tenants]]\nname = \"globex\"\ntoken_sha256 = \"{digest}\"\n{ROUTE}"
        )
    }

    #[test]
    fn tenants_have_no_quota_unless_one_is_set_and_a_tenants_keys_fall_back_to_the_default() {
        let none = parse(ROUTE).unwrap();
        assert_eq!(none.tenant_quotas().of(&"anyone".into()), None);

        let c = parse(&tenants("tenant_retry_budget_ratio = 0.05\ntenant_retry_budget_min_per_sec = 2")).unwrap();
        let quotas = c.tenant_quotas();
        assert_eq!(quotas.of(&"acme".into()), Some(BudgetLimits { ratio: 0.05, min_per_sec: 0.5 }), "its own floor");
        assert_eq!(quotas.of(&"globex".into()), Some(BudgetLimits { ratio: 0.05, min_per_sec: 2.0 }), "the default");
        assert_eq!(quotas.of(&"unlisted".into()), Some(BudgetLimits { ratio: 0.05, min_per_sec: 2.0 }));
        assert!(describe(&c).contains("tenant quota  5% of first attempts + 2/s"), "{}", describe(&c));

        // One key of its own and no default: the other key is a tenant's documented default.
        let c = parse(&tenants("")).unwrap();
        assert_eq!(
            c.tenant_quotas().of(&"acme".into()),
            Some(BudgetLimits { ratio: TENANT_DEFAULT.ratio, min_per_sec: 0.5 })
        );
        assert_eq!(c.tenant_quotas().of(&"globex".into()), None);
    }

    #[test]
    fn a_quota_out_of_range_is_refused_naming_its_key() {
        let e = parse(&tenants("tenant_retry_budget_ratio = 1.5")).unwrap_err();
        assert!(e.contains("auth.tenant_retry_budget_ratio"), "{e}");
        let e = parse(&tenants("tenant_retry_budget_min_per_sec = -1")).unwrap_err();
        assert!(e.contains("auth.tenant_retry_budget_min_per_sec"), "{e}");
        let e = parse(&tenants("").replace("retry_budget_min_per_sec = 0.5", "retry_budget_ratio = nan")).unwrap_err();
        assert!(e.contains("auth.tenants[0].retry_budget_ratio"), "{e}");
    }

    #[test]
    fn a_route_names_an_upstream_and_calls_its_url() {
        let text = "[[upstreams]]\nname = \"provider\"\nurl = \"http://127.0.0.1:9000/v1\"\nbudget_ratio = 0.2\n\
                    [[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"provider\"\n\
                    [[routes]]\nname = \"refunds\"\npath_prefix = \"/refunds\"\nupstream = \"http://127.0.0.1:9000/v1\"\n";
        let c = parse(text).unwrap();
        let (named, by_url) = (&c.routes[0], &c.routes[1]);
        assert_eq!(named.upstream, "http://127.0.0.1:9000/v1");
        assert_eq!(named.upstream_key(), "provider");
        assert_eq!(by_url.upstream_key(), "http://127.0.0.1:9000/v1", "a URL is not the named upstream");
        assert_eq!(c.upstreams[0].budget, BudgetLimits { ratio: 0.2, min_per_sec: UPSTREAM_DEFAULT.min_per_sec });
        assert!(describe(&c).contains("(upstream provider)"), "{}", describe(&c));
    }

    #[test]
    fn upstreams_that_cannot_be_used_are_refused_naming_the_key() {
        let upstream = |name: &str, url: &str| format!("[[upstreams]]\nname = \"{name}\"\nurl = \"{url}\"\n");
        let route = |to: &str| ROUTE.replace("http://127.0.0.1:9000", to);
        let cases = [
            (route("nowhere"), "routes[0].upstream"),
            (format!("{}{}", upstream("p", "ftp://x"), ROUTE), "upstreams[0].url"),
            (format!("{}{}{}", upstream("p", "http://a"), upstream("p", "http://b"), ROUTE), "upstreams[1].name"),
            (format!("{}{}", upstream("a b", "http://a"), ROUTE), "upstreams[0].name"),
            (format!("{}budget_ratio = 2\n{}", upstream("p", "http://a"), ROUTE), "upstreams[0].budget_ratio"),
        ];
        for (text, key) in cases {
            let e = parse(&text).unwrap_err();
            assert!(e.contains(key), "{key}: {e}");
        }
    }
}
