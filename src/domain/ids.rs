//! Names: of records, claims, tenants, routes and policies, each its own type rather than a
//! bare string or UUID.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use uuid::Uuid;

/// A record's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RecordId(pub Uuid);

impl RecordId {
    /// A new record's id: a UUIDv7, so that ids sort by creation time.
    pub fn new() -> RecordId {
        RecordId(Uuid::now_v7())
    }
}

impl Default for RecordId {
    fn default() -> RecordId {
        RecordId::new()
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

/// Who holds a lease: a node's worker, by the name it writes into the records it claims.
/// Shared, not copied: every write of an execution names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner(Arc<str>);

impl Owner {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

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

/// Whose a record is: the tenant a request's credentials name (docs/configuration.md `[auth]`), `default`
/// without tenants. Keys are unique per tenant. Shared, not copied: the ingress resolves it once
/// per request and it flows into the record, its lookups and its logs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tenant(Arc<str>);

impl Tenant {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The tenant of a broker that configures none: one allocation for the process, shared.
impl Default for Tenant {
    fn default() -> Tenant {
        static DEFAULT: OnceLock<Tenant> = OnceLock::new();
        DEFAULT.get_or_init(|| Tenant::from("default")).clone()
    }
}

impl From<&str> for Tenant {
    fn from(name: &str) -> Tenant {
        Tenant(name.into())
    }
}

impl From<String> for Tenant {
    fn from(name: String) -> Tenant {
        Tenant(name.into())
    }
}

impl Deref for Tenant {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for Tenant {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Tenant {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Tenant {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

/// The digest of an effective policy: 12 lower-case hex digits. Shared, not copied: every
/// attempt is stored with its version.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyVersion(Arc<str>);

impl PolicyVersion {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A version as stored with a record: the name of a policy that may no longer be configured.
impl From<&str> for PolicyVersion {
    fn from(version: &str) -> PolicyVersion {
        PolicyVersion(version.into())
    }
}

impl fmt::Display for PolicyVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Deref for PolicyVersion {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<String> for PolicyVersion {
    fn from(version: String) -> PolicyVersion {
        PolicyVersion(version.into())
    }
}

impl Serialize for PolicyVersion {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for PolicyVersion {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<PolicyVersion, D::Error> {
        String::deserialize(deserializer).map(PolicyVersion::from)
    }
}

/// A route's name, as configured and as its records, metrics and logs carry it. Shared, not
/// copied: every request on the route names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteName(Arc<str>);

impl RouteName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for RouteName {
    fn from(name: &str) -> RouteName {
        RouteName(name.into())
    }
}

impl From<String> for RouteName {
    fn from(name: String) -> RouteName {
        RouteName(name.into())
    }
}

impl Deref for RouteName {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for RouteName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for RouteName {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for RouteName {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl fmt::Display for RouteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for RouteName {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for RouteName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<RouteName, D::Error> {
        String::deserialize(deserializer).map(RouteName::from)
    }
}
