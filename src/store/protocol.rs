//! The store's protocol: what the guards on its records mean. Nodes sharing a store must agree
//! on it, or one node's guarded write would not fence another's (docs/operations.md#upgrading).
//! The store keeps the protocol it speaks; every node checks it at start, and refuses to run
//! against a store of a later protocol. A migration that changes what the guards mean advances
//! it, and from then on the store refuses every write from a node of an older protocol that is
//! still running, loudly, rather than leaving it unguarded.
//!
//! - 0: writes guarded by the lease holder's name.
//! - 1: every claim carries a token, and every write under it is guarded by it.
//! - 2: leases set and compared in the store's clock (PostgreSQL's own), every marked attempt
//!   given a bound before which nothing frees its record, and a take-over guarded by the attempt
//!   in flight it was decided on.
//! - 3: only an outcome that proves its request finished upstream brings the bound down (an
//!   ambiguous one keeps it); a probe's "not executed" judged against the bound as of its asking;
//!   a done record's completion stamped, and its retention judged, in the store's clock; a
//!   record kept to the policy it was admitted under.

use std::fmt;

use super::StoreError;

/// The protocol this build speaks.
pub const STORE_PROTOCOL: i64 = 3;

/// A migration, by its version and description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migration {
    pub version: i64,
    pub description: String,
}

/// Where a store stands against this build: what `idem migrate --status` shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The protocol the store speaks now; `None` for an empty database.
    pub store: Option<i64>,
    /// The migrations applied to it, oldest first.
    pub applied: Vec<Migration>,
    /// This build's migrations not applied yet, oldest first.
    pub pending: Vec<Migration>,
    /// Applied migrations this build does not know: a later build migrated the store.
    pub unknown: Vec<Migration>,
}

/// What an operator may do, as [`Status::upgrade`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upgrade {
    /// Nothing to apply.
    UpToDate,
    /// An empty database: the first node to start creates the schema.
    Fresh,
    /// The migrations keep the store's protocol: nodes can be upgraded one at a time while the
    /// others serve, in either order.
    Rolling,
    /// The migrations move the store from protocol `from` to `to`: every node of the older
    /// protocol must be stopped first (once they are applied, it is refused at its next write).
    StopEveryNode { from: i64, to: i64 },
    /// The store speaks a later protocol than this build: this build must not run against it.
    BuildBehind { store: i64 },
}

impl Status {
    pub fn upgrade(&self) -> Upgrade {
        match self.store {
            None => Upgrade::Fresh,
            Some(store) if store > STORE_PROTOCOL => Upgrade::BuildBehind { store },
            Some(store) if store < STORE_PROTOCOL => Upgrade::StopEveryNode { from: store, to: STORE_PROTOCOL },
            Some(_) if self.pending.is_empty() => Upgrade::UpToDate,
            Some(_) => Upgrade::Rolling,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let store = self.store.map_or("none (an empty database)".to_string(), |p| p.to_string());
        writeln!(f, "store protocol   {store}")?;
        writeln!(f, "this build       protocol {STORE_PROTOCOL}")?;
        let list = |migrations: &[Migration]| {
            migrations.iter().map(|m| format!("{} {}", m.version, m.description)).collect::<Vec<_>>().join(", ")
        };
        writeln!(f, "applied          {} migration(s){}", self.applied.len(), {
            self.applied.last().map(|m| format!(", the last {} {}", m.version, m.description)).unwrap_or_default()
        })?;
        if !self.pending.is_empty() {
            writeln!(f, "pending          {}", list(&self.pending))?;
        }
        if !self.unknown.is_empty() {
            writeln!(f, "unknown here     {} (applied by a later build)", list(&self.unknown))?;
        }
        let verdict = match self.upgrade() {
            Upgrade::UpToDate => "up to date: nodes of this build can run against it".to_string(),
            Upgrade::Fresh => "empty: the first node that starts (or `idem migrate`) creates the schema".to_string(),
            Upgrade::Rolling => "the pending migrations keep the protocol: upgrade the nodes one at a time while the \
                                 others serve"
                .to_string(),
            Upgrade::StopEveryNode { from, to } => format!(
                "the pending migrations move the store from protocol {from} to {to}: stop every node first, then \
                 migrate and start nodes of this build (a node of protocol {from} still running is refused at its \
                 next write)"
            ),
            Upgrade::BuildBehind { store } => format!(
                "the store speaks protocol {store}, later than this build's {STORE_PROTOCOL}: run a build that \
                 speaks protocol {store}"
            ),
        };
        write!(f, "upgrade          {verdict}")
    }
}

/// Refuses to serve a store of an earlier protocol: moving it on is `idem migrate`'s, which waits
/// for the nodes of that protocol to be gone ([`live_leases`]) and settles what they left behind.
pub(crate) fn startable(store: Option<i64>) -> Result<(), StoreError> {
    match store {
        Some(store) if store < STORE_PROTOCOL => Err(StoreError::Unavailable(format!(
            "the store speaks protocol {store}, and this build speaks protocol {STORE_PROTOCOL}: stop every node of \
             protocol {store}, then run `idem migrate` (it waits for their leases to end), then start this build"
        ))),
        _ => Ok(()),
    }
}

/// Refuses a migration that moves the store to another protocol while a node of the old one may
/// still act on it: `leases` are the claims still live, each as its record's id, its holder and
/// its expiry; up to five are named.
pub(crate) fn live_leases(from: i64, leases: &[(String, String, i64)]) -> Result<(), StoreError> {
    if leases.is_empty() {
        return Ok(());
    }
    let named: Vec<String> = leases
        .iter()
        .take(5)
        .map(|(id, owner, expires)| {
            let expires = crate::domain::Timestamp::from_millis(*expires).rfc3339();
            format!("record {id} held by {owner} until {expires}")
        })
        .collect();
    let more = if leases.len() > 5 { format!(" and {} more", leases.len() - 5) } else { String::new() };
    Err(StoreError::Unavailable(format!(
        "the migration moves the store from protocol {from} to {STORE_PROTOCOL}, but {} lease(s) of protocol {from} are \
         live: {}{more}. Stop every node of protocol {from}, wait for their leases to end, and run it again",
        leases.len(),
        named.join(", ")
    )))
}

/// Refuses to run against a store whose protocol is later than this build's: its guards would
/// mean something this node does not keep.
pub(crate) fn check(store: Option<i64>) -> Result<(), StoreError> {
    match store {
        Some(store) if store > STORE_PROTOCOL => Err(StoreError::Unavailable(format!(
            "the store speaks protocol {store}, but this build speaks protocol {STORE_PROTOCOL}: it must not write \
             to it; run a build that speaks protocol {store} (idem migrate --status tells more)"
        ))),
        _ => Ok(()),
    }
}

/// The status of a store from what it says of itself: its protocol and the migrations applied
/// (`(version, description)`, as sqlx keeps them), against this build's `migrator`.
pub(crate) fn status(store: Option<i64>, applied: Vec<(i64, String)>, migrator: &sqlx::migrate::Migrator) -> Status {
    let applied: Vec<Migration> =
        applied.into_iter().map(|(version, description)| Migration { version, description }).collect();
    let known: Vec<Migration> =
        migrator.iter().map(|m| Migration { version: m.version, description: m.description.to_string() }).collect();
    let pending = known.iter().filter(|m| !applied.iter().any(|a| a.version == m.version)).cloned().collect();
    let unknown = applied.iter().filter(|a| !known.iter().any(|m| m.version == a.version)).cloned().collect();
    Status { store, applied, pending, unknown }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(version: i64) -> Migration {
        Migration { version, description: format!("m{version}") }
    }

    /// A store's status against a build whose migrations are 1 to 3.
    fn status_of(store: Option<i64>, applied: &[i64]) -> Status {
        let pending = (1..=3).filter(|v| !applied.contains(v)).map(m).collect();
        let unknown = applied.iter().copied().filter(|v| *v > 3).map(m).collect();
        Status { store, applied: applied.iter().copied().map(m).collect(), pending, unknown }
    }

    #[test]
    fn an_upgrade_rolls_only_when_the_protocol_stays() {
        assert_eq!(status_of(None, &[]).upgrade(), Upgrade::Fresh);
        assert_eq!(status_of(Some(STORE_PROTOCOL), &[1, 2, 3]).upgrade(), Upgrade::UpToDate);
        let behind = status_of(Some(STORE_PROTOCOL), &[1, 2]);
        assert_eq!(behind.upgrade(), Upgrade::Rolling);
        assert_eq!(behind.pending, vec![m(3)]);
        let older = status_of(Some(STORE_PROTOCOL - 1), &[1, 2]);
        assert_eq!(older.upgrade(), Upgrade::StopEveryNode { from: STORE_PROTOCOL - 1, to: STORE_PROTOCOL });
        let later = status_of(Some(STORE_PROTOCOL + 1), &[1, 2, 3, 4]);
        assert_eq!(later.upgrade(), Upgrade::BuildBehind { store: STORE_PROTOCOL + 1 });
        assert_eq!(later.unknown, vec![m(4)]);
        assert!(later.to_string().contains("run a build that speaks protocol"), "{later}");
    }

    #[test]
    fn the_status_sets_a_stores_migrations_against_the_builds() {
        let migrator = sqlx::migrate!("migrations/sqlite");
        let last = migrator.iter().last().unwrap().version;
        let applied = vec![(1, "records".to_string()), (999, "from a later build".to_string())];
        let status = status(Some(STORE_PROTOCOL), applied, &migrator);
        assert_eq!(status.pending.last().map(|m| m.version), Some(last));
        assert_eq!(status.unknown, vec![Migration { version: 999, description: "from a later build".into() }]);
    }

    #[test]
    fn a_store_of_a_later_protocol_is_refused_and_an_earlier_one_migrated() {
        assert!(check(None).is_ok());
        assert!(check(Some(STORE_PROTOCOL - 1)).is_ok(), "migrated at start");
        assert!(check(Some(STORE_PROTOCOL)).is_ok());
        let refused = check(Some(STORE_PROTOCOL + 1)).unwrap_err().to_string();
        assert!(refused.contains(&format!("this build speaks protocol {STORE_PROTOCOL}")), "{refused}");
    }
}
