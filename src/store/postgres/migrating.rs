//! `idem migrate` and `idem status` on PostgreSQL: the schema moved to this build's protocol,
//! and the protocol a store is at read back.

use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};

use super::options;
use crate::store::{protocol, span_ms, StoreError};

/// Migrations only, for `idem migrate`. A migration that moves the store to this build's
/// protocol waits for every lease of the older one to end, and raises the bound of every record
/// whose attempt may be on its way to at least `reach` from now, in the server's clock: the
/// older protocol may have cut one short (docs/operations.md#upgrading).
pub(crate) async fn migrate(url: &str, reach: Duration) -> Result<(), StoreError> {
    let (_, primary) = options(url)?.pick().await?;
    let pool = PgPoolOptions::new().max_connections(1).connect_with(primary).await?;
    let from = stored_protocol(&pool).await?;
    protocol::check(from)?;
    let moving = from.filter(|&from| from < protocol::STORE_PROTOCOL);
    if let Some(from) = moving {
        // A schema before protocol 2 has no clock of its own: its leases were the nodes'.
        let leases: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT id::text, lease_owner, lease_expires_at FROM records
             WHERE state = 'in_progress' AND lease_expires_at >= (extract(epoch FROM now()) * 1000)::bigint
             ORDER BY lease_expires_at",
        )
        .fetch_all(&pool)
        .await?;
        protocol::live_leases(from, &leases)?;
    }
    migrations().run(&pool).await.map_err(|e| StoreError::Unavailable(format!("migration failed: {e}")))?;
    if moving.is_some() {
        sqlx::query(
            "UPDATE records SET in_flight_until = GREATEST(COALESCE(in_flight_until, 0), idem_now() + $1)
             WHERE state = 'unknown' OR in_flight_number IS NOT NULL",
        )
        .bind(span_ms(reach))
        .execute(&pool)
        .await?;
    }
    pool.close().await;
    Ok(())
}

/// This build's migrations. Those applied by a later build that keeps the protocol are let be:
/// an upgrade that keeps it rolls both ways (docs/operations.md#upgrading).
pub(super) fn migrations() -> sqlx::migrate::Migrator {
    let mut migrator = sqlx::migrate!("migrations/postgres");
    migrator.set_ignore_missing(true);
    migrator
}

/// The protocol the database at `url` speaks, its migrations and this build's, changing nothing:
/// `idem migrate --status`.
pub(crate) async fn status(url: &str) -> Result<protocol::Status, StoreError> {
    let (_, primary) = options(url)?.pick().await?;
    let pool = PgPoolOptions::new().max_connections(1).connect_with(primary).await?;
    let status = status_on(&pool).await;
    pool.close().await;
    status
}

pub(super) async fn status_on(pool: &PgPool) -> Result<protocol::Status, StoreError> {
    let store = stored_protocol(pool).await?;
    let has_migrations: bool =
        sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(pool).await?;
    let applied = match has_migrations {
        false => Vec::new(),
        true => {
            sqlx::query_as("SELECT version, description FROM _sqlx_migrations WHERE success ORDER BY version")
                .fetch_all(pool)
                .await?
        }
    };
    Ok(protocol::status(store, applied, &migrations()))
}

/// The protocol the database speaks: the one it keeps, or for a schema from before it kept one,
/// 1 once claims carried tokens and 0 before; `None` for an empty database.
pub(super) async fn stored_protocol(pool: &PgPool) -> Result<Option<i64>, StoreError> {
    let (kept, records, tokens): (bool, bool, bool) = sqlx::query_as(
        "SELECT to_regclass('idem_store') IS NOT NULL, to_regclass('records') IS NOT NULL,
                EXISTS (SELECT 1 FROM information_schema.columns
                        WHERE table_name = 'records' AND column_name = 'claim_token'
                          AND table_schema = current_schema())",
    )
    .fetch_one(pool)
    .await?;
    if kept {
        let protocol: i32 = sqlx::query_scalar("SELECT protocol FROM idem_store").fetch_one(pool).await?;
        return Ok(Some(i64::from(protocol)));
    }
    Ok(records.then_some(i64::from(tokens)))
}
