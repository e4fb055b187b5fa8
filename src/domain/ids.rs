//! Names: of records, claims, tenants, routes and policies, each its own type rather than a
//! bare string or UUID.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use uuid::Uuid;

/// A name shared rather than copied (`Arc<str>`): read as a `str`, built from one, compared
/// with one, shown and serialized as the text itself.
macro_rules! name {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl From<&str> for $name {
            fn from(name: &str) -> $name {
                $name(name.into())
            }
        }

        impl From<String> for $name {
            fn from(name: String) -> $name {
                $name(name.into())
            }
        }

        impl Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                &*self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                &*self.0 == *other
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<$name, D::Error> {
                String::deserialize(deserializer).map($name::from)
            }
        }
    };
}

/// A record's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RecordId(pub Uuid);

impl RecordId {
    /// A new record's id: a UUIDv7, so that ids sort by creation time. Not `Default`: a default
    /// value that is a fresh id each time would hide where ids are made.
    #[allow(clippy::new_without_default)]
    pub fn new() -> RecordId {
        RecordId(Uuid::now_v7())
    }
}

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

name!(
    /// Who holds a lease: a node's worker, by the name it writes into the records it claims.
    /// Shared, not copied: every write of an execution names it.
    Owner
);

/// The fencing token of one claim of a record: each claim (a claimed admission, a single or bulk
/// claim) is given the record's previous token plus one, and every write made under the claim
/// names it. A write whose token is not the record's latest is refused, so an execution whose
/// claim was taken over cannot write, or send, after a newer claim was made — whoever made it,
/// this process included. 0: never claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ClaimToken(pub i64);

impl ClaimToken {
    /// The token of a claim made at insert: a record's first.
    pub const FIRST: ClaimToken = ClaimToken(1);
}

impl fmt::Display for ClaimToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Who writes under a claim: the node that holds it, named in the record's lease and history,
/// and the claim's token, which alone decides whether the write is still the holder's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub owner: Owner,
    pub token: ClaimToken,
}

name!(
    /// Whose a record is: the tenant a request's credentials name (docs/configuration.md `[auth]`), `default`
    /// without tenants. Keys are unique per tenant. Shared, not copied: the ingress resolves it once
    /// per request and it flows into the record, its lookups and its logs.
    Tenant
);

impl Tenant {
    /// A tenant's name as a config may write it: non-empty visible ASCII, so that a log line,
    /// a metric label and the admin API show it as written.
    pub fn parse(text: &str) -> Result<Tenant, &'static str> {
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("must be non-empty visible ASCII");
        }
        Ok(Tenant::from(text))
    }
}

/// The tenant of a broker that configures none: one allocation for the process, shared.
impl Default for Tenant {
    fn default() -> Tenant {
        static DEFAULT: OnceLock<Tenant> = OnceLock::new();
        DEFAULT.get_or_init(|| Tenant::from("default")).clone()
    }
}

name!(
    /// The digest of an effective policy: 12 lower-case hex digits. Shared, not copied: every
    /// attempt is stored with its version.
    PolicyVersion
);

name!(
    /// A route's name, as configured and as its records, metrics and logs carry it. Shared, not
    /// copied: every request on the route names it.
    RouteName
);

impl RouteName {
    /// A route's name as a config may write it: letters, digits, `-`, `_` and `.` (the same rule
    /// names an `[[upstreams]]` entry), so that it reads the same in a URL, a label and a log.
    pub fn parse(text: &str) -> Result<RouteName, &'static str> {
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
            return Err("must be non-empty and use only letters, digits, - _ .");
        }
        Ok(RouteName::from(text))
    }
}
