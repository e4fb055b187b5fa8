//! The PostgreSQL store, for several `idem serve` processes sharing one database. Every write is
//! one conditional statement (`INSERT … ON CONFLICT`, `UPDATE … WHERE <expected state>`), so row
//! locks and the unique index make it safe from any number of connections; the operator actions
//! that read before they write lock their row for that one transaction only. Work queues are
//! taken with `FOR UPDATE SKIP LOCKED`, so nodes sweeping at once never wait on each other. A
//! trigger announces settled and queued records on the `idem_records` channel, which one
//! listening connection per process relays as [`Notice`]s (`notices`). New keys that arrive
//! together are inserted by one statement (`admissions`), and the outcomes of attempts that end
//! together are stored by one call of a SQL function that updates each row as the one-row
//! statement would (`outcomes`). The operator's actions live in `actions`, take-over and the
//! sweeps in `upkeep`, the emergency switches in `switches`.
//!
//! The SQL mirrors `sqlite/writes.rs` statement for statement; that store's semantics are the
//! reference. UUIDs are bound as text and JSON as text cast to `jsonb`, and both are read back as
//! text (see `COLUMNS`), so the store needs no sqlx type features beyond the defaults.
//!
//! A statement about one record names it by id and checks its state with `state IS NOT DISTINCT
//! FROM '…'` rather than `state = '…'`. The equality would let the planner prove a partial
//! index's predicate (`records_leases` for `in_progress`, say) and scan that index whole,
//! filtering on the id — and it does, on a table too new to have statistics, and keeps that
//! plan cached on the connection: each write then reads every in-progress record's entry. The
//! other form cannot match an index, so the primary key is the only way in.

mod actions;
mod admissions;
mod hosts;
mod lanes;
mod leases;
mod listing;
mod migrating;
mod notices;
mod outcomes;
mod primary;
pub(super) mod recorded;
mod replication;
mod rows;
mod stats;
mod switches;
#[cfg(test)]
mod tests;
mod upkeep;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::Connection;
use tokio::sync::{broadcast, oneshot};

use self::admissions::Admissions;
use self::hosts::Hosts;
pub(crate) use self::migrating::{migrate, status};
use self::migrating::{migrations, status_on, stored_protocol};
use self::outcomes::Outcomes;
use self::primary::{Found, Primary};
pub(crate) use self::replication::inspect;
use self::rows::{get, COLUMNS};
use super::protocol;
use super::stats::{Side, StatsRows, StatsSpan};
use super::{
    decode, span_ms, Action, AddAnswerCounts, Admission, Admit, AttemptEnded, AttemptStarted, Cancel, Cancelled,
    ClaimQueued, ClaimUnclaimed, ClearSwitch, Condition, DurabilityInForce, Figures, LeaseClock, LeaseStatus,
    ListFilter, Notice, Notices, Operator, Page, Probed, ProbesDue, Records, Renew, Resolve, Retry, Serving,
    StoreError, Sweep, SwitchCleared, SwitchLog, TakeOver, Upkeep,
};
use crate::config::Durability;
use crate::domain::key::IdempotencyKey;
use crate::domain::switch::Switch;
use crate::domain::RecordId;
use crate::domain::RouteName;
use crate::domain::{ClaimToken, Phase, Tenant, Timestamp};
use crate::record::Record;

/// Connections per process: enough for a node's workers and requests, few enough that a dozen
/// nodes fit in PostgreSQL's default `max_connections`.
const MAX_CONNECTIONS: u32 = 16;
/// Notices held for a slow subscriber before it starts missing some (it then sees `Lagged` and
/// re-reads what it waits for).
const NOTICE_BACKLOG: usize = 1024;
/// How long a health check may wait for the server, within the health check's own bound.
const PING_WITHIN: Duration = Duration::from_millis(800);
pub(crate) struct PostgresStore {
    pool: PgPool,
    /// The server it writes to, among the hosts its URL names: the pool connects there, and
    /// follows a failover to the new primary.
    primary: Arc<Primary>,
    /// Whose clock leases and attempt bounds are kept in: the server's, but for tests.
    clock: LeaseClock,
    admissions: Admissions,
    outcomes: Outcomes,
    notices: broadcast::Sender<Notice>,
    /// The task relaying notifications and what stops it: [`Store::close`], or the store's drop.
    relay: std::sync::Mutex<Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>>,
    durability: DurabilityInForce,
    /// The health checks' own connection: a pool busy with requests must not pass for a
    /// database that is down, nor a pool's idle connection for one that is up.
    health_check: tokio::sync::Mutex<Option<PgConnection>>,
}

impl PostgresStore {
    /// Connects to the database at `url` (`postgres://…`), applies migrations, and starts
    /// listening for changes made by other processes. Leases are kept in `clock`: the server's
    /// ([`LeaseClock::Database`]) but for tests that hold time still. Its sessions commit as
    /// `sync` says.
    pub(crate) async fn open(url: &str, sync: Durability, clock: LeaseClock) -> Result<PostgresStore, StoreError> {
        let primary = Primary::connect(session(url, sync)?).await?;
        let pool = primary.pool().clone();
        let store = stored_protocol(&pool).await?;
        protocol::check(store)?;
        protocol::startable(store)?;
        migrations().run(&pool).await.map_err(|e| StoreError::Unavailable(format!("migration failed: {e}")))?;
        let durability = durability_in_force(&pool, sync).await?;
        replication::warn_without_synchronous_standby(&pool, &primary.serving().host).await;
        // Listen before returning, so no change made after `open` goes unannounced.
        let listener = notices::listen(&pool).await?;
        let (notices, _) = broadcast::channel(NOTICE_BACKLOG);
        let (relay, stop) = oneshot::channel();
        let relaying = tokio::spawn(notices::relay_notices(pool.clone(), listener, notices.clone(), stop));
        let (admissions, outcomes) = (Admissions::start(pool.clone(), clock), Outcomes::start(pool.clone(), clock));
        let health_check = tokio::sync::Mutex::new(None);
        Ok(PostgresStore {
            pool,
            primary,
            clock,
            admissions,
            outcomes,
            notices,
            relay: std::sync::Mutex::new(Some((relay, relaying))),
            durability,
            health_check,
        })
    }
}

/// The hosts this node's store connects to, as `url` names them, each connection declaring the
/// store protocol it speaks, which the store's trigger checks on every write to `records`
/// (`migrations/postgres`).
fn options(url: &str) -> Result<Hosts, StoreError> {
    Ok(Hosts::parse(url)?.map(|options| options.options([("idem.protocol", protocol::STORE_PROTOCOL.to_string())])))
}

/// How this node's store connects, committing as the database does. `normal` is refused: on
/// PostgreSQL it could only turn `synchronous_commit` off, whose commits any crash of the server
/// loses (one backend killed by the OOM killer restarts them all), answers told included
/// (docs/guarantees.md#power-loss-and-store-sync). The configuration refuses it first.
fn session(url: &str, sync: Durability) -> Result<Hosts, StoreError> {
    match sync {
        Durability::Full => options(url),
        Durability::Normal => Err(StoreError::Unavailable(
            "[store] sync = \"normal\" is for SQLite only: on PostgreSQL a crash of the database server would lose \
             the last commits"
                .into(),
        )),
    }
}

/// What the store's sessions commit with, as the server says: with `full`, whatever the
/// server's own setting is (`remote_apply` for a standby, say), which an operator may have
/// turned off for the database or role.
async fn durability_in_force(pool: &PgPool, sync: Durability) -> Result<DurabilityInForce, StoreError> {
    let setting: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(pool).await?;
    let in_force = if setting == "off" { Durability::Normal } else { Durability::Full };
    if in_force != sync {
        tracing::warn!(
            store.sync = %sync,
            synchronous_commit = %setting,
            "the database's synchronous_commit for Idem's sessions overrides [store] sync; /admin/node shows the one in force"
        );
    }
    Ok(DurabilityInForce { sync: in_force, setting: format!("synchronous_commit={setting}") })
}

#[async_trait]
impl Records for PostgresStore {
    async fn admit(&self, admit: Admit) -> Result<Admission, StoreError> {
        self.admissions.admit(admit).await
    }

    async fn lookup(&self, tenant: &Tenant, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        sqlx::query(&format!("SELECT {COLUMNS} FROM records WHERE tenant = $1 AND key = $2"))
            .bind(tenant)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?
            .map(|row| decode(&row))
            .transpose()
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        get(&self.pool, id).await
    }

    async fn claim(&self, claim: ClaimQueued) -> Result<Option<ClaimToken>, StoreError> {
        leases::claim(&self.pool, self.clock, claim).await
    }

    async fn attempt_started(&self, started: AttemptStarted) -> Result<LeaseStatus, StoreError> {
        leases::attempt_started(&self.pool, self.clock, started).await
    }

    async fn attempt_ended(&self, ended: AttemptEnded) -> Result<LeaseStatus, StoreError> {
        self.outcomes.attempt_ended(ended).await
    }

    async fn renew(&self, renew: Renew) -> Result<LeaseStatus, StoreError> {
        leases::renew(&self.pool, self.clock, renew).await
    }

    async fn cancel(&self, cancel: Cancel) -> Result<Cancelled, StoreError> {
        actions::cancel(&self.pool, cancel).await
    }
}

#[async_trait]
impl Operator for PostgresStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        listing::list(&self.pool, filter).await
    }

    async fn resolve(&self, resolve: Resolve) -> Result<Action, StoreError> {
        actions::resolve(&self.pool, self.clock, resolve).await
    }

    async fn retry(&self, retry: Retry) -> Result<Action, StoreError> {
        actions::retry(&self.pool, self.clock, retry).await
    }
}

#[async_trait]
impl Upkeep for PostgresStore {
    async fn expired_leases(&self, now: Timestamp, limit: u32) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM records
             WHERE state = 'in_progress' AND lease_expires_at < COALESCE($1::bigint, idem_now())
             ORDER BY lease_expires_at LIMIT $2"
        ))
        .bind(self.clock.bind_now(now))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(decode).collect()
    }

    async fn take_over(&self, take_over: TakeOver) -> Result<bool, StoreError> {
        upkeep::take_over(&self.pool, take_over).await
    }

    async fn claim_unclaimed(&self, claim: ClaimUnclaimed) -> Result<Vec<Record>, StoreError> {
        upkeep::claim_unclaimed(&self.pool, self.clock, claim).await
    }

    async fn probes_due(&self, due: ProbesDue) -> Result<Vec<Record>, StoreError> {
        let ProbesDue { route, settle, now, limit } = due;
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM records WHERE state = 'unknown' AND route = $1
               AND COALESCE(next_probe_at, updated_at + $2) <= $3
             ORDER BY created_at LIMIT $4"
        ))
        .bind(route)
        .bind(span_ms(settle))
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(decode).collect()
    }

    async fn store_time(&self, node_now: Timestamp) -> Result<Timestamp, StoreError> {
        Ok(match self.clock {
            LeaseClock::Node => node_now,
            LeaseClock::Database => sqlx::query_scalar("SELECT idem_now()").fetch_one(&self.pool).await?,
        })
    }

    async fn probed(&self, probed: Probed) -> Result<Action, StoreError> {
        actions::probed(&self.pool, self.clock, probed).await
    }

    async fn sweep_done(&self, sweep: Sweep) -> Result<u64, StoreError> {
        upkeep::sweep_done(&self.pool, self.clock, sweep).await
    }
}

#[async_trait]
impl Condition for PostgresStore {
    /// The server answers and takes writes. A server that fails or has become a standby, where the
    /// URL names several, sends the store looking for the new primary; a new timeline or start
    /// behind the same address (a promotion, a managed service's failover) counts as a change of
    /// server (docs/high-availability.md).
    async fn ping(&self) -> Result<(), StoreError> {
        let mut held = self.health_check.lock().await;
        // Taken out while in use: a check that fails, or is abandoned halfway, leaves no
        // connection in an unknown state behind; the next one connects afresh, where the pool
        // connects now.
        // Within a bound of its own, shorter than the health check's: a server that died
        // silently (powered off, cut off) never answers, and the check that waits for it must
        // still send the store looking for another.
        let checked = tokio::time::timeout(PING_WITHIN, async {
            let mut conn = match held.take() {
                Some(conn) => conn,
                None => PgConnection::connect_with(&self.pool.connect_options()).await?,
            };
            let found = primary::ask(&mut conn).await?;
            Ok::<_, StoreError>((conn, found))
        })
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::Unavailable(format!("the store's server did not answer within {PING_WITHIN:?}")))
        });
        let (conn, found) = match checked {
            Ok((conn, found)) => (Some(conn), Ok(found)),
            Err(e) => (None, Err(e)),
        };
        self.primary.checked(&found);
        match found? {
            Found::Primary(_) => {
                *held = conn;
                Ok(())
            }
            Found::Standby => {
                Err(StoreError::Unavailable("the store's server is a standby: looking for the primary".into()))
            }
        }
    }

    fn serving(&self) -> Option<Serving> {
        Some(self.primary.serving())
    }

    fn durability(&self) -> DurabilityInForce {
        self.durability.clone()
    }

    async fn close(&self) {
        let relay = self.relay.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((stop, relaying)) = relay {
            let _ = stop.send(());
            let _ = relaying.await;
        }
    }
}

#[async_trait]
impl Figures for PostgresStore {
    async fn count_by_phase(&self) -> Result<Vec<(Phase, u64)>, StoreError> {
        listing::count_by_phase(&self.pool).await
    }

    async fn add_answer_counts(&self, add: AddAnswerCounts) -> Result<(), StoreError> {
        stats::add_answer_counts(&self.pool, add.counts, add.forget_before).await
    }

    async fn stats(&self, span: &StatsSpan) -> Result<StatsRows, StoreError> {
        stats::read(&self.pool, span).await
    }

    async fn sides(&self, route: &RouteName, since: Timestamp) -> Result<Vec<Side>, StoreError> {
        stats::sides(&self.pool, route, since).await
    }
}

#[async_trait]
impl SwitchLog for PostgresStore {
    async fn set_switch(&self, switch: Switch) -> Result<Option<Switch>, StoreError> {
        switches::set(&self.pool, &switch).await
    }

    async fn clear_switch(&self, clear: ClearSwitch) -> Result<SwitchCleared, StoreError> {
        switches::clear(&self.pool, clear.id, &clear.clearing).await
    }

    async fn active_switches(&self, now: Timestamp) -> Result<Vec<Switch>, StoreError> {
        switches::active(&self.pool, now).await
    }

    async fn switch_history(&self, limit: u32) -> Result<Vec<Switch>, StoreError> {
        switches::history(&self.pool, limit).await
    }
}

#[async_trait]
impl Notices for PostgresStore {
    async fn watch(&self, id: RecordId) -> Result<(), StoreError> {
        sqlx::query("UPDATE records SET watched = TRUE WHERE id = $1::uuid AND NOT watched")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    fn notices(&self) -> Option<broadcast::Receiver<Notice>> {
        Some(self.notices.subscribe())
    }
}
