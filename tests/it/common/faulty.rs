//! A store with faults the test turns on and off: the real store underneath (SQLite or
//! PostgreSQL), and in front of it the faults of a real deployment, played at the very call a
//! node makes. A mark that is committed and then held (the node paused between its mark and
//! its send), a probe's answer held before it is written (the prober paused), renewals that
//! hang or fail, and the whole store out of reach. Each node of a test gets its own, on its own connections to the one database.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem::domain::key::IdempotencyKey;
use idem::domain::switch::Switch;
use idem::domain::{ClaimToken, Phase, RecordId, RouteName, Tenant, Timestamp};
use idem::record::Record;
use idem::store::stats::{Side, StatsRows, StatsSpan};
use idem::store::{
    Action, AddAnswerCounts, Admission, Admit, AttemptEnded, AttemptStarted, Cancel, Cancelled, ClaimQueued,
    ClaimUnclaimed, ClearSwitch, Condition, DurabilityInForce, Figures, LeaseStatus, ListFilter, Notice, Notices,
    Operator, Page, Probed, ProbesDue, Records, Renew, Resolve, Retry, Serving, Store, StoreError, Sweep,
    SwitchCleared, SwitchLog, TakeOver, Upkeep,
};
use tokio::sync::{Notify, Semaphore};

/// What a renewal does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewals {
    /// Renews, as the store would.
    Pass,
    /// Never answers (until the test turns it back to `Pass`): a store that stalls.
    Hang,
    /// Fails at once: a store that refuses the write.
    Fail,
}

/// The faults in force, shared by the test and the node.
pub struct Faults {
    /// Every call fails: the store is out of reach.
    outage: AtomicBool,
    renewals: Mutex<Renewals>,
    /// While set, a mark is committed and then held here before the node hears of it.
    marks_held: Mutex<Option<Arc<Semaphore>>>,
    /// While set, a probe's answer is held here before it is written.
    probes_held: Mutex<Option<Arc<Semaphore>>>,
    /// Calls of each kind, for the test to wait on or count.
    pub marks: AtomicUsize,
    pub renews: AtomicUsize,
    pub outcomes: AtomicUsize,
    pub probes: AtomicUsize,
    /// How often the store's server changed (a failover), as the node is told.
    server_changes: AtomicU64,
    news: Notify,
}

impl Default for Faults {
    fn default() -> Faults {
        Faults {
            outage: AtomicBool::new(false),
            renewals: Mutex::new(Renewals::Pass),
            marks_held: Mutex::new(None),
            probes_held: Mutex::new(None),
            marks: AtomicUsize::new(0),
            renews: AtomicUsize::new(0),
            outcomes: AtomicUsize::new(0),
            probes: AtomicUsize::new(0),
            server_changes: AtomicU64::new(0),
            news: Notify::new(),
        }
    }
}

impl Faults {
    /// The store's server changes under the node, as in a failover to a standby: another
    /// machine, another clock.
    pub fn serve_another(&self) {
        self.server_changes.fetch_add(1, Ordering::SeqCst);
    }

    pub fn outage(&self, on: bool) {
        self.outage.store(on, Ordering::SeqCst);
    }

    pub fn renewals(&self, renewals: Renewals) {
        *self.renewals.lock().unwrap() = renewals;
        self.news.notify_waiters();
    }

    /// From now on, each mark is committed and then held until [`Faults::release_marks`].
    pub fn hold_marks(&self) {
        *self.marks_held.lock().unwrap() = Some(Arc::new(Semaphore::new(0)));
    }

    /// Lets the held marks (and every later one) answer their node.
    pub fn release_marks(&self) {
        if let Some(gate) = self.marks_held.lock().unwrap().take() {
            gate.add_permits(Semaphore::MAX_PERMITS / 2);
        }
    }

    /// From now on, each probe's answer is held before it is written, until
    /// [`Faults::release_probes`]: the prober paused between its answer and its write.
    pub fn hold_probes(&self) {
        *self.probes_held.lock().unwrap() = Some(Arc::new(Semaphore::new(0)));
    }

    pub fn release_probes(&self) {
        if let Some(gate) = self.probes_held.lock().unwrap().take() {
            gate.add_permits(Semaphore::MAX_PERMITS / 2);
        }
    }

    /// Waits until `count(self)` reaches `n`, for at most ten seconds.
    pub async fn until(&self, what: &str, n: usize, count: impl Fn(&Faults) -> usize) {
        let wait = async {
            loop {
                let news = self.news.notified();
                tokio::pin!(news);
                news.as_mut().enable();
                if count(self) >= n {
                    return;
                }
                news.await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), wait)
            .await
            .unwrap_or_else(|_| panic!("{what} did not reach {n} within ten seconds"));
    }

    fn counted(&self, calls: &AtomicUsize) {
        calls.fetch_add(1, Ordering::SeqCst);
        self.news.notify_waiters();
    }

    fn reachable(&self) -> Result<(), StoreError> {
        match self.outage.load(Ordering::SeqCst) {
            true => Err(StoreError::Unavailable("the test cut the store off".into())),
            false => Ok(()),
        }
    }
}

/// `inner`, with `faults` in front of it.
pub struct Faulty {
    inner: Arc<dyn Store>,
    faults: Arc<Faults>,
}

impl Faulty {
    pub fn wrap(inner: Arc<dyn Store>, faults: Arc<Faults>) -> Arc<dyn Store> {
        Arc::new(Faulty { inner, faults })
    }
}

#[async_trait]
impl Records for Faulty {
    async fn admit(&self, admit: Admit) -> Result<Admission, StoreError> {
        self.faults.reachable()?;
        self.inner.admit(admit).await
    }

    async fn lookup(&self, tenant: &Tenant, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.faults.reachable()?;
        self.inner.lookup(tenant, key).await
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.faults.reachable()?;
        self.inner.get(id).await
    }

    async fn claim(&self, claim: ClaimQueued) -> Result<Option<ClaimToken>, StoreError> {
        self.faults.reachable()?;
        self.inner.claim(claim).await
    }

    async fn attempt_started(&self, started: AttemptStarted) -> Result<LeaseStatus, StoreError> {
        self.faults.reachable()?;
        let marked = self.inner.attempt_started(started).await;
        self.faults.counted(&self.faults.marks);
        let held = self.faults.marks_held.lock().unwrap().clone();
        if let Some(gate) = held {
            let _ = gate.acquire().await;
        }
        marked
    }

    async fn attempt_ended(&self, ended: AttemptEnded) -> Result<LeaseStatus, StoreError> {
        self.faults.counted(&self.faults.outcomes);
        self.faults.reachable()?;
        self.inner.attempt_ended(ended).await
    }

    async fn renew(&self, renew: Renew) -> Result<LeaseStatus, StoreError> {
        self.faults.counted(&self.faults.renews);
        self.faults.reachable()?;
        loop {
            let news = self.faults.news.notified();
            tokio::pin!(news);
            news.as_mut().enable();
            let renewals = *self.faults.renewals.lock().unwrap();
            match renewals {
                Renewals::Pass => return self.inner.renew(renew).await,
                Renewals::Fail => return Err(StoreError::Unavailable("the test's store refuses renewals".into())),
                Renewals::Hang => news.await,
            }
        }
    }

    async fn cancel(&self, cancel: Cancel) -> Result<Cancelled, StoreError> {
        self.faults.reachable()?;
        self.inner.cancel(cancel).await
    }
}

#[async_trait]
impl Operator for Faulty {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        self.faults.reachable()?;
        self.inner.list(filter).await
    }

    async fn resolve(&self, resolve: Resolve) -> Result<Action, StoreError> {
        self.faults.reachable()?;
        self.inner.resolve(resolve).await
    }

    async fn retry(&self, retry: Retry) -> Result<Action, StoreError> {
        self.faults.reachable()?;
        self.inner.retry(retry).await
    }
}

#[async_trait]
impl Upkeep for Faulty {
    async fn expired_leases(&self, now: Timestamp, limit: u32) -> Result<Vec<Record>, StoreError> {
        self.faults.reachable()?;
        self.inner.expired_leases(now, limit).await
    }

    async fn take_over(&self, take_over: TakeOver) -> Result<bool, StoreError> {
        self.faults.reachable()?;
        self.inner.take_over(take_over).await
    }

    async fn claim_unclaimed(&self, claim: ClaimUnclaimed) -> Result<Vec<Record>, StoreError> {
        self.faults.reachable()?;
        self.inner.claim_unclaimed(claim).await
    }

    async fn probes_due(&self, due: ProbesDue) -> Result<Vec<Record>, StoreError> {
        self.faults.reachable()?;
        self.inner.probes_due(due).await
    }

    async fn store_time(&self, node_now: Timestamp) -> Result<Timestamp, StoreError> {
        self.faults.reachable()?;
        self.inner.store_time(node_now).await
    }

    async fn probed(&self, probed: Probed) -> Result<Action, StoreError> {
        self.faults.counted(&self.faults.probes);
        let held = self.faults.probes_held.lock().unwrap().clone();
        if let Some(gate) = held {
            let _ = gate.acquire().await;
        }
        self.faults.reachable()?;
        self.inner.probed(probed).await
    }

    async fn sweep_done(&self, sweep: Sweep) -> Result<u64, StoreError> {
        self.faults.reachable()?;
        self.inner.sweep_done(sweep).await
    }
}

#[async_trait]
impl Condition for Faulty {
    async fn ping(&self) -> Result<(), StoreError> {
        self.faults.reachable()?;
        self.inner.ping().await
    }

    fn durability(&self) -> DurabilityInForce {
        self.inner.durability()
    }

    fn serving(&self) -> Option<Serving> {
        let changes = self.faults.server_changes.load(Ordering::SeqCst);
        let serving = self.inner.serving();
        if changes == 0 {
            return serving;
        }
        let serving =
            serving.unwrap_or_else(|| Serving { host: "the file".into(), timeline: None, started: None, changes: 0 });
        Some(Serving { changes: serving.changes + changes, ..serving })
    }

    async fn close(&self) {
        self.inner.close().await
    }
}

#[async_trait]
impl Figures for Faulty {
    async fn count_by_phase(&self) -> Result<Vec<(Phase, u64)>, StoreError> {
        self.faults.reachable()?;
        self.inner.count_by_phase().await
    }

    async fn add_answer_counts(&self, add: AddAnswerCounts) -> Result<(), StoreError> {
        self.faults.reachable()?;
        self.inner.add_answer_counts(add).await
    }

    async fn stats(&self, span: &StatsSpan) -> Result<StatsRows, StoreError> {
        self.faults.reachable()?;
        self.inner.stats(span).await
    }

    async fn sides(&self, route: &RouteName, since: Timestamp) -> Result<Vec<Side>, StoreError> {
        self.faults.reachable()?;
        self.inner.sides(route, since).await
    }
}

#[async_trait]
impl SwitchLog for Faulty {
    async fn set_switch(&self, switch: Switch) -> Result<Option<Switch>, StoreError> {
        self.faults.reachable()?;
        self.inner.set_switch(switch).await
    }

    async fn clear_switch(&self, clear: ClearSwitch) -> Result<SwitchCleared, StoreError> {
        self.faults.reachable()?;
        self.inner.clear_switch(clear).await
    }

    async fn active_switches(&self, now: Timestamp) -> Result<Vec<Switch>, StoreError> {
        self.faults.reachable()?;
        self.inner.active_switches(now).await
    }

    async fn switch_history(&self, limit: u32) -> Result<Vec<Switch>, StoreError> {
        self.faults.reachable()?;
        self.inner.switch_history(limit).await
    }
}

#[async_trait]
impl Notices for Faulty {
    async fn watch(&self, id: RecordId) -> Result<(), StoreError> {
        self.faults.reachable()?;
        self.inner.watch(id).await
    }

    fn notices(&self) -> Option<tokio::sync::broadcast::Receiver<Notice>> {
        self.inner.notices()
    }
}
