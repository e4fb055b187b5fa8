//! A node of Idem, as its worker (`src/worker`) and upkeep loops (`src/upkeep`) behave: one
//! execution at a time, a take-over sweep, a prober. Each step is what the code does next; the
//! nondeterminism is the world's: when time moves, what the upstream answers, which fault comes.

use idem::domain::Phase;
use idem::record::rules::{expiry_event, Expiry};
use idem::record::transition;

use crate::store::{Answer, Class, Op, PhaseKey, Resp, Then, Tick};
use crate::world::{class_of, Effect, Health, Req, State};
use crate::{Mutant, Protocol};

/// How a node's take-over sweep holds back after the store failed, or after the node started
/// (`upkeep::Sweeper`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Hold {
    No,
    /// A pass failed: nothing is taken over until one succeeds.
    UntilAnswered,
    /// Nothing is taken over before this tick.
    Until(Tick),
}

/// An execution's claim, as its node holds it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Job {
    pub gen: u8,
    pub claim: u8,
    /// The lease is trusted before this tick (`LeaseTrust`), on the node's monotonic clock,
    /// which runs as the store's does.
    pub trust: Tick,
    /// The policy it runs under, fixed when it was claimed.
    pub replay_safe: bool,
    /// Attempts numbered up to this one ran before the request's deadline was last set, and
    /// do not count against `max_attempts`.
    pub base: u8,
    /// A renewal failed or found the claim taken: no further attempt goes under it.
    pub doubt: bool,
}

/// Where a node's execution stands.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Exec {
    Idle,
    /// Claimed, attempt `next` about to be marked; `stop`: a cancel was seen. `stamp`: the time
    /// the node read for its mark, where the store keeps time in the writing node's clock
    /// ([`Bounds::stamped`](crate::Bounds::stamped)): read before the write is sent, it is stale
    /// by however long the node stalls in between.
    /// The stamp is the store's time and the monotonic time read together.
    Claimed {
        job: Job,
        next: u8,
        stop: bool,
        stamp: Option<(Tick, Tick)>,
    },
    /// Attempt `number` marked: it is sent before `send_by`, or never.
    Marked {
        job: Job,
        number: u8,
        send_by: Tick,
    },
    /// Sent, awaiting its answer.
    Sent {
        job: Job,
        number: u8,
    },
    /// Its answer (or its failure) in hand, not stored yet.
    Ended {
        job: Job,
        number: u8,
        class: Class,
        resp: Option<Resp>,
    },
    /// An outcome the store could not take, told to its client all the same, written again.
    Unrecorded {
        job: Job,
        number: u8,
        class: Class,
        then: Then,
    },
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Sweep {
    Idle,
    /// An expired lease read, and what the transition table decided for it: the write follows.
    Read {
        claim: u8,
        expires: Tick,
        in_flight: Option<u8>,
        to: PhaseKey,
    },
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Probe {
    Idle,
    /// Asked at `asked_at` (the store's time read before sending) about the record `gen` under
    /// `claim`; once it reaches the upstream, `arrived` holds its verdict: executed (with that
    /// answer) or not.
    Asked {
        gen: u8,
        claim: u8,
        asked_at: Tick,
        arrived: Option<Option<Resp>>,
    },
    /// Its answer came back: written next.
    Answered {
        gen: u8,
        claim: u8,
        asked_at: Tick,
        executed: Option<Resp>,
    },
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Node {
    /// How far its clock runs ahead of the store's.
    pub ahead: Tick,
    pub up: bool,
    pub paused: bool,
    /// The store protocol its build speaks.
    pub protocol: u8,
    pub exec: Exec,
    pub sweep: Sweep,
    pub probe: Probe,
    pub hold: Hold,
}

/// The store answers node `n`'s calls: it is up, and speaks the node's protocol (or the trigger
/// that would refuse it is gone, [`Mutant::OlderNodeUnguarded`]).
fn reachable(model: &Protocol, s: &State, n: u8) -> bool {
    let speaks = s.nodes[n as usize].protocol == s.protocol || model.broken(Mutant::OlderNodeUnguarded);
    s.health != Health::Down && speaks
}

/// A client's request with the key reaches node `n`: recorded, claimed at once if the node has
/// its worker free (attempt 1 marked in the same insert), or answered by the key's record.
pub fn admit(model: &Protocol, s: &mut State, n: u8) {
    if !reachable(model, s, n) {
        return;
    }
    let b = &model.bounds;
    let claim = s.nodes[n as usize].exec == Exec::Idle;
    let judged = if model.broken(Mutant::RetentionOnNodeClocks) { s.node_now(n) } else { s.store_time() };
    let replaced = s.rec().filter(|r| r.phase == PhaseKey::Done).and_then(|r| r.done_at);
    let route = s.route;
    let op = Op::Admit { node: n, claim, version: route.version, replay_safe: route.replay_safe, judged };
    match s.call(model, Some(n), op) {
        Some(Answer::Created { claimed }) => {
            let gen = s.rec().expect("created").gen;
            s.lives[gen as usize].safe = route.replay_safe;
            if replaced.is_some_and(|done| u16::from(done) + u16::from(b.retention) >= u16::from(s.store_time())) {
                s.early = true;
            }
            if claimed {
                let job = Job {
                    gen,
                    claim: 1,
                    trust: s.t + b.trust(),
                    replay_safe: route.replay_safe,
                    base: 0,
                    doubt: false,
                };
                s.nodes[n as usize].exec = Exec::Marked { job, number: 1, send_by: s.t + b.window };
            }
        }
        Some(Answer::Existing) => {
            let rec = s.rec().expect("existing");
            if let (PhaseKey::Done, Some(resp)) = (rec.phase, rec.response) {
                let gen = rec.gen;
                s.tell(gen, resp);
            }
        }
        _ => {}
    }
}

/// Whether node `n`'s execution has a step to take now.
pub fn can_step(model: &Protocol, s: &State, n: u8) -> bool {
    let b = &model.bounds;
    match s.nodes[n as usize].exec {
        Exec::Idle => s.rec().is_some_and(|r| r.phase == PhaseKey::Queued) && reachable(model, s, n),
        Exec::Claimed { .. } | Exec::Marked { .. } | Exec::Ended { .. } => true,
        Exec::Sent { job, number } => {
            let req = s.req(job.gen, job.claim, number).expect("a request awaited is kept");
            req.answer.is_some() || s.t >= req.sent + b.limit
        }
        Exec::Unrecorded { .. } => s.health == Health::Up && reachable(model, s, n),
    }
}

/// Node `n`'s execution takes its next step.
pub fn step(model: &Protocol, s: &mut State, n: u8) {
    let b = &model.bounds;
    let t = s.t;
    let exec = match s.nodes[n as usize].exec {
        Exec::Idle => {
            let Some(Answer::Claimed(Some(claim))) = s.call(model, Some(n), Op::Claim { node: n }) else { return };
            let rec = s.rec().expect("claimed");
            let base = rec.base;
            let next = rec.last.map_or(1, |last| last.number + 1);
            let job = Job {
                gen: rec.gen,
                claim,
                trust: t + b.trust(),
                replay_safe: s.policy_of(model, rec),
                base,
                doubt: false,
            };
            Exec::Claimed { job, next, stop: false, stamp: None }
        }
        Exec::Claimed { job, next, stop: false, stamp: None }
            if b.stamped && !job.doubt && next - job.base <= b.max_attempts =>
        {
            Exec::Claimed { job, next, stop: false, stamp: Some((s.store_time(), t)) }
        }
        Exec::Claimed { job, next, stop, stamp } => {
            if job.doubt || stop || next - job.base > b.max_attempts {
                // Handed back (its claim in doubt), or settled with nothing sent: cancelled, or no
                // attempt left (every one before said it did not execute).
                let then = if job.doubt { Then::Release } else { Then::Free };
                s.call(model, Some(n), Op::Ended { claim: job.claim, attempt: None, then });
                Exec::Idle
            } else {
                // The mark's lease counts from the store's time it carries, its send window and the
                // trust it renews from the monotonic time read with it.
                let (at, read) = stamp.unwrap_or((s.store_now(model, Some(n)), t));
                match s.call_at(model, Some(n), Op::Mark { claim: job.claim, number: next }, at) {
                    Some(Answer::Held { cancel: false }) => {
                        let job = Job { trust: job.trust.max(read + b.trust()), ..job };
                        Exec::Marked { job, number: next, send_by: (read + b.window).min(job.trust) }
                    }
                    Some(Answer::Held { cancel: true }) => Exec::Claimed { job, next, stop: true, stamp: None },
                    // Taken, or not recorded: without its mark, nothing is sent.
                    _ => Exec::Idle,
                }
            }
        }
        Exec::Marked { job, number, send_by } => {
            if t < send_by || model.broken(Mutant::SendWindowUnchecked) {
                let req =
                    Req { gen: job.gen, claim: job.claim, number, sent: t, effect: Effect::Pending, answer: None };
                s.reqs.push(req);
                let life = &mut s.lives[job.gen as usize];
                if life.told.is_some() {
                    life.resent = true;
                }
                Exec::Sent { job, number }
            } else {
                // Past its window: given up unsent (`not_sent`).
                Exec::Ended { job, number, class: Class::NotExecuted, resp: None }
            }
        }
        Exec::Sent { job, number } => {
            let r = s.req(job.gen, job.claim, number).expect("a request awaited is kept");
            match r.answer {
                Some(answer) if t < r.sent + b.limit => {
                    let resp = match r.effect {
                        Effect::Executed(resp) => Some(resp),
                        _ => None,
                    };
                    Exec::Ended { job, number, class: class_of(answer), resp }
                }
                // Cut at its limit: it may have executed.
                _ => Exec::Ended { job, number, class: Class::Ambiguous, resp: None },
            }
        }
        Exec::Ended { job, number, class, resp } => {
            let retry = number - job.base < b.max_attempts;
            let then = match class {
                Class::Success => Then::Done(resp.expect("a final answer follows its execution")),
                Class::NotExecuted | Class::Ambiguous if class == Class::NotExecuted || job.replay_safe => {
                    if retry {
                        Then::Wait
                    } else {
                        Then::Free
                    }
                }
                Class::NotExecuted | Class::Ambiguous => Then::Unknown,
            };
            let op = Op::Ended { claim: job.claim, attempt: Some((number, class)), then };
            match s.call(model, Some(n), op) {
                Some(Answer::Held { cancel }) => {
                    if let Then::Done(resp) = then {
                        s.tell(job.gen, resp);
                    }
                    match then {
                        Then::Wait => Exec::Claimed { job, next: number + 1, stop: cancel, stamp: None },
                        _ => Exec::Idle,
                    }
                }
                Some(_) => Exec::Idle,
                // Between attempts, an outcome not stored ends the execution; the record's lease
                // will run out.
                None if then == Then::Wait => Exec::Idle,
                None => {
                    // Told to its client as it is, not recorded, and written again.
                    if let Then::Done(resp) = then {
                        s.tell(job.gen, resp);
                    }
                    let refused = s.nodes[n as usize].protocol != s.protocol;
                    if refused {
                        // Not the store's absence: it would be refused again.
                        Exec::Idle
                    } else {
                        Exec::Unrecorded { job, number, class, then }
                    }
                }
            }
        }
        Exec::Unrecorded { job, number, class, then } => {
            let op = Op::Ended { claim: job.claim, attempt: Some((number, class)), then };
            match s.call(model, Some(n), op) {
                Some(_) => Exec::Idle,
                None => return,
            }
        }
    };
    s.nodes[n as usize].exec = exec;
}

/// Whether node `n` renews its claim's lease now: while its attempt is in flight, or while its
/// unrecorded outcome is written again, once its trust in the lease has run out. A running node
/// renews every third of a lease, before its trust runs out; here it renews when it does, before
/// time moves on (the store's lease outlives the trust by the clock margin). Only a pause, a crash
/// or a failing store keeps it from it.
pub fn can_renew(model: &Protocol, s: &State, n: u8) -> bool {
    match s.nodes[n as usize].exec {
        Exec::Sent { job, .. } => !job.doubt && job.trust <= s.t,
        // The writer of an unrecorded outcome renews between its tries whatever an earlier
        // renewal found (`worker::unrecorded`), while the store takes small writes.
        Exec::Unrecorded { job, .. } => {
            !model.broken(Mutant::UnrecordedOutcomeNotRenewed) && job.trust <= s.t && s.health != Health::Down
        }
        _ => false,
    }
}

pub fn renew(model: &Protocol, s: &mut State, n: u8) {
    let b = &model.bounds;
    let Some(job) = s.nodes[n as usize].job().copied() else { return };
    let renewed = match s.call(model, Some(n), Op::Renew { claim: job.claim }) {
        Some(Answer::Held { .. }) => Job { trust: job.trust.max(s.t + b.trust()), ..job },
        // Taken, or the store failed: the attempt in flight finishes, no other goes under it.
        // (An unrecorded outcome's writer goes on trying, and renewing.)
        _ if matches!(s.nodes[n as usize].exec, Exec::Unrecorded { .. }) => Job { trust: s.t + 1, ..job },
        _ => Job { doubt: true, ..job },
    };
    let exec = &mut s.nodes[n as usize].exec;
    match exec {
        Exec::Sent { job, .. } | Exec::Unrecorded { job, .. } => *job = renewed,
        _ => {}
    }
}

/// Whether a lease has run out, for node `n`'s sweep: in the store's clock, or in the node's own
/// ([`Mutant::LeasesOnNodeClocks`]).
fn expired(model: &Protocol, s: &State, n: u8, expires: Tick) -> bool {
    let now = if model.broken(Mutant::LeasesOnNodeClocks) { s.node_now(n) } else { s.store_time() };
    expires < now
}

/// Whether node `n`'s take-over sweep has a step to take now.
pub fn can_sweep(model: &Protocol, s: &State, n: u8) -> bool {
    let node = &s.nodes[n as usize];
    if let Sweep::Read { .. } = node.sweep {
        return true;
    }
    if s.health == Health::Down {
        return node.hold != Hold::UntilAnswered;
    }
    match node.hold {
        Hold::UntilAnswered => true,
        Hold::Until(until) if s.t < until => false,
        _ => s.rec().is_some_and(|r| {
            r.phase == PhaseKey::InProgress && r.lease.is_some_and(|l| expired(model, s, n, l.expires))
        }),
    }
}

/// Node `n`'s sweep takes its next step: a pass that finds the store failing holds take-overs
/// back until one succeeds and for a lease after; otherwise an expired lease is read and decided,
/// then the take-over written, guarded by what was read.
pub fn sweep(model: &Protocol, s: &mut State, n: u8) {
    let b = &model.bounds;
    let node = &s.nodes[n as usize];
    match node.sweep {
        Sweep::Read { claim, expires, in_flight, to } => {
            let taken = s.call(model, Some(n), Op::TakeOver { claim, expires, in_flight, to });
            let node = &mut s.nodes[n as usize];
            node.sweep = Sweep::Idle;
            if taken.is_none() {
                node.hold = Hold::UntilAnswered;
            }
        }
        Sweep::Idle if s.health == Health::Down => s.nodes[n as usize].hold = Hold::UntilAnswered,
        Sweep::Idle if node.hold == Hold::UntilAnswered => {
            s.nodes[n as usize].hold =
                if model.broken(Mutant::NoTakeoverHoldAfterOutage) { Hold::No } else { Hold::Until(s.t + b.lease) };
        }
        Sweep::Idle => {
            let rec = s.rec().expect("a lease to take over");
            let lease = rec.lease.expect("leased");
            let event = expiry_event(Expiry {
                attempt_unrecorded: rec.in_flight.is_some(),
                replay_safe: s.policy_of(model, rec),
                deadline_passed: false,
                takeovers: u32::from(rec.takeovers),
                max_takeovers: 3,
                attempt_may_have_run: rec.in_flight.is_some() || rec.last.is_some(),
            });
            let to = PhaseKey::of(transition(Phase::InProgress, event).unwrap_or(Phase::Unknown));
            let read = Sweep::Read { claim: rec.claim, expires: lease.expires, in_flight: rec.in_flight, to };
            let node = &mut s.nodes[n as usize];
            node.sweep = read;
            node.hold = Hold::No;
        }
    }
}

/// Node `n` probes the key's `unknown` record, stamped with the store's time before it is sent.
pub fn ask(model: &Protocol, s: &mut State, n: u8) {
    let Some(rec) = s.rec() else { return };
    let (gen, claim) = (rec.gen, rec.claim);
    let asked_at = s.store_now(model, Some(n));
    s.left.probes -= 1;
    s.nodes[n as usize].probe = Probe::Asked { gen, claim, asked_at, arrived: None };
}

/// Node `n` writes its probe's answer: settled, refused, or told to wait for the bound.
pub fn probed(model: &Protocol, s: &mut State, n: u8) {
    let Probe::Answered { gen, claim, asked_at, executed } = s.nodes[n as usize].probe else { return };
    s.nodes[n as usize].probe = Probe::Idle;
    if s.rec().is_some_and(|r| r.gen == gen) {
        s.call(model, Some(n), Op::Probed { claim, executed, asked_at });
    }
}
