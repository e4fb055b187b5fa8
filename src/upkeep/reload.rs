//! Reloading the configuration without a restart (docs/configuration.md): on `SIGHUP` or `POST
//! /admin/config/reload` the file the broker was started with is read again and validated
//! completely, by the same loader as `idem check`; then it is applied whole, or refused whole and
//! the running configuration kept.
//!
//! Applied, it serves every request that arrives from then on, and every background pass (probes,
//! take-overs, the retention sweep) that starts. Executions already running keep the route and
//! policy they started with (see [`crate::worker`]): a record's attempts never change policy
//! half-way, and a route that was removed still lets its records in flight finish.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use crate::config::{self, Changes, Config, ConfigError};
use crate::edge::tls::Certificates;
use crate::observe::metrics;
use crate::runtime::Live;
use crate::upstream::Upstream;

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("this broker was started without a config file: there is nothing to read again")]
    NoFile,
    #[error(transparent)]
    Config(#[from] ConfigError),
}

impl ReloadError {
    /// The configuration key at fault, when there is one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ReloadError::Config(e) => e.key(),
            ReloadError::NoFile => None,
        }
    }

    /// The whole story in one line: the error and what caused it (a file that cannot be read
    /// says why).
    pub fn detail(&self) -> String {
        crate::observe::logs::in_one_line(self)
    }
}

/// A reload that was applied.
#[derive(Debug, Clone)]
pub struct Applied {
    pub changes: Changes,
    /// The configuration now in force.
    pub config: Arc<Config>,
    pub loaded_at: SystemTime,
}

pub struct Reloader {
    /// The file read again; `None` for a broker started from a configuration in memory.
    file: Option<PathBuf>,
    /// The configuration and its routes' runtimes, replaced together.
    config: Arc<Live>,
    /// The listeners' certificates, read again at each reload so that they rotate.
    certificates: Certificates,
    /// Its clients of TLS profiles no route uses any more are dropped.
    upstream: Upstream,
    /// One reload at a time: two at once would each compare the file with a configuration the
    /// other is replacing.
    busy: tokio::sync::Mutex<()>,
}

impl Reloader {
    pub fn new(file: Option<PathBuf>, config: Arc<Live>, certificates: Certificates, upstream: Upstream) -> Reloader {
        metrics::config_loaded(config.loaded_at());
        Reloader { file, config, certificates, upstream, busy: tokio::sync::Mutex::new(()) }
    }

    /// Reads the file again and applies it, or keeps the running configuration and says why.
    /// `trigger` (`SIGHUP`, the admin endpoint) is logged with the outcome.
    pub async fn reload(&self, trigger: &str) -> Result<Applied, ReloadError> {
        let _one_at_a_time = self.busy.lock().await;
        let result = self.apply().await;
        match &result {
            Ok(applied) => {
                metrics::config_reload(true);
                tracing::info!(trigger, changes = %applied.changes.summary(), "configuration reloaded");
            }
            Err(e) => {
                metrics::config_reload(false);
                tracing::warn!(
                    trigger,
                    error = %e.detail(),
                    "configuration reload refused; the running configuration is kept"
                );
            }
        }
        result
    }

    async fn apply(&self) -> Result<Applied, ReloadError> {
        let file = self.file.as_ref().ok_or(ReloadError::NoFile)?;
        // Read as `Config::load` reads it, without holding a runtime thread on the file system.
        let text = tokio::fs::read_to_string(file)
            .await
            .map_err(|source| ConfigError::Read { path: file.display().to_string(), source })?;
        let text = config::overridden(&text, file)?;
        let new = Config::parse(&text).map_err(|e| e.in_file(file))?;
        let mut changes = config::changes(&self.config.current(), &new)?;
        // Read again even when the paths are the same: rotation rewrites the files in place.
        changes.settings.extend(self.certificates.reload(&new)?);
        // The routes and their runtimes in one step: a request reads both or neither.
        let new = Arc::new(new);
        self.config.reconfigure(new.clone());
        // Executions still running under the old configuration make a new client if they need one.
        self.upstream.keep_clients_of(&new);
        let loaded_at = self.config.loaded_at();
        metrics::config_loaded(loaded_at);
        Ok(Applied { changes, config: new, loaded_at })
    }

    /// Reloads on every `SIGHUP` until `turns` end, logging each outcome.
    #[cfg(unix)]
    pub async fn on_hangup(self: Arc<Self>, mut turns: crate::domain::clock::Turns) {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hangups = match signal(SignalKind::hangup()) {
            Ok(hangups) => hangups,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP: reload with POST /admin/config/reload");
                // Nothing to do but wait for the shutdown, as the loop would have.
                turns.next(std::future::pending::<()>()).await;
                return;
            }
        };
        while let Some(Some(())) = turns.next(hangups.recv()).await {
            // The outcome is logged (and counted) by `reload`.
            let _ = self.reload("SIGHUP").await;
        }
    }
}
