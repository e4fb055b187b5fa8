//! `[store] sync`: what a commit survives before it counts (docs/guarantees.md#power-loss-and-store-sync).

use super::{invalid, ConfigError};

/// What a commit survives before the store counts it (docs/guarantees.md#power-loss-and-store-sync).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// Synced to disk before it counts: it survives a power loss.
    #[default]
    Full,
    /// Handed to the operating system before it counts: it survives the process's crash, but
    /// the last commits may be lost with the machine (power loss, kernel crash).
    Normal,
}

impl Durability {
    /// The value of `[store] sync` that names it.
    pub fn parse(text: &str) -> Option<Durability> {
        match text {
            "full" => Some(Durability::Full),
            "normal" => Some(Durability::Normal),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Full => "full",
            Durability::Normal => "normal",
        }
    }
}

impl std::fmt::Display for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// SQLite's `PRAGMA synchronous` levels the store runs with. `OFF` is not one: it would lose
/// commits on power loss even past a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Synchronous {
    Normal,
    Full,
    Extra,
}

impl Synchronous {
    /// The level a url's own `synchronous=` names, else the one `sync` asks for.
    pub(crate) fn chosen(url: Option<Synchronous>, sync: Durability) -> Synchronous {
        url.unwrap_or(match sync {
            Durability::Full => Synchronous::Full,
            Durability::Normal => Synchronous::Normal,
        })
    }

    pub(crate) fn pragma(self) -> &'static str {
        match self {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
            Synchronous::Extra => "EXTRA",
        }
    }

    pub(crate) fn durability(self) -> Durability {
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

/// The durability a SQLite url's own `synchronous=` asks for, if it names one: what
/// `[store] sync` must agree with. The error says why the url's level is refused.
pub(crate) fn sqlite_url_durability(url: &str) -> Result<Option<Durability>, String> {
    Ok(split_synchronous(url)?.1.map(Synchronous::durability))
}

/// Takes `synchronous=` out of a SQLite url (the driver does not know it): the url left, and
/// the level it names, if it names one. The error says why the url's level is refused.
pub(crate) fn split_synchronous(url: &str) -> Result<(String, Option<Synchronous>), String> {
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

/// The durability `[store] sync` asks for. A SQLite url's own `synchronous=`, from before the
/// key, decides where the key is not set, so that such a file keeps its meaning; where both are
/// set they must agree, or one of them would be silently ignored.
///
/// `"normal"` is refused on PostgreSQL. There it could only mean `synchronous_commit = off`,
/// whose commits are lost not with the machine alone but with any crash of the database server:
/// one backend killed (by the OOM killer, say) restarts them all, and the WAL not yet written
/// goes. A client told an answer would then find no record of it and execute it again.
pub(super) fn validate(key: Option<&toml::Value>, url: &str) -> Result<Durability, ConfigError> {
    let asked = key.map(parse).transpose()?;
    if asked == Some(Durability::Normal) && !url.starts_with("sqlite:") {
        return Err(invalid(
            "store.sync",
            "`normal` is for SQLite only: on PostgreSQL it would turn synchronous_commit off, and any crash of \
             the database server (one backend killed by the OOM killer is enough) would lose the last commits, \
             answers told included, so that their keys execute again; remove the key (\"full\" is the default)",
        ));
    }
    let in_url = url_durability(url)?;
    match (asked, in_url) {
        (Some(asked), Some(in_url)) if asked != in_url => Err(invalid(
            "store.sync",
            format!(
                "`{asked}` disagrees with the `synchronous=` of store.url, which asks for {in_url}: \
                 set it in one place (store.sync is the documented one)"
            ),
        )),
        (asked, in_url) => Ok(asked.or(in_url).unwrap_or_default()),
    }
}

fn parse(value: &toml::Value) -> Result<Durability, ConfigError> {
    let not_one = |what: String| invalid("store.sync", format!("{what} is not one of \"full\", \"normal\""));
    let text = value.as_str().ok_or_else(|| not_one(format!("{value} ({})", value.type_str())))?;
    Durability::parse(text).ok_or_else(|| not_one(format!("`{text}`")))
}

fn url_durability(url: &str) -> Result<Option<Durability>, ConfigError> {
    if !url.starts_with("sqlite:") {
        return Ok(None);
    }
    sqlite_url_durability(url).map_err(|reason| invalid("store.url", reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_parses_back_from_its_name() {
        for sync in [Durability::Full, Durability::Normal] {
            assert_eq!(Durability::parse(sync.as_str()), Some(sync));
        }
        for other in ["fast", "off", "FULL", "", "extra"] {
            assert_eq!(Durability::parse(other), None, "{other}");
        }
        assert_eq!(Durability::default(), Durability::Full);
    }

    #[test]
    fn the_url_decides_the_level_where_it_names_one_and_the_key_elsewhere() {
        assert_eq!(Synchronous::chosen(None, Durability::Full), Synchronous::Full);
        assert_eq!(Synchronous::chosen(None, Durability::Normal), Synchronous::Normal);
        assert_eq!(Synchronous::chosen(Some(Synchronous::Extra), Durability::Full), Synchronous::Extra);
        assert_eq!(sqlite_url_durability("sqlite://idem.db?synchronous=extra").unwrap(), Some(Durability::Full));
        assert_eq!(sqlite_url_durability("sqlite://idem.db?synchronous=NORMAL").unwrap(), Some(Durability::Normal));
        assert_eq!(sqlite_url_durability("sqlite://idem.db").unwrap(), None);
    }
}
