//! A candidate policy for `idem simulate --history`, read from its own file in one of two forms:
//!
//! - a whole config (it has `[[routes]]`): the route of the same name, exactly as a broker
//!   would read that file, defaults included;
//! - a change to the route (`[retry]` with any keys of `[routes.retry]`, optionally a
//!   top-level `replay_safe`, and `[tenants.<name>]` or `[tenants.default]` with
//!   `retry_budget_ratio` / `retry_budget_min_per_sec` to change tenants' retry quotas): the keys
//!   given replace the current ones, and every key left out keeps its current value.
//!
//! Either is validated as a config is, and its errors name the key.

use serde::Deserialize;

use std::collections::BTreeMap;

use super::quotas::RawQuota;
use super::raw::RawRetry;
use super::*;

/// Top-level tables that only a whole config has.
const WHOLE: [&str; 5] = ["routes", "server", "store", "auth", "worker"];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawChange {
    retry: Option<RawRetry>,
    replay_safe: Option<bool>,
    tenants: Option<BTreeMap<String, RawQuota>>,
}

/// The candidate's policy for the route `current`, and its replay safety.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub retry: RetryPolicy,
    pub replay_safe: bool,
    /// The tenants' retry quotas it runs under.
    pub tenants: TenantQuotas,
    /// How the file was read, in words, for the report.
    pub form: &'static str,
}

impl Candidate {
    /// A candidate for the route `current`, whose tenants have the quotas `quotas` now.
    pub fn parse(text: &str, current: &Route, quotas: &TenantQuotas) -> Result<Candidate, ConfigError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| super::syntax(text, &e))?;
        if WHOLE.iter().any(|key| table.contains_key(*key)) {
            // Only the route's policy is read: the secrets the file names are not needed.
            let (config, _unset) = Config::parse_offline(text, |name| std::env::var(name).ok())?;
            let Some(route) = config.route_named(&current.name) else {
                let known: Vec<&str> = config.routes.iter().map(|r| r.name.as_str()).collect();
                return Err(invalid(
                    "routes",
                    format!("no route named `{}` (routes: {})", current.name, known.join(", ")),
                ));
            };
            return Ok(Candidate {
                retry: route.retry.clone(),
                replay_safe: route.replay_safe,
                tenants: config.tenant_quotas(),
                form: "a whole config: the route as a broker would read it",
            });
        }
        let change: RawChange = toml::from_str(text).map_err(|e| {
            ConfigError::Syntax(format!(
                "{}; a candidate is a whole config (with [[routes]]) or a change: [retry] with keys of \
                 [routes.retry], optionally replay_safe, and [tenants.<name>] quotas",
                super::syntax(text, &e)
            ))
        })?;
        if change.retry.is_none() && change.replay_safe.is_none() && change.tenants.is_none() {
            return Err(invalid(
                "retry",
                "is missing: the candidate changes nothing (give [retry] keys, replay_safe or [tenants.<name>] quotas)",
            ));
        }
        let retry = match change.retry {
            Some(raw) => over(raw, &current.retry).validate("retry")?,
            None => current.retry.clone(),
        };
        Ok(Candidate {
            retry,
            replay_safe: change.replay_safe.unwrap_or(current.replay_safe),
            tenants: match change.tenants {
                Some(changes) => quotas.changed(changes)?,
                None => quotas.clone(),
            },
            form: "a change to the route: the keys given replace the current ones",
        })
    }
}

/// `raw` with every key it leaves out taken from `current`.
fn over(raw: RawRetry, current: &RetryPolicy) -> RawRetry {
    let ms = |d: Duration| Some(format!("{}ms", d.as_millis()));
    let statuses = |list: &[u16]| Some(list.iter().map(|&s| i64::from(s)).collect());
    let jitter = match current.jitter {
        Jitter::Full => "full",
        Jitter::Equal => "equal",
        Jitter::Decorrelated => "decorrelated",
        Jitter::None => "none",
    };
    RawRetry {
        max_attempts: raw.max_attempts.or(Some(i64::from(current.max_attempts))),
        deadline: raw.deadline.or_else(|| ms(current.deadline)),
        per_try_timeout: raw.per_try_timeout.or_else(|| ms(current.per_try_timeout)),
        min_try: raw.min_try.or_else(|| ms(current.min_try)),
        base: raw.base.or_else(|| ms(current.base)),
        cap: raw.cap.or_else(|| ms(current.cap)),
        jitter: raw.jitter.or_else(|| Some(jitter.to_string())),
        not_processed: raw.not_processed.or_else(|| statuses(&current.not_processed)),
        ambiguous: raw.ambiguous.or_else(|| statuses(&current.ambiguous)),
        budget_ratio: raw.budget_ratio.or(Some(current.budget_ratio)),
        budget_min_per_sec: raw.budget_min_per_sec.or(Some(current.budget_min_per_sec)),
        stream_idle_timeout: raw.stream_idle_timeout.or_else(|| ms(current.stream_idle_timeout)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route() -> Route {
        let config = Config::parse(
            "[[routes]]\nname = \"payments\"\npath_prefix = \"/p\"\nupstream = \"http://127.0.0.1:9\"\n\
             replay_safe = true\n[routes.retry]\nmax_attempts = 4\ndeadline = \"5s\"\njitter = \"equal\"\n\
             not_processed = [503]\n",
        )
        .unwrap();
        config.routes[0].clone()
    }

    #[test]
    fn a_change_replaces_only_the_keys_it_gives() {
        let current = route();
        let c = Candidate::parse("[retry]\nmax_attempts = 1\n", &current, &TenantQuotas::default()).unwrap();
        assert_eq!(c.retry, RetryPolicy { max_attempts: 1, ..current.retry.clone() });
        assert!(c.replay_safe);
        let c = Candidate::parse("replay_safe = false\n", &current, &TenantQuotas::default()).unwrap();
        assert_eq!((c.retry, c.replay_safe), (current.retry, false));
    }

    #[test]
    fn a_whole_config_gives_the_route_as_written_with_defaults() {
        let text = "[[routes]]\nname = \"payments\"\npath_prefix = \"/p\"\nupstream = \"http://127.0.0.1:9\"\n\
                    [routes.retry]\nmax_attempts = 2\n";
        let c = Candidate::parse(text, &route(), &TenantQuotas::default()).unwrap();
        assert_eq!(
            (c.retry.max_attempts, c.retry.deadline, c.retry.jitter),
            (2, Duration::from_secs(30), Jitter::Full)
        );
        assert!(!c.replay_safe);
    }

    #[test]
    fn bad_candidates_are_refused_naming_the_key() {
        let current = route();
        let cases = [
            ("[retry]\nmax_attempts = 0\n", "`retry.max_attempts`: must be at least 1"),
            ("[retry]\nbase = \"10s\"\ncap = \"1s\"\n", "`retry.base`: must not exceed cap"),
            ("[retry]\nmax_attemps = 2\n", "unknown field `max_attemps`"),
            ("retries = 2\n", "unknown field `retries`"),
            ("", "`retry`: is missing"),
            ("[retry\n", "line 1, column 7 (`[retry`): invalid table header"),
            (
                "[[routes]]\nname = \"orders\"\npath_prefix = \"/o\"\nupstream = \"http://127.0.0.1:9\"\n",
                "`routes`: no route named `payments` (routes: orders)",
            ),
        ];
        for (text, expected) in cases {
            let got = Candidate::parse(text, &current, &TenantQuotas::default()).unwrap_err().to_string();
            assert!(got.contains(expected), "{text:?}: {got}");
        }
    }
}
