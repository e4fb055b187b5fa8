//! Opening the store a `store.url` names, applying its migrations, or only reading where it
//! stands against this build.

use std::sync::Arc;
use std::time::Duration;

use super::{postgres, protocol, sqlite, LeaseClock, Store, StoreError};
use crate::config::Durability;

/// The two backends, as a `store.url` names them.
enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    fn of(url: &str) -> Result<Backend, StoreError> {
        if url.starts_with("sqlite:") {
            Ok(Backend::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Backend::Postgres)
        } else {
            Err(StoreError::Unavailable(format!("unsupported store url `{url}`")))
        }
    }
}

/// Opens the store named by a `store.url`, applying migrations: PostgreSQL keeps leases in its
/// own clock.
pub async fn open(url: &str) -> Result<Arc<dyn Store>, StoreError> {
    open_with(url, LeaseClock::Database).await
}

/// Opens the store named by a `store.url`, keeping leases in `clock` where the backend can
/// choose (PostgreSQL; SQLite's are always its host's, [`LeaseClock::Node`]). Commits are fully
/// durable, unless a SQLite url's own `synchronous=` says otherwise.
pub async fn open_with(url: &str, clock: LeaseClock) -> Result<Arc<dyn Store>, StoreError> {
    open_synced(url, Durability::Full, clock).await
}

/// Opens the store named by a `store.url` as [`open_with`] does, its commits as durable as
/// `sync` says: `[store] sync`. A SQLite url's own `synchronous=` is applied as written, so
/// that one with `extra` keeps it; the configuration refuses one that disagrees with `sync`.
pub async fn open_synced(url: &str, sync: Durability, clock: LeaseClock) -> Result<Arc<dyn Store>, StoreError> {
    let store: Arc<dyn Store> = match Backend::of(url)? {
        Backend::Sqlite => Arc::new(sqlite::SqliteStore::open(url, sync).await?),
        Backend::Postgres => Arc::new(postgres::PostgresStore::open(url, sync, clock).await?),
    };
    Ok(store)
}

/// Applies the migrations of the store named by a `store.url`, and nothing else: `idem migrate`.
/// Refused, changing nothing, when the store speaks a later protocol than this build, or when
/// the migrations move it to this build's protocol while a lease of the older one is live. A
/// store moved on has the bound of every record whose attempt may be on its way raised to at
/// least `reach` from now: the longest any attempt may still reach the upstream
/// ([`Config::longest_reach`](crate::config::Config::longest_reach)).
pub async fn migrate(url: &str, reach: Duration) -> Result<(), StoreError> {
    match Backend::of(url)? {
        Backend::Sqlite => sqlite::migrate(url, reach).await,
        Backend::Postgres => postgres::migrate(url, reach).await,
    }
}

/// For a SQLite store, what is wrong with the directory its file goes in, if anything: it must
/// exist (the file is created in it, not the directories above).
pub fn missing_directory(url: &str) -> Option<String> {
    match Backend::of(url) {
        Ok(Backend::Sqlite) => sqlite::missing_directory(url),
        _ => None,
    }
}

/// What `idem check --connect` finds at `url`, changing nothing: see [`Inspection`].
pub async fn inspect(url: &str) -> Result<Inspection, StoreError> {
    match Backend::of(url)? {
        Backend::Sqlite => {
            let status = sqlite::status(url).await?;
            Ok(Inspection { serving: None, replication: None, status, warnings: Vec::new() })
        }
        Backend::Postgres => postgres::inspect(url).await,
    }
}

/// A store as `idem check --connect` finds it.
#[derive(Debug)]
pub struct Inspection {
    /// The server that serves it (PostgreSQL).
    pub serving: Option<Serving>,
    /// How that server replicates, in a line (PostgreSQL's primary).
    pub replication: Option<String>,
    /// Its protocol and migrations.
    pub status: protocol::Status,
    /// What an operator should hear: a primary without a synchronous standby, a standby.
    pub warnings: Vec<String>,
}

/// Where the store named by a `store.url` stands against this build, changing nothing:
/// `idem migrate --status`.
pub async fn status(url: &str) -> Result<protocol::Status, StoreError> {
    match Backend::of(url)? {
        Backend::Sqlite => sqlite::status(url).await,
        Backend::Postgres => postgres::status(url).await,
    }
}

/// The server a store is connected to, where it can name one (PostgreSQL's): `GET /admin/node`
/// and `idem check --connect` show it, and the take-over sweep holds back after it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Serving {
    /// The host serving it, as `host:port`.
    pub host: String,
    /// Its timeline: a promotion starts a new one. `None` until a health check has read it.
    pub timeline: Option<String>,
    /// When it started (UTC): a server started afresh on another machine keeps its timeline.
    pub started: Option<String>,
    /// How often the serving server changed (another host, a new timeline or start) since the store
    /// opened: leases and bounds set in one server's clock are judged in another's after it.
    pub changes: u64,
}
