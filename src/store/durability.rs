//! How durable a commit is, as the database says once the store has set it: `[store] sync`
//! (docs/guarantees.md#power-loss-and-store-sync) is read by the configuration.

use crate::config::Durability;

/// The durability a store runs with, as its database said once the store had set it: what an
/// operator is told, rather than what was asked (PostgreSQL may be set to more, or less).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurabilityInForce {
    pub sync: Durability,
    /// The database's own setting, as it reported it: `synchronous=FULL` (SQLite),
    /// `synchronous_commit=on` (PostgreSQL).
    pub setting: String,
}
