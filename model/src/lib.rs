//! A model of Idem's claim protocol (docs/guarantees.md), checked by stateright over every
//! interleaving within its bounds.
//!
//! One key, its records, the store that keeps them and the nodes that share it, an upstream that
//! may hold a request in its own queue and execute it late, clients, an operator and the faults
//! of a real deployment, on one discrete clock:
//!
//! - [`store`] — the store's writes as their SQL keeps the key's record, each guarded as its
//!   `WHERE` clause is; the phases are the crate's own transition table's, the bounds and late
//!   outcomes its own rules' (`idem::record`);
//! - [`node`] — what a node does: admit, claim, mark, send, renew, store an outcome (or write an
//!   unrecorded one again), take over expired leases, probe `unknown` records;
//! - [`world`] — the upstream, the clients, the operator, the faults and time;
//! - [`properties`] — what must hold: at most one effect per key that is not replay-safe, no
//!   answer told ever contradicted, a done record reachable, records settled once faults stop;
//! - [`mutants`] — the protocol with one rule broken: each must fail the check.
//!
//! Time moves in ticks. A running node takes the steps it can at once, before time moves on;
//! only a pause, a crash, or the store failing holds one back. The upstream, the clients and the
//! operator act whenever they like, within their bounds.

use stateright::{Model, Property};

pub mod mutants;
pub mod node;
pub mod properties;
pub mod scenarios;
pub mod store;
pub mod walk;
pub mod world;

pub use mutants::Mutant;
pub use scenarios::Scenario;
pub use store::{Answer, Op, Store, Tick};
pub use world::{Action, State};

/// The model's bounds: how many of each thing, how long each duration, in ticks.
#[derive(Clone, Debug)]
pub struct Bounds {
    pub nodes: u8,
    /// The last tick explored.
    pub horizon: Tick,
    /// `worker.lease`.
    pub lease: Tick,
    /// `worker.clock_margin`: a node trusts its lease for `lease - margin`.
    pub margin: Tick,
    /// `worker.send_window`.
    pub window: Tick,
    /// `per_try_timeout`: an attempt's time limit, past which the upstream can no longer execute
    /// it (the upstream's own queue is shorter than the limit, as docs/guarantees.md asks).
    pub limit: Tick,
    /// The route's `retention` (no tombstones: a key past it is free for a new record).
    pub retention: Tick,
    /// `max_attempts`.
    pub max_attempts: u8,
    /// Requests the clients send, in all.
    pub requests: u8,
    /// Faults in all, of the kinds `kinds` allows.
    pub faults: u8,
    pub kinds: Kinds,
    /// Operator actions in all.
    pub operator: u8,
    /// Probes asked in all.
    pub probes: u8,
    /// How far the last node's clock runs ahead of the store's.
    pub ahead: Tick,
    /// Records the key may have (a done record past its retention gives way to a new one).
    pub gens: u8,
    /// Ticks after the last request, operator's action or fault within which the key's record
    /// must have settled, when `liveness` is checked.
    pub settles_within: Tick,
    pub liveness: bool,
    /// The store keeps time in the writing node's clock, as SQLite's nodes on one host do: a
    /// mark carries the time its node read before sending it, stale by any stall in between.
    /// (Otherwise the store reads its own clock at each write, as PostgreSQL does.)
    pub stamped: bool,
    /// How far the store's clock steps back, where a scenario steps it.
    pub clock_back: Tick,
}

impl Bounds {
    /// How long after its mark an attempt may still reach the upstream: `send_window + limit +
    /// clock_margin`, as the worker's `reach` computes it.
    pub fn reach(&self) -> Tick {
        self.window + self.limit + self.margin
    }

    /// How long a node trusts a lease from the write that set it.
    pub fn trust(&self) -> Tick {
        self.lease - self.margin
    }
}

impl Bounds {
    /// These bounds with some changed, as `name=value,…` says (`IDEM_MODEL_BOUNDS`).
    pub fn with(mut self, text: &str) -> Result<Bounds, String> {
        for pair in text.split(',').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').ok_or_else(|| format!("`{pair}` is not name=value"))?;
            let value: u8 = value.trim().parse().map_err(|_| format!("`{value}` is not a small number"))?;
            let field = match name.trim() {
                "nodes" => &mut self.nodes,
                "horizon" => &mut self.horizon,
                "lease" => &mut self.lease,
                "margin" => &mut self.margin,
                "window" => &mut self.window,
                "limit" => &mut self.limit,
                "retention" => &mut self.retention,
                "max_attempts" => &mut self.max_attempts,
                "requests" => &mut self.requests,
                "faults" => &mut self.faults,
                "operator" => &mut self.operator,
                "probes" => &mut self.probes,
                "ahead" => &mut self.ahead,
                "gens" => &mut self.gens,
                "settles_within" => &mut self.settles_within,
                "clock_back" => &mut self.clock_back,
                "liveness" => {
                    self.liveness = value != 0;
                    continue;
                }
                "stamped" => {
                    self.stamped = value != 0;
                    continue;
                }
                "kinds" => {
                    // A bit each: pause 1, crash 2, store 4, reload 8, clock 16.
                    let bit = |b: u8| value & b != 0;
                    self.kinds = Kinds { pause: bit(1), crash: bit(2), store: bit(4), reload: bit(8), clock: bit(16) };
                    continue;
                }
                other => return Err(format!("no bound is called `{other}`")),
            };
            *field = value;
        }
        Ok(self)
    }
}

/// The kinds of fault a scenario plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kinds {
    /// A node paused (a stop-the-world stall, SIGSTOP, a frozen VM), and resumed.
    pub pause: bool,
    /// A node killed, and started again (as a build of the store's protocol).
    pub crash: bool,
    /// The store out of reach, or refusing outcomes, and back.
    pub store: bool,
    /// A reload that flips the route's `replay_safe`.
    pub reload: bool,
    /// The store's clock stepping back.
    pub clock: bool,
}

impl Kinds {
    pub const ALL: Kinds = Kinds { pause: true, crash: true, store: true, reload: true, clock: true };
    pub const NODES: Kinds = Kinds { pause: true, crash: true, store: false, reload: false, clock: false };
    pub const NONE: Kinds = Kinds { pause: false, crash: false, store: false, reload: false, clock: false };
}

/// Where the model starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// An empty store of protocol 3, every node of protocol 3.
    Fresh,
    /// A store just migrated from protocol 2 to 3 while a node of protocol 2 still runs, with its
    /// attempt on its way to the upstream (its lease expired: the migration waits for live
    /// leases to end), or with a record protocol 2 made `unknown` on a gateway's 504 and whose
    /// request the upstream may still execute.
    Upgrade,
}

/// The model: the bounds, where it starts, and the rule it breaks, if any.
#[derive(Clone, Debug)]
pub struct Protocol {
    pub bounds: Bounds,
    pub starts: Vec<Start>,
    pub mutant: Option<Mutant>,
}

impl Protocol {
    pub fn new(scenario: &Scenario, mutant: Option<Mutant>) -> Protocol {
        Protocol { bounds: scenario.bounds.clone(), starts: scenario.starts.to_vec(), mutant }
    }

    pub fn broken(&self, mutant: Mutant) -> bool {
        self.mutant == Some(mutant)
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        self.starts.iter().flat_map(|&start| world::starts(self, start)).collect()
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        world::actions(self, state, actions)
    }

    fn next_state(&self, state: &State, action: Action) -> Option<State> {
        world::next(self, state, action)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::all()
    }
}

#[cfg(test)]
mod tests {
    use stateright::{Checker, HasDiscoveries, Model};

    use super::*;

    /// Small bounds, for a check that ends within seconds unoptimised.
    fn small(mutant: Option<Mutant>) -> Protocol {
        let mut scenario = scenarios::named("three-nodes").unwrap();
        scenario.bounds = scenario.bounds.with("nodes=2,horizon=5,faults=0").unwrap();
        Protocol::new(&scenario, mutant)
    }

    #[test]
    fn the_protocol_holds_within_small_bounds() {
        let model = small(None);
        let checker = model.clone().checker().spawn_bfs().join();
        for property in model.properties() {
            let found = checker.discovery(property.name);
            match property.expectation {
                stateright::Expectation::Sometimes => assert!(found.is_some(), "{} never reached", property.name),
                _ => assert!(found.is_none(), "{} fails: {}", property.name, found.unwrap()),
            }
        }
        assert!(checker.unique_state_count() > 1_000, "{} states", checker.unique_state_count());
    }

    #[test]
    fn a_gateways_504_that_cut_the_bound_would_execute_a_key_twice_within_small_bounds() {
        let model = small(Some(Mutant::AmbiguousCutsBound));
        let checker = model.checker().finish_when(HasDiscoveries::AnyFailures).spawn_bfs().join();
        let path = checker.discovery(properties::NEVER_TWICE).expect("a counterexample");
        assert!(path.into_actions().contains(&Action::AnswerGateway(0)), "through a gateway's answer");
    }

    #[test]
    fn every_mutant_is_named_once_and_read_back_by_its_name() {
        for mutant in Mutant::ALL {
            assert_eq!(Mutant::parse(mutant.name()), Some(mutant));
            assert!(scenarios::named(mutant.scenario()).is_some(), "{}", mutant.name());
        }
        let names: std::collections::BTreeSet<_> = Mutant::ALL.iter().map(|m| m.name()).collect();
        assert_eq!(names.len(), Mutant::ALL.len());
    }
}
