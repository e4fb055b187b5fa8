//! How durable a commit is before it counts: `[store] sync` (docs/guarantees.md#power-loss-and-store-sync).

/// What a commit survives before the store counts it (docs/guarantees.md#power-loss-and-store-sync).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// Synced to disk before it counts: it survives a power loss.
    #[default]
    Full,
    /// Handed to the operating system before it counts: it survives the process's crash, but
    /// the last commits may be lost with the machine (power loss, kernel crash).
    Normal,
}

impl Durability {
    /// The value of `[store] sync` that names it.
    pub fn parse(text: &str) -> Option<Durability> {
        match text {
            "full" => Some(Durability::Full),
            "normal" => Some(Durability::Normal),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Full => "full",
            Durability::Normal => "normal",
        }
    }
}

impl std::fmt::Display for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The durability a store runs with, as its database said once the store had set it: what an
/// operator is told, rather than what was asked (PostgreSQL may be set to more, or less).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurabilityInForce {
    pub sync: Durability,
    /// The database's own setting, as it reported it: `synchronous=FULL` (SQLite),
    /// `synchronous_commit=on` (PostgreSQL).
    pub setting: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_parses_back_from_its_name() {
        for sync in [Durability::Full, Durability::Normal] {
            assert_eq!(Durability::parse(sync.as_str()), Some(sync));
        }
        for other in ["fast", "off", "FULL", "", "extra"] {
            assert_eq!(Durability::parse(other), None, "{other}");
        }
        assert_eq!(Durability::default(), Durability::Full);
    }
}
