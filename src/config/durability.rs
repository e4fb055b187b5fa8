//! `[store] sync`: what a commit survives before it counts (docs/guarantees.md#power-loss-and-store-sync).

use super::{invalid, ConfigError};
use crate::store::Durability;

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
    crate::store::sqlite::url_durability(url).map_err(|reason| invalid("store.url", reason))
}
