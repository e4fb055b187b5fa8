//! The retry budgets a retry is charged to besides its route's (docs/concepts.md, retry
//! budgets): its tenant's quota, over all routes, and its named upstream's, shared by every
//! route that calls it. Each node keeps its own (docs/operations.md, several nodes).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;

use super::{lock, Ticks};
use crate::config::{BudgetLimits, Config, TenantQuotas};
use crate::domain::{BudgetScope, Tenant};
use crate::policy::{withdraw_from_all, RetryBudget};

/// One retry budget shared by the executions charged to it, with the retries it refused.
pub(crate) struct SharedBudget {
    budget: Mutex<RetryBudget>,
    refused: AtomicU64,
}

impl SharedBudget {
    pub(crate) fn new(limits: BudgetLimits, now: Instant) -> SharedBudget {
        SharedBudget { budget: Mutex::new(RetryBudget::new(limits.ratio, limits.min_per_sec, now)), refused: 0.into() }
    }

    pub(crate) fn limits(&self) -> BudgetLimits {
        let (ratio, min_per_sec) = lock(&self.budget).limits();
        BudgetLimits { ratio, min_per_sec }
    }

    /// How it stands at `now`, for `/admin/stats`.
    pub(crate) fn view(&self, scope: BudgetScope, name: &str, now: Instant) -> BudgetView {
        let limits = self.limits();
        let window = lock(&self.budget).window_at(now);
        BudgetView {
            scope: scope.as_str(),
            name: name.to_string(),
            ratio: limits.ratio,
            min_per_sec: limits.min_per_sec,
            first_attempts: window.firsts,
            retries: window.retries,
            allowed: window.allowed.floor() as u64,
            refused_total: self.refused.load(Ordering::Relaxed),
        }
    }
}

/// A budget as `/admin/stats` shows it: its last 10 s on this node.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetView {
    pub scope: &'static str,
    pub name: String,
    pub ratio: f64,
    pub min_per_sec: f64,
    pub first_attempts: u64,
    pub retries: u64,
    /// Retries the window allows in all.
    pub allowed: u64,
    /// Retries it refused since this node started (or since its limits last changed).
    pub refused_total: u64,
}

/// The budgets one execution's attempts are charged to, taken when it starts: a reload
/// meanwhile changes nothing for it.
pub(crate) struct Charges {
    pub(crate) route: Arc<SharedBudget>,
    pub(crate) upstream: Option<Arc<SharedBudget>>,
    pub(crate) tenant: Option<Arc<SharedBudget>>,
    pub(crate) ticks: Ticks,
}

impl Charges {
    /// A first attempt: earns its share of a retry in every budget.
    pub(crate) fn first_attempt(&self) {
        let now = self.ticks.now();
        for shared in std::iter::once(&self.route).chain(&self.upstream).chain(&self.tenant) {
            lock(&shared.budget).deposit(now);
        }
    }

    /// One retry, taken from every budget or from none. The locks are taken route, upstream,
    /// tenant, always in that order, so that two executions never wait for each other's.
    pub(crate) fn take_retry(&self) -> Result<(), BudgetScope> {
        let now = self.ticks.now();
        let charged: Vec<(BudgetScope, &SharedBudget)> = [
            (BudgetScope::Route, Some(&self.route)),
            (BudgetScope::Upstream, self.upstream.as_ref()),
            (BudgetScope::Tenant, self.tenant.as_ref()),
        ]
        .into_iter()
        .filter_map(|(scope, shared)| shared.map(|shared| (scope, &**shared)))
        .collect();
        let mut held: Vec<_> = charged.iter().map(|(_, shared)| lock(&shared.budget)).collect();
        let mut budgets: Vec<(BudgetScope, &mut RetryBudget)> =
            charged.iter().zip(held.iter_mut()).map(|((scope, _), budget)| (*scope, &mut **budget)).collect();
        let taken = withdraw_from_all(&mut budgets, now);
        if let Err(refused) = taken {
            if let Some((_, shared)) = charged.iter().find(|(scope, _)| *scope == refused) {
                shared.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
        taken
    }
}

/// Every tenant's quota: the listed tenants' own and the default, each tenant's budget made
/// when it first retries.
#[derive(Default)]
pub(super) struct TenantBudgets {
    quotas: TenantQuotas,
    budgets: Mutex<HashMap<Tenant, Arc<SharedBudget>>>,
}

/// Tenants not listed in the config (each credential of a route that forwards it is one) are
/// remembered up to this many; past it, those whose window is empty are forgotten.
const UNLISTED_KEPT: usize = 10_000;

impl TenantBudgets {
    /// The quotas of `config`, keeping every budget whose limits stay the same.
    pub(super) fn reconfigured(&self, config: &Config) -> TenantBudgets {
        let quotas = config.tenant_quotas();
        let kept = lock(&self.budgets)
            .iter()
            .filter(|(tenant, shared)| quotas.of(tenant) == Some(shared.limits()))
            .map(|(tenant, shared)| (tenant.clone(), shared.clone()))
            .collect();
        TenantBudgets { quotas, budgets: Mutex::new(kept) }
    }

    /// The budget of `tenant`'s quota; `None` when it has none.
    pub(super) fn of(&self, tenant: &Tenant, now: Instant) -> Option<Arc<SharedBudget>> {
        let limits = self.quotas.of(tenant)?;
        let mut budgets = lock(&self.budgets);
        if let Some(shared) = budgets.get(tenant) {
            return Some(shared.clone());
        }
        if budgets.len() >= UNLISTED_KEPT {
            budgets.retain(|t, shared| {
                self.quotas.listed.contains_key(t.as_str()) || lock(&shared.budget).window_at(now).firsts > 0
            });
        }
        let shared = Arc::new(SharedBudget::new(limits, now));
        budgets.insert(tenant.clone(), shared.clone());
        Some(shared)
    }

    pub(super) fn views(&self, now: Instant) -> Vec<BudgetView> {
        let mut views: Vec<BudgetView> =
            lock(&self.budgets).iter().map(|(t, shared)| shared.view(BudgetScope::Tenant, t, now)).collect();
        views.sort_by(|a, b| a.name.cmp(&b.name));
        views
    }
}
