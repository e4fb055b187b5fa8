//! The serving settings: listeners, their TLS, forwarding, drain, telemetry, TLS towards
//! upstreams and the PostgreSQL store's URL.

use super::*;

/// A self-signed certificate and its key for `name`, written to `dir`: (certificate, key).
fn certificate(dir: &std::path::Path, stem: &str, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let issued = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
    let (cert, key) = (dir.join(format!("{stem}.crt")), dir.join(format!("{stem}.key")));
    std::fs::write(&cert, issued.cert.pem()).unwrap();
    std::fs::write(&key, issued.signing_key.serialize_pem()).unwrap();
    (cert, key)
}

#[test]
fn serving_settings_have_defaults_and_idem_check_shows_them() {
    let c = Config::parse_with_env(MINIMAL, no_env).unwrap();
    assert_eq!(c.server.drain, Duration::from_secs(10));
    assert!(c.server.access_log && c.server.forwarded.enabled && c.server.forwarded.trusted_proxies.is_empty());
    assert!(c.server.tls.is_none() && c.server.admin_tls.is_none() && c.routes[0].upstream_tls.is_none());
    assert_eq!(c.telemetry, TelemetryConfig { otlp_endpoint: None, service_name: "idem".into(), sampling_ratio: 1.0 });
    let said = describe(&c);
    for line in [
        "tls           data off; admin off",
        "drain 10s (after 0s of failing readiness on SIGTERM); access log on; forwarded on, no trusted proxy",
        "telemetry     off",
    ] {
        assert!(said.contains(line), "{line:?} not in:\n{said}");
    }
    let text = format!(
        "[server]\ndrain = \"30s\"\naccess_log = false\ntrusted_proxies = [\"10.0.0.0/8\", \"192.0.2.7\"]\n\
         [telemetry]\notlp_endpoint = \"http://collector:4318\"\nservice_name = \"idem-eu\"\nsampling_ratio = 0.25\n{MINIMAL}"
    );
    let c = Config::parse_with_env(&text, no_env).unwrap();
    assert_eq!(c.server.drain, Duration::from_secs(30));
    assert!(!c.server.access_log);
    let proxies: Vec<String> = c.server.forwarded.trusted_proxies.iter().map(ToString::to_string).collect();
    assert_eq!(proxies, ["10.0.0.0/8", "192.0.2.7/32"]);
    assert_eq!(c.telemetry.otlp_endpoint.as_ref().map(|u| u.as_str()), Some("http://collector:4318/"));
    let said = describe(&c);
    assert!(said.contains("trusting 10.0.0.0/8, 192.0.2.7/32") && said.contains("sampling 0.25"), "{said}");
    let off = Config::parse_with_env(&format!("[server]\nforwarded = false\n{MINIMAL}"), no_env).unwrap();
    assert!(!off.server.forwarded.enabled && describe(&off).contains("forwarded off"));
}

#[test]
fn bad_serving_and_telemetry_settings_name_their_key() {
    let cases = [
        ("[server]\ndrain = \"soon\"", "server.drain"),
        ("[server]\ntrusted_proxies = [\"10.0.0.0/33\"]", "server.trusted_proxies"),
        ("[server]\ntrusted_proxies = [\"proxy.internal\"]", "server.trusted_proxies"),
        ("[telemetry]\notlp_endpoint = \"collector:4318\"", "telemetry.otlp_endpoint"),
        ("[telemetry]\notlp_endpoint = \"grpc://collector:4317\"", "telemetry.otlp_endpoint"),
        ("[telemetry]\notlp_endpoint = \"http://u:secret@collector:4318\"", "telemetry.otlp_endpoint"),
        ("[telemetry]\nsampling_ratio = 1.5", "telemetry.sampling_ratio"),
        ("[telemetry]\nsampling_ratio = -0.1", "telemetry.sampling_ratio"),
        ("[telemetry]\nservice_name = \" \"", "telemetry.service_name"),
        ("[telemetry]\nendpoint = \"http://collector:4318\"", "endpoint"),
    ];
    for (table, key) in cases {
        let e = error_of(&format!("{table}\n{MINIMAL}"));
        assert!(e.contains(key), "{table}: {e}");
        assert!(!e.contains("secret"), "a password is echoed: {e}");
    }
}

#[test]
fn a_listeners_certificate_and_key_are_read_and_checked_with_the_config() {
    let dir = tempfile::TempDir::new().unwrap();
    let (cert, key) = certificate(dir.path(), "data", "idem.example");
    let (other_cert, other_key) = certificate(dir.path(), "admin", "admin.example");
    let server = |lines: String| Config::parse_with_env(&format!("[server]\n{lines}\n{MINIMAL}"), no_env);
    let c = server(format!("tls_cert = {cert:?}\ntls_key = {key:?}")).unwrap();
    assert_eq!(c.server.tls.as_ref().map(|t| &t.cert), Some(&cert));
    assert!(c.server.admin_tls.is_none(), "the admin listener takes only its own pair");
    assert!(describe(&c).contains(&format!("tls           data {} (re-read on reload); admin off", cert.display())));
    let both = server(format!(
        "tls_cert = {cert:?}\ntls_key = {key:?}\nadmin_tls_cert = {other_cert:?}\nadmin_tls_key = {other_key:?}"
    ))
    .unwrap();
    assert_eq!(both.server.admin_tls.as_ref().map(|t| &t.cert), Some(&other_cert));

    let refusals = [
        (format!("tls_cert = {cert:?}"), "server.tls_key"),
        (format!("admin_tls_key = {key:?}"), "server.admin_tls_cert"),
        (format!("tls_cert = \"/nonexistent/idem.crt\"\ntls_key = {key:?}"), "server.tls_cert"),
        (format!("tls_cert = {key:?}\ntls_key = {key:?}"), "server.tls_cert"),
        (format!("tls_cert = {cert:?}\ntls_key = {cert:?}"), "server.tls_key"),
        (format!("tls_cert = {cert:?}\ntls_key = {other_key:?}"), "server.tls_key"),
    ];
    for (lines, key) in refusals {
        let e = server(lines.clone()).unwrap_err().to_string();
        assert!(e.contains(key), "{lines}: {e}");
    }
    let mismatch = server(format!("tls_cert = {cert:?}\ntls_key = {other_key:?}")).unwrap_err().to_string();
    assert!(mismatch.contains("cannot sign for"), "{mismatch}");
}

#[test]
fn tls_towards_an_upstream_is_set_on_its_route_or_its_named_upstream_never_both() {
    let dir = tempfile::TempDir::new().unwrap();
    let (cert, key) = certificate(dir.path(), "client", "idem-client");
    let https = MINIMAL.replace("http://127.0.0.1:9000", "https://127.0.0.1:9443");
    let route = |lines: String| Config::parse_with_env(&format!("{https}{lines}\n"), no_env);
    let c = route(format!(
        "ca_file = {cert:?}\nclient_cert = {cert:?}\nclient_key = {key:?}\nserver_name = \"bank.internal\""
    ))
    .unwrap();
    let tls = c.routes[0].upstream_tls.as_ref().unwrap();
    assert_eq!((tls.roots.len(), tls.client.is_some()), (1, true));
    assert_eq!(tls.server_name.as_ref().map(|n| n.to_str().into_owned()), Some("bank.internal".into()));
    assert!(describe(&c).contains("upstream tls: 1 extra root(s), a client certificate, server name bank.internal"));
    let same = route(format!("ca_file = {cert:?}")).unwrap();
    let again = route(format!("ca_file = {cert:?}")).unwrap();
    assert_eq!(same.routes[0].upstream_tls, again.routes[0].upstream_tls, "equal files are one profile");

    let refusals = [
        (format!("client_cert = {cert:?}"), "routes[0].client_key"),
        (format!("client_key = {key:?}"), "routes[0].client_cert"),
        ("ca_file = \"/nonexistent/ca.pem\"".to_string(), "routes[0].ca_file"),
        (format!("ca_file = {key:?}"), "routes[0].ca_file"),
        ("server_name = \"not a name\"".to_string(), "routes[0].server_name"),
    ];
    for (lines, key) in refusals {
        let e = route(lines.clone()).unwrap_err().to_string();
        assert!(e.contains(key), "{lines}: {e}");
    }
    let (_, other_key) = certificate(dir.path(), "other", "someone-else");
    let mismatch = route(format!("client_cert = {cert:?}\nclient_key = {other_key:?}")).unwrap_err().to_string();
    assert!(mismatch.contains("routes[0].client_key") && mismatch.contains("cannot sign for"), "{mismatch}");
    let plain = error_of(&format!("{MINIMAL}ca_file = {cert:?}\n"));
    assert!(plain.contains("routes[0].ca_file") && plain.contains("https"), "{plain}");

    let named = |route_lines: &str| {
        format!(
            "[[upstreams]]\nname = \"bank\"\nurl = \"https://127.0.0.1:9443\"\nca_file = {cert:?}\n\
             [[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"bank\"\n{route_lines}\n"
        )
    };
    let c = Config::parse_with_env(&named(""), no_env).unwrap();
    assert_eq!(c.routes[0].upstream_tls.as_ref().map(|t| t.roots.len()), Some(1), "inherited from the upstream");
    let e = error_of(&named(&format!("ca_file = {cert:?}")));
    assert!(e.contains("routes[0]") && e.contains("bank"), "{e}");
}

#[test]
fn a_postgres_store_url_is_read_as_the_driver_reads_it() {
    let dir = tempfile::TempDir::new().unwrap();
    let (ca, _) = certificate(dir.path(), "ca", "db.internal");
    let store = |url: String| Config::parse_with_env(&format!("[store]\nurl = \"{url}\"\n{MINIMAL}"), no_env);
    for mode in ["disable", "prefer", "require", "verify-ca", "verify-full"] {
        let url = format!("postgres://idem@db.internal/idem?sslmode={mode}&sslrootcert={}", ca.display());
        assert!(store(url).is_ok(), "sslmode={mode}");
    }
    let e = store("postgres://idem@db.internal/idem?sslmode=verify_full".into()).unwrap_err().to_string();
    assert!(e.contains("store.url") && e.contains("verify_full"), "{e}");
    let e = store("postgres://idem@db.internal/idem?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem".into())
        .unwrap_err()
        .to_string();
    assert!(e.contains("store.url") && e.contains("/nonexistent/ca.pem"), "{e}");
}
