//! How often the writer syncs: `[store] sync`, or the `?synchronous=` a SQLite url may carry
//! (kept for the configurations written before the key). In WAL mode, `FULL` syncs the log at
//! every commit and `NORMAL` only at checkpoints (docs/guarantees.md#power-loss-and-store-sync).

use rusqlite::Connection;

use crate::store::{Durability, DurabilityInForce, StoreError};

/// SQLite's `PRAGMA synchronous` levels the store runs with. `OFF` is not one: it would lose
/// commits on power loss even past a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Synchronous {
    Normal,
    Full,
    Extra,
}

impl Synchronous {
    /// The level a url's own `synchronous=` names, else the one `sync` asks for.
    pub(super) fn chosen(url: Option<Synchronous>, sync: Durability) -> Synchronous {
        url.unwrap_or(match sync {
            Durability::Full => Synchronous::Full,
            Durability::Normal => Synchronous::Normal,
        })
    }

    pub(super) fn pragma(self) -> &'static str {
        match self {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
            Synchronous::Extra => "EXTRA",
        }
    }

    fn durability(self) -> Durability {
        match self {
            Synchronous::Normal => Durability::Normal,
            Synchronous::Full | Synchronous::Extra => Durability::Full,
        }
    }

    fn parse(value: &str) -> Option<Synchronous> {
        match value.to_ascii_lowercase().as_str() {
            "normal" => Some(Synchronous::Normal),
            "full" => Some(Synchronous::Full),
            "extra" => Some(Synchronous::Extra),
            _ => None,
        }
    }
}

/// Takes `synchronous=` out of the url (sqlx does not know it): the url left, and the level it
/// names, if it names one.
pub(super) fn split_synchronous(url: &str) -> Result<(String, Option<Synchronous>), StoreError> {
    split(url).map_err(StoreError::Unavailable)
}

/// The durability a SQLite url's own `synchronous=` asks for, if it names one: what
/// `[store] sync` must agree with. The error says why the url's level is refused.
pub fn url_durability(url: &str) -> Result<Option<Durability>, String> {
    Ok(split(url)?.1.map(Synchronous::durability))
}

fn split(url: &str) -> Result<(String, Option<Synchronous>), String> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), None));
    };
    let mut synchronous = None;
    let mut rest = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("synchronous", value)) => {
                synchronous = Some(Synchronous::parse(value).ok_or_else(|| {
                    format!("synchronous={value}: use full, normal or extra (off would lose acknowledged records)")
                })?)
            }
            _ => rest.push(pair),
        }
    }
    let url = if rest.is_empty() { base.to_string() } else { format!("{base}?{}", rest.join("&")) };
    Ok((url, synchronous))
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
    fn the_url_decides_the_level_where_it_names_one_and_the_key_elsewhere() {
        assert_eq!(Synchronous::chosen(None, Durability::Full), Synchronous::Full);
        assert_eq!(Synchronous::chosen(None, Durability::Normal), Synchronous::Normal);
        assert_eq!(Synchronous::chosen(Some(Synchronous::Extra), Durability::Full), Synchronous::Extra);
        assert_eq!(url_durability("sqlite://idem.db?synchronous=extra").unwrap(), Some(Durability::Full));
        assert_eq!(url_durability("sqlite://idem.db?synchronous=NORMAL").unwrap(), Some(Durability::Normal));
        assert_eq!(url_durability("sqlite://idem.db").unwrap(), None);
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
