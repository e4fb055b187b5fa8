//! The world around the nodes: the model's state, where it starts, and every action that can
//! happen next: a node's step, the upstream's, a client's request, an operator's action, a
//! fault, or time moving on.

use arrayvec::ArrayVec;

use crate::node::{Exec, Hold, Job, Node, Probe, Sweep};
use crate::store::{resp, Answer, Class, Last, Lease, Op, PhaseKey, Rec, Resp, Store, Tick};
use crate::{Mutant, Protocol, Start};

/// The store's health, as every node sees it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Health {
    Up,
    /// Out of reach: every call fails (a network cut, a database restarting).
    Down,
    /// It takes small writes but not an outcome's (a full disk, say).
    OutcomesFail,
}

/// The route as the configuration in force says: a reload changes its policy, and so its version.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Route {
    pub version: u8,
    pub replay_safe: bool,
}

/// What the upstream did with a request.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Effect {
    /// Not yet: it may still execute it, until its attempt's limit.
    Pending,
    /// Executed: its answer is this execution's.
    Executed(Resp),
    /// Refused: it will never execute it (it said so: a `not_processed` status).
    Refused,
}

/// What the upstream answered.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ans {
    /// Its final answer, after executing.
    Final,
    /// "Not processed" (429, 503): it did not execute it and will not.
    NotProcessed,
    /// A gateway's 502 or 504: the service behind it may still execute it.
    Gateway,
}

/// A request sent upstream, an attempt: record `gen`'s attempt `number` under claim `claim`.
/// Dropped once its limit has passed and no node waits for its answer: the upstream can no
/// longer execute it, and what it did is kept in [`State::first`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Req {
    pub gen: u8,
    pub claim: u8,
    pub number: u8,
    pub sent: Tick,
    pub effect: Effect,
    pub answer: Option<Ans>,
}

/// The most nodes, records of the key, and requests kept at once, any bounds have.
pub const MAX_NODES: usize = 3;
pub const MAX_GENS: usize = 2;
pub const MAX_REQS: usize = 8;

/// What became of one record of the key, as the world saw it.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Life {
    /// Whether it was admitted replay-safe.
    pub safe: bool,
    /// How often the upstream executed it, and the answer of its first execution.
    pub effects: u8,
    pub first: Option<Resp>,
    /// The answer its clients were told, if any.
    pub told: Option<Resp>,
    /// An attempt was sent after a client had been told its answer; and whether that is
    /// excused, as the node that told the answer without recording it crashed or paused before
    /// it could (its outcome is lost with it: docs/guarantees.md).
    pub resent: bool,
    pub excused: bool,
}

/// What is left of the bounded environment.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Left {
    pub requests: u8,
    pub faults: u8,
    pub operator: u8,
    pub probes: u8,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct State {
    /// Now, in the store's clock.
    pub t: Tick,
    pub store: Store,
    /// What the database has flushed, where a crash of its server loses the rest
    /// ([`Mutant::NormalCommitsLost`]); `None` when every commit is flushed before it counts.
    pub flushed: Option<Store>,
    pub health: Health,
    /// How far the store's clock has stepped back behind real time (an NTP step on the
    /// database's host, or SQLite's one host).
    pub back: Tick,
    /// The store's protocol.
    pub protocol: u8,
    pub route: Route,
    /// The nodes, in no order: none is named by any other part of the state, so states that
    /// differ only by the nodes' order are one ([`State::canonical`]).
    pub nodes: ArrayVec<Node, MAX_NODES>,
    pub reqs: ArrayVec<Req, MAX_REQS>,
    /// What became of each record of the key, by its `gen`.
    pub lives: [Life; MAX_GENS],
    /// A client was told an answer other than one told before for the same record.
    pub contradicted: bool,
    /// A done record gave way to a new one before its retention had passed.
    pub early: bool,
    pub left: Left,
    /// Ticks since something last started work, broke or mended (a request, an operator's
    /// action, a fault and its end), up to what the liveness property needs; kept only when it is
    /// checked.
    pub calm: Tick,
}

/// Everything that can happen next. Nodes are named by their place in the state's list.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    Tick,
    /// A client sends the key's request to a node.
    Request(u8),
    /// A node's execution takes its next step (claim, mark, send, give up, hear the answer or
    /// time out, store the outcome or write it again, hand back, stop).
    Step(u8),
    /// A node renews its claim's lease, its trust in it having run out.
    Renew(u8),
    /// A node's take-over sweep takes its next step (read the expired leases, or write a take-over).
    Sweep(u8),
    /// A node probes the key's `unknown` record.
    Ask(u8),
    /// A node writes its probe's answer.
    Probed(u8),
    /// The upstream executes request `i`, or answers it (finally, "not processed", or as a
    /// gateway), or takes in a node's probe, or gives its answer back.
    Execute(u8),
    AnswerFinal(u8),
    AnswerNotProcessed(u8),
    AnswerGateway(u8),
    ProbeArrives(u8),
    ProbeReturns(u8),
    /// An operator settles the `unknown` record as executed (having seen it did), or not
    /// executed (having seen it did not), re-drives it, or cancels the key's request.
    ResolveExecuted,
    ResolveNotExecuted,
    Retry,
    Cancel,
    Pause(u8),
    Resume(u8),
    Crash(u8),
    Restart(u8),
    StoreDown,
    StoreOutcomesFail,
    StoreUp,
    /// The database server crashes and restarts, losing what it had not flushed
    /// ([`Mutant::NormalCommitsLost`]; with every commit flushed, it is [`Action::StoreDown`]).
    DatabaseCrash,
    /// The database flushes what it committed ([`Mutant::NormalCommitsLost`] only).
    Flush,
    /// A reload flips the route's `replay_safe`.
    Reload,
    /// The store's clock steps back by `Bounds::clock_back`.
    ClockBack,
}

impl State {
    pub fn rec(&self) -> Option<&Rec> {
        self.store.rec.as_ref()
    }

    /// A client is told `resp` for the record `gen`.
    pub fn tell(&mut self, gen: u8, resp: Resp) {
        let life = &mut self.lives[gen as usize];
        match life.told {
            Some(told) if told != resp => self.contradicted = true,
            _ => life.told = Some(resp),
        }
    }

    /// The answer of the first execution of record `gen`, if the upstream executed it.
    pub fn executed(&self, gen: u8) -> Option<Resp> {
        self.lives[gen as usize].first
    }

    /// Node `n` crashes or pauses: an answer it told without recording it may be lost.
    fn excuse(&mut self, n: u8) {
        if let Exec::Unrecorded { job, .. } = self.nodes[n as usize].exec {
            self.lives[job.gen as usize].excused = true;
        }
    }

    /// The request of attempt `number` of record `gen` under claim `claim`, while it is kept.
    pub fn req(&self, gen: u8, claim: u8, number: u8) -> Option<&Req> {
        self.reqs.iter().find(|r| (r.gen, r.claim, r.number) == (gen, claim, number))
    }

    /// The store's answer to `op` from node `node` (`None`: an operator), or `None` when the call
    /// fails: the store out of reach, an outcome it cannot take, or a node of another protocol
    /// refused by its trigger.
    pub fn call(&mut self, model: &Protocol, node: Option<u8>, op: Op) -> Option<Answer> {
        let now = self.store_now(model, node);
        self.call_at(model, node, op, now)
    }

    /// [`State::call`], the write carrying `now` as the store's time.
    pub fn call_at(&mut self, model: &Protocol, node: Option<u8>, op: Op, now: Tick) -> Option<Answer> {
        let outcome = matches!(op, Op::Ended { .. });
        match self.health {
            Health::Down => return None,
            Health::OutcomesFail if outcome => return None,
            _ => {}
        }
        let refused = node.is_some_and(|n| self.nodes[n as usize].protocol != self.protocol);
        if refused && !model.broken(Mutant::OlderNodeUnguarded) {
            return None;
        }
        // A node that still speaks protocol 2, let write, writes by protocol 2's rules.
        let rules = match (node, &op) {
            (Some(n), Op::Probed { .. }) if self.nodes[n as usize].protocol < 3 => Some(Mutant::ProbeJudgedAtWrite),
            (Some(n), _) if self.nodes[n as usize].protocol < 3 => Some(Mutant::AmbiguousCutsBound),
            _ => model.mutant,
        };
        Some(self.store.apply(&op, now, &model.bounds, rules))
    }

    /// The time a write carries as the store's: the store's own, but for leases on the nodes'
    /// clocks ([`Mutant::LeasesOnNodeClocks`]), where it is the writing node's.
    pub fn store_now(&self, model: &Protocol, node: Option<u8>) -> Tick {
        match node {
            Some(n) if model.broken(Mutant::LeasesOnNodeClocks) => self.node_now(n),
            _ => self.store_time(),
        }
    }

    /// The store's clock now.
    pub fn store_time(&self) -> Tick {
        self.t.saturating_sub(self.back)
    }

    /// Node `n`'s own clock.
    pub fn node_now(&self, n: u8) -> Tick {
        self.t + self.nodes[n as usize].ahead
    }

    /// Whether the record's policy, the one it was admitted under, is replay-safe
    /// (`Route::policy_of`): while the route still has that policy, what it says; else the
    /// safe side (`idem::record::rules::replay_safe`).
    pub fn policy_of(&self, model: &Protocol, rec: &Rec) -> bool {
        if rec.version == self.route.version {
            rec.replay_safe
        } else if model.broken(Mutant::PolicyFromCurrentRoute) {
            self.route.replay_safe
        } else {
            idem::record::rules::replay_safe(None)
        }
    }

    /// The state in its canonical form: the nodes sorted, requests nobody can act on dropped.
    fn canonical(mut self, model: &Protocol) -> State {
        let b = &model.bounds;
        let (t, nodes) = (self.t, &self.nodes);
        let awaited = |r: &Req| {
            nodes.iter().any(|n| matches!(n.exec, Exec::Sent { job, number } if (job.gen, job.claim, number) == (r.gen, r.claim, r.number)))
        };
        self.reqs.retain(|r| t <= r.sent + b.limit || awaited(r));
        self.nodes.sort();
        self
    }
}

/// The states the model starts from.
pub fn starts(model: &Protocol, start: Start) -> Vec<State> {
    let b = &model.bounds;
    // Only a decision a mutant makes on a node's clock reads one: the last node's runs ahead.
    let reads_node_clocks = model.broken(Mutant::LeasesOnNodeClocks) || model.broken(Mutant::RetentionOnNodeClocks);
    let node = |i: u8, protocol| Node {
        ahead: if reads_node_clocks && i + 1 == b.nodes { b.ahead } else { 0 },
        up: true,
        paused: false,
        protocol,
        exec: Exec::Idle,
        sweep: Sweep::Idle,
        probe: Probe::Idle,
        hold: Hold::No,
    };
    assert!(b.nodes as usize <= MAX_NODES && b.gens as usize <= MAX_GENS, "bounds past the model's arrays");
    let base = |t: Tick, replay_safe: bool| State {
        t,
        store: Store::default(),
        flushed: model.broken(Mutant::NormalCommitsLost).then(Store::default),
        health: Health::Up,
        back: 0,
        protocol: 3,
        route: Route { version: 0, replay_safe },
        nodes: (0..b.nodes).map(|i| node(i, 3)).collect(),
        reqs: ArrayVec::new(),
        lives: [Life::default(); MAX_GENS],
        contradicted: false,
        early: false,
        left: Left { requests: b.requests, faults: b.faults, operator: b.operator, probes: b.probes },
        calm: 0,
    };
    let states = match start {
        Start::Fresh => vec![base(0, false), base(0, true)],
        Start::Upgrade => {
            // Node 0 speaks protocol 2. It marked and sent attempt 1 at tick 0 and froze; its lease
            // (from the mark) has run out, which is what the migration waited for.
            let sent = Req { gen: 0, claim: 1, number: 1, sent: 0, effect: Effect::Pending, answer: None };
            let marked = Rec {
                gen: 0,
                phase: PhaseKey::InProgress,
                claim: 1,
                lease: Some(Lease { expires: b.lease }),
                in_flight: Some(1),
                until: Some(b.reach()),
                takeovers: 0,
                last: None,
                response: None,
                done_at: None,
                version: 0,
                replay_safe: false,
                cancel: false,
                base: 0,
            };
            let mut in_flight = base(b.lease + 1, false);
            in_flight.store = Store { rec: Some(marked.clone()), gens: 1 };
            in_flight.reqs.push(sent.clone());
            let job = Job { gen: 0, claim: 1, trust: b.trust(), replay_safe: false, base: 0, doubt: false };
            in_flight.nodes[0] = Node { paused: true, exec: Exec::Sent { job, number: 1 }, ..node(0, 2) };
            // Protocol 2 made the record unknown on the gateway's 504 at tick 0, bringing its bound
            // down to then; the service behind the gateway may still execute the request. The
            // migration raises the bounds of `unknown` records again.
            let migrated = 1;
            let cut = Rec {
                phase: PhaseKey::Unknown,
                lease: None,
                in_flight: None,
                until: Some(if model.broken(Mutant::MigrationKeepsCutBounds) { 0 } else { migrated + b.reach() }),
                last: Some(Last { number: 1, lost: false }),
                ..marked
            };
            let mut unknown = base(migrated, false);
            unknown.store = Store { rec: Some(cut), gens: 1 };
            unknown.reqs.push(Req { answer: Some(Ans::Gateway), ..sent });
            unknown.nodes[0] = node(0, 2);
            vec![in_flight, unknown]
        }
    };
    states
        .into_iter()
        .map(|mut state| {
            if let Some(flushed) = &mut state.flushed {
                *flushed = state.store.clone();
            }
            state.canonical(model)
        })
        .collect()
}

/// Every action enabled in `state`.
pub fn actions(model: &Protocol, state: &State, actions: &mut Vec<Action>) {
    let b = &model.bounds;
    let mut urgent = false;
    for n in 0..b.nodes {
        let node = &state.nodes[n as usize];
        // Nodes in the same state are one: act for the first of them only.
        if state.nodes[..n as usize].contains(node) {
            continue;
        }
        if !node.up {
            actions.push(Action::Restart(n));
            continue;
        }
        if node.paused {
            actions.push(Action::Resume(n));
            continue;
        }
        if crate::node::can_step(model, state, n) {
            actions.push(Action::Step(n));
            urgent = true;
        }
        if crate::node::can_renew(model, state, n) {
            actions.push(Action::Renew(n));
            urgent = true;
        }
        if crate::node::can_sweep(model, state, n) {
            actions.push(Action::Sweep(n));
            urgent = true;
        }
        if matches!(node.probe, Probe::Answered { .. }) {
            actions.push(Action::Probed(n));
            urgent = true;
        }
        let unknown = state.rec().is_some_and(|r| r.phase == PhaseKey::Unknown);
        if unknown && node.probe == Probe::Idle && state.left.probes > 0 && state.health != Health::Down {
            actions.push(Action::Ask(n));
        }
        if state.left.requests > 0 && admissible(model, state) {
            actions.push(Action::Request(n));
        }
        if state.left.faults > 0 && b.kinds.pause {
            actions.push(Action::Pause(n));
        }
        if state.left.faults > 0 && b.kinds.crash {
            actions.push(Action::Crash(n));
        }
    }
    for (i, req) in state.reqs.iter().enumerate() {
        let i = i as u8;
        if req.effect == Effect::Pending && state.t <= req.sent + b.limit {
            actions.push(Action::Execute(i));
        }
        if req.answer.is_none() && state.t < req.sent + b.limit {
            match req.effect {
                Effect::Executed(_) => actions.push(Action::AnswerFinal(i)),
                Effect::Pending => actions.push(Action::AnswerNotProcessed(i)),
                Effect::Refused => {}
            }
            actions.push(Action::AnswerGateway(i));
        }
    }
    for (n, node) in state.nodes.iter().enumerate() {
        if let Probe::Asked { arrived, .. } = node.probe {
            actions.push(if arrived.is_none() { Action::ProbeArrives(n as u8) } else { Action::ProbeReturns(n as u8) });
        }
    }
    if state.left.operator > 0 && state.health != Health::Down {
        if let Some(rec) = state.rec() {
            if rec.phase == PhaseKey::Unknown {
                // The operator speaks from what they see upstream.
                if state.executed(rec.gen).is_some() {
                    actions.push(Action::ResolveExecuted);
                } else {
                    actions.push(Action::ResolveNotExecuted);
                    actions.push(Action::Retry);
                }
            }
            if matches!(rec.phase, PhaseKey::Queued | PhaseKey::InProgress) {
                actions.push(Action::Cancel);
            }
        }
    }
    if state.left.faults > 0 && state.health == Health::Up {
        if b.kinds.store {
            actions.extend([Action::StoreDown, Action::StoreOutcomesFail]);
            if state.flushed.is_some() {
                actions.push(Action::DatabaseCrash);
            }
        }
        if b.kinds.reload {
            actions.push(Action::Reload);
        }
        if b.kinds.clock && state.back == 0 {
            actions.push(Action::ClockBack);
        }
    }
    if state.health != Health::Up {
        actions.push(Action::StoreUp);
    }
    if state.flushed.as_ref().is_some_and(|flushed| *flushed != state.store) {
        actions.push(Action::Flush);
    }
    // Time moves once every running node has taken the steps it can take now, and only while
    // something depends on it: before the first request, nothing does.
    let waiting = state.rec().is_some() || !state.reqs.is_empty();
    if !urgent && waiting && state.t < b.horizon {
        actions.push(Action::Tick);
    }
}

/// Whether a request with the key can be recorded: a new record only while the key may have
/// another.
fn admissible(model: &Protocol, state: &State) -> bool {
    let new_record = match state.rec() {
        None => true,
        Some(rec) => rec.phase == PhaseKey::Done,
    };
    !new_record || state.store.gens < model.bounds.gens
}

/// The state after `action`.
pub fn next(model: &Protocol, state: &State, action: Action) -> Option<State> {
    let mut s = state.clone();
    let b = &model.bounds;
    let disturbed = |s: &mut State| s.calm = 0;
    let fault = |s: &mut State| {
        s.left.faults -= 1;
        disturbed(s);
    };
    match action {
        Action::Tick => {
            s.t += 1;
            if b.liveness {
                s.calm = (s.calm + 1).min(b.settles_within);
            }
        }
        Action::Request(n) => {
            s.left.requests -= 1;
            disturbed(&mut s);
            crate::node::admit(model, &mut s, n);
        }
        Action::Step(n) => crate::node::step(model, &mut s, n),
        Action::Renew(n) => crate::node::renew(model, &mut s, n),
        Action::Sweep(n) => crate::node::sweep(model, &mut s, n),
        Action::Ask(n) => crate::node::ask(model, &mut s, n),
        Action::Probed(n) => crate::node::probed(model, &mut s, n),
        Action::Execute(i) => {
            let req = s.reqs[i as usize].clone();
            let life = &mut s.lives[req.gen as usize];
            // A replay-safe record's upstream deduplicates by key: a second request executes
            // nothing and answers as the first did.
            let answer = match life.first {
                Some(first) if life.safe => first,
                _ => {
                    life.effects += 1;
                    resp(req.claim, req.number)
                }
            };
            life.first.get_or_insert(answer);
            s.reqs[i as usize].effect = Effect::Executed(answer);
        }
        Action::AnswerFinal(i) => s.reqs[i as usize].answer = Some(Ans::Final),
        Action::AnswerNotProcessed(i) => {
            let req = &mut s.reqs[i as usize];
            req.effect = Effect::Refused;
            req.answer = Some(Ans::NotProcessed);
        }
        Action::AnswerGateway(i) => s.reqs[i as usize].answer = Some(Ans::Gateway),
        Action::ProbeArrives(n) => {
            let Probe::Asked { gen, claim, asked_at, arrived: None } = s.nodes[n as usize].probe else { return None };
            let arrived = Some(s.executed(gen));
            s.nodes[n as usize].probe = Probe::Asked { gen, claim, asked_at, arrived };
        }
        Action::ProbeReturns(n) => {
            let Probe::Asked { gen, claim, asked_at, arrived: Some(executed) } = s.nodes[n as usize].probe else {
                return None;
            };
            s.nodes[n as usize].probe = Probe::Answered { gen, claim, asked_at, executed };
        }
        Action::ResolveExecuted | Action::ResolveNotExecuted | Action::Retry | Action::Cancel => {
            s.left.operator -= 1;
            disturbed(&mut s);
            let gen = s.rec()?.gen;
            let op = match action {
                Action::ResolveExecuted => Op::Resolve { executed: Some(s.executed(gen)?) },
                Action::ResolveNotExecuted => Op::Resolve { executed: None },
                Action::Retry => Op::Retry,
                _ => Op::Cancel,
            };
            s.call(model, None, op);
        }
        Action::Pause(n) => {
            fault(&mut s);
            s.excuse(n);
            s.nodes[n as usize].paused = true;
        }
        Action::Resume(n) => {
            disturbed(&mut s);
            s.nodes[n as usize].paused = false;
        }
        Action::Crash(n) => {
            fault(&mut s);
            s.excuse(n);
            let node = &mut s.nodes[n as usize];
            node.up = false;
            node.exec = Exec::Idle;
            node.sweep = Sweep::Idle;
            node.probe = Probe::Idle;
        }
        Action::Restart(n) => {
            disturbed(&mut s);
            let hold = if model.broken(Mutant::NoTakeoverHoldAtStart) { Hold::No } else { Hold::Until(s.t + b.lease) };
            let protocol = s.protocol;
            let node = &mut s.nodes[n as usize];
            node.up = true;
            node.paused = false;
            // A node restarts as a build of the store's protocol.
            node.protocol = protocol;
            node.hold = hold;
        }
        Action::StoreDown => {
            fault(&mut s);
            s.health = Health::Down;
        }
        Action::StoreOutcomesFail => {
            fault(&mut s);
            s.health = Health::OutcomesFail;
        }
        Action::StoreUp => {
            disturbed(&mut s);
            s.health = Health::Up;
        }
        Action::DatabaseCrash => {
            fault(&mut s);
            s.health = Health::Down;
            if let Some(flushed) = &s.flushed {
                s.store = flushed.clone();
            }
        }
        Action::Flush => s.flushed = Some(s.store.clone()),
        Action::Reload => {
            fault(&mut s);
            s.route = Route { version: s.route.version + 1, replay_safe: !s.route.replay_safe };
        }
        Action::ClockBack => {
            fault(&mut s);
            s.back = b.clock_back;
        }
    }
    Some(s.canonical(model))
}

impl Node {
    pub fn job(&self) -> Option<&Job> {
        match &self.exec {
            Exec::Idle => None,
            Exec::Claimed { job, .. }
            | Exec::Marked { job, .. }
            | Exec::Sent { job, .. }
            | Exec::Ended { job, .. }
            | Exec::Unrecorded { job, .. } => Some(job),
        }
    }
}

/// How an answer read by a node classes its attempt.
pub fn class_of(answer: Ans) -> Class {
    match answer {
        Ans::Final => Class::Success,
        Ans::NotProcessed => Class::NotExecuted,
        Ans::Gateway => Class::Ambiguous,
    }
}
