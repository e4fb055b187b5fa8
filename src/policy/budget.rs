//! The retry budget (Finagle's `RetryBudget`): over a sliding window, retries may add at most
//! `ratio` of the first attempts, plus a floor of `min_per_sec` retries per second so that a
//! quiet route can still retry. When the budget is spent, failures are returned instead of
//! retried: in a storm, load is never multiplied.

use std::time::{Duration, Instant};

use crate::domain::BudgetScope;

/// The window is kept as one-second buckets.
const BUCKETS: usize = 10;
const BUCKET: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub(crate) struct RetryBudget {
    ratio: f64,
    min_per_sec: f64,
    /// (first attempts, retries) per one-second bucket, a ring indexed by second modulo BUCKETS.
    buckets: [(u64, u64); BUCKETS],
    /// The newest second (counted from `origin`) the ring holds.
    newest: u64,
    origin: Instant,
}

impl RetryBudget {
    pub(crate) fn new(ratio: f64, min_per_sec: f64, now: Instant) -> RetryBudget {
        RetryBudget { ratio, min_per_sec, buckets: [(0, 0); BUCKETS], newest: 0, origin: now }
    }

    /// Moves the window to `now`, clearing buckets that fell out of it.
    fn advance(&mut self, now: Instant) -> usize {
        let second = now.saturating_duration_since(self.origin).as_secs() / BUCKET.as_secs();
        if second > self.newest {
            let stale = (second - self.newest).min(BUCKETS as u64);
            for s in 1..=stale {
                self.buckets[((self.newest + s) % BUCKETS as u64) as usize] = (0, 0);
            }
            self.newest = second;
        }
        (self.newest % BUCKETS as u64) as usize
    }

    /// A first attempt: earns `ratio` of a retry.
    pub(crate) fn deposit(&mut self, now: Instant) {
        let i = self.advance(now);
        self.buckets[i].0 += 1;
    }

    /// Takes one retry from the budget if it allows one.
    pub(crate) fn try_withdraw(&mut self, now: Instant) -> bool {
        let allowed = self.allows(now);
        if allowed {
            self.withdraw(now);
        }
        allowed
    }

    /// Whether one more retry fits in the window that ends at `now`.
    pub(crate) fn allows(&mut self, now: Instant) -> bool {
        self.advance(now);
        let window = self.window();
        (window.retries + 1) as f64 <= window.allowed
    }

    fn withdraw(&mut self, now: Instant) {
        let i = self.advance(now);
        self.buckets[i].1 += 1;
    }

    /// The window as of the last deposit or withdrawal: first attempts, retries and what the
    /// retries may reach.
    pub(crate) fn window(&self) -> Window {
        let (firsts, retries) = self.buckets.iter().fold((0u64, 0u64), |(f, r), (bf, br)| (f + bf, r + br));
        Window { firsts, retries, allowed: self.min_per_sec * BUCKETS as f64 + self.ratio * firsts as f64 }
    }

    /// The window as of `now`.
    pub(crate) fn window_at(&mut self, now: Instant) -> Window {
        self.advance(now);
        self.window()
    }

    /// The budget's settings: its ratio and its floor per second.
    pub(crate) fn limits(&self) -> (f64, f64) {
        (self.ratio, self.min_per_sec)
    }
}

/// What an execution's first attempt earns and its retries are charged to: one budget, or
/// several at once (a simulation's route and tenant).
pub trait Charge {
    fn first_attempt(&mut self, now: Instant);
    /// One retry, taken if every budget has one; otherwise the budget that has none.
    fn retry(&mut self, now: Instant) -> Result<(), BudgetScope>;
}

/// A route's budget alone.
impl Charge for RetryBudget {
    fn first_attempt(&mut self, now: Instant) {
        self.deposit(now);
    }

    fn retry(&mut self, now: Instant) -> Result<(), BudgetScope> {
        self.try_withdraw(now).then_some(()).ok_or(BudgetScope::Route)
    }
}

/// A budget's sliding window: what its first attempts earned and its retries spent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Window {
    pub firsts: u64,
    pub retries: u64,
    /// Retries the window allows: the floor plus the ratio's share of the first attempts.
    pub allowed: f64,
}

/// Charges one retry to every budget it must fit, or to none: the first budget (in the order
/// given) with no retry left is named, and nothing is taken from the others.
pub(crate) fn withdraw_from_all(
    budgets: &mut [(BudgetScope, &mut RetryBudget)],
    now: Instant,
) -> Result<(), BudgetScope> {
    for (scope, budget) in budgets.iter_mut() {
        if !budget.allows(now) {
            return Err(*scope);
        }
    }
    for (_, budget) in budgets.iter_mut() {
        budget.withdraw(now);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_capped_at_a_fraction_of_first_attempts() {
        let t0 = Instant::now();
        let mut b = RetryBudget::new(0.1, 0.0, t0);
        for _ in 0..100 {
            b.deposit(t0);
        }
        let granted = (0..50).filter(|_| b.try_withdraw(t0)).count();
        assert_eq!(granted, 10, "10% of 100 first attempts");
    }

    #[test]
    fn a_floor_lets_a_quiet_route_retry() {
        let t0 = Instant::now();
        let mut b = RetryBudget::new(0.1, 1.0, t0);
        // No traffic at all: the floor of 1/s over a 10 s window allows 10 retries.
        let granted = (0..50).filter(|_| b.try_withdraw(t0)).count();
        assert_eq!(granted, 10);
    }

    #[test]
    fn the_window_slides() {
        let t0 = Instant::now();
        let mut b = RetryBudget::new(0.5, 0.0, t0);
        for _ in 0..10 {
            b.deposit(t0);
        }
        assert_eq!((0..10).filter(|_| b.try_withdraw(t0)).count(), 5);
        // Nine seconds on, the old deposits and withdrawals still count.
        assert!(!b.try_withdraw(t0 + Duration::from_secs(9)));
        // Past the window they are gone: no deposits left, so no retries either.
        let later = t0 + Duration::from_secs(11);
        assert!(!b.try_withdraw(later));
        for _ in 0..4 {
            b.deposit(later);
        }
        assert_eq!((0..10).filter(|_| b.try_withdraw(later)).count(), 2);
    }

    #[test]
    fn a_retry_charged_to_several_budgets_is_taken_from_all_or_from_none() {
        let t0 = Instant::now();
        let mut route = RetryBudget::new(0.0, 1.0, t0); // 10 retries a window
        let mut tenant = RetryBudget::new(0.0, 0.3, t0); // 3
        let mut granted = 0;
        let refused = loop {
            match withdraw_from_all(&mut [(BudgetScope::Route, &mut route), (BudgetScope::Tenant, &mut tenant)], t0) {
                Ok(()) => granted += 1,
                Err(scope) => break scope,
            }
        };
        assert_eq!((granted, refused), (3, BudgetScope::Tenant), "the smaller budget runs dry first");
        assert_eq!(route.window().retries, 3, "the refused retry took nothing from the route");
        assert_eq!(tenant.window().retries, 3);
    }

    #[test]
    fn a_zero_budget_refuses_every_retry() {
        let t0 = Instant::now();
        let mut b = RetryBudget::new(0.0, 0.0, t0);
        b.deposit(t0);
        assert!(!b.try_withdraw(t0));
    }
}
