//! The bounds `check` explores, scenario by scenario: each is every interleaving of what it
//! holds. One scenario of everything at once would not end on two cores; these do, in minutes,
//! and together they hold every step, fault and actor of the model.

use crate::{Bounds, Kinds, Start};

/// One set of bounds, and where it starts.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: &'static str,
    /// What it explores, in a line.
    pub what: &'static str,
    pub bounds: Bounds,
    pub starts: &'static [Start],
}

const FRESH: &[Start] = &[Start::Fresh];

/// The durations every scenario shares, in ticks: an attempt's limit longer than the lease, as
/// in the worst case the probe's holes needed.
fn base() -> Bounds {
    Bounds {
        nodes: 2,
        horizon: 7,
        lease: 2,
        margin: 1,
        window: 1,
        limit: 3,
        retention: 1,
        max_attempts: 2,
        requests: 2,
        faults: 1,
        kinds: Kinds::NODES,
        operator: 0,
        probes: 1,
        ahead: 2,
        gens: 1,
        settles_within: 11,
        liveness: false,
        stamped: false,
        clock_back: 3,
    }
}

pub fn all() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "three-nodes",
            what: "three nodes, a client's request and its retry, a probe, a node paused or killed",
            bounds: Bounds { nodes: 3, ..base() },
            starts: FRESH,
        },
        Scenario {
            name: "two-faults",
            what: "two nodes, a request and its retry, a probe, two pauses or kills",
            bounds: Bounds { faults: 2, ..base() },
            starts: FRESH,
        },
        Scenario {
            name: "clock-step",
            what: "two nodes on one host's clock, each mark stamped before it is sent; a pause, and the clock stepping back",
            bounds: Bounds { faults: 2, stamped: true, kinds: Kinds { pause: true, clock: true, ..Kinds::NONE }, ..base() },
            starts: FRESH,
        },
        Scenario {
            name: "store",
            what: "two nodes, a request and its retry, the store lost or refusing outcomes, a node killed",
            bounds: Bounds { faults: 2, probes: 0, kinds: Kinds { crash: true, store: true, ..Kinds::NONE }, ..base() },
            starts: FRESH,
        },
        Scenario {
            name: "operator",
            what: "two nodes, a request and its retry, a probe, an operator's action, a node paused or killed",
            bounds: Bounds { operator: 1, ..base() },
            starts: FRESH,
        },
        Scenario {
            name: "reload-retention",
            what: "two nodes, three requests, a reload flipping replay_safe, a done record's retention ending",
            bounds: Bounds {
                requests: 3,
                gens: 2,
                horizon: 8,
                kinds: Kinds { reload: true, ..Kinds::NONE },
                ..base()
            },
            starts: FRESH,
        },
        Scenario {
            name: "upgrade",
            what: "three nodes, one of protocol 2 still running after the store moved to protocol 3",
            bounds: Bounds { nodes: 3, ..base() },
            starts: &[Start::Upgrade],
        },
        Scenario {
            name: "liveness",
            what: "two nodes, a request and its retry, any one fault: every record settles once faults stop",
            bounds: Bounds { horizon: 14, kinds: Kinds::ALL, liveness: true, ..base() },
            starts: FRESH,
        },
    ]
}

pub fn named(name: &str) -> Option<Scenario> {
    all().into_iter().find(|s| s.name == name)
}
