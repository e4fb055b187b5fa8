//! What happened to a record, as its history says: each entry's action.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{Owner, Phase, Tenant};

/// One action in a record's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HistoryAction {
    /// A client sent a freed key's request again: it was queued afresh.
    Requeued,
    /// A client or an operator asked that no further attempt start.
    Cancel,
    /// An operator sent it again, asserting that it did not execute.
    Retry,
    /// An operator settled an `unknown` record as executed, with a response.
    ResolveExecuted,
    /// An operator settled an `unknown` record as not executed: the key is free.
    ResolveNotExecuted,
    /// A probe asked the upstream what became of it.
    Probe,
    /// Its lease expired and a take-over moved it to this phase.
    TakeOver(Phase),
    /// The outcome of the attempt a take-over left `lost` came late and moved it to this phase.
    LateOutcome(Phase),
}

/// The phases an action may name, for reading one back.
const PHASES: [Phase; 5] = [Phase::Queued, Phase::Free, Phase::InProgress, Phase::Done, Phase::Unknown];

impl HistoryAction {
    pub fn parse(text: &str) -> Option<HistoryAction> {
        // Entries written before phases were named there say `not_started` for the queue.
        let phase = |name: &str| match name {
            "not_started" => Some(Phase::Queued),
            _ => PHASES.into_iter().find(|p| p.as_str() == name),
        };
        Some(match text {
            "requeued" => HistoryAction::Requeued,
            "cancel" => HistoryAction::Cancel,
            "retry" => HistoryAction::Retry,
            "resolve executed" => HistoryAction::ResolveExecuted,
            "resolve not_executed" => HistoryAction::ResolveNotExecuted,
            "probe" => HistoryAction::Probe,
            _ => match text.split_once(" → ") {
                Some(("take-over", to)) => HistoryAction::TakeOver(phase(to)?),
                Some(("late outcome", to)) => HistoryAction::LateOutcome(phase(to)?),
                _ => return None,
            },
        })
    }
}

impl fmt::Display for HistoryAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HistoryAction::Requeued => f.write_str("requeued"),
            HistoryAction::Cancel => f.write_str("cancel"),
            HistoryAction::Retry => f.write_str("retry"),
            HistoryAction::ResolveExecuted => f.write_str("resolve executed"),
            HistoryAction::ResolveNotExecuted => f.write_str("resolve not_executed"),
            HistoryAction::Probe => f.write_str("probe"),
            HistoryAction::TakeOver(to) => write!(f, "take-over → {}", to.as_str()),
            HistoryAction::LateOutcome(to) => write!(f, "late outcome → {}", to.as_str()),
        }
    }
}

impl Serialize for HistoryAction {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HistoryAction {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<HistoryAction, D::Error> {
        let text = String::deserialize(deserializer)?;
        HistoryAction::parse(&text).ok_or_else(|| serde::de::Error::custom(format!("no history action is `{text}`")))
    }
}

/// Who did what a history entry says. Written as a name: `client` (the request that sent a free
/// key again), `client:<tenant>` (a tenant's client, by its own endpoints), `probe`,
/// `node:<owner>` (a node's worker), or an operator's own name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Actor {
    Client(Option<Tenant>),
    Probe,
    Node(Owner),
    Operator(String),
}

impl Actor {
    /// Reads a name back. An operator's name that reads as another actor's is that actor's:
    /// the name is all the history keeps.
    pub fn parse(text: &str) -> Actor {
        match text {
            "client" => Actor::Client(None),
            "probe" => Actor::Probe,
            _ => match text.split_once(':') {
                Some(("client", tenant)) => Actor::Client(Some(Tenant::from(tenant))),
                Some(("node", owner)) => Actor::Node(Owner::from(owner)),
                _ => Actor::Operator(text.to_string()),
            },
        }
    }
}

impl fmt::Display for Actor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Actor::Client(None) => f.write_str("client"),
            Actor::Client(Some(tenant)) => write!(f, "client:{tenant}"),
            Actor::Probe => f.write_str("probe"),
            Actor::Node(owner) => write!(f, "node:{owner}"),
            Actor::Operator(name) => f.write_str(name),
        }
    }
}

impl Serialize for Actor {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Actor {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Actor, D::Error> {
        Ok(Actor::parse(&String::deserialize(deserializer)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_actor_is_read_back_as_it_is_written() {
        let actors = [
            Actor::Client(None),
            Actor::Client(Some(Tenant::from("acme"))),
            Actor::Probe,
            Actor::Node(Owner::from("host-1-abcd")),
            Actor::Operator("alice".into()),
        ];
        for actor in actors {
            let json = serde_json::to_string(&actor).unwrap();
            assert_eq!(serde_json::from_str::<Actor>(&json).unwrap(), actor, "{json}");
        }
        assert_eq!(Actor::Node(Owner::from("n")).to_string(), "node:n");
        assert_eq!(Actor::parse("client:acme"), Actor::Client(Some(Tenant::from("acme"))));
    }

    #[test]
    fn every_action_is_read_back_as_it_is_written() {
        let mut actions = vec![
            HistoryAction::Requeued,
            HistoryAction::Cancel,
            HistoryAction::Retry,
            HistoryAction::ResolveExecuted,
            HistoryAction::ResolveNotExecuted,
            HistoryAction::Probe,
        ];
        for phase in PHASES {
            actions.extend([HistoryAction::TakeOver(phase), HistoryAction::LateOutcome(phase)]);
        }
        for action in actions {
            let json = serde_json::to_string(&action).unwrap();
            assert_eq!(serde_json::from_str::<HistoryAction>(&json).unwrap(), action, "{json}");
        }
        assert_eq!(HistoryAction::LateOutcome(Phase::Done).to_string(), "late outcome → done");
        assert_eq!(HistoryAction::parse("take-over → not_started"), Some(HistoryAction::TakeOver(Phase::Queued)));
        assert_eq!(HistoryAction::parse("take-over → nowhere"), None);
        assert_eq!(HistoryAction::parse("deleted"), None);
    }
}
