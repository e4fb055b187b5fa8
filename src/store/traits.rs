//! The store's contract, split by concern as the backends' files are: what the data plane
//! writes and reads, what an operator does, what the background loops ask, the store's
//! condition, its figures, the switches and the notices. [`Store`] is all of them.

use async_trait::async_trait;

use super::stats::{Side, StatsRows, StatsSpan};
use super::{
    Action, AddAnswerCounts, Admission, Admit, AttemptEnded, AttemptStarted, Cancel, Cancelled, ClaimQueued,
    ClaimUnclaimed, ClearSwitch, DurabilityInForce, LeaseStatus, ListFilter, Notice, Page, Probed, ProbesDue, Renew,
    Resolve, Retry, Serving, StoreError, Sweep, SwitchCleared, TakeOver,
};
use crate::domain::key::IdempotencyKey;
use crate::domain::switch::Switch;
use crate::domain::{ClaimToken, Phase, RecordId, RouteName, Tenant, Timestamp};
use crate::record::Record;

/// The data plane's writes and reads of one record: admission, claims, attempts, the lease, a cancel.
#[async_trait]
pub trait Records: Send + Sync + 'static {
    /// Records a request unless its key exists. Atomic under any concurrency: of many requests
    /// with one key, exactly one gets `Created` (or `Requeued`). A `done` record past retention
    /// counts as absent and is replaced.
    async fn admit(&self, admit: Admit) -> Result<Admission, StoreError>;

    async fn lookup(&self, tenant: &Tenant, key: &IdempotencyKey) -> Result<Option<Record>, StoreError>;

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError>;

    /// Queued → in_progress under `owner`'s lease: the new claim's token, or `None` if it is no
    /// longer queued.
    async fn claim(&self, claim: ClaimQueued) -> Result<Option<ClaimToken>, StoreError>;

    /// Persists "attempt `number` may have been sent" before it is sent, with the version of
    /// the policy it is sent under, and extends the lease. If the holder's claim is no longer
    /// the record's latest (its token differs), nothing is written and the attempt must not be
    /// sent.
    async fn attempt_started(&self, started: AttemptStarted) -> Result<LeaseStatus, StoreError>;

    /// Stores an attempt's outcome (or, with no attempt, a stop before any) and what follows,
    /// under the holder's claim. Under a claim that is no longer the record's, it is refused
    /// (`Lost`) — except the late outcome of the attempt that was in flight when a take-over
    /// moved the record to `unknown` under that same claim, which settles the record
    /// ([`AttemptEnded::late`] decides how) and is still answered `Lost`: the worker is done.
    async fn attempt_ended(&self, ended: AttemptEnded) -> Result<LeaseStatus, StoreError>;

    /// Extends the holder's lease, under its claim.
    async fn renew(&self, renew: Renew) -> Result<LeaseStatus, StoreError>;

    async fn cancel(&self, cancel: Cancel) -> Result<Cancelled, StoreError>;
}

/// What an operator does to records: list them, settle an `unknown` one, re-drive it.
#[async_trait]
pub trait Operator: Send + Sync + 'static {
    // ---- operators --------------------------------------------------------------------------

    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError>;

    /// Settles an `unknown` record; anything else is refused. `not_executed` is refused as
    /// `InFlight` until the record's `in_flight_until` has passed in the store's clock.
    async fn resolve(&self, resolve: Resolve) -> Result<Action, StoreError>;

    /// Re-drives an `unknown` record (the operator asserts a re-send is safe): queued again with
    /// a fresh deadline, once its `in_flight_until` has passed (`InFlight` before). Anything
    /// else is refused.
    async fn retry(&self, retry: Retry) -> Result<Action, StoreError>;
}

/// What the background loops ask of every node's store: take-overs of expired leases, queued work nobody claimed, probes, the retention sweep.
#[async_trait]
pub trait Upkeep: Send + Sync + 'static {
    // ---- take-over and reconciliation ---------------------------------------------------------

    /// `in_progress` records whose lease expired, in the store's clock (`now` when it is the
    /// node's).
    async fn expired_leases(&self, now: Timestamp, limit: u32) -> Result<Vec<Record>, StoreError>;

    /// Moves a record whose lease expired to `to`, recording the attempt that was lost in
    /// flight, if any, and counting the take-over. Only if the lease is still the `expired` one
    /// seen, under the same claim, with the same attempt in flight: of several nodes sweeping at
    /// once, one wins (the others get `false`), and a mark that landed since the read is never
    /// wiped. The claim's token is kept: only a new claim makes a new one.
    async fn take_over(&self, take_over: TakeOver) -> Result<bool, StoreError>;

    /// Claims, for `owner`, up to `limit` queued records that nobody has claimed since
    /// `idle_since` (the node that queued them died, or is busy), each with a new claim token
    /// (in the records returned). Safe to call from many nodes at once: each record is claimed
    /// by one. The caller has a worker free for each of `limit`.
    async fn claim_unclaimed(&self, claim: ClaimUnclaimed) -> Result<Vec<Record>, StoreError>;

    /// `unknown` records of `route` whose next probe is due at `now`; the first probe is due
    /// `settle` after the record became unknown.
    async fn probes_due(&self, due: ProbesDue) -> Result<Vec<Record>, StoreError>;

    /// The time in the clock this store keeps leases and attempts' bounds in ([`LeaseClock`]):
    /// `node_now` where that is the node's, else the database's own, read now. A probe is stamped
    /// with it before it is sent.
    async fn store_time(&self, node_now: Timestamp) -> Result<Timestamp, StoreError>;

    /// Records a probe: settles the record with `resolution`, or schedules the next probe — if
    /// it is still `unknown` under the claim the probe read. "Not executed" is refused as
    /// `InFlight` (nothing written) unless the record's `in_flight_until` had passed when the
    /// probe was sent (`asked_at`).
    async fn probed(&self, probed: Probed) -> Result<Action, StoreError>;

    /// Ends retention by the plan: up to `limit` `done` records of each route turned into
    /// tombstones or deleted, and up to `limit` tombstones past their time deleted; returns how
    /// many records changed.
    async fn sweep_done(&self, sweep: Sweep) -> Result<u64, StoreError>;
}

/// Whether the store can be trusted with a request, and what it runs on.
#[async_trait]
pub trait Condition: Send + Sync + 'static {
    /// Can the store be trusted with a request right now? A cheap check, run a few times a second
    /// by every node: the database answers, and (SQLite) its files are still the ones opened. A
    /// store that refuses work after a loss also finds out here whether it may resume.
    async fn ping(&self) -> Result<(), StoreError>;

    /// What its commits survive, as its database reported it once the store had set it, at
    /// opening (`/admin/node`): read then, so that asking works whatever the store's state.
    fn durability(&self) -> DurabilityInForce;

    /// The server it is connected to, where it names one; `None` for SQLite's file.
    fn serving(&self) -> Option<Serving> {
        None
    }

    /// Stops what the store runs in the background beside its writes (PostgreSQL's relay of
    /// notices) and waits for it: a node's last step in a shutdown.
    async fn close(&self) {}
}

/// The figures the store keeps: counts by phase, answers counted in memory, the stats and a canary's sides.
#[async_trait]
pub trait Figures: Send + Sync + 'static {
    /// How many records are in each phase (queued and free `not_started` counted apart).
    async fn count_by_phase(&self) -> Result<Vec<(Phase, u64)>, StoreError>;

    // ---- stats ------------------------------------------------------------------------------

    /// Adds replays and 409s counted in memory to the per-second counters every node shares,
    /// and forgets counters of seconds before `forget_before`.
    async fn add_answer_counts(&self, add: AddAnswerCounts) -> Result<(), StoreError>;

    /// What `/admin/stats` draws for `span`, aggregated by the database: requests by step of
    /// arrival, the reconciliation queue's comings and goings, the answer counters.
    async fn stats(&self, span: &StatsSpan) -> Result<StatsRows, StoreError>;

    /// A route's requests that arrived since `since` and have settled, by the policy version
    /// their attempts ran under: the two sides of a canary, for its stop conditions.
    async fn sides(&self, route: &RouteName, since: Timestamp) -> Result<Vec<Side>, StoreError>;
}

/// An operator's emergency switches, as every node shares them.
#[async_trait]
pub trait SwitchLog: Send + Sync + 'static {
    // ---- emergency switches (docs/operations.md) ---------------------------------------------------------

    /// Stores `switch`, set at its `set_at`. A switch of the same scope and action that is active
    /// then is cleared in the same transaction, as replaced by this one (by its actor, for its
    /// reason), and returned; of two concurrent sets, one replaces the other.
    async fn set_switch(&self, switch: Switch) -> Result<Option<Switch>, StoreError>;

    /// Clears switch `id` if it is active at `clearing.at`.
    async fn clear_switch(&self, clear: ClearSwitch) -> Result<SwitchCleared, StoreError>;

    /// The switches active at `now`, oldest first: what every node obeys.
    async fn active_switches(&self, now: Timestamp) -> Result<Vec<Switch>, StoreError>;

    /// The audit trail: every switch ever set (active, expired, cleared or replaced), newest
    /// first, at most `limit`.
    async fn switch_history(&self, limit: u32) -> Result<Vec<Switch>, StoreError>;
}

/// News of records settled by other processes sharing the database.
#[async_trait]
pub trait Notices: Send + Sync + 'static {
    /// Asks for a [`Notice::Settled`] when this record settles, whichever process settles it.
    /// Call before re-reading the record, so a settlement in between is not missed.
    async fn watch(&self, _id: RecordId) -> Result<(), StoreError> {
        Ok(())
    }

    /// News of records changed by other processes sharing this database, where the backend
    /// can deliver it (PostgreSQL's LISTEN/NOTIFY); `None` for a single-process store.
    fn notices(&self) -> Option<tokio::sync::broadcast::Receiver<Notice>> {
        None
    }
}

/// A store of record: every concern above, which both backends implement (SQLite and
/// PostgreSQL), each in the files named after it.
pub trait Store: Records + Operator + Upkeep + Condition + Figures + SwitchLog + Notices {}

impl<T: Records + Operator + Upkeep + Condition + Figures + SwitchLog + Notices> Store for T {}
