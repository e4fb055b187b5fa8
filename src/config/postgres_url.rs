//! A PostgreSQL store URL read libpq's way: `postgres://user@h1:5432,h2:5432/db?
//! target_session_attrs=read-write` (docs/high-availability.md). sqlx takes one host and ignores
//! `target_session_attrs`, so the URL is read here into one set of connection options per host,
//! and which one to pick; the store asks them (`store::postgres::hosts`). `idem check` refuses
//! what cannot be read, before any connection.

use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;

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

/// A store URL's hosts, each with the URL's other settings, and which one to pick.
#[derive(Debug, Clone)]
pub(crate) struct PostgresUrl {
    /// Each host's connection options, in the URL's order, with its name as `host:port`.
    pub(crate) hosts: Vec<(String, PgConnectOptions)>,
    pub(crate) target: Target,
    /// The authority the URL trusts for the servers' certificates (`sslrootcert`).
    pub(crate) authority: Option<String>,
}

/// `sslmode` as libpq spells it.
const SSL_MODES: [&str; 6] = ["disable", "allow", "prefer", "require", "verify-ca", "verify-full"];

impl PostgresUrl {
    /// Reads a store URL with one host or several (`h1:5432,h2:5432`), and its
    /// `target_session_attrs` (`read-write` when there are several and it says nothing).
    pub(crate) fn read(url: &str) -> Result<PostgresUrl, String> {
        let bad = |why: String| format!("bad postgres url: {why}");
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
            return Ok(PostgresUrl {
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
            .collect::<Result<Vec<_>, String>>()?;
        let target = target.unwrap_or(if several { Target::ReadWrite } else { Target::Any });
        Ok(PostgresUrl { hosts, target, authority: tls_authority })
    }
}

/// A host as the store names it: `host:port`, or a socket's directory.
fn name_of(options: &PgConnectOptions) -> String {
    match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    }
}

/// `target_session_attrs`, as a store that writes can take it.
fn target_of(value: &str) -> Result<Target, String> {
    match value {
        "any" => Ok(Target::Any),
        "read-write" | "primary" => Ok(Target::ReadWrite),
        other => Err(format!(
            "bad postgres url: target_session_attrs={other}: Idem writes to its store, so it takes `read-write` \
             (or `primary`), or `any` for one endpoint that always leads to the primary"
        )),
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
        let hosts = PostgresUrl::read(
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
        assert_eq!(PostgresUrl::read("postgres://u@a,b/db").unwrap().target, Target::ReadWrite);
        assert_eq!(PostgresUrl::read("postgres://u@a/db").unwrap().target, Target::Any);
        assert_eq!(
            PostgresUrl::read("postgres://u@a/db?target_session_attrs=primary").unwrap().target,
            Target::ReadWrite
        );
        assert_eq!(PostgresUrl::read("postgres://u@a,b/db?target_session_attrs=any").unwrap().target, Target::Any);
        assert_eq!(PostgresUrl::read("postgresql://u@a").unwrap().hosts.len(), 1);
    }

    #[test]
    fn a_target_that_cannot_take_writes_or_an_empty_host_is_refused_saying_why() {
        let standby = PostgresUrl::read("postgres://u@a,b/db?target_session_attrs=standby").unwrap_err();
        assert!(standby.contains("target_session_attrs=standby") && standby.contains("read-write"), "{standby}");
        let prefer = PostgresUrl::read("postgres://u@a,b/db?target_session_attrs=prefer-standby").unwrap_err();
        assert!(prefer.contains("prefer-standby"), "{prefer}");
        // A socket, as the driver reads one: its directory percent-encoded as the host.
        let socket = PostgresUrl::read("postgres://idem@%2Frun%2Fpostgresql/idem").unwrap();
        assert!(socket.hosts.len() == 1 && socket.hosts[0].0.starts_with("/run/postgresql"), "{:?}", socket.hosts[0].0);
        let empty = PostgresUrl::read("postgres://u@a,,b/db").unwrap_err();
        assert!(empty.contains("an empty host"), "{empty}");
        let mode = PostgresUrl::read("postgres://u@a/db?sslmode=verify_full").unwrap_err();
        assert!(mode.contains("sslmode=verify_full is not a mode") && mode.contains("verify-full"), "{mode}");
        assert_eq!(mode.matches("verify_full").count(), 1, "said once: {mode}");
    }

    proptest::proptest! {
        /// Whatever follows the scheme, reading a URL answers (an error or hosts), never panics.
        #[test]
        fn any_url_is_read_or_refused_never_a_panic(rest in "\\PC{0,80}") {
            let _ = PostgresUrl::read(&format!("postgres://{rest}"));
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
            let parsed = PostgresUrl::read(&format!("postgres://idem@{}/db?sslmode=disable", list.join(","))).unwrap();
            let names: Vec<String> = parsed.hosts.iter().map(|(n, _)| n.clone()).collect();
            let want: Vec<String> = hosts.iter().map(|(h, p)| format!("{h}:{}", p.unwrap_or(5432))).collect();
            proptest::prop_assert_eq!(names, want);
            proptest::prop_assert_eq!(parsed.hosts.len(), hosts.len());
        }
    }
}
