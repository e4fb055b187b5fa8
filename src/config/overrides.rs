//! Keys of the configuration file overridden from the environment (docs/configuration.md): a
//! variable `IDEM_<TABLE>__<KEY>` sets `<key>` of `[<table>]` (`IDEM_STORE__URL`,
//! `IDEM_WORKER__LEASE`, `IDEM_SERVER__LIMITS__MAX_CONNECTIONS` for a table within a table),
//! over what the file says. Routes, a list of tables, are the file's alone. A value is read as
//! TOML when it is one (`64`, `true`, `["a", "b"]`) and as a string otherwise (`15s`,
//! `postgres://…`). Precedence: a command-line flag, then the environment, then the file, then
//! the default.

use super::{syntax, ConfigError};

/// The prefix of an override's name, and what separates the table from the key.
const PREFIX: &str = "IDEM_";
const SEPARATOR: &str = "__";

/// `text` with the overrides among `vars` applied; `text` itself when there are none, so that
/// an error's line is the file's.
pub(super) fn apply(text: &str, vars: impl Iterator<Item = (String, String)>) -> Result<String, ConfigError> {
    let mut overrides: Vec<(Vec<String>, String)> = vars
        .filter_map(|(name, value)| {
            let path = name.strip_prefix(PREFIX)?;
            path.contains(SEPARATOR).then(|| (path.split(SEPARATOR).map(str::to_ascii_lowercase).collect(), value))
        })
        .collect();
    if overrides.is_empty() {
        return Ok(text.to_string());
    }
    overrides.sort();
    let mut table: toml::Table = toml::from_str(text).map_err(|e| syntax(text, &e))?;
    for (path, value) in overrides {
        let name = format!("{PREFIX}{}", path.join(SEPARATOR).to_ascii_uppercase());
        set(&mut table, &path, value_of(&value)).map_err(|why| ConfigError::Invalid {
            key: path.join("."),
            problem: format!("cannot be set from {name}: {why}"),
        })?;
    }
    Ok(table.to_string())
}

/// `value` as TOML when it reads as a value, or as a string.
fn value_of(value: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()))
}

/// Sets `path` (tables, then a key) in `table`, making the tables it lacks.
fn set(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    let (key, tables) = path.split_last().ok_or("no key")?;
    if key.is_empty() || tables.iter().any(String::is_empty) {
        return Err("an empty name between its `__`".into());
    }
    let mut at = table;
    for name in tables {
        let entry = at.entry(name.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        at = match entry {
            toml::Value::Table(inner) => inner,
            _ => return Err(format!("`{name}` is not a table")),
        };
    }
    at.insert(key.clone(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Iterator<Item = (String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>().into_iter()
    }

    #[test]
    fn a_variable_with_a_double_underscore_sets_its_key_over_the_file() {
        let file = "[store]\nurl = \"sqlite://a.db\"\n[worker]\nlease = \"15s\"\n";
        let text = apply(
            file,
            vars(&[
                ("IDEM_STORE__URL", "postgres://idem@db/idem"),
                ("IDEM_WORKER__CONCURRENCY", "8"),
                ("IDEM_SERVER__LIMITS__MAX_CONNECTIONS", "100"),
                ("IDEM_ADMIN_TOKEN", "not a key: no double underscore"),
                ("PATH", "/bin"),
            ]),
        )
        .unwrap();
        let table: toml::Table = toml::from_str(&text).unwrap();
        assert_eq!(table["store"]["url"].as_str(), Some("postgres://idem@db/idem"));
        assert_eq!(table["worker"]["lease"].as_str(), Some("15s"), "the file's, where not overridden");
        assert_eq!(table["worker"]["concurrency"].as_integer(), Some(8), "read as TOML");
        assert_eq!(table["server"]["limits"]["max_connections"].as_integer(), Some(100), "tables made");
        assert!(!text.contains("not a key"));
    }

    #[test]
    fn without_overrides_the_file_is_read_as_it_is() {
        let file = "# a comment\n[store]\nurl = \"sqlite://a.db\"\n";
        assert_eq!(apply(file, vars(&[("IDEM_ADMIN_URL", "http://x")])).unwrap(), file);
    }

    #[test]
    fn an_override_through_a_value_that_is_not_a_table_is_refused_naming_the_variable() {
        let e = apply("[store]\nurl = \"sqlite://a.db\"\n", vars(&[("IDEM_STORE__URL__HOST", "x")])).unwrap_err();
        let said = e.to_string();
        assert!(
            said.contains("store.url.host") && said.contains("IDEM_STORE__URL__HOST") && said.contains("not a table"),
            "{said}"
        );
        let e = apply("", vars(&[("IDEM_STORE____URL", "x")])).unwrap_err().to_string();
        assert!(e.contains("an empty name"), "{e}");
    }

    proptest::proptest! {
        /// Whatever the environment holds, applying it answers (a text or an error), never panics.
        #[test]
        fn any_environment_is_applied_or_refused_never_a_panic(
            pairs in proptest::collection::vec(("IDEM_[A-Z_]{0,12}", "\\PC{0,20}"), 0..6)
        ) {
            let _ = apply("[store]\nurl = \"sqlite://a.db\"\n", pairs.into_iter());
        }
    }
}
