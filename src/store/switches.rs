//! The emergency switches' rows, read the same way from either backend, and what clearing one
//! can come to.

use uuid::Uuid;

use super::{Columns, StoreError};
use crate::domain::switch::{Clearing, Scope, Switch, SwitchAction};

/// The most history rows one listing returns.
pub const MAX_HISTORY: u32 = 1000;

/// The outcome of clearing a switch.
#[derive(Debug, Clone)]
pub enum SwitchCleared {
    /// It was active; now it is cleared, with who, when and why.
    Cleared(Switch),
    /// It was already cleared, replaced or expired: nothing changed.
    NotActive(Switch),
    Missing,
}

/// Reads a switch from a row of either backend (ids as text, times as 64-bit integers).
pub(crate) fn decode_switch(row: &impl Columns) -> Result<Switch, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(format!("switches column {what}"));
    let text = |name: &'static str| row.text(name)?.ok_or_else(|| corrupt(name));
    let id = |name: &'static str, value: &str| Uuid::parse_str(value).map_err(|_| corrupt(name));
    let cleared = match row.time("cleared_at")? {
        None => None,
        Some(at) => Some(Clearing {
            at,
            actor: text("cleared_by")?,
            reason: text("cleared_reason")?,
            replaced_by: row.text("replaced_by")?.map(|r| id("replaced_by", &r)).transpose()?,
        }),
    };
    Ok(Switch {
        id: id("id", &text("id")?)?,
        scope: Scope::of(&text("scope")?),
        action: SwitchAction::parse(&text("action")?).ok_or_else(|| corrupt("action"))?,
        reason: text("reason")?,
        actor: text("actor")?,
        set_at: row.time("set_at")?.ok_or_else(|| corrupt("set_at"))?,
        expires_at: row.time("expires_at")?,
        cleared,
    })
}
