//! `[store] sync`, and how it meets a SQLite url's own `?synchronous=`.

use super::*;
use crate::config::Durability;

fn with_store(lines: &str) -> String {
    format!("[store]\n{lines}\n{MINIMAL}")
}

fn sync_of(lines: &str) -> Durability {
    Config::parse_with_env(&with_store(lines), no_env).unwrap().store.sync
}

#[test]
fn store_sync_is_full_unless_set_to_normal_and_idem_check_shows_it() {
    assert_eq!(Config::parse_with_env(MINIMAL, no_env).unwrap().store.sync, Durability::Full);
    assert_eq!(sync_of("sync = \"full\""), Durability::Full);
    assert_eq!(sync_of("sync = \"normal\""), Durability::Normal);
    let said = describe(&Config::parse_with_env(&with_store("sync = \"normal\""), no_env).unwrap());
    assert!(said.contains("store sync    normal (survives a crash of the process"), "{said}");
    let said = describe(&Config::parse_with_env(MINIMAL, no_env).unwrap());
    assert!(said.contains("store sync    full (every commit synced to disk"), "{said}");
}

#[test]
fn a_bad_store_sync_is_refused_by_its_key() {
    for bad in ["\"fast\"", "\"off\"", "\"FULL\"", "\"\"", "1", "true", "[\"full\"]"] {
        let e = error_of(&with_store(&format!("sync = {bad}")));
        assert!(e.starts_with("config key `store.sync`: "), "{bad}: {e}");
        assert!(e.contains("\"full\", \"normal\""), "{bad}: {e}");
    }
}

#[test]
fn normal_is_refused_on_postgresql_saying_what_it_would_lose() {
    assert_eq!(sync_of("url = \"postgres://idem@db/idem\"\nsync = \"full\""), Durability::Full);
    let e = error_of(&with_store("url = \"postgres://idem@db/idem\"\nsync = \"normal\""));
    assert!(e.starts_with("config key `store.sync`: `normal` is for SQLite only"), "{e}");
    assert!(e.contains("crash of the database server") && e.contains("execute again"), "{e}");
}

#[test]
fn a_sqlite_urls_synchronous_decides_unless_store_sync_disagrees() {
    assert_eq!(sync_of("url = \"sqlite://idem.db?synchronous=normal\""), Durability::Normal);
    assert_eq!(sync_of("url = \"sqlite://idem.db?synchronous=extra\""), Durability::Full);
    assert_eq!(sync_of("url = \"sqlite://idem.db?synchronous=normal\"\nsync = \"normal\""), Durability::Normal);
    assert_eq!(sync_of("url = \"sqlite://idem.db?synchronous=extra\"\nsync = \"full\""), Durability::Full);
    for (synchronous, sync) in [("full", "normal"), ("extra", "normal"), ("normal", "full")] {
        let e =
            error_of(&with_store(&format!("url = \"sqlite://idem.db?synchronous={synchronous}\"\nsync = \"{sync}\"")));
        assert!(e.starts_with("config key `store.sync`: ") && e.contains("disagrees"), "{e}");
    }
    let e = error_of(&with_store("url = \"sqlite://idem.db?synchronous=off\""));
    assert!(e.starts_with("config key `store.url`: ") && e.contains("synchronous=off"), "{e}");
}
