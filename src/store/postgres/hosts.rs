//! The hosts a PostgreSQL store URL names, libpq's way: `postgres://user@h1:5432,h2:5432/db?
//! target_session_attrs=read-write` (docs/high-availability.md). sqlx takes one host and ignores
//! `target_session_attrs`, so the store picks the host itself: it asks each in turn, in the
//! order given, whether it takes writes, and connects its pool there. When the connections die
//! (a failover), it asks again and points the pool at the new primary, without a restart.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::Connection;

use crate::store::StoreError;

/// Which host of several the store connects to: libpq's `target_session_attrs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// The first host that accepts a connection (`any`): one endpoint that always leads to the
    /// primary, as a managed service's does.
    Any,
    /// The first that takes writes (`read-write`, or `primary`: the same to a store that only
    /// ever writes).
    ReadWrite,
}

/// The hosts of a store URL, each with the URL's other settings, and which one to pick.
#[derive(Debug, Clone)]
pub(crate) struct Hosts {
    /// Each host's connection options, in the URL's order, with its name as `host:port`.
    hosts: Vec<(String, PgConnectOptions)>,
    pub(crate) target: Target,
    /// The authority the URL trusts for the servers' certificates (`sslrootcert`), named when
    /// a certificate is refused.
    authority: Option<String>,
}

/// `sslmode` as libpq spells it.
const SSL_MODES: [&str; 6] = ["disable", "allow", "prefer", "require", "verify-ca", "verify-full"];

/// How long asking one host may take before the next is asked.
pub(super) const ASK_WITHIN: Duration = Duration::from_secs(5);

impl Hosts {
    /// Reads a store URL with one host or several (`h1:5432,h2:5432`), and its
    /// `target_session_attrs` (`read-write` when there are several and it says nothing).
    pub(crate) fn parse(url: &str) -> Result<Hosts, StoreError> {
        let bad = |why: String| StoreError::Unavailable(format!("bad postgres url: {why}"));
        let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("no `postgres://`".into()))?;
        let (authority, tail) = match rest.find(['/', '?']) {
            Some(at) => rest.split_at(at),
            None => (rest, ""),
        };
        let (user, hostlist) = match authority.rsplit_once('@') {
            Some((user, hosts)) => (Some(user), hosts),
            None => (None, authority),
        };
        let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
        let (mut target, mut tls_authority) = (None, None);
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("target_session_attrs", value)) => target = Some(target_of(value)?),
                Some(("sslrootcert", value)) => {
                    tls_authority = Some(value.to_string());
                    kept.push(pair);
                }
                Some(("sslmode", value)) if !SSL_MODES.contains(&value) => {
                    return Err(bad(format!("sslmode={value} is not a mode: give one of {}", SSL_MODES.join(", "))));
                }
                _ => kept.push(pair),
            }
        }
        if !hostlist.contains(',') {
            // One host, or none (a socket, `?host=/run/postgresql`): the URL as the driver reads it.
            let query = if kept.is_empty() { String::new() } else { format!("?{}", kept.join("&")) };
            let options = PgConnectOptions::from_str(&format!("{scheme}://{authority}{path}{query}"))
                .map_err(|e| bad(e.to_string()))?;
            let name = name_of(&options);
            return Ok(Hosts {
                hosts: vec![(name, options)],
                target: target.unwrap_or(Target::Any),
                authority: tls_authority,
            });
        }
        let names = split_hosts(hostlist);
        if names.iter().any(|h| h.is_empty()) {
            return Err(bad(format!("an empty host in `{hostlist}`")));
        }
        let several = names.len() > 1;
        let query = if kept.is_empty() { String::new() } else { format!("?{}", kept.join("&")) };
        let hosts = names
            .into_iter()
            .map(|host| {
                let user = user.map(|u| format!("{u}@")).unwrap_or_default();
                let one = format!("{scheme}://{user}{host}{path}{query}");
                let options = PgConnectOptions::from_str(&one).map_err(|e| bad(e.to_string()))?;
                let name = name_of(&options);
                Ok((name, options))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let target = target.unwrap_or(if several { Target::ReadWrite } else { Target::Any });
        Ok(Hosts { hosts, target, authority: tls_authority })
    }

    /// Each host's options with `change` made to them (the protocol each connection declares, say).
    pub(crate) fn map(mut self, change: impl Fn(PgConnectOptions) -> PgConnectOptions) -> Hosts {
        self.hosts = self.hosts.into_iter().map(|(name, options)| (name, change(options))).collect();
        self
    }

    pub(crate) fn several(&self) -> bool {
        self.hosts.len() > 1
    }

    /// The host to connect to: the first (in the URL's order) that accepts a connection and, for
    /// [`Target::ReadWrite`], is not a standby. Each refusal is named in the error when none will
    /// do, with its cause (refused, not found, a certificate, a password) and what to do.
    pub(crate) async fn pick(&self) -> Result<(String, PgConnectOptions), StoreError> {
        // Every host is asked at once, so that one that does not answer delays nothing beyond
        // ASK_WITHIN; the answers are taken in the URL's order.
        let asks: Vec<_> = self
            .hosts
            .iter()
            .map(|(_, options)| tokio::spawn(tokio::time::timeout(ASK_WITHIN, takes_writes(options.clone()))))
            .collect();
        let mut refusals = Vec::new();
        // With `any`, a standby that answers serves only if no host takes writes: a store that
        // writes is better served by a primary, and one found on a standby looks again.
        let mut standby = None;
        for ((name, options), ask) in self.hosts.iter().zip(asks) {
            match ask.await {
                Ok(Ok(Ok(true))) => return Ok((name.clone(), options.clone())),
                Ok(Ok(Ok(false))) if self.target == Target::Any => {
                    standby.get_or_insert_with(|| (name.clone(), options.clone()));
                }
                Ok(Ok(Ok(false))) => refusals.push(format!("{name} is a standby")),
                Ok(Ok(Err(e))) => refusals.push(format!("{name}: {}", self.explain(&e))),
                Ok(Err(_)) => refusals.push(format!("{name} did not answer within {ASK_WITHIN:?}")),
                Err(e) => refusals.push(format!("{name}: {e}")),
            }
        }
        if let Some(standby) = standby {
            return Ok(standby);
        }
        Err(StoreError::Unavailable(match refusals.as_slice() {
            [one] if !self.several() => format!("cannot connect to the store at {one}"),
            _ => format!("no host of the store takes writes: {}", refusals.join("; ")),
        }))
    }

    /// A failed connection's cause, once, and what to do about it.
    fn explain(&self, error: &sqlx::Error) -> String {
        let said = crate::logs::in_one_line(error);
        let remedy = if said.contains("UnknownIssuer") || said.contains("invalid peer certificate") {
            match &self.authority {
                Some(file) => format!("the server's certificate is not issued by the authority in {file} (sslrootcert), or names another host"),
                None => "the server's certificate is not issued by a public authority: name its authority with sslrootcert=/path/ca.crt in the store URL".to_string(),
            }
        } else if said.contains("password authentication failed") {
            "check the role's password (PGPASSWORD or ~/.pgpass)".to_string()
        } else if said.contains("no pg_hba.conf entry") {
            "the server's pg_hba.conf admits no such connection: add a line for this host, role and database (hostssl with TLS)".to_string()
        } else if said.contains("lookup address") || said.contains("Name or service not known") {
            "the host name does not resolve".to_string()
        } else if said.contains("Connection refused") {
            "nothing listens there: is the server running, on that port?".to_string()
        } else {
            return said;
        };
        format!("{said}; {remedy}")
    }
}

/// Whether the server at `options` takes writes: not a standby in recovery.
async fn takes_writes(options: PgConnectOptions) -> Result<bool, sqlx::Error> {
    let mut conn = PgConnection::connect_with(&options).await?;
    let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()").fetch_one(&mut conn).await?;
    let _ = conn.close().await;
    Ok(!standby)
}

/// A host as the store names it: `host:port`, or a socket's directory.
fn name_of(options: &PgConnectOptions) -> String {
    match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    }
}

/// `target_session_attrs`, as a store that writes can take it.
fn target_of(value: &str) -> Result<Target, StoreError> {
    match value {
        "any" => Ok(Target::Any),
        "read-write" | "primary" => Ok(Target::ReadWrite),
        other => Err(StoreError::Unavailable(format!(
            "bad postgres url: target_session_attrs={other}: Idem writes to its store, so it takes `read-write` \
             (or `primary`), or `any` for one endpoint that always leads to the primary"
        ))),
    }
}

/// `h1:5432,[::1]:5433,h3` → each host, with its port if it has one (brackets kept for sqlx).
fn split_hosts(list: &str) -> Vec<&str> {
    list.split(',').collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_of_several_hosts_is_one_url_per_host_with_the_rest_kept() {
        let hosts = Hosts::parse(
            "postgres://idem:secret@db1:5432,db2:6543,[::1]/idem?sslmode=disable&target_session_attrs=read-write",
        )
        .unwrap();
        let names: Vec<&str> = hosts.hosts.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["db1:5432", "db2:6543", "[::1]:5432"]);
        assert_eq!(hosts.target, Target::ReadWrite);
        for (_, options) in &hosts.hosts {
            assert_eq!((options.get_username(), options.get_database()), ("idem", Some("idem")));
        }
    }

    #[test]
    fn target_session_attrs_defaults_to_read_write_for_several_hosts_and_any_for_one() {
        assert_eq!(Hosts::parse("postgres://u@a,b/db").unwrap().target, Target::ReadWrite);
        assert_eq!(Hosts::parse("postgres://u@a/db").unwrap().target, Target::Any);
        assert_eq!(Hosts::parse("postgres://u@a/db?target_session_attrs=primary").unwrap().target, Target::ReadWrite);
        assert_eq!(Hosts::parse("postgres://u@a,b/db?target_session_attrs=any").unwrap().target, Target::Any);
        assert!(!Hosts::parse("postgresql://u@a").unwrap().several());
    }

    #[test]
    fn a_target_that_cannot_take_writes_or_an_empty_host_is_refused_saying_why() {
        let standby = Hosts::parse("postgres://u@a,b/db?target_session_attrs=standby").unwrap_err().to_string();
        assert!(standby.contains("target_session_attrs=standby") && standby.contains("read-write"), "{standby}");
        let prefer = Hosts::parse("postgres://u@a,b/db?target_session_attrs=prefer-standby").unwrap_err().to_string();
        assert!(prefer.contains("prefer-standby"), "{prefer}");
        // A socket, as the driver reads one: its directory percent-encoded as the host.
        let socket = Hosts::parse("postgres://idem@%2Frun%2Fpostgresql/idem").unwrap();
        assert!(!socket.several() && socket.hosts[0].0.starts_with("/run/postgresql"), "{:?}", socket.hosts[0].0);
        let empty = Hosts::parse("postgres://u@a,,b/db").unwrap_err().to_string();
        assert!(empty.contains("an empty host"), "{empty}");
        let mode = Hosts::parse("postgres://u@a/db?sslmode=verify_full").unwrap_err().to_string();
        assert!(mode.contains("sslmode=verify_full is not a mode") && mode.contains("verify-full"), "{mode}");
        assert_eq!(mode.matches("verify_full").count(), 1, "said once: {mode}");
    }

    proptest::proptest! {
        /// Whatever follows the scheme, reading a URL answers (an error or hosts), never panics.
        #[test]
        fn any_url_is_read_or_refused_never_a_panic(rest in "\\PC{0,80}") {
            let _ = Hosts::parse(&format!("postgres://{rest}"));
        }

        /// Every host of a list comes back, in its order, with its port or 5432.
        #[test]
        fn every_host_of_a_list_is_kept_in_order(
            hosts in proptest::collection::vec(("[a-z][a-z0-9]{0,7}", proptest::option::of(1u16..)), 1..5)
        ) {
            let list: Vec<String> = hosts
                .iter()
                .map(|(h, p)| p.map_or_else(|| h.clone(), |p| format!("{h}:{p}")))
                .collect();
            let parsed = Hosts::parse(&format!("postgres://idem@{}/db?sslmode=disable", list.join(","))).unwrap();
            let names: Vec<String> = parsed.hosts.iter().map(|(n, _)| n.clone()).collect();
            let want: Vec<String> = hosts.iter().map(|(h, p)| format!("{h}:{}", p.unwrap_or(5432))).collect();
            proptest::prop_assert_eq!(names, want);
            proptest::prop_assert_eq!(parsed.several(), hosts.len() > 1);
        }
    }
}
