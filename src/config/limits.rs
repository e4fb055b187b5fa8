//! The `[server]` limits that keep misbehaving clients from starving the others (docs/security.md): how
//! long a client may take to send its request, how many connections it may hold open, and how
//! many request bytes the broker holds in memory at once.

use std::time::Duration;

use super::raw::{duration, positive, RawServer};
use super::{invalid, ConfigError, Route};

/// A client that takes longer than this to send a request head or to continue its body is not
/// slow but absent or hostile; a larger setting would let it hold its connection that long.
const MAX_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// More open connections than this in one process is a typo, not a plan.
const MAX_CONNECTIONS: usize = 1_000_000;

#[derive(Debug, Clone, PartialEq)]
pub struct EdgeLimits {
    /// Time to receive a request's complete head, counted from the moment the connection is
    /// ready for one: a slow head is cut, and so is a keep-alive connection left idle.
    pub header_timeout: Duration,
    /// The longest silence allowed between two parts of a request body: a stalled upload holds
    /// a connection and a reservation of the body budget, so it is cut (408).
    pub body_timeout: Duration,
    /// Open client connections on the data listener. `None` derives it at start from the
    /// open-file limit (see `edge::process`), the way HAProxy derives its `maxconn`.
    pub max_connections: Option<usize>,
    /// Open connections on the admin listener, a budget of its own: health checks and metrics
    /// keep answering while the data plane is full.
    pub admin_max_connections: usize,
    /// Request body bytes the data plane holds in memory at once, over all requests.
    pub max_buffered_bodies: usize,
}

impl EdgeLimits {
    pub(super) fn validate(raw: &RawServer) -> Result<EdgeLimits, ConfigError> {
        let header_timeout = bounded_timeout("server.header_timeout", raw.header_timeout.as_deref(), "10s")?;
        let body_timeout = bounded_timeout("server.body_timeout", raw.body_timeout.as_deref(), "30s")?;
        let max_connections = match raw.max_connections {
            None => None,
            Some(n) => Some(connections("server.max_connections", Some(n), 1)?),
        };
        let admin_max_connections = connections("server.admin_max_connections", raw.admin_max_connections, 64)?;
        let text = raw.max_buffered_bodies.as_deref().unwrap_or("256MiB");
        let max_buffered_bodies =
            text.parse::<bytesize::ByteSize>().ok().and_then(|size| usize::try_from(size.as_u64()).ok()).ok_or_else(
                || invalid("server.max_buffered_bodies", format!("`{text}` is not a size like \"256MiB\"")),
            )?;
        if max_buffered_bodies == 0 {
            return Err(invalid("server.max_buffered_bodies", "must be greater than zero"));
        }
        Ok(EdgeLimits { header_timeout, body_timeout, max_connections, admin_max_connections, max_buffered_bodies })
    }

    /// Every route's largest body must fit in the budget, or such a request could never be read.
    pub(super) fn check_routes(&self, routes: &[Route]) -> Result<(), ConfigError> {
        match routes.iter().enumerate().find(|(_, r)| r.max_body > self.max_buffered_bodies) {
            Some((i, route)) => Err(invalid(
                "server.max_buffered_bodies",
                format!(
                    "{} bytes is less than routes[{i}].max_body ({} bytes): such a request could never be accepted",
                    self.max_buffered_bodies, route.max_body
                ),
            )),
            None => Ok(()),
        }
    }

    /// One line for `idem check`.
    pub fn describe(&self) -> String {
        let h = super::described::span;
        let connections = match self.max_connections {
            Some(n) => n.to_string(),
            None => "auto (from the open-file limit)".into(),
        };
        format!(
            "header_timeout {}, body_timeout {}; max_connections {connections}, admin {}; max_buffered_bodies {}",
            h(self.header_timeout),
            h(self.body_timeout),
            self.admin_max_connections,
            super::described::size(self.max_buffered_bodies as u64)
        )
    }
}

fn bounded_timeout(key: &str, value: Option<&str>, default: &str) -> Result<Duration, ConfigError> {
    let d = duration(key, value, default)?;
    if d > MAX_TIMEOUT {
        return Err(invalid(key, format!("must be at most {}", humantime::format_duration(MAX_TIMEOUT))));
    }
    Ok(d)
}

fn connections(key: &str, value: Option<i64>, default: i64) -> Result<usize, ConfigError> {
    let n = positive(key, value, default)?;
    if n > MAX_CONNECTIONS {
        return Err(invalid(key, format!("{n} is beyond any sane bound (at most {MAX_CONNECTIONS})")));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use crate::config::{describe, Config};

    use super::*;

    const ROUTE: &str = "[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"http://127.0.0.1:9000\"\n";

    fn with_server(lines: &str) -> Result<Config, ConfigError> {
        Config::parse_with_env(&format!("[server]\n{lines}\n{ROUTE}"), |_| None)
    }

    fn error_of(lines: &str) -> String {
        with_server(lines).unwrap_err().to_string()
    }

    #[test]
    fn the_limits_have_defaults_a_proxy_operator_expects() {
        let limits = with_server("").unwrap().server.limits;
        assert_eq!(limits.header_timeout, Duration::from_secs(10));
        assert_eq!(limits.body_timeout, Duration::from_secs(30));
        assert_eq!(limits.max_connections, None);
        assert_eq!(limits.admin_max_connections, 64);
        assert_eq!(limits.max_buffered_bodies, 256 * 1024 * 1024);
    }

    #[test]
    fn each_limit_can_be_set() {
        let limits = with_server(
            "header_timeout = \"300ms\"\nbody_timeout = \"2s\"\nmax_connections = 20\nadmin_max_connections = 4\nmax_buffered_bodies = \"4MiB\"",
        )
        .unwrap()
        .server
        .limits;
        assert_eq!(limits.header_timeout, Duration::from_millis(300));
        assert_eq!(limits.body_timeout, Duration::from_secs(2));
        assert_eq!(limits.max_connections, Some(20));
        assert_eq!(limits.admin_max_connections, 4);
        assert_eq!(limits.max_buffered_bodies, 4 * 1024 * 1024);
    }

    #[test]
    fn bad_limits_name_their_key() {
        for (line, key) in [
            ("header_timeout = \"soon\"", "server.header_timeout"),
            ("header_timeout = \"0s\"", "server.header_timeout"),
            ("header_timeout = \"1h\"", "server.header_timeout"),
            ("body_timeout = \"-1s\"", "server.body_timeout"),
            ("body_timeout = \"6m\"", "server.body_timeout"),
            ("max_connections = 0", "server.max_connections"),
            ("max_connections = -5", "server.max_connections"),
            ("max_connections = 50000000", "server.max_connections"),
            ("admin_max_connections = 0", "server.admin_max_connections"),
            ("max_buffered_bodies = \"lots\"", "server.max_buffered_bodies"),
            ("max_buffered_bodies = \"0B\"", "server.max_buffered_bodies"),
        ] {
            let e = error_of(line);
            assert!(e.contains(key), "{line}: {e}");
        }
        let e = error_of("max_connections = \"many\"");
        assert!(e.contains("max_connections"), "{e}");
    }

    #[test]
    fn a_body_budget_smaller_than_a_route_body_is_refused() {
        let e = error_of("max_buffered_bodies = \"512KiB\"");
        assert!(e.contains("server.max_buffered_bodies") && e.contains("routes[0].max_body"), "{e}");
        assert!(with_server("max_buffered_bodies = \"1MiB\"").is_ok());
    }

    #[test]
    fn check_shows_the_limits() {
        let out = describe(&with_server("max_connections = 20").unwrap());
        assert!(out.contains("header_timeout 10s, body_timeout 30s"), "{out}");
        assert!(out.contains("max_connections 20, admin 64"), "{out}");
        assert!(out.contains("max_buffered_bodies 256MiB"), "{out}");
        let out = describe(&with_server("").unwrap());
        assert!(out.contains("max_connections auto"), "{out}");
    }
}
