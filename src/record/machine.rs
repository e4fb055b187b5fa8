//! The state machine of a record (its states: docs/concepts.md), pure: where a record goes on
//! each event. The stores persist what [`transition`] decides, guarded by the phase it was
//! decided from.

use crate::domain::Phase;

/// The events that move a record between its states, and the store's commands that do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A request with the same key and fingerprint arrives for a free record.
    Requeue,
    Claim,
    AttemptSent,
    FinalResponse,
    WaitForRetry,
    AmbiguousNotReplaySafe,
    /// Retries stopped and nothing may have executed (or the route is replay-safe).
    StopFree,
    /// Handed back between attempts (at shutdown), for any worker to continue.
    Release,
    LeaseExpired {
        attempt_unrecorded: bool,
        replay_safe: bool,
        deadline_passed: bool,
    },
    /// A lease expired that would be continued, but the record was taken over too often already.
    TakeoverCapReached {
        attempt_may_have_run: bool,
    },
    ResolveExecuted,
    ResolveNotExecuted,
    /// A probe that could not tell: the record waits for the next one.
    ProbeInconclusive,
    OperatorRetry,
    /// A cancel: while queued nothing was sent and the key is freed; while in progress the worker
    /// is asked to stop (one attempt in flight finishes). Anything else has nothing to cancel.
    Cancel,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a record that is {} cannot take {event:?}", from.as_str())]
pub struct Refused {
    pub from: Phase,
    pub event: Event,
}

/// The transition table as a function: anything not listed is refused.
pub fn transition(from: Phase, event: Event) -> Result<Phase, Refused> {
    use Event::*;
    use Phase::*;
    let to = match (from, event) {
        (Free, Requeue) => Queued,
        (Queued, Claim) => InProgress,
        (Queued, Cancel) => Free,
        (InProgress, Cancel) => InProgress,
        (InProgress, AttemptSent | WaitForRetry) => InProgress,
        (InProgress, FinalResponse) => Done,
        (InProgress, AmbiguousNotReplaySafe) => Unknown,
        (InProgress, StopFree) => Free,
        (InProgress, Release) => Queued,
        (InProgress, LeaseExpired { attempt_unrecorded, replay_safe, deadline_passed }) => {
            if attempt_unrecorded && !replay_safe {
                Unknown
            } else if deadline_passed {
                Free
            } else {
                Queued
            }
        }
        (InProgress, TakeoverCapReached { attempt_may_have_run: true }) => Unknown,
        (InProgress, TakeoverCapReached { attempt_may_have_run: false }) => Free,
        (Unknown, ResolveExecuted) => Done,
        (Unknown, ResolveNotExecuted) => Free,
        (Unknown, ProbeInconclusive) => Unknown,
        (Unknown, OperatorRetry) => Queued,
        _ => return Err(Refused { from, event }),
    };
    Ok(to)
}

/// The phase a fresh insert stores: queued, or claimed in the same commit by a worker that sends
/// it at once (a new record is queued, and the claim is the table's `Claim`).
pub fn admitted(claimed: bool) -> Phase {
    match transition(Phase::Queued, Event::Claim) {
        Ok(claimed_phase) if claimed => claimed_phase,
        _ => Phase::Queued,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Event::*;
    use Phase::*;

    const ALL_PHASES: [Phase; 5] = [Queued, Free, InProgress, Done, Unknown];

    fn expired(attempt_unrecorded: bool, replay_safe: bool, deadline_passed: bool) -> Event {
        LeaseExpired { attempt_unrecorded, replay_safe, deadline_passed }
    }

    #[test]
    fn the_happy_path_goes_queued_in_progress_done() {
        let p = transition(Queued, Claim).unwrap();
        let p = transition(p, AttemptSent).unwrap();
        assert_eq!(transition(p, FinalResponse), Ok(Done));
    }

    #[test]
    fn an_ambiguous_attempt_on_an_unsafe_route_becomes_unknown_and_only_an_operator_settles_it() {
        assert_eq!(transition(InProgress, AmbiguousNotReplaySafe), Ok(Unknown));
        assert_eq!(transition(Unknown, ResolveExecuted), Ok(Done));
        assert_eq!(transition(Unknown, ResolveNotExecuted), Ok(Free));
        assert_eq!(transition(Unknown, OperatorRetry), Ok(Queued));
        for event in [Claim, Requeue, FinalResponse, StopFree, Cancel] {
            assert!(transition(Unknown, event).is_err(), "{event:?}");
        }
    }

    #[test]
    fn lease_expiry_follows_what_may_have_been_sent() {
        assert_eq!(transition(InProgress, expired(true, false, false)), Ok(Unknown));
        assert_eq!(transition(InProgress, expired(true, false, true)), Ok(Unknown));
        assert_eq!(transition(InProgress, expired(true, true, false)), Ok(Queued));
        assert_eq!(transition(InProgress, expired(false, false, false)), Ok(Queued));
        assert_eq!(transition(InProgress, expired(false, false, true)), Ok(Free));
    }

    #[test]
    fn a_record_taken_over_too_often_stops_unknown_if_an_attempt_may_have_run_and_free_otherwise() {
        let capped = |attempt_may_have_run| TakeoverCapReached { attempt_may_have_run };
        assert_eq!(transition(InProgress, capped(true)), Ok(Unknown));
        assert_eq!(transition(InProgress, capped(false)), Ok(Free));
        for from in [Queued, Free, Done, Unknown] {
            assert!(transition(from, capped(true)).is_err(), "{from:?}");
        }
    }

    #[test]
    fn done_is_final_and_only_settled_records_are_resolved() {
        for event in [Requeue, Claim, AttemptSent, FinalResponse, ResolveExecuted, ResolveNotExecuted, OperatorRetry] {
            assert!(transition(Done, event).is_err(), "{event:?}");
        }
        for from in [Queued, Free, InProgress, Done] {
            assert!(transition(from, ResolveExecuted).is_err(), "{from:?}");
            assert!(transition(from, OperatorRetry).is_err(), "{from:?}");
        }
    }

    #[test]
    fn only_a_free_record_is_requeued_and_only_a_queued_one_is_claimed() {
        for from in ALL_PHASES {
            assert_eq!(transition(from, Requeue).is_ok(), from == Free, "{from:?}");
            assert_eq!(transition(from, Claim).is_ok(), from == Queued, "{from:?}");
        }
    }

    /// Every event, with every combination of the facts some carry.
    fn every_event() -> Vec<Event> {
        let mut events = vec![
            Requeue,
            Claim,
            AttemptSent,
            FinalResponse,
            WaitForRetry,
            AmbiguousNotReplaySafe,
            StopFree,
            Release,
            ResolveExecuted,
            ResolveNotExecuted,
            ProbeInconclusive,
            OperatorRetry,
            Cancel,
        ];
        for bits in 0..8 {
            events.push(expired(bits & 1 != 0, bits & 2 != 0, bits & 4 != 0));
        }
        events.extend([true, false].map(|attempt_may_have_run| TakeoverCapReached { attempt_may_have_run }));
        events
    }

    /// The transition table, row by row: every allowed (from, event, to). Any pair not listed must be
    /// refused.
    fn table() -> Vec<(Phase, Event, Phase)> {
        let mut rows = vec![
            (Free, Requeue, Queued),
            (Queued, Claim, InProgress),
            (Queued, Cancel, Free),
            (InProgress, Cancel, InProgress),
            (InProgress, AttemptSent, InProgress),
            (InProgress, WaitForRetry, InProgress),
            (InProgress, FinalResponse, Done),
            (InProgress, AmbiguousNotReplaySafe, Unknown),
            (InProgress, StopFree, Free),
            (InProgress, Release, Queued),
            (InProgress, TakeoverCapReached { attempt_may_have_run: true }, Unknown),
            (InProgress, TakeoverCapReached { attempt_may_have_run: false }, Free),
            (Unknown, ResolveExecuted, Done),
            (Unknown, ResolveNotExecuted, Free),
            (Unknown, ProbeInconclusive, Unknown),
            (Unknown, OperatorRetry, Queued),
        ];
        // (attempt unrecorded, replay-safe, deadline passed) → where an expired lease goes.
        for (facts, to) in [
            ((true, false, false), Unknown),
            ((true, false, true), Unknown),
            ((true, true, false), Queued),
            ((true, true, true), Free),
            ((false, false, false), Queued),
            ((false, false, true), Free),
            ((false, true, false), Queued),
            ((false, true, true), Free),
        ] {
            rows.push((InProgress, expired(facts.0, facts.1, facts.2), to));
        }
        rows
    }

    #[test]
    fn every_phase_and_event_pair_goes_where_the_table_says_and_the_rest_are_refused() {
        let table = table();
        for from in ALL_PHASES {
            for event in every_event() {
                let row = table.iter().find(|(f, e, _)| *f == from && *e == event);
                match row {
                    Some(&(_, _, to)) => assert_eq!(transition(from, event), Ok(to), "{from:?} × {event:?}"),
                    None => assert_eq!(transition(from, event), Err(Refused { from, event }), "{from:?} × {event:?}"),
                }
            }
        }
        // Every row was reached by the loop above: the table lists no event `every_event` misses.
        assert!(table.iter().all(|(_, e, _)| every_event().contains(e)));
        assert_eq!(table.len(), 24);
    }

    #[test]
    fn done_refuses_everything() {
        for event in every_event() {
            assert!(transition(Done, event).is_err(), "{event:?}");
        }
    }

    #[test]
    fn a_fresh_insert_is_queued_or_claimed() {
        assert_eq!(admitted(false), Queued);
        assert_eq!(admitted(true), InProgress);
    }

    #[test]
    fn a_refusal_names_the_phase_and_the_event() {
        let refused = transition(Done, Cancel).unwrap_err();
        assert_eq!(refused.to_string(), "a record that is done cannot take Cancel");
    }
}
