//! The claim protocol's rules that are not a phase change (docs/guarantees.md): which outcome ends
//! an attempt's life, what waits for the attempts' bound and as of when, where an expired lease
//! goes, what a late outcome or a probe's answer says. Pure, like [`transition`](super::transition):
//! the stores, the worker and the upkeep loops decide with them, and so does the model of the
//! protocol (`model/`), which checks them over every interleaving.

use std::time::Duration;

use super::machine::Event;
use crate::domain::{AttemptOutcome, Phase, Timestamp};

/// Whether an attempt that ended as `outcome` proves that its request has finished upstream, so
/// that nothing of it can take effect later: an answer the upstream gave as its own (a success,
/// a final status, or one that says it did not execute the request), or a request that never
/// left. An ambiguous ending proves nothing of the kind: a gateway's 502 or 504 may come back at
/// once while the service behind it executes the request later, and a timeout or a cut
/// connection says nothing of what the upstream still holds. Only an outcome that ends its
/// attempt's life may bring the record's bound (`in_flight_until`) down to its own time.
pub fn ends_attempt(outcome: AttemptOutcome) -> bool {
    match outcome {
        AttemptOutcome::Success | AttemptOutcome::Final | AttemptOutcome::NotExecuted => true,
        AttemptOutcome::Ambiguous | AttemptOutcome::Lost => false,
    }
}

/// Whether `event` says an `unknown` record did not execute (it frees it) or sends it again: it
/// must then wait until no attempt marked under the record can still reach the upstream.
pub fn waits_for_attempts(event: Event) -> bool {
    matches!(event, Event::ResolveNotExecuted | Event::OperatorRetry)
}

/// How long `event` must still wait for the attempts marked under a record whose bound is
/// `in_flight_until`, judged as of `as_of` in the clock the bound was set in; `None` when it need
/// not. `as_of` is when the evidence was taken: an operator's word counts when it is written,
/// a probe's "not executed" when the probe was sent (the upstream says it had not executed the
/// request by the time it was asked; what reaches it afterwards, it cannot speak for).
pub fn bound_left(in_flight_until: Option<Timestamp>, event: Event, as_of: Timestamp) -> Option<Duration> {
    let until = in_flight_until.filter(|until| *until > as_of)?;
    waits_for_attempts(event).then(|| until - as_of)
}

/// What a take-over read of a record whose lease expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry {
    /// An attempt was marked and its outcome never stored.
    pub attempt_unrecorded: bool,
    /// The record's policy, the one it was admitted under (see [`replay_safe`]), says so.
    pub replay_safe: bool,
    pub deadline_passed: bool,
    /// How often its lease was taken over before, and how often it may be.
    pub takeovers: u32,
    pub max_takeovers: u32,
    /// Some attempt of it may have executed: one in flight, or one stored as anything but "not
    /// executed".
    pub attempt_may_have_run: bool,
}

/// The event an expired lease is (docs/concepts.md): its expiry, or, where that would queue the
/// record again after `max_takeovers` take-overs, the take-over cap: a record whose workers keep
/// dying on it is stopped rather than continued.
pub fn expiry_event(expiry: Expiry) -> Event {
    let Expiry { attempt_unrecorded, replay_safe, deadline_passed, takeovers, max_takeovers, attempt_may_have_run } =
        expiry;
    let expired = Event::LeaseExpired { attempt_unrecorded, replay_safe, deadline_passed };
    let requeued = super::transition(Phase::InProgress, expired) == Ok(Phase::Queued);
    if requeued && takeovers >= max_takeovers {
        Event::TakeoverCapReached { attempt_may_have_run }
    } else {
        expired
    }
}

/// Whether a record may be sent again after an attempt that may have executed: only where the
/// policy it was admitted under says so, and that policy is still known. A record whose policy a
/// reload removed (or whose route is gone) is judged on the safe side, never on the route's
/// current setting: a reload must not make an operation admitted as unsafe to repeat safe.
pub fn replay_safe(admitted_under: Option<bool>) -> bool {
    admitted_under.unwrap_or(false)
}

/// What the late outcome of an attempt says of the `unknown` record its take-over left: its
/// attempt's answer is the best evidence there is, so it settles the record as a probe would. A
/// final answer (`final_answer`: the execution would have stored it as `done`) executed it; an
/// answer that says nothing executed frees the key; anything else leaves it `unknown`.
pub fn late_event(final_answer: bool, outcome: AttemptOutcome) -> Event {
    match outcome {
        AttemptOutcome::Success | AttemptOutcome::Final if final_answer => Event::ResolveExecuted,
        AttemptOutcome::NotExecuted => Event::ResolveNotExecuted,
        _ => Event::ProbeInconclusive,
    }
}

/// What a probe's answer says of an `unknown` record: a 2xx that it executed, a 404 that it had
/// not by the time the probe was asked, anything else (or no answer) nothing.
pub fn probe_event(status: Option<u16>) -> Event {
    match status {
        Some(200..=299) => Event::ResolveExecuted,
        Some(404) => Event::ResolveNotExecuted,
        _ => Event::ProbeInconclusive,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::AttemptOutcome::*;

    #[test]
    fn only_an_answer_of_the_upstreams_own_or_a_request_never_sent_ends_an_attempts_life() {
        assert!(ends_attempt(Success) && ends_attempt(Final) && ends_attempt(NotExecuted));
        assert!(!ends_attempt(Ambiguous), "a gateway's 504 may come back before the service executes");
        assert!(!ends_attempt(Lost));
    }

    #[test]
    fn what_frees_or_resends_waits_for_the_bound_as_of_its_evidence() {
        let bound = Some(Timestamp::from_millis(1_000));
        let at = |ms| Timestamp::from_millis(ms);
        assert_eq!(bound_left(bound, Event::ResolveNotExecuted, at(400)), Some(Duration::from_millis(600)));
        assert_eq!(bound_left(bound, Event::OperatorRetry, at(999)), Some(Duration::from_millis(1)));
        assert_eq!(bound_left(bound, Event::ResolveNotExecuted, at(1_000)), None, "the bound has passed");
        assert_eq!(bound_left(bound, Event::ResolveExecuted, at(0)), None, "executed settles at once");
        assert_eq!(bound_left(None, Event::OperatorRetry, at(0)), None, "nothing was marked");
    }

    #[test]
    fn an_expired_lease_is_its_expiry_or_past_the_cap_the_cap() {
        let expiry = Expiry {
            attempt_unrecorded: false,
            replay_safe: false,
            deadline_passed: false,
            takeovers: 0,
            max_takeovers: 3,
            attempt_may_have_run: false,
        };
        let expired = |e: Expiry| Event::LeaseExpired {
            attempt_unrecorded: e.attempt_unrecorded,
            replay_safe: e.replay_safe,
            deadline_passed: e.deadline_passed,
        };
        assert_eq!(expiry_event(expiry), expired(expiry));
        let capped = Expiry { takeovers: 3, attempt_may_have_run: true, ..expiry };
        assert_eq!(expiry_event(capped), Event::TakeoverCapReached { attempt_may_have_run: true });
        let stops_anyway = Expiry { takeovers: 3, attempt_unrecorded: true, ..expiry };
        assert_eq!(expiry_event(stops_anyway), expired(stops_anyway), "unknown whatever the count");
    }

    #[test]
    fn a_record_whose_policy_is_unknown_is_not_replay_safe() {
        assert!(replay_safe(Some(true)));
        assert!(!replay_safe(Some(false)));
        assert!(!replay_safe(None));
    }

    #[test]
    fn a_late_outcome_and_a_probe_settle_as_their_evidence_says() {
        assert_eq!(late_event(true, Success), Event::ResolveExecuted);
        assert_eq!(late_event(true, Final), Event::ResolveExecuted);
        assert_eq!(late_event(false, Success), Event::ProbeInconclusive, "not the answer stored as done");
        assert_eq!(late_event(false, NotExecuted), Event::ResolveNotExecuted);
        assert_eq!(late_event(false, Ambiguous), Event::ProbeInconclusive);
        assert_eq!(probe_event(Some(201)), Event::ResolveExecuted);
        assert_eq!(probe_event(Some(404)), Event::ResolveNotExecuted);
        assert_eq!(probe_event(Some(500)), Event::ProbeInconclusive);
        assert_eq!(probe_event(None), Event::ProbeInconclusive);
    }
}
