//! The store's writes, one named struct each. The same value is the [`Store`](super::Store)
//! method's argument, the SQLite writer's queued message and the PostgreSQL batch's item, so a
//! write's fields are spelled once. Where a write moves a record, the phase it stores is the one
//! [`transition`] decides; each backend persists that decision, guarded by the phase it was
//! decided from.

use std::time::Duration;

use uuid::Uuid;

use super::{AttemptEnd, NewRecord, Resolution, SweepPlan, TakeOverTo};
use crate::domain::switch::Clearing;
use crate::domain::Actor;
use crate::domain::HistoryAction;
use crate::domain::RouteName;
use crate::domain::State;
use crate::domain::{ClaimToken, Holder, Owner, Phase, RecordId, Timestamp};
use crate::domain::{PolicyVersion, StopReason};
use crate::record::rules::{ends_attempt, late_event};
use crate::record::{admitted, transition, Attempt, Event, HistoryEntry, Lease, Refused};
use crate::record::{StoredResponse, StreamFacts};
use crate::store::stats::AnswerCount;

/// Records a request unless its key exists (see [`Store::admit`](super::Store::admit)).
#[derive(Debug, Clone)]
pub struct Admit {
    pub new: NewRecord,
    /// A `done` record that finished before this is past its retention: absent for this key.
    pub retention_cutoff: Timestamp,
}

/// What an admission writes over the key's record, where it may write over it: a `done` record
/// past its retention gives way to a fresh one (queued: the admission that replaces it does not
/// claim it), and a free record of the same request takes the table's `Requeue`, with the
/// history entry that says so.
#[derive(Debug, Clone)]
pub(crate) struct Overwrite {
    pub replaced: Phase,
    pub requeued: Phase,
    pub entry: HistoryEntry,
}

impl Overwrite {
    /// For an admission at `now`.
    pub(crate) fn at(now: Timestamp) -> Result<Overwrite, Refused> {
        Ok(Overwrite {
            replaced: admitted(false),
            requeued: transition(Phase::Free, Event::Requeue)?,
            entry: HistoryEntry {
                at: now,
                actor: Actor::Client(None),
                action: HistoryAction::Requeued,
                note: Some("the same request was sent again for a free key".into()),
            },
        })
    }
}

/// Takes a queued record under `owner`'s lease, with a new claim token. The lease runs `lease`
/// from the write, in the store's clock (see [`LeaseClock`](super::LeaseClock)).
#[derive(Debug, Clone)]
pub struct ClaimQueued {
    pub id: RecordId,
    pub owner: Owner,
    pub lease: Duration,
    pub now: Timestamp,
}

/// Marks attempt `number` as possibly sent, before it is sent, and extends the lease. Clears how
/// an earlier attempt's answer streamed: the facts a record shows are its latest answer's.
#[derive(Debug, Clone)]
pub struct AttemptStarted {
    pub id: RecordId,
    pub holder: Holder,
    pub number: u32,
    /// The attempt's start, as the node stamps it (and the store's time in [`LeaseClock::Node`](super::LeaseClock)).
    pub started_at: Timestamp,
    /// How long the lease runs from this write, in the store's clock.
    pub lease: Duration,
    /// How long after this write the attempt it marks may still reach the upstream: the node's
    /// send window, the attempt's time limit and the clock margin. The record's
    /// `in_flight_until` becomes at least the store's time plus this.
    pub reach: Duration,
    /// The version of the policy it is sent under.
    pub policy_version: PolicyVersion,
}

/// Stores an attempt's outcome (or, with no attempt, a stop before any) and what follows.
#[derive(Debug, Clone)]
pub struct AttemptEnded {
    pub id: RecordId,
    pub holder: Holder,
    pub attempt: Option<Attempt>,
    pub then: AttemptEnd,
    /// How the attempt's answer streamed (docs/concepts.md), when it did. Stored by the same write as
    /// the outcome: a done record is never seen without knowing whether it kept its body.
    /// `None` leaves what the record holds as it is.
    pub stream: Option<StreamFacts>,
    pub now: Timestamp,
}

/// Extends the holder's lease to `lease` from this write, in the store's clock.
#[derive(Debug, Clone)]
pub struct Renew {
    pub id: RecordId,
    pub holder: Holder,
    pub lease: Duration,
    pub now: Timestamp,
}

/// A client's or an operator's cancel.
#[derive(Debug, Clone)]
pub struct Cancel {
    pub id: RecordId,
    pub entry: HistoryEntry,
}

/// Settles an `unknown` record.
#[derive(Debug, Clone)]
pub struct Resolve {
    pub id: RecordId,
    pub resolution: Resolution,
    pub entry: HistoryEntry,
}

/// Re-drives an `unknown` record with a fresh deadline: refused (`InFlight`) while an attempt it
/// marked may still reach the upstream.
#[derive(Debug, Clone)]
pub struct Retry {
    pub id: RecordId,
    pub deadline_at: Timestamp,
    pub entry: HistoryEntry,
}

/// Moves a record whose lease expired to `to`, if it still stands as it was read: the same
/// claim, the same expired lease, the same attempt in flight (or none). Each of them decided `to`.
#[derive(Debug, Clone)]
pub struct TakeOver {
    pub id: RecordId,
    /// The expired lease as it was seen, and the claim it was held under: of several nodes
    /// sweeping at once, one wins, and a lease renewed since is not taken.
    pub expired: Lease,
    pub claim: ClaimToken,
    /// The number of the attempt that was in flight when it was read, if one was: an attempt
    /// marked since (in the very millisecond its lease was read in, say) makes the decision
    /// stale, and the take-over is refused.
    pub in_flight: Option<u32>,
    pub to: TakeOverTo,
    /// The attempt lost in flight, if one may have been.
    pub lost: Option<Attempt>,
    pub entry: HistoryEntry,
}

/// Claims queued records that nobody has claimed since `idle_since`, each under a lease of
/// `lease` from the write.
#[derive(Debug, Clone)]
pub struct ClaimUnclaimed {
    pub owner: Owner,
    pub lease: Duration,
    pub idle_since: Timestamp,
    pub now: Timestamp,
    pub limit: u32,
}

/// Records a probe of an `unknown` record: settled by `resolution`, or probed again later.
#[derive(Debug, Clone)]
pub struct Probed {
    pub id: RecordId,
    /// The record's claim as the probe read it: a probe of an execution that an operator's retry
    /// has since replaced by another does not settle the new one.
    pub claim: ClaimToken,
    pub resolution: Option<Resolution>,
    /// When the probe was sent, in the store's clock (see [`Store::store_time`](super::Store::store_time)):
    /// a "not executed" speaks of what had reached the upstream by then, so it is judged against
    /// the record's bound as of then, not as of when it is written.
    pub asked_at: Timestamp,
    pub next_probe_at: Timestamp,
    pub entry: HistoryEntry,
}

/// Ends retention by `plan`, at most `limit` records of each kind.
#[derive(Debug, Clone)]
pub struct Sweep {
    pub plan: SweepPlan,
    pub limit: u32,
}

/// Clears a switch if it is active at `clearing.at`.
#[derive(Debug, Clone)]
pub struct ClearSwitch {
    pub id: Uuid,
    pub clearing: Clearing,
}

/// Adds answers counted in memory to the shared counters, forgetting seconds before
/// `forget_before`.
#[derive(Debug, Clone)]
pub struct AddAnswerCounts {
    pub counts: Vec<AnswerCount>,
    pub forget_before: Timestamp,
}

/// Which `unknown` records of `route` are due a probe at `now`: the first is due `settle` after
/// the record became unknown, the next when the last probe scheduled it.
#[derive(Debug, Clone)]
pub struct ProbesDue {
    pub route: RouteName,
    pub settle: Duration,
    pub now: Timestamp,
    pub limit: u32,
}

// ---- the decisions the backends persist ------------------------------------------------------

/// What a fresh insert stores, as [`admitted`] decides: queued, or claimed with attempt 1 marked
/// as about to be sent.
pub(crate) struct Fresh {
    pub state: State,
    pub queued: bool,
    pub in_flight: Option<(u32, Timestamp)>,
    /// The first claim's token when it is claimed at insert, else none yet.
    pub claim: ClaimToken,
}

impl NewRecord {
    pub(crate) fn fresh(&self) -> Fresh {
        let phase = admitted(self.claim.is_some());
        let claimed = phase == Phase::InProgress;
        let in_flight = claimed.then_some((1, self.now));
        let claim = if claimed { ClaimToken::FIRST } else { ClaimToken::default() };
        Fresh { state: phase.state(), queued: phase == Phase::Queued, in_flight, claim }
    }
}

/// What a record stores after an attempt, whichever backend stores it.
pub(crate) struct Stored<'a> {
    pub state: State,
    pub stop: Option<StopReason>,
    pub response: Option<&'a StoredResponse>,
    /// Handed back to the queue (a release), rather than kept or settled.
    pub queued: bool,
    /// While waiting: the earliest start of the next attempt.
    pub not_before: Option<Timestamp>,
}

impl AttemptEnd {
    /// The event of the transition table this is.
    pub fn event(&self) -> Event {
        match self {
            AttemptEnd::Wait { .. } => Event::WaitForRetry,
            AttemptEnd::Release => Event::Release,
            AttemptEnd::Done(..) => Event::FinalResponse,
            AttemptEnd::Unknown(_) | AttemptEnd::Cut(..) => Event::AmbiguousNotReplaySafe,
            AttemptEnd::Free(_) => Event::StopFree,
        }
    }

    /// What the record stores, from `in_progress` (the only phase a lease holder writes in).
    pub(crate) fn stored(&self) -> Result<Stored<'_>, Refused> {
        let phase = transition(Phase::InProgress, self.event())?;
        let (stop, response, not_before) = match self {
            AttemptEnd::Wait { not_before } => (None, None, Some(*not_before)),
            AttemptEnd::Release => (None, None, None),
            AttemptEnd::Done(stop, response) => (Some(*stop), Some(response), None),
            AttemptEnd::Unknown(stop) | AttemptEnd::Free(stop) => (Some(*stop), None, None),
            AttemptEnd::Cut(stop, partial) => (Some(*stop), Some(partial), None),
        };
        Ok(Stored { state: phase.state(), stop, response, queued: phase == Phase::Queued, not_before })
    }
}

/// What a late outcome stores: the outcome of the attempt that was in flight when the record's
/// lease expired and a take-over moved it to `unknown` (its worker paused, or its store writes
/// stalled, past the lease). The attempt may have executed, which is why the record is
/// `unknown`; its own answer is the best evidence there is, so it settles the record as a probe
/// would: a final answer makes it `done`, an answer that says nothing executed frees the key,
/// and anything else leaves it `unknown` with the attempt's observation in place of "lost".
pub(crate) struct Late<'a> {
    /// Stored in place of the `lost` attempt the take-over recorded, which had this number.
    pub attempt: &'a Attempt,
    pub state: State,
    pub response: Option<&'a StoredResponse>,
    pub entry: HistoryEntry,
}

impl AttemptEnded {
    /// Whether its attempt's outcome proves the request finished upstream ([`ends_attempt`]): only
    /// then may the write bring the record's bound down to its own time.
    pub(crate) fn ends_its_attempt(&self) -> bool {
        self.attempt.as_ref().is_some_and(|attempt| ends_attempt(attempt.outcome))
    }

    /// The late outcome this write is, should its claim have been taken over to `unknown` while
    /// its attempt was in flight; `None` when it carries no attempt (a stop before sending, a
    /// release), which tells nothing about what executed.
    pub(crate) fn late(&self) -> Option<Late<'_>> {
        let attempt = self.attempt.as_ref()?;
        let answer = match &self.then {
            AttemptEnd::Done(_, response) => Some(response),
            _ => None,
        };
        let event = late_event(answer.is_some(), attempt.outcome);
        let response = answer.filter(|_| event == Event::ResolveExecuted);
        let to = transition(Phase::Unknown, event).ok()?;
        let entry = HistoryEntry {
            at: self.now,
            actor: Actor::Node(self.holder.owner.clone()),
            action: HistoryAction::LateOutcome(to),
            note: Some(format!(
                "attempt {} ({}) ended after its lease expired and the record was taken over",
                attempt.number,
                attempt.outcome.as_str()
            )),
        };
        Some(Late { attempt, state: to.state(), response, entry })
    }
}

impl TakeOverTo {
    /// Where `event` (a lease's expiry, or the take-over cap) moves an `in_progress` record, and
    /// why it stopped there if it did.
    pub fn after(event: Event) -> Result<TakeOverTo, Refused> {
        let capped = matches!(event, Event::TakeoverCapReached { .. });
        Ok(match transition(Phase::InProgress, event)? {
            Phase::Queued if !capped => TakeOverTo::Queued,
            Phase::Free => TakeOverTo::Free(if capped { StopReason::TakeoverCap } else { StopReason::Deadline }),
            Phase::Unknown => {
                TakeOverTo::Unknown(if capped { StopReason::TakeoverCap } else { StopReason::UnsafeReplay })
            }
            _ => return Err(Refused { from: Phase::InProgress, event }),
        })
    }
}

impl Resolution {
    pub fn event(&self) -> Event {
        match self {
            Resolution::Executed(_) => Event::ResolveExecuted,
            Resolution::NotExecuted => Event::ResolveNotExecuted,
        }
    }

    /// The state it settles an `unknown` record in, and the response to store.
    pub(crate) fn stored(&self) -> Result<(State, Option<&StoredResponse>), Refused> {
        let phase = transition(Phase::Unknown, self.event())?;
        let response = match self {
            Resolution::Executed(response) => Some(response),
            Resolution::NotExecuted => None,
        };
        Ok((phase.state(), response))
    }
}

/// The phase an operator's retry re-drives an `unknown` record to.
pub(crate) fn retried() -> Result<Phase, Refused> {
    transition(Phase::Unknown, Event::OperatorRetry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Phase::*;

    #[test]
    fn an_admission_writes_over_a_key_as_the_table_says() {
        let at = Timestamp::from_millis(1_000);
        let overwrite = Overwrite::at(at).unwrap();
        assert_eq!(overwrite.replaced, admitted(false), "an expired record gives way to a fresh one");
        assert_eq!(Ok(overwrite.requeued), transition(Free, Event::Requeue));
        assert_eq!((overwrite.entry.at, overwrite.entry.action), (at, HistoryAction::Requeued));
    }

    fn phase(stored: &Stored<'_>) -> Phase {
        Phase::of(stored.state, stored.queued)
    }

    #[test]
    fn what_an_attempt_leaves_behind_is_the_transition_from_in_progress() {
        let response = StoredResponse { status: 200, headers: vec![], body: Default::default() };
        let seven = Timestamp::from_millis(7);
        let cases = [
            (AttemptEnd::Wait { not_before: seven }, InProgress),
            (AttemptEnd::Release, Queued),
            (AttemptEnd::Done(StopReason::Success, response.clone()), Done),
            (AttemptEnd::Unknown(StopReason::UnsafeReplay), Unknown),
            (AttemptEnd::Free(StopReason::Deadline), Free),
        ];
        for (then, to) in cases {
            let stored = then.stored().unwrap();
            assert_eq!(phase(&stored), to, "{then:?}");
            assert_eq!(Ok(to), transition(InProgress, then.event()));
            assert_eq!(stored.not_before, if to == InProgress { Some(seven) } else { None }, "{then:?}");
            assert_eq!(stored.response.is_some(), to == Done, "{then:?}");
        }
        // A streamed answer cut after its first byte: unknown, what arrived of it kept.
        let cut = AttemptEnd::Cut(StopReason::StreamCut, response.clone());
        let stored = cut.stored().unwrap();
        assert_eq!(phase(&stored), Unknown);
        assert_eq!(stored.stop, Some(StopReason::StreamCut));
        assert_eq!(stored.response, Some(&response));
    }

    #[test]
    fn a_take_over_goes_where_the_expiry_or_the_cap_sends_it_and_says_why() {
        let expired = |attempt_unrecorded, replay_safe, deadline_passed| Event::LeaseExpired {
            attempt_unrecorded,
            replay_safe,
            deadline_passed,
        };
        assert_eq!(TakeOverTo::after(expired(false, false, false)), Ok(TakeOverTo::Queued));
        assert_eq!(TakeOverTo::after(expired(false, false, true)), Ok(TakeOverTo::Free(StopReason::Deadline)));
        assert_eq!(TakeOverTo::after(expired(true, false, false)), Ok(TakeOverTo::Unknown(StopReason::UnsafeReplay)));
        let capped = |attempt_may_have_run| Event::TakeoverCapReached { attempt_may_have_run };
        assert_eq!(TakeOverTo::after(capped(true)), Ok(TakeOverTo::Unknown(StopReason::TakeoverCap)));
        assert_eq!(TakeOverTo::after(capped(false)), Ok(TakeOverTo::Free(StopReason::TakeoverCap)));
        assert!(TakeOverTo::after(Event::Claim).is_err(), "not an event a take-over takes");
    }

    #[test]
    fn resolutions_and_retries_move_an_unknown_record_as_the_table_says() {
        let executed = Resolution::Executed(StoredResponse { status: 201, headers: vec![], body: Default::default() });
        assert_eq!(executed.stored().unwrap().0, State::Done);
        assert!(executed.stored().unwrap().1.is_some());
        assert_eq!(Resolution::NotExecuted.stored().unwrap(), (State::NotStarted, None));
        assert_eq!(retried(), Ok(Queued));
    }
}
