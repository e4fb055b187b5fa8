//! The store, as its SQL keeps one key's record: each write of `src/store` (the same on SQLite
//! and PostgreSQL) as one function, with the guard its `WHERE` clause has and what its `SET` does.
//! Where a write moves a record, the phase is the crate's own transition table's; where it
//! judges a bound or a late outcome, the crate's own rules decide (`idem::record::rules`). The
//! conformance test (`tests/it/conformance.rs`) replays the model's walks against both real
//! stores and checks that each write answers as [`Store::apply`] does.

use idem::domain::{AttemptOutcome, Phase, Timestamp};
use idem::record::rules::{bound_left, ends_attempt, late_event};
use idem::record::{transition, Event};

use crate::mutants::Mutant;
use crate::Bounds;

/// A time, in ticks of the model's clock: the store's clock (PostgreSQL's own, or the one host's
/// that SQLite nodes share).
pub type Tick = u8;

/// Which execution's answer a record keeps: the attempt that executed, named by its claim and
/// number ([`resp`]), whose answer it is.
pub type Resp = u8;

/// The answer of attempt `number` under claim `claim`.
pub fn resp(claim: u8, number: u8) -> Resp {
    claim * 8 + number
}

/// How an attempt ended, as the worker classifies it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// A final answer: executed.
    Success,
    /// Not executed: the upstream said so, or the request never left.
    NotExecuted,
    /// It may have executed: a gateway's status, a timeout, a cut connection.
    Ambiguous,
}

impl Class {
    pub fn outcome(self) -> AttemptOutcome {
        match self {
            Class::Success => AttemptOutcome::Success,
            Class::NotExecuted => AttemptOutcome::NotExecuted,
            Class::Ambiguous => AttemptOutcome::Ambiguous,
        }
    }
}

/// What an execution leaves a record in after an attempt (`store::AfterAttempt`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Then {
    Wait,
    Done(Resp),
    Unknown,
    Free,
    Release,
}

impl Then {
    pub fn event(self) -> Event {
        match self {
            Then::Wait => Event::WaitForRetry,
            Then::Done(_) => Event::FinalResponse,
            Then::Unknown => Event::AmbiguousNotReplaySafe,
            Then::Free => Event::StopFree,
            Then::Release => Event::Release,
        }
    }
}

/// A lease: when it expires, in the store's clock. (Who holds it is kept too, but no guard
/// reads it: every write is guarded by the claim's token.)
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Lease {
    pub expires: Tick,
}

/// The last attempt stored with a record: its number, and whether a take-over stored it as lost
/// (the only attempt a late outcome may replace).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Last {
    pub number: u8,
    pub lost: bool,
}

/// One key's record, as the columns the protocol reads and writes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rec {
    /// Which record of the key: a done record past its retention gives way to a new one.
    pub gen: u8,
    pub phase: PhaseKey,
    /// `claim_token`.
    pub claim: u8,
    pub lease: Option<Lease>,
    /// `in_flight_number`: an attempt marked and its outcome not stored.
    pub in_flight: Option<u8>,
    /// `in_flight_until`: no attempt marked so far can reach the upstream after it.
    pub until: Option<Tick>,
    pub takeovers: u8,
    pub last: Option<Last>,
    pub response: Option<Resp>,
    pub done_at: Option<Tick>,
    /// The version of the policy it was admitted under, and whether that policy is replay-safe.
    pub version: u8,
    pub replay_safe: bool,
    pub cancel: bool,
    /// The number of its last attempt when its deadline was last set (a requeue, an operator's
    /// retry): attempts up to it do not count against `max_attempts`. Not a column: the worker
    /// counts the attempts that started since the request's arrival, which the deadline gives.
    pub base: u8,
}

/// [`Phase`], ordered and hashable for the model's states.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum PhaseKey {
    Queued,
    Free,
    InProgress,
    Done,
    Unknown,
}

impl PhaseKey {
    pub fn of(phase: Phase) -> PhaseKey {
        match phase {
            Phase::Queued => PhaseKey::Queued,
            Phase::Free => PhaseKey::Free,
            Phase::InProgress => PhaseKey::InProgress,
            Phase::Done => PhaseKey::Done,
            Phase::Unknown => PhaseKey::Unknown,
        }
    }

    pub fn phase(self) -> Phase {
        match self {
            PhaseKey::Queued => Phase::Queued,
            PhaseKey::Free => Phase::Free,
            PhaseKey::InProgress => Phase::InProgress,
            PhaseKey::Done => Phase::Done,
            PhaseKey::Unknown => Phase::Unknown,
        }
    }
}

/// A write to the store, as a node (or an operator) sends it: the command of `src/store/command.rs`
/// it is, with the values the model gives it. `now` is the store's time of the write.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Op {
    /// `Store::admit`: a request with the key. `claim`: the admitting node has a worker free and
    /// claims it in the insert, marking attempt 1. `judged`: the time its retention cutoff is
    /// reckoned from (the store's own; a node's in [`Mutant::RetentionOnNodeClocks`]).
    Admit { node: u8, claim: bool, version: u8, replay_safe: bool, judged: Tick },
    /// `Store::claim`.
    Claim { node: u8 },
    /// `Store::attempt_started`.
    Mark { claim: u8, number: u8 },
    /// `Store::renew`.
    Renew { claim: u8 },
    /// `Store::attempt_ended`, with the attempt it carries if any.
    Ended { claim: u8, attempt: Option<(u8, Class)>, then: Then },
    /// `Store::take_over`, on what the sweep read.
    TakeOver { claim: u8, expires: Tick, in_flight: Option<u8>, to: PhaseKey },
    /// `Store::probed` with a verdict: `Some(resp)` executed (2xx), `None` not executed (404).
    Probed { claim: u8, executed: Option<Resp>, asked_at: Tick },
    /// `Store::resolve`: an operator's word.
    Resolve { executed: Option<Resp> },
    /// `Store::retry`: an operator's re-drive.
    Retry,
    /// `Store::cancel`.
    Cancel,
}

/// What a write answered.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Answer {
    /// A new record (`Created`), claimed by the admitting node or queued.
    Created {
        claimed: bool,
    },
    /// A free record queued again (`Requeued`).
    Requeued,
    /// The key's record decides (`Existing`).
    Existing,
    /// A claim's token, or none (`Option<ClaimToken>`).
    Claimed(Option<u8>),
    /// `Lease::Held`.
    Held {
        cancel: bool,
    },
    /// `Lease::Lost`; `late`: it was taken as the late outcome of its attempt.
    Lost {
        late: bool,
    },
    /// `Action::Applied`, or a take-over (`true`).
    Applied,
    /// `Action::Refused`, a take-over refused (`false`), a cancel with nothing to cancel.
    Refused,
    /// `Action::InFlight`: the bound had this many ticks left.
    InFlight(Tick),
    Missing,
}

/// The store: the key's record, if it has one.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Store {
    pub rec: Option<Rec>,
    /// How many records the key has had: the next one's `gen`.
    pub gens: u8,
}

thread_local! {
    /// The writes applied on this thread, while a walk keeps them ([`journal`]).
    static JOURNAL: std::cell::RefCell<Option<Vec<(Op, Tick, Answer)>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f`, and returns with its result every write it applied, in order, with the store's time
/// of each and its answer.
pub fn journal<T>(f: impl FnOnce() -> T) -> (T, Vec<(Op, Tick, Answer)>) {
    JOURNAL.with(|j| *j.borrow_mut() = Some(Vec::new()));
    let result = f();
    let writes = JOURNAL.with(|j| j.borrow_mut().take()).unwrap_or_default();
    (result, writes)
}

impl Store {
    /// Applies `op` at the store's time `now`: what the write answers, the record as it leaves it.
    pub fn apply(&mut self, op: &Op, now: Tick, bounds: &Bounds, mutant: Option<Mutant>) -> Answer {
        let answer = self.applied(op, now, bounds, mutant);
        JOURNAL.with(|j| {
            if let Some(writes) = j.borrow_mut().as_mut() {
                writes.push((op.clone(), now, answer));
            }
        });
        answer
    }

    fn applied(&mut self, op: &Op, now: Tick, bounds: &Bounds, mutant: Option<Mutant>) -> Answer {
        match *op {
            Op::Admit { claim, version, replay_safe, judged, .. } => {
                self.admit(claim, version, replay_safe, judged, now, bounds)
            }
            Op::Claim { .. } => self.claim(now, bounds),
            Op::Mark { claim, number } => self.mark(claim, number, now, bounds),
            Op::Renew { claim } => self.renew(claim, now, bounds),
            Op::Ended { claim, attempt, then } => self.ended(claim, attempt, then, now, mutant),
            Op::TakeOver { claim, expires, in_flight, to } => self.take_over(claim, expires, in_flight, to, mutant),
            Op::Probed { claim, executed, asked_at } => {
                let as_of = if mutant == Some(Mutant::ProbeJudgedAtWrite) { now } else { asked_at };
                self.settle(Some(claim), executed, as_of, now, mutant)
            }
            Op::Resolve { executed } => self.settle(None, executed, now, now, mutant),
            Op::Retry => self.retry(now),
            Op::Cancel => self.cancel(),
        }
    }

    /// `admit`: a fresh insert (claimed, with attempt 1 marked, or queued); a done record past
    /// its retention replaced by a new one, queued; a free record of the same request queued
    /// again (`Overwrite`); anything else left to decide the answer.
    fn admit(&mut self, claim: bool, version: u8, replay_safe: bool, judged: Tick, now: Tick, b: &Bounds) -> Answer {
        let fresh = |gen: u8, claim: bool| {
            let phase = idem::record::admitted(claim);
            Rec {
                gen,
                phase: PhaseKey::of(phase),
                claim: u8::from(claim),
                lease: claim.then_some(Lease { expires: now + b.lease }),
                in_flight: claim.then_some(1),
                until: claim.then_some(now + b.reach()),
                takeovers: 0,
                last: None,
                response: None,
                done_at: None,
                version,
                replay_safe,
                cancel: false,
                base: 0,
            }
        };
        let Some(rec) = &mut self.rec else {
            self.rec = Some(fresh(self.gens, claim));
            self.gens += 1;
            return Answer::Created { claimed: claim };
        };
        match rec.phase {
            // `records.done_at < $cutoff`, the cutoff being the judge's time less the retention.
            PhaseKey::Done
                if rec.done_at.is_some_and(|done| u16::from(done) + u16::from(b.retention) < u16::from(judged)) =>
            {
                // The claim token is not reset: the new record's claims go on counting.
                let claim = rec.claim;
                *rec = Rec { claim, ..fresh(self.gens, false) };
                self.gens += 1;
                Answer::Created { claimed: false }
            }
            PhaseKey::Free => {
                let to = transition(Phase::Free, Event::Requeue).expect("a free record is requeued");
                rec.phase = PhaseKey::of(to);
                rec.lease = None;
                rec.in_flight = None;
                rec.response = None;
                rec.cancel = false;
                rec.base = rec.last.map_or(0, |last| last.number);
                Answer::Requeued
            }
            _ => Answer::Existing,
        }
    }

    /// `claim`: a queued record, under a new token.
    fn claim(&mut self, now: Tick, b: &Bounds) -> Answer {
        match &mut self.rec {
            Some(rec) if rec.phase == PhaseKey::Queued => {
                rec.phase = PhaseKey::of(transition(Phase::Queued, Event::Claim).expect("claimable"));
                rec.claim += 1;
                rec.lease = Some(Lease { expires: now + b.lease });
                Answer::Claimed(Some(rec.claim))
            }
            _ => Answer::Claimed(None),
        }
    }

    /// The record an update guarded by `state = 'in_progress' AND claim_token = $claim` finds.
    fn held(&mut self, claim: u8) -> Option<&mut Rec> {
        self.rec.as_mut().filter(|rec| rec.phase == PhaseKey::InProgress && rec.claim == claim)
    }

    /// `attempt_started`: the mark, the lease renewed, the bound raised.
    fn mark(&mut self, claim: u8, number: u8, now: Tick, b: &Bounds) -> Answer {
        let Some(rec) = self.held(claim) else { return Answer::Lost { late: false } };
        rec.in_flight = Some(number);
        if let Some(lease) = &mut rec.lease {
            lease.expires = now + b.lease;
        }
        rec.until = Some(rec.until.unwrap_or(0).max(now + b.reach()));
        Answer::Held { cancel: rec.cancel }
    }

    fn renew(&mut self, claim: u8, now: Tick, b: &Bounds) -> Answer {
        let Some(rec) = self.held(claim) else { return Answer::Lost { late: false } };
        if let Some(lease) = &mut rec.lease {
            lease.expires = now + b.lease;
        }
        Answer::Held { cancel: rec.cancel }
    }

    /// `attempt_ended`: the outcome under its claim; refused, it may be the late outcome of the
    /// attempt its claim's take-over left lost.
    fn ended(
        &mut self,
        claim: u8,
        attempt: Option<(u8, Class)>,
        then: Then,
        now: Tick,
        mutant: Option<Mutant>,
    ) -> Answer {
        let ends = match mutant {
            // As protocol 2 stood: any outcome that carried its attempt brought the bound down.
            Some(Mutant::AmbiguousCutsBound) => attempt.is_some(),
            _ => attempt.is_some_and(|(_, class)| ends_attempt(class.outcome())),
        };
        if let Some(rec) = self.held(claim) {
            let to = PhaseKey::of(transition(Phase::InProgress, then.event()).expect("a holder's outcome applies"));
            if let Some((number, _)) = attempt {
                rec.last = Some(Last { number, lost: false });
            }
            rec.in_flight = None;
            if ends && rec.takeovers == 0 && rec.until.is_some_and(|until| until > now) {
                rec.until = Some(now);
            }
            rec.phase = to;
            if to != PhaseKey::InProgress {
                rec.lease = None;
            }
            if let Then::Done(resp) = then {
                rec.response = Some(resp);
                rec.done_at = Some(now);
            }
            return Answer::Held { cancel: rec.cancel };
        }
        Answer::Lost { late: self.late_outcome(claim, attempt, then, now) }
    }

    /// `late_outcome`: settles an `unknown` record still as its claim's take-over left it.
    fn late_outcome(&mut self, claim: u8, attempt: Option<(u8, Class)>, then: Then, now: Tick) -> bool {
        let Some((number, class)) = attempt else { return false };
        let Some(rec) = &mut self.rec else { return false };
        let lost = Some(Last { number, lost: true });
        if rec.phase != PhaseKey::Unknown || rec.claim != claim || rec.last != lost {
            return false;
        }
        let answer = match then {
            Then::Done(resp) => Some(resp),
            _ => None,
        };
        let event = late_event(answer.is_some(), class.outcome());
        let Ok(to) = transition(Phase::Unknown, event) else { return false };
        rec.phase = PhaseKey::of(to);
        rec.last = Some(Last { number, lost: false });
        if to == Phase::Done {
            rec.response = answer;
            rec.done_at = Some(now);
        }
        true
    }

    /// `take_over`: guarded by the claim, the expired lease and the attempt in flight it was
    /// decided on.
    fn take_over(
        &mut self,
        claim: u8,
        expires: Tick,
        in_flight: Option<u8>,
        to: PhaseKey,
        mutant: Option<Mutant>,
    ) -> Answer {
        let Some(rec) = &mut self.rec else { return Answer::Refused };
        let same_attempt = mutant == Some(Mutant::TakeoverIgnoresInFlight) || rec.in_flight == in_flight;
        let guard = rec.phase == PhaseKey::InProgress
            && rec.claim == claim
            && rec.lease.map(|l| l.expires) == Some(expires)
            && same_attempt;
        if !guard {
            return Answer::Refused;
        }
        rec.phase = to;
        if let Some(number) = in_flight {
            rec.last = Some(Last { number, lost: true });
        }
        rec.in_flight = None;
        rec.lease = None;
        rec.takeovers += 1;
        Answer::Applied
    }

    /// `settle` (a probe's verdict, `claim` naming the claim it read, or an operator's word):
    /// the transition from the phase as read, then for "not executed" the bound as of `as_of`,
    /// then the update guarded by the claim.
    fn settle(
        &mut self,
        claim: Option<u8>,
        executed: Option<Resp>,
        as_of: Tick,
        now: Tick,
        mutant: Option<Mutant>,
    ) -> Answer {
        let Some(rec) = &mut self.rec else { return Answer::Missing };
        let event = if executed.is_some() { Event::ResolveExecuted } else { Event::ResolveNotExecuted };
        let Ok(to) = transition(rec.phase.phase(), event) else { return Answer::Refused };
        let bound_ignored = mutant == Some(Mutant::ProbeTrustedBeforeBound) && claim.is_some();
        if let Some(left) = bound_left(rec.until.map(ticks), event, ticks(as_of)).filter(|_| !bound_ignored) {
            return Answer::InFlight(left.as_secs() as Tick);
        }
        if claim.is_some_and(|claim| claim != rec.claim) {
            return Answer::Refused;
        }
        rec.phase = PhaseKey::of(to);
        if let Some(resp) = executed {
            rec.response = Some(resp);
            rec.done_at = Some(now);
        }
        Answer::Applied
    }

    /// `retry`: an operator re-drives an `unknown` record, once its bound has passed.
    fn retry(&mut self, now: Tick) -> Answer {
        let Some(rec) = &mut self.rec else { return Answer::Missing };
        let Ok(to) = transition(rec.phase.phase(), Event::OperatorRetry) else { return Answer::Refused };
        if let Some(left) = bound_left(rec.until.map(ticks), Event::OperatorRetry, ticks(now)) {
            return Answer::InFlight(left.as_secs() as Tick);
        }
        rec.phase = PhaseKey::of(to);
        rec.takeovers = 0;
        rec.cancel = false;
        rec.base = rec.last.map_or(0, |last| last.number);
        Answer::Applied
    }

    /// `cancel`: a queued record freed, one in progress flagged for its worker.
    fn cancel(&mut self) -> Answer {
        let Some(rec) = &mut self.rec else { return Answer::Missing };
        match transition(rec.phase.phase(), Event::Cancel) {
            Ok(Phase::Free) => {
                rec.phase = PhaseKey::Free;
                Answer::Applied
            }
            Ok(Phase::InProgress) => {
                rec.cancel = true;
                Answer::Applied
            }
            _ => Answer::Refused,
        }
    }
}

/// A tick as the crate's time: one second each, so that the crate's rules compute in the model's
/// units.
pub fn ticks(tick: Tick) -> Timestamp {
    Timestamp::from_millis(i64::from(tick) * 1_000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenarios;

    fn bounds() -> Bounds {
        scenarios::named("three-nodes").unwrap().bounds
    }

    /// A store whose record was admitted claimed at tick 0, attempt 1 marked.
    fn marked() -> Store {
        let mut store = Store::default();
        let admit = Op::Admit { node: 0, claim: true, version: 0, replay_safe: false, judged: 0 };
        assert_eq!(store.apply(&admit, 0, &bounds(), None), Answer::Created { claimed: true });
        store
    }

    #[test]
    fn only_an_outcome_that_ends_its_attempt_brings_the_bound_down() {
        let b = bounds();
        for (class, then, until) in [
            (Class::Ambiguous, Then::Unknown, b.reach()),
            (Class::NotExecuted, Then::Free, 1),
            (Class::Success, Then::Done(resp(1, 1)), 1),
        ] {
            let mut store = marked();
            let ended = Op::Ended { claim: 1, attempt: Some((1, class)), then };
            assert_eq!(store.apply(&ended, 1, &b, None), Answer::Held { cancel: false });
            assert_eq!(store.rec.unwrap().until, Some(until), "{class:?}");
        }
        let mut store = marked();
        let ended = Op::Ended { claim: 1, attempt: Some((1, Class::Ambiguous)), then: Then::Unknown };
        store.apply(&ended, 1, &b, Some(Mutant::AmbiguousCutsBound));
        assert_eq!(store.rec.unwrap().until, Some(1), "as protocol 2 stood");
    }

    #[test]
    fn a_probes_404_is_judged_as_of_its_asking() {
        let b = bounds();
        let mut store = marked();
        let ended = Op::Ended { claim: 1, attempt: Some((1, Class::Ambiguous)), then: Then::Unknown };
        store.apply(&ended, 0, &b, None);
        let asked = Op::Probed { claim: 1, executed: None, asked_at: b.reach() - 1 };
        assert_eq!(store.clone().apply(&asked, b.reach() + 5, &b, None), Answer::InFlight(1));
        assert_eq!(store.clone().apply(&asked, b.reach() + 5, &b, Some(Mutant::ProbeJudgedAtWrite)), Answer::Applied);
        let past = Op::Probed { claim: 1, executed: None, asked_at: b.reach() };
        assert_eq!(store.apply(&past, b.reach(), &b, None), Answer::Applied);
        assert_eq!(store.rec.unwrap().phase, PhaseKey::Free);
    }

    #[test]
    fn a_take_over_is_refused_once_what_it_read_has_changed() {
        let b = bounds();
        let mut store = marked();
        let read = Op::TakeOver { claim: 1, expires: b.lease, in_flight: None, to: PhaseKey::Queued };
        assert_eq!(store.clone().apply(&read, b.lease + 1, &b, None), Answer::Refused, "an attempt is in flight");
        assert_eq!(store.clone().apply(&read, b.lease + 1, &b, Some(Mutant::TakeoverIgnoresInFlight)), Answer::Applied);
        let read = Op::TakeOver { claim: 1, expires: b.lease, in_flight: Some(1), to: PhaseKey::Unknown };
        assert_eq!(store.apply(&read, b.lease + 1, &b, None), Answer::Applied);
        let rec = store.rec.unwrap();
        assert_eq!((rec.phase, rec.last, rec.takeovers), (PhaseKey::Unknown, Some(Last { number: 1, lost: true }), 1));
    }
}
