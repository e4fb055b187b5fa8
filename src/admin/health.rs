//! `idem health`: whether the node a config describes is alive (or ready), asked on this host's
//! admin listener as a container's health check asks it, with no tool but the binary itself.

use std::time::Duration;

use crate::config::Config;

/// How long the node has to answer.
const WITHIN: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("the node at {url} did not answer: {}", crate::observe::logs::in_one_line(cause))]
    Unreachable { url: String, cause: reqwest::Error },
    #[error("the node at {url} answered {status}: {body}")]
    Unhealthy { url: String, status: u16, body: String },
}

/// Asks `/healthz` (`/readyz` when `ready`) of the admin listener `config` names, on this host:
/// its port, and the loopback address of its family when it listens on every address. Over TLS
/// when the listener has a certificate, without checking it (a health check asks its own host).
pub async fn ask(config: &Config, ready: bool) -> Result<String, HealthError> {
    let mut addr = config.server.admin_listen;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let scheme = if config.server.admin_tls.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{addr}/{}", if ready { "readyz" } else { "healthz" });
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(WITHIN)
        .danger_accept_invalid_certs(true)
        .build()
        .map_err(|cause| HealthError::Unreachable { url: url.clone(), cause })?;
    let answer = http.get(&url).send().await.map_err(|cause| HealthError::Unreachable { url: url.clone(), cause })?;
    let status = answer.status().as_u16();
    let body = answer.text().await.unwrap_or_default().trim().to_string();
    match status {
        200 => Ok(body),
        _ => Err(HealthError::Unhealthy { url, status, body }),
    }
}
