//! Which server the store writes to, and following it through a failover
//! (docs/high-availability.md). The health checks ask the serving server, a few times a second,
//! whether it still takes writes and whether it is still the same server; when it fails or has
//! become a standby, the store looks among the URL's hosts for the primary, in the background,
//! and points its pool there.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};

use super::hosts::Hosts;
use super::MAX_CONNECTIONS;
use crate::store::{Serving, StoreError};

/// The server the store writes to, as the health checks last saw it.
pub(super) struct Primary {
    hosts: Hosts,
    pool: PgPool,
    serving: Mutex<Serving>,
    /// When the pool last moved to another host: connections opened before are not used again.
    moved: Arc<Mutex<Option<Instant>>>,
    /// A search for the primary is under way: one at a time.
    looking: AtomicBool,
}

/// What tells one server from another behind one address: a promoted standby starts a new
/// timeline, and any server that starts (a managed service's failover restarts it on another
/// machine, with the same timeline) has a new start time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Identity {
    pub(super) timeline: String,
    pub(super) started: String,
}

/// What a health check found.
pub(super) enum Found {
    Primary(Identity),
    Standby,
}

impl Primary {
    /// Connects to the host of `hosts` that takes writes, with a pool of connections there.
    pub(super) async fn connect(hosts: Hosts) -> Result<Arc<Primary>, StoreError> {
        let (host, options) = hosts.pick().await?;
        let moved = Arc::new(Mutex::new(None));
        let pool = pool(options, moved.clone()).await?;
        let identity = match ask(&mut *pool.acquire().await?).await? {
            Found::Primary(identity) => Some(identity),
            Found::Standby => None,
        };
        let serving = Serving {
            host,
            timeline: identity.as_ref().map(|i| i.timeline.clone()),
            started: identity.map(|i| i.started),
            changes: 0,
        };
        Ok(Arc::new(Primary { hosts, pool, serving: Mutex::new(serving), moved, looking: AtomicBool::new(false) }))
    }

    pub(super) fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub(super) fn serving(&self) -> Serving {
        lock(&self.serving).clone()
    }

    /// Takes in what a health check on the serving server found (`Err`: it could not ask). A
    /// primary whose identity changed counts as a change of server; a standby, or a server that
    /// cannot be asked when the URL names several, starts a search for the primary.
    pub(super) fn checked(self: &Arc<Self>, found: &Result<Found, StoreError>) {
        match found {
            Ok(Found::Primary(identity)) => {
                let mut serving = lock(&self.serving);
                let known = serving.timeline.as_deref().zip(serving.started.as_deref());
                if known.is_some_and(|(t, s)| (t, s) != (identity.timeline.as_str(), identity.started.as_str())) {
                    tracing::warn!(
                        host = %serving.host,
                        timeline = %identity.timeline,
                        started = %identity.started,
                        "the store's server changed behind its address (a promotion, or a restart)"
                    );
                    serving.changes += 1;
                }
                serving.timeline = Some(identity.timeline.clone());
                serving.started = Some(identity.started.clone());
            }
            Ok(Found::Standby) => self.look(),
            Err(_) if self.hosts.several() => self.look(),
            Err(_) => {}
        }
    }

    /// Looks for the primary among the URL's hosts in the background, unless a search is under
    /// way: the health check that asked for it must not wait on hosts that do not answer.
    fn look(self: &Arc<Self>) {
        if self.looking.swap(true, Ordering::AcqRel) {
            return;
        }
        let primary = self.clone();
        tokio::spawn(async move {
            if let Err(e) = primary.follow().await {
                e.log("looking for the store's primary failed; will look again");
            }
            primary.looking.store(false, Ordering::Release);
        });
    }

    /// Points the pool at the host that takes writes now, if another. The connections opened to
    /// the old one are not used again (some may still answer, as a standby's would, refusing
    /// every write).
    async fn follow(&self) -> Result<(), StoreError> {
        let (host, options) = self.hosts.pick().await?;
        let from = {
            let mut serving = lock(&self.serving);
            if serving.host == host {
                return Ok(());
            }
            let from = std::mem::replace(&mut serving.host, host.clone());
            // The new host's identity is read by the next health check, without counting twice.
            (serving.timeline, serving.started) = (None, None);
            serving.changes += 1;
            from
        };
        self.pool.set_connect_options(options);
        *lock(&self.moved) = Some(Instant::now());
        tracing::warn!(%from, to = %host, "the store's primary moved: connecting there from now on");
        // A connection to the old server that was being made as the pool moved is made by now:
        // no connection older than this is used again either (those to the new server are made
        // again, once).
        let moved = self.moved.clone();
        tokio::spawn(async move {
            tokio::time::sleep(super::hosts::ASK_WITHIN).await;
            *lock(&moved) = Some(Instant::now());
        });
        Ok(())
    }
}

/// Asks the server on `conn` whether it is a standby and, if not, who it is.
pub(super) async fn ask(conn: &mut PgConnection) -> Result<Found, StoreError> {
    let (standby, timeline, started): (bool, Option<String>, String) = sqlx::query_as(
        "SELECT pg_is_in_recovery(),
                CASE WHEN pg_is_in_recovery() THEN NULL
                     ELSE substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) END,
                to_char(pg_postmaster_start_time() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
    )
    .fetch_one(conn)
    .await?;
    Ok(match (standby, timeline) {
        (false, Some(timeline)) => Found::Primary(Identity { timeline, started }),
        _ => Found::Standby,
    })
}

/// The pool of the store's connections to the server `connect` names, and to whichever it is
/// pointed at later ([`Primary::follow`]): a connection opened before the last move (`moved`) is
/// closed rather than used.
async fn pool(connect: PgConnectOptions, moved: Arc<Mutex<Option<Instant>>>) -> Result<PgPool, StoreError> {
    Ok(PgPoolOptions::new()
        .max_connections(MAX_CONNECTIONS)
        .before_acquire(move |_, meta| {
            let opened_before_move = lock(&moved).is_some_and(|at| meta.age > at.elapsed());
            Box::pin(async move { Ok(!opened_before_move) })
        })
        .connect_with(connect)
        .await?)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
