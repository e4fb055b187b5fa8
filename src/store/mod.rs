//! Durable records. One trait, one implementation per backend, each with its own SQL: SQLite
//! (embedded default, one writer fed by group commit) and PostgreSQL.

use std::time::Duration;

use crate::domain::fingerprint::Fingerprint;
use crate::domain::key::IdempotencyKey;
use crate::domain::RecordId;
use crate::domain::RouteName;
use crate::domain::{Owner, Phase, Tenant, Timestamp};
use crate::domain::{PolicyVersion, StopReason};
use crate::record::{transition, Event, Record, StoredRequest, StoredResponse};

mod command;
mod durability;
mod error;
mod health;
mod listing;
mod names;
mod opening;
pub(crate) mod postgres;
pub mod protocol;
pub mod recorded;
mod rows;
pub mod sqlite;
pub mod stats;
mod switches;
mod timestamp;
mod traits;

pub(crate) use timestamp::span_ms;

pub(crate) use command::{retried, Fresh, Overwrite, Stored};
pub use command::{
    AddAnswerCounts, Admit, AttemptEnded, AttemptStarted, Cancel, ClaimQueued, ClaimUnclaimed, ClearSwitch, Probed,
    ProbesDue, Renew, Resolve, Retry, Sweep, TakeOver,
};
pub use durability::DurabilityInForce;
pub use error::StoreError;
pub use health::{store_health, watch_store, Health, HEALTH_TIMEOUT};
pub use listing::{page, Cursor, ListFilter, Page};
pub use opening::{inspect, migrate, missing_directory, open, open_synced, open_with, status, Inspection, Serving};
pub(crate) use rows::{decode, Columns};
pub(crate) use switches::decode_switch;
pub use switches::{SwitchCleared, MAX_HISTORY};
pub use traits::{Condition, Figures, Notices, Operator, Records, Store, SwitchLog, Upkeep};

/// A request about to be recorded.
#[derive(Debug, Clone)]
pub struct NewRecord {
    pub id: RecordId,
    pub tenant: Tenant,
    pub key: IdempotencyKey,
    pub route: RouteName,
    pub method: http::Method,
    pub path: String,
    pub query: String,
    pub fingerprint: Fingerprint,
    pub request: StoredRequest,
    pub deadline_at: Timestamp,
    pub now: Timestamp,
    /// The policy the admission chose for it (its route's, a canary's, or an MCP tool's
    /// replay-safe one), stored with the key whether it is claimed now or later: whichever node
    /// executes it, or takes it over, follows this decision rather than making its own.
    pub policy_version: Option<PolicyVersion>,
    /// Record it already claimed, its first attempt marked as about to be sent, in the same
    /// commit: for a worker that will send it at once. Applies to a fresh insert only; a record
    /// taken over from a free or expired one is queued as usual.
    pub claim: Option<Claim>,
    /// Done records of the key that finished at or after this are still remembered (tombstones,
    /// docs/agents.md): past their retention, the same request is refused with the record rather than
    /// executed again. `None`: the route keeps no tombstones.
    pub tombstone_cutoff: Option<Timestamp>,
}

impl NewRecord {
    /// The record as a fresh insert stores it: queued, or claimed with attempt 1 marked. Its
    /// lease and bound are as the node's clock reckons them; a store that keeps them in its own
    /// clock ([`LeaseClock::Database`]) holds its own reckoning.
    pub fn inserted(self) -> Record {
        let fresh = self.fresh();
        let claim = self.claim;
        Record {
            id: self.id,
            tenant: self.tenant,
            key: self.key,
            route: self.route,
            method: self.method,
            path: self.path,
            query: self.query,
            fingerprint: self.fingerprint,
            request: self.request,
            state: fresh.state,
            queued: fresh.queued,
            deadline_at: self.deadline_at,
            in_flight: fresh.in_flight,
            lease: claim
                .as_ref()
                .map(|c| crate::record::Lease { owner: c.owner.clone(), expires_at: c.marked_at + c.lease }),
            in_flight_until: claim.as_ref().map(|c| c.marked_at + c.reach),
            claim: fresh.claim,
            attempts: Vec::new(),
            stop_reason: None,
            response: None,
            history: Vec::new(),
            cancel_requested: false,
            probe_count: 0,
            next_probe_at: None,
            takeovers: 0,
            not_before: None,
            tombstone_until: None,
            done_at: None,
            policy_version: self.policy_version,
            stream: None,
            created_at: self.now,
            updated_at: self.now,
        }
    }
}

/// What the retention sweep does, route by route.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepPlan {
    pub now: Timestamp,
    pub routes: Vec<RouteSweep>,
    /// Done records of routes no longer configured end their retention before this; no
    /// tombstone is kept for them.
    pub others_cutoff: Timestamp,
}

impl SweepPlan {
    /// The same plan as of `now` rather than its own: every cutoff moved with it. A store that
    /// keeps time in its own clock judges a done record's age there, as its completion was
    /// stamped.
    pub(crate) fn as_of(self, now: Timestamp) -> SweepPlan {
        let shift = now.as_millis() - self.now.as_millis();
        let moved = |at: Timestamp| Timestamp::from_millis(at.as_millis().saturating_add(shift));
        SweepPlan {
            now,
            routes: self.routes.into_iter().map(|r| RouteSweep { cutoff: moved(r.cutoff), ..r }).collect(),
            others_cutoff: moved(self.others_cutoff),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct RouteSweep {
    pub route: RouteName,
    /// Done records finished before this are past their retention.
    pub cutoff: Timestamp,
    /// How long a tombstone outlives its record's completion (retention + tombstone), or `None`
    /// when the route keeps none and the records are deleted.
    pub tombstone_after: Option<Duration>,
}

/// A worker's lease on a record it admits, with its first attempt marked as about to be sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub owner: Owner,
    /// When the insert is sent, by the node's clock: the store's time for the lease and the
    /// bound in [`LeaseClock::Node`]. Not the request's arrival, which may be long before (a
    /// slow body), while the node counts its trust and its send window from the write.
    pub marked_at: Timestamp,
    /// How long the lease runs from the insert, in the store's clock.
    pub lease: Duration,
    /// How long after the insert its first attempt may still reach the upstream (see
    /// [`AttemptStarted::reach`]).
    pub reach: Duration,
}

/// Whose clock a store sets and compares leases and attempt bounds in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseClock {
    /// The database server's own (PostgreSQL): one clock for every node sharing the store,
    /// whatever each node's own clock says. The default for PostgreSQL.
    Database,
    /// The `now` each write carries: the node's clock. SQLite's, since every node sharing a
    /// SQLite file shares its host's clock; and a test's that holds time still with a manual one.
    Node,
}

impl LeaseClock {
    /// The time to bind where the SQL reads the store's time as `COALESCE($n, idem_now())`:
    /// the node's `now`, or nothing, so that the database reads its own clock.
    pub(crate) fn bind_now(self, now: Timestamp) -> Option<Timestamp> {
        match self {
            LeaseClock::Database => None,
            LeaseClock::Node => Some(now),
        }
    }
}

/// The result of recording a request: either this request owns execution now, or a record for
/// the key already exists and decides the answer.
#[derive(Debug, Clone)]
pub enum Admission {
    /// A new record, queued. The caller hands it to a worker.
    Created(Record),
    /// A free record with the same fingerprint, queued again. The caller hands it to a worker.
    Requeued(Record),
    /// A record that this request does not own: replay it, or refuse.
    Existing(Record),
}

/// How an attempt ended, for the record.
#[derive(Debug, Clone)]
pub enum AttemptEnd {
    /// Another attempt follows, not before this time; the lease is kept.
    Wait { not_before: Timestamp },
    /// `done`, with the response to replay.
    Done(StopReason, StoredResponse),
    /// `unknown`: it may have executed and must not be sent again automatically.
    Unknown(StopReason),
    /// `unknown`, as a streamed answer cut after its first byte reached the client (docs/concepts.md):
    /// what arrived of it is kept in the record's response for the operator, never replayed.
    Cut(StopReason, StoredResponse),
    /// `not_started`, free: nothing executed (or the route is replay-safe); the key is released.
    Free(StopReason),
    /// `not_started`, queued: handed back between attempts (at shutdown) for any worker to
    /// continue within the same deadline.
    Release,
}

/// Where a take-over moves a record whose lease expired (docs/concepts.md), and why it stopped there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeOverTo {
    /// Queued again, for any worker to continue within the same deadline.
    Queued,
    /// `not_started`, free: nothing that may have executed is left unsettled (or the route is
    /// replay-safe); the key is released.
    Free(StopReason),
    /// `unknown`: an attempt may have executed, and only reconciliation settles it.
    Unknown(StopReason),
}

impl TakeOverTo {
    pub fn phase(self) -> Phase {
        match self {
            TakeOverTo::Queued => Phase::Queued,
            TakeOverTo::Free(_) => Phase::Free,
            TakeOverTo::Unknown(_) => Phase::Unknown,
        }
    }

    pub fn stop_reason(self) -> Option<StopReason> {
        match self {
            TakeOverTo::Queued => None,
            TakeOverTo::Free(stop) | TakeOverTo::Unknown(stop) => Some(stop),
        }
    }
}

/// Whether a worker still holds a record's lease, and whether someone asked it to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStatus {
    Held {
        cancel_requested: bool,
    },
    /// Another worker took the record over (or it was settled): stop touching it.
    Lost,
}

impl LeaseStatus {
    pub fn is_held(self) -> bool {
        matches!(self, LeaseStatus::Held { .. })
    }

    pub fn cancel_requested(self) -> bool {
        matches!(self, LeaseStatus::Held { cancel_requested: true })
    }
}

/// The outcome of a cancel request.
#[derive(Debug, Clone)]
pub enum Cancelled {
    /// It was queued: nothing was sent, and the key is free again.
    Dequeued(Record),
    /// A worker holds it: no further attempt starts; one in flight finishes.
    Flagged(Record),
    /// Done or unknown (or already free): there is nothing to cancel.
    Refused(Record),
    Missing,
}

/// How an `unknown` record is settled, by an operator or a probe.
#[derive(Debug, Clone)]
pub enum Resolution {
    /// It executed: `done`, with this response replayed to duplicates.
    Executed(StoredResponse),
    /// It did not execute: the key is freed.
    NotExecuted,
}

/// Decides `event` for `record` as read: the phase it moves to, or the action's answer when the
/// record is missing or the transition table refuses the event from where it stands.
// Both sides carry a whole record, so boxing the error would save no move.
#[allow(clippy::result_large_err)]
pub(crate) fn decide(record: Option<Record>, event: Event) -> Result<(Record, Phase), Action> {
    match record {
        None => Err(Action::Missing),
        Some(record) => match transition(record.phase(), event) {
            Ok(to) => Ok((record, to)),
            Err(_) => Err(Action::Refused(record)),
        },
    }
}

/// The result of an operator action on one record.
#[derive(Debug, Clone)]
pub enum Action {
    Applied(Record),
    /// The record is not in a state the action applies to; it is returned unchanged.
    Refused(Record),
    /// The action would free the record (not executed) or send it again (retry), but an attempt
    /// marked under it may still reach the upstream for this long, in the store's clock: until
    /// then nothing may say it did not execute (docs/guarantees.md). Returned unchanged.
    InFlight(Record, Duration),
    Missing,
}

impl Action {
    /// The record as the action left it, when it applied.
    pub fn applied(&self) -> Option<&Record> {
        match self {
            Action::Applied(record) => Some(record),
            _ => None,
        }
    }
}

/// A change to a record, announced to every process that shares the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// A watched record left `in_progress`/queued: waiting requests can answer.
    Settled(RecordId),
    /// It was queued: an idle worker may claim it.
    Queued(RecordId),
}
