//! What a reload would change: the settings that can change under a running broker, and the
//! refusal of those that cannot. Pure: the running configuration and the file's, both already
//! validated, in; the changes (or the key that needs a restart) out.

use serde_json::{json, Value};

use super::{invalid, Config, ConfigError, Route};
use crate::domain::PolicyVersion;
use crate::domain::RouteName;

/// Settings the running process was built around: its listeners, whether they speak TLS, their
/// connection budgets and timeouts, the request-body budget, the store it opened, its worker
/// pool, the lease that every node sharing the store must agree on to tell a dead worker from a
/// slow one, and where its traces go. A file that changes one of them is refused whole: nothing
/// of it is applied. (A listener's certificate files are read again at each reload: renaming
/// them, or rewriting them in place, rotates the certificate without a restart.)
pub const RESTART_ONLY: [&str; 18] = [
    "server.listen",
    "server.admin_listen",
    "server.tls_cert",
    "server.admin_tls_cert",
    "server.header_timeout",
    "server.body_timeout",
    "server.max_connections",
    "server.admin_max_connections",
    "server.max_buffered_bodies",
    "store.url",
    "store.sync",
    "worker.concurrency",
    "worker.lease",
    "worker.send_window",
    "worker.clock_margin",
    "telemetry.otlp_endpoint",
    "telemetry.service_name",
    "telemetry.sampling_ratio",
];

/// A route and the version of its policy.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteVersion {
    pub name: RouteName,
    pub policy_version: PolicyVersion,
}

/// A route that is in both configurations but not the same in them.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteChange {
    pub name: String,
    pub old_version: PolicyVersion,
    pub new_version: PolicyVersion,
    /// The route's keys whose values differ, as the file names them.
    pub keys: Vec<&'static str>,
}

/// Everything a reload changes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Changes {
    pub added: Vec<RouteVersion>,
    pub changed: Vec<RouteChange>,
    pub removed: Vec<RouteVersion>,
    /// Keys outside the routes that change: `store.retention`, `auth`, `worker.max_takeovers`.
    pub settings: Vec<&'static str>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty() && self.settings.is_empty()
    }

    pub fn to_json(&self) -> Value {
        let route = |r: &RouteVersion| json!({"name": r.name, "policy_version": r.policy_version.as_str()});
        json!({
            "added": self.added.iter().map(route).collect::<Vec<_>>(),
            "changed": self.changed.iter().map(|c| json!({
                "name": c.name,
                "policy_version": {"old": c.old_version.as_str(), "new": c.new_version.as_str()},
                "keys": c.keys,
            })).collect::<Vec<_>>(),
            "removed": self.removed.iter().map(route).collect::<Vec<_>>(),
            "settings": self.settings,
        })
    }

    /// One line for the log: `added a (v1); changed b (v2 -> v3); removed c (v4)`.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        let list = |routes: &[RouteVersion]| {
            routes.iter().map(|r| format!("{} ({})", r.name, r.policy_version)).collect::<Vec<_>>().join(", ")
        };
        if !self.added.is_empty() {
            parts.push(format!("added {}", list(&self.added)));
        }
        if !self.changed.is_empty() {
            let changed: Vec<String> = self
                .changed
                .iter()
                .map(|c| format!("{} ({} -> {}; {})", c.name, c.old_version, c.new_version, c.keys.join(", ")))
                .collect();
            parts.push(format!("changed {}", changed.join(", ")));
        }
        if !self.removed.is_empty() {
            parts.push(format!("removed {}", list(&self.removed)));
        }
        if !self.settings.is_empty() {
            parts.push(format!("settings {}", self.settings.join(", ")));
        }
        if parts.is_empty() {
            "nothing changed".into()
        } else {
            parts.join("; ")
        }
    }
}

/// What applying `file` over `running` changes, or the first restart-only key it changes.
pub fn changes(running: &Config, file: &Config) -> Result<Changes, ConfigError> {
    let (a, b) = (running, file);
    let restart_only = [
        a.server.listen != b.server.listen,
        a.server.admin_listen != b.server.admin_listen,
        a.server.tls.is_some() != b.server.tls.is_some(),
        a.server.admin_tls.is_some() != b.server.admin_tls.is_some(),
        a.server.limits.header_timeout != b.server.limits.header_timeout,
        a.server.limits.body_timeout != b.server.limits.body_timeout,
        a.server.limits.max_connections != b.server.limits.max_connections,
        a.server.limits.admin_max_connections != b.server.limits.admin_max_connections,
        a.server.limits.max_buffered_bodies != b.server.limits.max_buffered_bodies,
        a.store.url != b.store.url,
        a.store.sync != b.store.sync,
        a.worker.concurrency != b.worker.concurrency,
        a.worker.lease != b.worker.lease,
        a.worker.send_window != b.worker.send_window,
        a.worker.clock_margin != b.worker.clock_margin,
        a.telemetry.otlp_endpoint != b.telemetry.otlp_endpoint,
        a.telemetry.service_name != b.telemetry.service_name,
        a.telemetry.sampling_ratio != b.telemetry.sampling_ratio,
    ];
    let differing: Vec<&str> = RESTART_ONLY.iter().zip(restart_only).filter(|(_, d)| *d).map(|(k, _)| *k).collect();
    if let Some((first, others)) = differing.split_first() {
        let also = if others.is_empty() { String::new() } else { format!(" (and {})", others.join(", ")) };
        return Err(invalid(
            *first,
            format!(
                "cannot change while the broker runs{also}: restart it to apply this file; the running \
                 configuration is kept, nothing of the file applied"
            ),
        ));
    }

    let mut changes = Changes::default();
    for route in &b.routes {
        match a.route_named(&route.name) {
            None => changes.added.push(version_of(route)),
            Some(old) if old != route => changes.changed.push(RouteChange {
                name: route.name.to_string(),
                old_version: old.policy_version.clone(),
                new_version: route.policy_version.clone(),
                keys: differing_keys(old, route),
            }),
            Some(_) => {}
        }
    }
    changes.removed = a.routes.iter().filter(|r| b.route_named(&r.name).is_none()).map(version_of).collect();
    let settings = [
        ("store.retention", a.store.retention != b.store.retention),
        ("auth", a.auth != b.auth),
        ("worker.max_takeovers", a.worker.max_takeovers != b.worker.max_takeovers),
        ("server.drain", a.server.drain != b.server.drain),
        ("server.access_log", a.server.access_log != b.server.access_log),
        ("server.forwarded", a.server.forwarded.enabled != b.server.forwarded.enabled),
        ("server.trusted_proxies", a.server.forwarded.trusted_proxies != b.server.forwarded.trusted_proxies),
    ];
    changes.settings = settings.iter().filter(|(_, d)| *d).map(|(k, _)| *k).collect();
    Ok(changes)
}

fn version_of(route: &Route) -> RouteVersion {
    RouteVersion { name: route.name.clone(), policy_version: route.policy_version.clone() }
}

/// The keys of a route's table whose values differ (credentials by their names and values,
/// which are never shown).
fn differing_keys(a: &Route, b: &Route) -> Vec<&'static str> {
    let keys = [
        ("path_prefix", a.path_prefix != b.path_prefix),
        ("upstream", a.upstream != b.upstream),
        ("methods", a.methods != b.methods),
        ("replay_safe", a.replay_safe != b.replay_safe),
        ("forward_idempotency_key", a.forward_idempotency_key != b.forward_idempotency_key),
        ("upstream_headers_env", a.upstream_headers != b.upstream_headers),
        ("forward_authorization", a.forward_authorization != b.forward_authorization),
        ("require_key", a.require_key != b.require_key),
        ("retention", a.retention != b.retention),
        ("tombstone", a.tombstone != b.tombstone),
        ("key_from", a.key_from != b.key_from),
        ("fingerprint_ignore", a.fingerprint_ignore != b.fingerprint_ignore),
        ("max_body", a.max_body != b.max_body),
        ("max_stored_body", a.max_stored_body != b.max_stored_body),
        ("max_concurrency", a.max_concurrency != b.max_concurrency),
        ("retry", a.retry != b.retry),
        ("circuit", a.circuit != b.circuit),
        ("probe", a.probe != b.probe),
        ("deadline_header", a.deadline_header != b.deadline_header),
        ("attempt_header", a.attempt_header != b.attempt_header),
        ("ca_file", a.upstream_tls.as_ref().map(|t| &t.roots) != b.upstream_tls.as_ref().map(|t| &t.roots)),
        ("client_cert", client_chain(a) != client_chain(b)),
        (
            "server_name",
            a.upstream_tls.as_ref().map(|t| &t.server_name) != b.upstream_tls.as_ref().map(|t| &t.server_name),
        ),
        ("canary", a.canary != b.canary),
    ];
    keys.iter().filter(|(_, d)| *d).map(|(k, _)| *k).collect()
}

/// The client certificate a route presents upstream, if any.
fn client_chain(route: &Route) -> Option<&[rustls::pki_types::CertificateDer<'static>]> {
    route.upstream_tls.as_ref()?.client.as_deref()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UP: &str = "http://127.0.0.1:9000";

    fn config(routes: &str, worker: &str) -> Config {
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[store]\nurl = \"sqlite://x.db\"\n\
             [worker]\n{worker}\n{routes}"
        );
        Config::parse_with_env(&text, |_| None).unwrap()
    }

    fn route(name: &str, extra: &str) -> String {
        format!("[[routes]]\nname = \"{name}\"\npath_prefix = \"/{name}\"\nupstream = \"{UP}\"\n{extra}\n")
    }

    #[test]
    fn the_same_file_changes_nothing() {
        let a = config(&route("pay", ""), "");
        let c = changes(&a, &config(&route("pay", ""), "")).unwrap();
        assert!(c.is_empty(), "{c:?}");
        assert_eq!(c.summary(), "nothing changed");
    }

    #[test]
    fn routes_added_changed_and_removed_are_listed_with_their_versions() {
        let a = config(&format!("{}{}", route("pay", ""), route("mail", "")), "");
        let b = config(
            &format!("{}{}", route("pay", "[routes.retry]\nmax_attempts = 1"), route("tickets", "")),
            "max_takeovers = 5",
        );
        let c = changes(&a, &b).unwrap();
        assert_eq!(c.added, vec![version_of(b.route_named("tickets").unwrap())]);
        assert_eq!(c.removed, vec![version_of(a.route_named("mail").unwrap())]);
        let [changed] = c.changed.as_slice() else { panic!("{c:?}") };
        assert_eq!(changed.name, "pay");
        assert_eq!(changed.old_version, a.route_named("pay").unwrap().policy_version);
        assert_eq!(changed.new_version, b.route_named("pay").unwrap().policy_version);
        assert_ne!(changed.old_version, changed.new_version);
        assert_eq!(changed.keys, vec!["retry"]);
        assert_eq!(c.settings, vec!["worker.max_takeovers"]);
        let json = c.to_json();
        assert_eq!(json["changed"][0]["policy_version"]["old"], changed.old_version.as_str());
        assert!(c.summary().contains("changed pay ("), "{}", c.summary());
    }

    #[test]
    fn an_attempt_header_renamed_is_a_change_that_keeps_the_policy_version() {
        let a = config(&route("pay", ""), "");
        let b = config(&route("pay", "attempt_header = \"X-Claim\""), "");
        let c = changes(&a, &b).unwrap();
        assert_eq!(c.changed[0].keys, vec!["attempt_header"]);
        assert_eq!(c.changed[0].old_version, c.changed[0].new_version);
    }

    #[test]
    fn a_change_outside_the_policy_keeps_the_version() {
        let a = config(&route("pay", ""), "");
        let b = config(&route("pay", "max_body = \"2KiB\""), "");
        let c = changes(&a, &b).unwrap();
        assert_eq!(c.changed[0].old_version, c.changed[0].new_version);
        assert_eq!(c.changed[0].keys, vec!["max_body"]);
    }

    #[test]
    fn a_restart_only_key_is_refused_by_name() {
        let a = config(&route("pay", ""), "");
        for (worker, key) in [
            ("concurrency = 8", "worker.concurrency"),
            ("lease = \"3s\"", "worker.lease"),
            ("send_window = \"500ms\"", "worker.send_window"),
            ("clock_margin = \"2s\"", "worker.clock_margin"),
        ] {
            let e = changes(&a, &config(&route("pay", ""), worker)).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")) && e.contains("restart"), "{e}");
        }
        let mut moved = config(&route("pay", ""), "");
        moved.store.url = "sqlite://elsewhere.db".into();
        moved.server.limits.max_buffered_bodies *= 2;
        let e = changes(&a, &moved).unwrap_err().to_string();
        assert!(e.contains("`server.max_buffered_bodies`") && e.contains("store.url"), "{e}");
        let mut relaxed = config(&route("pay", ""), "");
        relaxed.store.sync = crate::config::Durability::Normal;
        let e = changes(&a, &relaxed).unwrap_err().to_string();
        assert!(e.contains("`store.sync`") && e.contains("restart"), "{e}");
        let mut traced = config(&route("pay", ""), "");
        traced.telemetry.sampling_ratio = 0.5;
        let e = changes(&a, &traced).unwrap_err().to_string();
        assert!(e.contains("`telemetry.sampling_ratio`"), "{e}");
        let mut secured = config(&route("pay", ""), "");
        secured.server.admin_tls =
            Some(crate::config::ListenerTls::for_test("/etc/idem/admin.crt".into(), "/etc/idem/admin.key".into()));
        let e = changes(&a, &secured).unwrap_err().to_string();
        assert!(e.contains("`server.admin_tls_cert`"), "{e}");
    }

    #[test]
    fn serving_settings_change_on_reload() {
        let a = config(&route("pay", ""), "");
        let mut b = config(&route("pay", ""), "");
        b.server.drain = std::time::Duration::from_secs(30);
        b.server.access_log = false;
        b.server.forwarded.trusted_proxies = vec!["10.0.0.0/8".parse().unwrap()];
        let c = changes(&a, &b).unwrap();
        assert_eq!(c.settings, vec!["server.drain", "server.access_log", "server.trusted_proxies"]);
    }
}
