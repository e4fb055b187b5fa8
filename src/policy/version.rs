//! `policy_version`: a short, stable name for an effective policy — everything that decides a
//! record's attempts. It is a digest of the policy's values, never of a route's name, so two
//! policies of one route (a canary's and the main one) have versions of their own, and the same
//! values give the same version in every process, after every restart and on every node.
//!
//! What is in it: the whole retry table (attempt cap, deadline, per-try timeout, `min_try`,
//! backoff base and cap, jitter, which statuses mean not executed or maybe executed, the retry
//! budget), `replay_safe`, the deadline header each attempt carries, and the circuit settings
//! (an open circuit stops retries). What is not: where attempts go and what they carry
//! (upstream, credentials, forwarded headers) and how a request is keyed or admitted — changing
//! those changes no decision of the policy.

use std::time::Duration;

use sha2::{Digest, Sha256};

use super::{BreakerSettings, Jitter, RetryPolicy};
use crate::domain::PolicyVersion;

/// Hex digits kept of the digest: 48 bits, enough that two policies a team ever runs side by
/// side do not collide, short enough for a metric label and a log line.
const DIGITS: usize = 12;

/// `[routes.retry] stream_idle_timeout` when it is not set.
pub(super) const STREAM_IDLE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);

/// The values that decide a record's attempts, borrowed from wherever they are configured.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Effective<'a> {
    pub retry: &'a RetryPolicy,
    pub replay_safe: bool,
    /// The header that tells the upstream each attempt's milliseconds, if any.
    pub deadline_header: Option<&'a str>,
    pub circuit: &'a BreakerSettings,
}

impl Effective<'_> {
    pub(crate) fn version(&self) -> PolicyVersion {
        let digest = Sha256::digest(self.canonical().as_bytes());
        PolicyVersion::from(&hex::encode(digest)[..DIGITS])
    }

    /// One `name=value` line per setting, in a fixed order, durations in whole microseconds and
    /// status lists sorted, so that only a change of behaviour changes the text. The first line
    /// names the encoding: a future field is added under a new one, never silently.
    fn canonical(&self) -> String {
        let r = self.retry;
        let c = self.circuit;
        let us = |d: Duration| d.as_micros().to_string();
        let statuses = |list: &[u16]| {
            let mut list = list.to_vec();
            list.sort_unstable();
            list.dedup();
            list.iter().map(u16::to_string).collect::<Vec<_>>().join(",")
        };
        let jitter = match r.jitter {
            Jitter::Full => "full",
            Jitter::Equal => "equal",
            Jitter::Decorrelated => "decorrelated",
            Jitter::None => "none",
        };
        let lines = [
            "idem-policy/1".to_string(),
            format!("max_attempts={}", r.max_attempts),
            format!("deadline_us={}", us(r.deadline)),
            format!("per_try_timeout_us={}", us(r.per_try_timeout)),
            format!("min_try_us={}", us(r.min_try)),
            format!("base_us={}", us(r.base)),
            format!("cap_us={}", us(r.cap)),
            format!("jitter={jitter}"),
            format!("not_processed={}", statuses(&r.not_processed)),
            format!("ambiguous={}", statuses(&r.ambiguous)),
            // Rust prints a float as the shortest text that reads back to the same value.
            format!("budget_ratio={}", r.budget_ratio),
            format!("budget_min_per_sec={}", r.budget_min_per_sec),
            format!("replay_safe={}", self.replay_safe),
            // Header names are case-insensitive: the configured spelling is not behaviour.
            format!("deadline_header={}", self.deadline_header.map(str::to_ascii_lowercase).unwrap_or_default()),
            format!("circuit_failures={}", c.failures),
            format!("circuit_open_for_us={}", us(c.open_for)),
            format!("circuit_max_open_for_us={}", us(c.max_open_for)),
            format!("circuit_trials={}", c.trials),
        ];
        let mut text = lines.join("\n");
        // Added while version 1 was in use: written only when it differs from its default, so
        // a policy that leaves it alone keeps the version it had before streaming existed.
        if r.stream_idle_timeout != STREAM_IDLE_TIMEOUT_DEFAULT {
            text.push_str(&format!("\nstream_idle_timeout_us={}", us(r.stream_idle_timeout)));
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version_of(retry: &RetryPolicy, replay_safe: bool, header: Option<&str>, circuit: &BreakerSettings) -> String {
        Effective { retry, replay_safe, deadline_header: header, circuit }.version().to_string()
    }

    fn seed_version() -> String {
        version_of(&RetryPolicy::seed_example(), false, None, &BreakerSettings::default())
    }

    #[test]
    fn the_same_policy_has_the_same_version_in_every_process() {
        // Pinned: a version must not drift between releases, restarts or nodes. If this
        // literal has to change, the encoding's first line must change with it.
        assert_eq!(seed_version(), "60699b2e2f8f");
        assert_eq!(seed_version().len(), 12);
        assert!(seed_version().bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
    }

    #[test]
    fn status_order_and_header_case_are_not_behaviour() {
        let mut retry = RetryPolicy::seed_example();
        retry.not_processed = vec![503, 429, 503];
        assert_eq!(version_of(&retry, false, None, &BreakerSettings::default()), seed_version());
        let circuit = BreakerSettings::default();
        let seed = RetryPolicy::seed_example();
        assert_eq!(
            version_of(&seed, false, Some("X-Deadline-Ms"), &circuit),
            version_of(&seed, false, Some("x-deadline-ms"), &circuit)
        );
    }

    #[test]
    fn any_change_of_a_deciding_value_is_a_new_version() {
        let ms = Duration::from_millis;
        /// One change of one value of the retry table.
        type Change = (&'static str, fn(&mut RetryPolicy));
        let changes: [Change; 12] = [
            ("max_attempts", |p| p.max_attempts = 4),
            ("deadline", |p| p.deadline = Duration::from_millis(1501)),
            ("per_try_timeout", |p| p.per_try_timeout = Duration::from_millis(601)),
            ("min_try", |p| p.min_try = Duration::from_millis(101)),
            ("base", |p| p.base = Duration::from_millis(201)),
            ("cap", |p| p.cap = Duration::from_millis(801)),
            ("jitter", |p| p.jitter = Jitter::Equal),
            ("not_processed", |p| p.not_processed = vec![503]),
            ("ambiguous", |p| p.ambiguous = vec![502, 504, 500]),
            ("budget_ratio", |p| p.budget_ratio = 0.2),
            ("budget_min_per_sec", |p| p.budget_min_per_sec = 10.5),
            ("stream_idle_timeout", |p| p.stream_idle_timeout = Duration::from_secs(31)),
        ];
        let mut seen = std::collections::HashSet::from([seed_version()]);
        for (field, change) in changes {
            let mut retry = RetryPolicy::seed_example();
            change(&mut retry);
            let version = version_of(&retry, false, None, &BreakerSettings::default());
            assert!(seen.insert(version), "changing {field} kept an earlier version");
        }
        let seed = RetryPolicy::seed_example();
        let circuit = BreakerSettings::default();
        let others = [
            ("replay_safe", version_of(&seed, true, None, &circuit)),
            ("deadline_header", version_of(&seed, false, Some("x-deadline-ms"), &circuit)),
            ("circuit.failures", version_of(&seed, false, None, &BreakerSettings { failures: 6, ..circuit })),
            ("circuit.open_for", version_of(&seed, false, None, &BreakerSettings { open_for: ms(5001), ..circuit })),
            (
                "circuit.max_open_for",
                version_of(&seed, false, None, &BreakerSettings { max_open_for: ms(60_001), ..circuit }),
            ),
            ("circuit.trials", version_of(&seed, false, None, &BreakerSettings { trials: 2, ..circuit })),
        ];
        for (field, version) in others {
            assert!(seen.insert(version), "changing {field} kept an earlier version");
        }
    }
}
