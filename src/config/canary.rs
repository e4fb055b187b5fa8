//! `[routes.canary]`: a candidate retry policy tried on a stable slice of a route's traffic, with
//! the conditions under which it ends itself.

use super::raw::{positive, RawCanary, RawRetry};
use super::Route;
use super::{invalid, ConfigError};
use crate::domain::key::IdempotencyKey;
use crate::domain::{PolicyVersion, RouteName, Tenant};
use crate::policy::{in_canary, CanaryStop, RetryPolicy};
use crate::record::rules;

#[derive(Debug, Clone, PartialEq)]
pub struct Canary {
    /// The share of the route's traffic, in percent, that runs under the candidate.
    pub percent: f64,
    pub by: CanaryBy,
    /// The candidate: the route's retry table with the canary's fields laid over it.
    pub retry: RetryPolicy,
    /// The candidate's own version: its attempts are stored and counted under it.
    pub policy_version: PolicyVersion,
    pub stop: CanaryStop,
}

/// What decides a request's side. Either way the same tenant (or key) always lands on the same
/// side, so a client retrying by hand never sees two policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CanaryBy {
    Tenant,
    Key,
}

/// The retry policy a record runs under, and its version.
#[derive(Debug, Clone, Copy)]
pub struct Policy<'a> {
    pub retry: &'a RetryPolicy,
    pub version: &'a PolicyVersion,
    /// May an attempt that possibly executed be sent again? The route's, but for a replay-safe
    /// tool on an MCP route (see [`Route::policy_with_replay_safety`]).
    pub replay_safe: bool,
}

impl Route {
    /// The policy for a request of `tenant` with `key`: the canary's when the route has one,
    /// it is `running` (no `canary_off` switch), and the request falls in its slice; else the
    /// route's own.
    pub fn policy_for(&self, tenant: &Tenant, key: &IdempotencyKey, running: bool) -> Policy<'_> {
        match &self.canary {
            Some(canary) if running && canary.includes(&self.name, tenant, key) => {
                Policy { retry: &canary.retry, version: &canary.policy_version, replay_safe: self.replay_safe }
            }
            _ => self.own_policy(),
        }
    }
}

impl Route {
    /// The policy a record admitted under `version` runs under, wherever that is asked: by its
    /// execution, a take-over, the estimate a duplicate is told, an MCP call's decision. The one
    /// `version` names while this route still has it, whatever the route's policy is now; else
    /// `now`, the route's choice today, held unsafe to repeat ([`rules::replay_safe`]): a reload
    /// that removed the record's policy must not make an operation admitted as unsafe to repeat
    /// safe to repeat.
    pub fn policy_of<'r>(&'r self, version: Option<&PolicyVersion>, now: Policy<'r>) -> Policy<'r> {
        let named = version.and_then(|version| self.policy_named(version.as_str()));
        named.unwrap_or(Policy { replay_safe: rules::replay_safe(None), ..now })
    }

    /// The route's own policy (not its canary's).
    pub fn own_policy(&self) -> Policy<'_> {
        Policy { retry: &self.retry, version: &self.policy_version, replay_safe: self.replay_safe }
    }

    /// The route's policy (its own, or its canary's) whose version is `version`, if either is.
    pub fn policy_named(&self, version: &str) -> Option<Policy<'_>> {
        let own = self.own_policy();
        let canary = self.canary.as_ref().map(|c| Policy {
            retry: &c.retry,
            version: &c.policy_version,
            replay_safe: self.replay_safe,
        });
        // An MCP route's calls to replay-safe tools run its own retry table, replay-safe.
        let replay_safe = self.mcp.as_ref().map(|m| Policy {
            retry: &self.retry,
            version: &m.replay_safe_version,
            replay_safe: true,
        });
        [Some(own), canary, replay_safe].into_iter().flatten().find(|p| p.version.as_str() == version)
    }
}

impl Canary {
    pub fn includes(&self, route: &RouteName, tenant: &Tenant, key: &IdempotencyKey) -> bool {
        let key = (self.by == CanaryBy::Key).then_some(key.as_str());
        in_canary(route, tenant, key, self.percent)
    }
}

impl RawCanary {
    pub(super) fn validate(
        self,
        key: &str,
        main: RawRetry,
        main_policy: &RetryPolicy,
        version: impl Fn(&RetryPolicy) -> PolicyVersion,
    ) -> Result<Canary, ConfigError> {
        let k = |name: &str| format!("{key}.{name}");
        let percent = self.percent.ok_or_else(|| invalid(k("percent"), "is required"))?;
        if !percent.is_finite() || percent <= 0.0 || percent >= 100.0 {
            return Err(invalid(
                k("percent"),
                "must be above 0 and below 100: a canary needs a control group (to roll out fully, make it the route's retry)",
            ));
        }
        let by = match self.by.as_deref().unwrap_or("key") {
            "key" => CanaryBy::Key,
            "tenant" => CanaryBy::Tenant,
            other => return Err(invalid(k("by"), format!("`{other}` is not one of tenant, key"))),
        };
        if self.retry.budget_ratio.is_some() || self.retry.budget_min_per_sec.is_some() {
            return Err(invalid(
                k("retry"),
                "cannot set budget_ratio or budget_min_per_sec: the retry budget is the route's, shared by both sides",
            ));
        }
        let retry = self.retry.over(main).validate(&k("retry"))?;
        // By version, not by value: listing the same statuses in another order changes nothing.
        if version(&retry) == version(main_policy) {
            return Err(invalid(k("retry"), "is the same as the route's retry policy: the canary would try nothing"));
        }
        let stop = self.stop;
        let fraction = |name: &str, value: Option<f64>, bound: f64| match value {
            Some(v) if !v.is_finite() || v < 0.0 || v > bound => {
                Err(invalid(k(&format!("stop.{name}")), format!("must be between 0 and {bound}")))
            }
            v => Ok(v),
        };
        let amplification_over =
            fraction("amplification_over", stop.amplification_over, f64::from(retry.max_attempts))?;
        if amplification_over.is_some_and(|a| a < 1.0) {
            return Err(invalid(k("stop.amplification_over"), "must be at least 1: every request makes one attempt"));
        }
        Ok(Canary {
            percent,
            by,
            stop: CanaryStop {
                amplification_over,
                final_success_drop: fraction("final_success_drop", stop.final_success_drop, 1.0)?,
                min_requests: positive(&k("stop.min_requests"), stop.min_requests, 100)? as u64,
            },
            policy_version: version(&retry),
            retry,
        })
    }
}

impl RawRetry {
    /// These fields where they are set, `main`'s elsewhere.
    fn over(self, main: RawRetry) -> RawRetry {
        RawRetry {
            max_attempts: self.max_attempts.or(main.max_attempts),
            deadline: self.deadline.or(main.deadline),
            per_try_timeout: self.per_try_timeout.or(main.per_try_timeout),
            min_try: self.min_try.or(main.min_try),
            base: self.base.or(main.base),
            cap: self.cap.or(main.cap),
            jitter: self.jitter.or(main.jitter),
            not_processed: self.not_processed.or(main.not_processed),
            ambiguous: self.ambiguous.or(main.ambiguous),
            budget_ratio: main.budget_ratio,
            budget_min_per_sec: main.budget_min_per_sec,
            stream_idle_timeout: self.stream_idle_timeout.or(main.stream_idle_timeout),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    const ROUTE: &str = r#"
        [[routes]]
        name = "payments"
        path_prefix = "/payments"
        upstream = "http://127.0.0.1:9000"
        [routes.retry]
        max_attempts = 3
        base = "200ms"
    "#;

    fn parse(canary: &str) -> Result<Config, ConfigError> {
        Config::parse_with_env(&format!("{ROUTE}{canary}"), |_| None)
    }

    fn error_of(canary: &str) -> String {
        parse(canary).unwrap_err().to_string()
    }

    #[test]
    fn the_candidate_inherits_every_field_it_does_not_set() {
        let c = parse("[routes.canary]\npercent = 10\n[routes.canary.retry]\nmax_attempts = 5\n").unwrap();
        let route = &c.routes[0];
        let canary = route.canary.as_ref().unwrap();
        assert_eq!(canary.retry.max_attempts, 5);
        assert_eq!(canary.retry.base, route.retry.base, "base comes from the route's own retry table");
        assert_eq!(RetryPolicy { max_attempts: 3, ..canary.retry.clone() }, route.retry);
        assert_eq!((canary.percent, canary.by), (10.0, CanaryBy::Key));
        assert_eq!(canary.stop, CanaryStop { amplification_over: None, final_success_drop: None, min_requests: 100 });
        assert!(Config::parse_with_env(ROUTE, |_| None).unwrap().routes[0].canary.is_none());
        let described = super::super::describe(&c);
        assert!(
            described.contains(&format!("canary 10% by key, policy_version {}: 5 attempts", canary.policy_version)),
            "{described}"
        );
    }

    #[test]
    fn a_request_keeps_its_side_and_runs_the_main_policy_while_the_canary_is_off() {
        let c = parse("[routes.canary]\npercent = 50\nretry = { max_attempts = 1 }\n").unwrap();
        let route = &c.routes[0];
        let canary = route.canary.as_ref().unwrap();
        let (route_name, acme) = (RouteName::from("payments"), Tenant::from("acme"));
        let keys = || (0..100).map(|i| IdempotencyKey::parse(&format!("k{i}")).unwrap());
        let inside = keys().find(|k| canary.includes(&route_name, &acme, k)).unwrap();
        let outside = keys().find(|k| !canary.includes(&route_name, &acme, k)).unwrap();
        assert_eq!(route.policy_for(&acme, &inside, true).version, &canary.policy_version);
        assert_eq!(route.policy_for(&acme, &inside, true).retry.max_attempts, 1);
        assert_eq!(route.policy_for(&acme, &inside, false).version, &route.policy_version);
        assert_eq!(route.policy_for(&acme, &outside, true).version, &route.policy_version);
        assert_ne!(canary.policy_version, route.policy_version);
    }

    #[test]
    fn stop_conditions_and_the_side_by_tenant_are_read() {
        let c = parse(
            "[routes.canary]\npercent = 2.5\nby = \"tenant\"\nretry = { jitter = \"equal\" }\n\
             [routes.canary.stop]\namplification_over = 1.4\nfinal_success_drop = 0.02\nmin_requests = 500\n",
        )
        .unwrap();
        let canary = c.routes[0].canary.as_ref().unwrap();
        assert_eq!(canary.by, CanaryBy::Tenant);
        assert_eq!(
            canary.stop,
            CanaryStop { amplification_over: Some(1.4), final_success_drop: Some(0.02), min_requests: 500 }
        );
    }

    #[test]
    fn a_canary_that_cannot_be_right_is_refused_naming_the_key() {
        let cases = [
            ("[routes.canary]\nretry = { max_attempts = 1 }\n", "routes[0].canary.percent"),
            ("[routes.canary]\npercent = 0\nretry = { max_attempts = 1 }\n", "routes[0].canary.percent"),
            ("[routes.canary]\npercent = 100\nretry = { max_attempts = 1 }\n", "routes[0].canary.percent"),
            ("[routes.canary]\npercent = nan\nretry = { max_attempts = 1 }\n", "routes[0].canary.percent"),
            ("[routes.canary]\npercent = 5\nby = \"ip\"\nretry = { max_attempts = 1 }\n", "routes[0].canary.by"),
            ("[routes.canary]\npercent = 5\n", "routes[0].canary.retry"),
            ("[routes.canary]\npercent = 5\nretry = { max_attempts = 3 }\n", "routes[0].canary.retry"),
            ("[routes.canary]\npercent = 5\nretry = { not_processed = [503, 429] }\n", "routes[0].canary.retry"),
            ("[routes.canary]\npercent = 5\nretry = { max_attempts = 0 }\n", "routes[0].canary.retry.max_attempts"),
            ("[routes.canary]\npercent = 5\nretry = { cap = \"10ms\" }\n", "routes[0].canary.retry.base"),
            ("[routes.canary]\npercent = 5\nretry = { tries = 2 }\n", "tries"),
            ("[routes.canary]\npercent = 5\nretry = { budget_ratio = 0.5 }\n", "routes[0].canary.retry"),
            (
                "[routes.canary]\npercent = 5\nretry = { max_attempts = 2 }\nstop = { amplification_over = 0.5 }\n",
                "routes[0].canary.stop.amplification_over",
            ),
            (
                "[routes.canary]\npercent = 5\nretry = { max_attempts = 2 }\nstop = { final_success_drop = 1.5 }\n",
                "routes[0].canary.stop.final_success_drop",
            ),
            (
                "[routes.canary]\npercent = 5\nretry = { max_attempts = 2 }\nstop = { min_requests = 0 }\n",
                "routes[0].canary.stop.min_requests",
            ),
        ];
        for (canary, key) in cases {
            let e = error_of(canary);
            assert!(e.contains(key), "{canary:?} → {e}");
        }
    }
}
