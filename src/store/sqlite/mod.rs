//! The SQLite store. SQLite allows one writer at a time, so instead of a pool of connections
//! fighting over the write lock, every write goes through the only writing connection: at once,
//! on its caller's thread, when the store is idle; else queued, and committed with whatever else
//! has queued up in one transaction ([`writer`]). Reads run on a separate pool of read-only
//! connections, which WAL lets proceed while the writer writes.
//!
//! Both refuse to work once the database files are no longer the ones opened ([`files`]).

mod actions;
mod checkpointer;
mod committer;
mod files;
mod listing;
mod migrating;
pub(super) mod recorded;
mod rows;
mod stats;
mod switches;
mod synchronous;
mod writer;
mod writes;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::Connection;

use self::files::DatabaseFiles;
pub use self::files::FileId;
use self::migrating::MigrationLock;
use self::synchronous::split_synchronous;
use self::writer::{Write, Writer};
use super::protocol;
use super::stats::{Side, StatsRows, StatsSpan};
use super::{
    decode, span_ms, Action, AddAnswerCounts, Admission, Admit, AttemptEnded, AttemptStarted, Cancel, Cancelled,
    ClaimQueued, ClaimUnclaimed, ClearSwitch, Condition, DurabilityInForce, Figures, LeaseStatus, ListFilter, Notices,
    Operator, Page, Probed, ProbesDue, Records, Renew, Resolve, Retry, StoreError, Sweep, SwitchCleared, SwitchLog,
    TakeOver, Upkeep,
};
use crate::config::{Durability, Synchronous};
use crate::domain::key::IdempotencyKey;
use crate::domain::switch::Switch;
use crate::domain::RecordId;
use crate::domain::RouteName;
use crate::domain::{ClaimToken, Phase, Tenant, Timestamp};
use crate::record::Record;

pub struct SqliteStore {
    writer: Writer,
    reads: SqlitePool,
    files: Arc<DatabaseFiles>,
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `url` and applies migrations. Its writer syncs
    /// as `sync` says, or as the url's own `?synchronous=` does where it has one: `full` makes
    /// every record durable before its request is sent upstream, `normal` trades the last commits
    /// on power loss for speed.
    pub async fn open(url: &str, sync: Durability) -> Result<SqliteStore, StoreError> {
        let (options, asked) = connect_options(url)?;
        if let Some(missing) = missing_directory(url) {
            return Err(StoreError::Unavailable(missing));
        }
        let migrating = MigrationLock::take(options.get_filename()).await?;
        let mut migrator = SqliteConnection::connect_with(&options).await?;
        let store = stored_protocol(&mut migrator).await?;
        protocol::check(store)?;
        protocol::startable(store)?;
        run_migrations(&mut migrator).await?;
        migrator.close().await?;
        drop(migrating);
        let files = Arc::new(DatabaseFiles::opened(options.get_filename())?);

        let reads = SqlitePoolOptions::new()
            .max_connections(8)
            .min_connections(1)
            // A reader opened while another file sits at the path would go on reading that
            // file after the store's own is back.
            .after_connect({
                let files = files.clone();
                move |_, _| {
                    let files = files.clone();
                    Box::pin(
                        async move { files.verify_database().map_err(|e| sqlx::Error::Configuration(Box::new(e))) },
                    )
                }
            })
            .connect_with(options.clone().read_only(true))
            .await?;

        let writer = writer::start(options.get_filename(), Synchronous::chosen(asked, sync), files.clone())?;
        Ok(SqliteStore { writer, reads, files })
    }

    /// The pool to read from, unless the files are lost: then a reader would read a file that
    /// no path names, or another file.
    fn reads(&self) -> Result<&SqlitePool, StoreError> {
        self.files.check()?;
        Ok(&self.reads)
    }

    async fn write<T>(&self, op: impl FnOnce(writer::Reply<T>) -> Write) -> Result<T, StoreError> {
        self.writer.write(op).await
    }
}

/// What is wrong with the directory the file at `url` goes in: it must exist.
pub(crate) fn missing_directory(url: &str) -> Option<String> {
    let (options, _) = connect_options(url).ok()?;
    let file = options.get_filename();
    let dir = match file.parent() {
        Some(dir) if dir.as_os_str().is_empty() => return None,
        Some(dir) => dir,
        None => return None,
    };
    (!dir.is_dir()).then(|| {
        format!(
            "store.url: the directory {} of the SQLite file {} does not exist: create it, writable by the user idem runs as",
            dir.display(),
            file.display()
        )
    })
}

/// How the store at `url` is opened, and the `synchronous=` its url asks for, if any.
fn connect_options(url: &str) -> Result<(SqliteConnectOptions, Option<Synchronous>), StoreError> {
    let (url, asked) = split_synchronous(url)?;
    if url.contains(":memory:") || url.contains("mode=memory") {
        // The writer and the readers are separate connections: each would get its own empty
        // database, and no write would ever be read back.
        return Err(StoreError::Unavailable(format!(
            "`{url}`: an in-memory SQLite database cannot be shared by the writer and the readers; give a file path"
        )));
    }
    let options = SqliteConnectOptions::from_str(&url)
        .map_err(|e| StoreError::Unavailable(format!("bad sqlite url `{url}`: {e}")))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10))
        .foreign_keys(true);
    Ok((options, asked))
}

/// Applies this build's migrations, under the [`MigrationLock`].
async fn run_migrations(conn: &mut SqliteConnection) -> Result<(), StoreError> {
    migrations().run(&mut *conn).await.map_err(|e| StoreError::Unavailable(format!("migration failed: {e}")))
}

/// Migrations only, for `idem migrate`. A migration that moves the store to this build's
/// protocol waits for every lease of the older one to end, and raises the bound of every record
/// whose attempt may be on its way to at least `reach` from now: the older protocol may have cut
/// one short (docs/operations.md#upgrading).
pub async fn migrate(url: &str, reach: Duration) -> Result<(), StoreError> {
    let (options, _) = connect_options(url)?;
    let _migrating = MigrationLock::take(options.get_filename()).await?;
    let mut conn = SqliteConnection::connect_with(&options).await?;
    let from = stored_protocol(&mut conn).await?;
    protocol::check(from)?;
    let now = Timestamp::now();
    let moving = from.filter(|&from| from < protocol::STORE_PROTOCOL);
    if let Some(from) = moving {
        let leases: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT id, lease_owner, lease_expires_at FROM records
             WHERE state = 'in_progress' AND lease_expires_at >= ?1 ORDER BY lease_expires_at",
        )
        .bind(now)
        .fetch_all(&mut conn)
        .await?;
        protocol::live_leases(from, &leases)?;
    }
    run_migrations(&mut conn).await?;
    conn.close().await?;
    if moving.is_some() {
        let conn = rusqlite::Connection::open(options.get_filename())?;
        writer::declare_protocol(&conn)?;
        conn.busy_timeout(Duration::from_secs(10))?;
        conn.execute(
            "UPDATE records SET in_flight_until = MAX(COALESCE(in_flight_until, 0), ?1)
             WHERE state = 'unknown' OR in_flight_number IS NOT NULL",
            [now + reach],
        )?;
    }
    Ok(())
}

/// This build's migrations. Those applied by a later build that keeps the protocol are let be:
/// an upgrade that keeps it rolls both ways (docs/operations.md#upgrading).
fn migrations() -> sqlx::migrate::Migrator {
    let mut migrator = sqlx::migrate!("migrations/sqlite");
    migrator.set_ignore_missing(true);
    migrator
}

/// The protocol the database at `url` speaks, its migrations and this build's, changing nothing:
/// `idem migrate --status`.
pub async fn status(url: &str) -> Result<protocol::Status, StoreError> {
    let (url, _) = split_synchronous(url)?;
    let options = SqliteConnectOptions::from_str(&url)
        .map_err(|e| StoreError::Unavailable(format!("bad sqlite url `{url}`: {e}")))?
        .read_only(true);
    if !options.get_filename().exists() {
        return Ok(protocol::status(None, Vec::new(), &migrations()));
    }
    let mut conn = SqliteConnection::connect_with(&options).await?;
    let store = stored_protocol(&mut conn).await?;
    let has_migrations: bool =
        sqlx::query_scalar("SELECT count(*) > 0 FROM sqlite_master WHERE name = '_sqlx_migrations'")
            .fetch_one(&mut conn)
            .await?;
    let applied = match has_migrations {
        false => Vec::new(),
        true => {
            sqlx::query_as("SELECT version, description FROM _sqlx_migrations WHERE success ORDER BY version")
                .fetch_all(&mut conn)
                .await?
        }
    };
    Ok(protocol::status(store, applied, &migrations()))
}

/// The protocol the database speaks: the one it keeps, or for a schema from before it kept one,
/// 1 once claims carried tokens and 0 before; `None` for an empty database.
async fn stored_protocol(conn: &mut SqliteConnection) -> Result<Option<i64>, StoreError> {
    let table = |name: &'static str| {
        sqlx::query_scalar::<_, bool>("SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?1")
            .bind(name)
    };
    if table("idem_store").fetch_one(&mut *conn).await? {
        return Ok(Some(sqlx::query_scalar("SELECT protocol FROM idem_store").fetch_one(&mut *conn).await?));
    }
    if !table("records").fetch_one(&mut *conn).await? {
        return Ok(None);
    }
    let tokens: bool =
        sqlx::query_scalar("SELECT count(*) > 0 FROM pragma_table_info('records') WHERE name = 'claim_token'")
            .fetch_one(&mut *conn)
            .await?;
    Ok(Some(i64::from(tokens)))
}

#[async_trait]
impl Records for SqliteStore {
    async fn admit(&self, admit: Admit) -> Result<Admission, StoreError> {
        self.write(|r| Write::Admit(admit, r)).await
    }

    async fn lookup(&self, tenant: &Tenant, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        sqlx::query("SELECT * FROM records WHERE tenant = ?1 AND key = ?2")
            .bind(tenant)
            .bind(key)
            .fetch_optional(self.reads()?)
            .await?
            .map(|row| decode(&row))
            .transpose()
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        sqlx::query("SELECT * FROM records WHERE id = ?1")
            .bind(id)
            .fetch_optional(self.reads()?)
            .await?
            .map(|row| decode(&row))
            .transpose()
    }

    async fn claim(&self, claim: ClaimQueued) -> Result<Option<ClaimToken>, StoreError> {
        self.write(|r| Write::Claim(claim, r)).await
    }

    async fn attempt_started(&self, started: AttemptStarted) -> Result<LeaseStatus, StoreError> {
        self.write(|r| Write::AttemptStarted(started, r)).await
    }

    async fn attempt_ended(&self, ended: AttemptEnded) -> Result<LeaseStatus, StoreError> {
        self.write(|r| Write::AttemptEnded(ended, r)).await
    }

    async fn renew(&self, renew: Renew) -> Result<LeaseStatus, StoreError> {
        self.write(|r| Write::Renew(renew, r)).await
    }

    async fn cancel(&self, cancel: Cancel) -> Result<Cancelled, StoreError> {
        self.write(|r| Write::Cancel(cancel, r)).await
    }
}

#[async_trait]
impl Operator for SqliteStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        listing::list(self.reads()?, filter).await
    }

    async fn resolve(&self, resolve: Resolve) -> Result<Action, StoreError> {
        self.write(|r| Write::Resolve(resolve, r)).await
    }

    async fn retry(&self, retry: Retry) -> Result<Action, StoreError> {
        self.write(|r| Write::Retry(retry, r)).await
    }
}

#[async_trait]
impl Upkeep for SqliteStore {
    async fn expired_leases(&self, now: Timestamp, limit: u32) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM records WHERE state = 'in_progress' AND lease_expires_at < ?1
             ORDER BY lease_expires_at LIMIT ?2",
        )
        .bind(now)
        .bind(limit as i64)
        .fetch_all(self.reads()?)
        .await?;
        rows.iter().map(decode).collect()
    }

    async fn take_over(&self, take_over: TakeOver) -> Result<bool, StoreError> {
        self.write(|r| Write::TakeOver(take_over, r)).await
    }

    async fn claim_unclaimed(&self, claim: ClaimUnclaimed) -> Result<Vec<Record>, StoreError> {
        self.write(|r| Write::ClaimUnclaimed(claim, r)).await
    }

    async fn probes_due(&self, due: ProbesDue) -> Result<Vec<Record>, StoreError> {
        let ProbesDue { route, settle, now, limit } = due;
        let rows = sqlx::query(
            "SELECT * FROM records WHERE state = 'unknown' AND route = ?1
               AND COALESCE(next_probe_at, updated_at + ?2) <= ?3
             ORDER BY created_at LIMIT ?4",
        )
        .bind(route)
        .bind(span_ms(settle))
        .bind(now)
        .bind(limit as i64)
        .fetch_all(self.reads()?)
        .await?;
        rows.iter().map(decode).collect()
    }

    /// One host's clock for every node sharing the file: the node's.
    async fn store_time(&self, node_now: Timestamp) -> Result<Timestamp, StoreError> {
        Ok(node_now)
    }

    async fn probed(&self, probed: Probed) -> Result<Action, StoreError> {
        self.write(|r| Write::Probed(probed, r)).await
    }

    async fn sweep_done(&self, sweep: Sweep) -> Result<u64, StoreError> {
        self.write(|r| Write::Sweep(sweep, r)).await
    }
}

#[async_trait]
impl Condition for SqliteStore {
    async fn ping(&self) -> Result<(), StoreError> {
        self.files.verify()?;
        self.files.verify_access()?;
        if !self.files.is_available() {
            // Its own files again: it resumes once they take a write.
            self.write(|r| Write::Probe(Timestamp::now(), r)).await?;
            self.files.restore();
        }
        sqlx::query("SELECT 1").execute(self.reads()?).await?;
        Ok(())
    }

    fn durability(&self) -> DurabilityInForce {
        self.writer.durability().clone()
    }
}

#[async_trait]
impl Figures for SqliteStore {
    async fn count_by_phase(&self) -> Result<Vec<(Phase, u64)>, StoreError> {
        listing::count_by_phase(self.reads()?).await
    }

    async fn add_answer_counts(&self, add: AddAnswerCounts) -> Result<(), StoreError> {
        self.write(|r| Write::AddAnswerCounts(add, r)).await
    }

    async fn stats(&self, span: &StatsSpan) -> Result<StatsRows, StoreError> {
        stats::read(&self.reads, span).await
    }

    async fn sides(&self, route: &RouteName, since: Timestamp) -> Result<Vec<Side>, StoreError> {
        stats::sides(&self.reads, route, since).await
    }
}

/// One process per file: no other process settles its records (the defaults: nothing to hear).
impl Notices for SqliteStore {}

#[async_trait]
impl SwitchLog for SqliteStore {
    async fn set_switch(&self, switch: Switch) -> Result<Option<Switch>, StoreError> {
        self.write(|r| Write::SetSwitch(switch, r)).await
    }

    async fn clear_switch(&self, clear: ClearSwitch) -> Result<SwitchCleared, StoreError> {
        self.write(|r| Write::ClearSwitch(clear, r)).await
    }

    async fn active_switches(&self, now: Timestamp) -> Result<Vec<Switch>, StoreError> {
        switches::active(self.reads()?, now).await
    }

    async fn switch_history(&self, limit: u32) -> Result<Vec<Switch>, StoreError> {
        switches::history(self.reads()?, limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_in_memory_database_is_refused_with_a_reason() {
        for url in ["sqlite::memory:", "sqlite://idem.db?mode=memory"] {
            let Err(e) = SqliteStore::open(url, Durability::Full).await else { panic!("{url} was accepted") };
            assert!(e.to_string().contains("give a file path"), "{e}");
        }
    }
}
