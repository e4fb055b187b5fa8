//! The PostgreSQL store's SQL for the emergency switches. A set runs in one transaction that
//! first locks the table against other writers, so that of two nodes setting the same scope and
//! action at once, the second replaces the first instead of both becoming active; readers are
//! not blocked.

use sqlx::postgres::PgPool;
use uuid::Uuid;

use crate::domain::switch::{Clearing, Switch};
use crate::domain::Timestamp;
use crate::store::{decode_switch, StoreError, SwitchCleared};

/// Every column of `switches`, ids as text.
const COLUMNS: &str = "id::text AS id, scope, action, reason, actor, set_at, expires_at, cleared_at, cleared_by,
    cleared_reason, replaced_by::text AS replaced_by";

pub(super) async fn set(pool: &PgPool, new: &Switch) -> Result<Option<Switch>, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query("LOCK TABLE switches IN SHARE ROW EXCLUSIVE MODE").execute(&mut *tx).await?;
    let replaced = sqlx::query(&format!(
        "UPDATE switches SET cleared_at = $3, cleared_by = $4, cleared_reason = $5, replaced_by = $6::uuid
         WHERE scope = $1 AND action = $2 AND cleared_at IS NULL AND (expires_at IS NULL OR expires_at > $3)
         RETURNING {COLUMNS}"
    ))
    .bind(&new.scope)
    .bind(new.action)
    .bind(new.set_at)
    .bind(&new.actor)
    .bind(format!("replaced by switch {}: {}", new.id, new.reason))
    .bind(new.id.to_string())
    .fetch_all(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO switches (id, scope, action, reason, actor, set_at, expires_at)
         VALUES ($1::uuid, $2, $3, $4, $5, $6, $7)",
    )
    .bind(new.id.to_string())
    .bind(&new.scope)
    .bind(new.action)
    .bind(&new.reason)
    .bind(&new.actor)
    .bind(new.set_at)
    .bind(new.expires_at)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    replaced.last().map(decode_switch).transpose()
}

pub(super) async fn clear(pool: &PgPool, id: Uuid, clearing: &Clearing) -> Result<SwitchCleared, StoreError> {
    let cleared = sqlx::query(&format!(
        "UPDATE switches SET cleared_at = $2, cleared_by = $3, cleared_reason = $4
         WHERE id = $1::uuid AND cleared_at IS NULL AND (expires_at IS NULL OR expires_at > $2)
         RETURNING {COLUMNS}"
    ))
    .bind(id.to_string())
    .bind(clearing.at)
    .bind(&clearing.actor)
    .bind(&clearing.reason)
    .fetch_optional(pool)
    .await?;
    if let Some(row) = cleared {
        return Ok(SwitchCleared::Cleared(decode_switch(&row)?));
    }
    let row = sqlx::query(&format!("SELECT {COLUMNS} FROM switches WHERE id = $1::uuid"))
        .bind(id.to_string())
        .fetch_optional(pool)
        .await?;
    Ok(match row {
        Some(row) => SwitchCleared::NotActive(decode_switch(&row)?),
        None => SwitchCleared::Missing,
    })
}

pub(super) async fn active(pool: &PgPool, now: Timestamp) -> Result<Vec<Switch>, StoreError> {
    let rows = sqlx::query(&format!(
        "SELECT {COLUMNS} FROM switches WHERE cleared_at IS NULL AND (expires_at IS NULL OR expires_at > $1)
         ORDER BY set_at, id"
    ))
    .bind(now)
    .fetch_all(pool)
    .await?;
    rows.iter().map(decode_switch).collect()
}

pub(super) async fn history(pool: &PgPool, limit: u32) -> Result<Vec<Switch>, StoreError> {
    let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM switches ORDER BY set_at DESC, id DESC LIMIT $1"))
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await?;
    rows.iter().map(decode_switch).collect()
}
