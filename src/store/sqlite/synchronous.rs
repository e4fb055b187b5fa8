//! How often the writer syncs, as `[store] sync` or the url's `?synchronous=` chose it (read by
//! the configuration, config/durability.rs). In WAL mode, `FULL` syncs the log at
//! every commit and `NORMAL` only at checkpoints (docs/guarantees.md#power-loss-and-store-sync).

use rusqlite::Connection;

use crate::config::{Durability, Synchronous};
use crate::store::{DurabilityInForce, StoreError};

/// Takes `synchronous=` out of the url (sqlx does not know it): the url left, and the level it
/// names, if it names one.
pub(super) fn split_synchronous(url: &str) -> Result<(String, Option<Synchronous>), StoreError> {
    crate::config::split_synchronous(url).map_err(StoreError::Unavailable)
}

/// The level `conn` syncs at, as SQLite reports it.
pub(super) fn in_force(conn: &Connection) -> Result<DurabilityInForce, StoreError> {
    let level: i64 = conn.query_row("PRAGMA synchronous", [], |row| row.get(0))?;
    let (sync, name) = match level {
        0 => (Durability::Normal, "OFF"),
        1 => (Durability::Normal, "NORMAL"),
        2 => (Durability::Full, "FULL"),
        _ => (Durability::Full, "EXTRA"),
    };
    Ok(DurabilityInForce { sync, setting: format!("synchronous={name}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synchronous_setting_is_taken_out_of_the_url() {
        let (url, s) = split_synchronous("sqlite://idem.db").unwrap();
        assert_eq!(url, "sqlite://idem.db");
        assert_eq!(s, None);
        let (url, s) = split_synchronous("sqlite://idem.db?synchronous=normal&mode=rwc").unwrap();
        assert_eq!(url, "sqlite://idem.db?mode=rwc");
        assert_eq!(s, Some(Synchronous::Normal));
        assert!(split_synchronous("sqlite://idem.db?synchronous=off").is_err());
    }

    #[test]
    fn the_level_in_force_is_read_back_from_the_connection() {
        let conn = Connection::open_in_memory().unwrap();
        for (pragma, sync, setting) in [
            ("NORMAL", Durability::Normal, "synchronous=NORMAL"),
            ("FULL", Durability::Full, "synchronous=FULL"),
            ("EXTRA", Durability::Full, "synchronous=EXTRA"),
        ] {
            conn.execute_batch(&format!("PRAGMA synchronous = {pragma}")).unwrap();
            assert_eq!(in_force(&conn).unwrap(), DurabilityInForce { sync, setting: setting.into() });
        }
    }
}
