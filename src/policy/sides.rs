//! A canary's two pure questions: which side a request is on, and whether the canary has shown
//! enough harm to end itself.

use sha2::{Digest, Sha256};

/// When the canary ends by itself. Neither condition is judged before the canary's side has
/// `min_requests` settled requests, and the success comparison also waits for the control group
/// to have as many: a handful of unlucky requests proves nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct CanaryStop {
    /// Physical attempts per logical request, on the canary's side, above which it stops.
    pub amplification_over: Option<f64>,
    /// How far (a fraction, 0.05 = five points) the canary's final success may fall below the
    /// control group's before it stops.
    pub final_success_drop: Option<f64>,
    pub min_requests: u64,
}

/// Whether a tenant (or, with `key`, one of its keys) falls in the route's canary slice of
/// `percent`. The bucket is a digest of the route and those names, so it is the same on every
/// node, across restarts, and whatever the candidate policy is: changing the candidate does not
/// reshuffle, and widening the slice only adds to it.
pub(crate) fn in_canary(route: &str, tenant: &str, key: Option<&str>, percent: f64) -> bool {
    let mut digest = Sha256::new().chain_update(route).chain_update([0]).chain_update(tenant);
    if let Some(key) = key {
        digest = digest.chain_update([0]).chain_update(key);
    }
    let digest = digest.finalize();
    let head = u64::from_be_bytes(digest[..8].try_into().expect("a SHA-256 digest has 8 bytes"));
    // Hundredths of a percent: 10.25 percent is 1,025 buckets of 10,000.
    ((head % 10_000) as f64) < percent * 100.0
}

/// The two sides of a canary: the route's own policy, and the one on trial.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CanarySide {
    Control,
    Canary,
}

impl CanarySide {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            CanarySide::Control => "control",
            CanarySide::Canary => "canary",
        }
    }
}

/// Settled requests on one side of a canary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cohort {
    pub requests: u64,
    pub attempts: u64,
    /// Requests whose final answer was a success.
    pub succeeded: u64,
}

impl Cohort {
    pub fn amplification(&self) -> f64 {
        self.attempts as f64 / self.requests.max(1) as f64
    }

    pub fn final_success(&self) -> f64 {
        self.succeeded as f64 / self.requests.max(1) as f64
    }
}

/// Why the canary should stop now, or `None` while it may go on. A condition is judged only once
/// the sides it compares have each seen `min_requests`.
pub(crate) fn stop_reason(stop: &CanaryStop, control: Cohort, canary: Cohort) -> Option<String> {
    if canary.requests < stop.min_requests {
        return None;
    }
    if let Some(limit) = stop.amplification_over {
        let amplification = canary.amplification();
        if amplification > limit {
            return Some(format!(
                "amplification {amplification:.2} is over {limit} after {} canary requests",
                canary.requests
            ));
        }
    }
    if let Some(limit) = stop.final_success_drop {
        let drop = control.final_success() - canary.final_success();
        if control.requests >= stop.min_requests && drop > limit {
            return Some(format!(
                "final success {:.3} against the control group's {:.3}: a drop of {drop:.3}, over {limit}",
                canary.final_success(),
                control.final_success()
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stop(amplification_over: Option<f64>, final_success_drop: Option<f64>) -> CanaryStop {
        CanaryStop { amplification_over, final_success_drop, min_requests: 100 }
    }

    fn cohort(requests: u64, attempts: u64, succeeded: u64) -> Cohort {
        Cohort { requests, attempts, succeeded }
    }

    /// `in_canary("payments", "acme", Some("key-{i}"), 50.0)` for i in 0..8, computed apart
    /// (SHA-256 of `payments\0acme\0key-i`, its first 8 bytes big-endian, modulo 10,000, below 5,000).
    const PINNED_SIDES: [bool; 8] = [false, false, true, true, true, true, true, false];

    #[test]
    fn a_side_is_a_fixed_function_of_route_tenant_and_key() {
        // Pinned: a change of the bucket function would move live traffic between policies.
        let sides: Vec<bool> = (0..8).map(|i| in_canary("payments", "acme", Some(&format!("key-{i}")), 50.0)).collect();
        assert_eq!(sides, PINNED_SIDES);
        assert!(!in_canary("payments", "acme", None, 0.0) && in_canary("payments", "acme", None, 100.0));
    }

    #[test]
    fn a_slice_holds_about_its_percent() {
        let inside = (0..20_000).filter(|i| in_canary("payments", "acme", Some(&format!("key-{i}")), 10.0)).count();
        assert!((1_800..2_200).contains(&inside), "{inside} of 20,000 in a 10% slice");
        for i in 0..100 {
            let key = format!("key-{i}");
            assert_eq!(
                in_canary("payments", "acme", Some(&key), 10.0),
                in_canary("payments", "acme", Some(&key), 10.0)
            );
        }
    }

    #[test]
    fn a_wider_slice_keeps_everyone_the_narrower_one_had() {
        for i in 0..5_000 {
            let tenant = format!("tenant-{i}");
            if in_canary("payments", &tenant, None, 5.0) {
                assert!(in_canary("payments", &tenant, None, 20.0), "{tenant} left the canary when it grew");
            }
        }
    }

    #[test]
    fn routes_slice_their_traffic_independently() {
        let both = (0..10_000)
            .filter(|i| {
                let tenant = i.to_string();
                in_canary("payments", &tenant, None, 50.0) == in_canary("emails", &tenant, None, 50.0)
            })
            .count();
        assert!((4_500..5_500).contains(&both), "{both} of 10,000 on the same side of two 50% canaries");
    }

    #[test]
    fn nothing_is_judged_before_min_requests() {
        let harmful = cohort(99, 300, 0);
        assert_eq!(stop_reason(&stop(Some(1.5), Some(0.05)), cohort(1000, 1000, 1000), harmful), None);
    }

    #[test]
    fn amplification_over_the_limit_stops_the_canary() {
        let reason = stop_reason(&stop(Some(1.5), None), cohort(1000, 1100, 990), cohort(100, 151, 99));
        assert_eq!(reason.as_deref(), Some("amplification 1.51 is over 1.5 after 100 canary requests"));
        assert_eq!(stop_reason(&stop(Some(1.5), None), cohort(1000, 1100, 990), cohort(100, 150, 99)), None);
    }

    #[test]
    fn a_drop_in_final_success_beyond_the_limit_stops_the_canary() {
        let s = stop(None, Some(0.05));
        let reason = stop_reason(&s, cohort(1000, 1000, 950), cohort(100, 100, 89)).expect("a six-point drop");
        assert!(reason.contains("drop of 0.060"), "{reason}");
        assert_eq!(stop_reason(&s, cohort(1000, 1000, 950), cohort(100, 100, 90)), None);
        // A canary that does better than its control is never stopped for it.
        assert_eq!(stop_reason(&s, cohort(1000, 1000, 500), cohort(100, 100, 100)), None);
    }

    #[test]
    fn the_success_comparison_waits_for_a_control_group_of_min_requests() {
        assert_eq!(stop_reason(&stop(None, Some(0.05)), cohort(99, 99, 99), cohort(100, 100, 0)), None);
    }
}
