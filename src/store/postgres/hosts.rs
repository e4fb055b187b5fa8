//! The hosts a PostgreSQL store URL names (read by `config::postgres_url`, libpq's way): sqlx
//! takes one host and ignores `target_session_attrs`, so the store picks the host itself: it
//! asks each in turn, in the order given, whether it takes writes, and connects its pool there. When the connections die
//! (a failover), it asks again and points the pool at the new primary, without a restart.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::Connection;

use crate::config::{PostgresUrl, Target};
use crate::store::StoreError;

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

/// How long asking one host may take before the next is asked.
pub(super) const ASK_WITHIN: Duration = Duration::from_secs(5);

impl Hosts {
    /// Reads a store URL with one host or several (`h1:5432,h2:5432`), and its
    /// `target_session_attrs` (`read-write` when there are several and it says nothing).
    pub(crate) fn parse(url: &str) -> Result<Hosts, StoreError> {
        let PostgresUrl { hosts, target, authority } = PostgresUrl::read(url).map_err(StoreError::Unavailable)?;
        Ok(Hosts { hosts, target, authority })
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
        let said = crate::observe::logs::in_one_line(error);
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
