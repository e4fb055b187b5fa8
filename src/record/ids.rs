//! Names the store's commands carry instead of bare strings and UUIDs.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use uuid::Uuid;

/// A record's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordId(pub Uuid);

impl From<Uuid> for RecordId {
    fn from(id: Uuid) -> RecordId {
        RecordId(id)
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Who holds a lease: a node's worker, by the name it writes into the records it claims.
/// Shared, not copied: every write of an execution names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner(Arc<str>);

impl From<&str> for Owner {
    fn from(name: &str) -> Owner {
        Owner(name.into())
    }
}

impl From<String> for Owner {
    fn from(name: String) -> Owner {
        Owner(name.into())
    }
}

impl Deref for Owner {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
