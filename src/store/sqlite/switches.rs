//! The SQLite store's SQL for the emergency switches: set and clear run on the one writing
//! connection, inside its transaction, which makes a replacement and its insert one change; the
//! listings run on the read pool.

use rusqlite::{params, Connection};
use sqlx::sqlite::SqlitePool;

use super::rows::WriterRow;
use crate::domain::switch::Switch;
use crate::domain::Timestamp;
use crate::store::{decode_switch, ClearSwitch, StoreError, SwitchCleared};

/// A switch that is active at `?3`, of scope `?1` and action `?2`, is cleared as replaced.
const REPLACE: &str = "
UPDATE switches SET cleared_at = ?3, cleared_by = ?4, cleared_reason = ?5, replaced_by = ?6
WHERE scope = ?1 AND action = ?2 AND cleared_at IS NULL AND (expires_at IS NULL OR expires_at > ?3)
RETURNING *";

const INSERT: &str = "
INSERT INTO switches (id, scope, action, reason, actor, set_at, expires_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";

const CLEAR: &str = "
UPDATE switches SET cleared_at = ?2, cleared_by = ?3, cleared_reason = ?4
WHERE id = ?1 AND cleared_at IS NULL AND (expires_at IS NULL OR expires_at > ?2)
RETURNING *";

const ACTIVE: &str = "
SELECT * FROM switches WHERE cleared_at IS NULL AND (expires_at IS NULL OR expires_at > ?1)
ORDER BY set_at, id";

const HISTORY: &str = "SELECT * FROM switches ORDER BY set_at DESC, id DESC LIMIT ?1";

/// The reason a replaced switch is kept with: which switch took its place, and why.
fn replaced_because(new: &Switch) -> String {
    format!("replaced by switch {}: {}", new.id, new.reason)
}

pub(super) fn set(conn: &Connection, new: Switch) -> Result<Option<Switch>, StoreError> {
    let mut replaced = None;
    {
        let mut replace = conn.prepare_cached(REPLACE)?;
        let mut rows = replace.query(params![
            new.scope,
            new.action,
            new.set_at,
            new.actor,
            replaced_because(&new),
            new.id.to_string()
        ])?;
        while let Some(row) = rows.next()? {
            replaced = Some(decode_switch(&WriterRow(row))?);
        }
    }
    conn.prepare_cached(INSERT)?.execute(params![
        new.id.to_string(),
        new.scope,
        new.action,
        new.reason,
        new.actor,
        new.set_at,
        new.expires_at
    ])?;
    Ok(replaced)
}

pub(super) fn clear(conn: &Connection, clear: ClearSwitch) -> Result<SwitchCleared, StoreError> {
    let ClearSwitch { id, clearing } = clear;
    let mut statement = conn.prepare_cached(CLEAR)?;
    let mut rows = statement.query(params![id.to_string(), clearing.at, clearing.actor, clearing.reason])?;
    if let Some(row) = rows.next()? {
        return Ok(SwitchCleared::Cleared(decode_switch(&WriterRow(row))?));
    }
    let mut statement = conn.prepare_cached("SELECT * FROM switches WHERE id = ?1")?;
    let mut rows = statement.query([id.to_string()])?;
    Ok(match rows.next()? {
        Some(row) => SwitchCleared::NotActive(decode_switch(&WriterRow(row))?),
        None => SwitchCleared::Missing,
    })
}

pub(super) async fn active(reads: &SqlitePool, now: Timestamp) -> Result<Vec<Switch>, StoreError> {
    let rows = sqlx::query(ACTIVE).bind(now).fetch_all(reads).await?;
    rows.iter().map(decode_switch).collect()
}

pub(super) async fn history(reads: &SqlitePool, limit: u32) -> Result<Vec<Switch>, StoreError> {
    let rows = sqlx::query(HISTORY).bind(i64::from(limit)).fetch_all(reads).await?;
    rows.iter().map(decode_switch).collect()
}
