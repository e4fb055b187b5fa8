//! What a stranger installs: the sample configs in `deploy/` pass `idem check` as shipped (their
//! certificate files made here, where they name them), and the shell completions and the manual
//! page come out of the binary.

use std::path::Path;
use std::process::Command;

use crate::common::pki::Authority;

/// `idem` with `args`: its exit status, stdout and stderr.
/// The secrets the samples read from the environment, as their service would have them.
const SAMPLE_SECRETS: [&str; 3] = ["IDEM_ADMIN_TOKEN", "PAYMENTS_UPSTREAM_AUTH", "LEDGER_UPSTREAM_AUTH"];

fn idem(args: &[&str]) -> (bool, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    for secret in SAMPLE_SECRETS {
        command.env(secret, "set-by-the-service");
    }
    let out = command.args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// The files the samples name under /etc/idem/tls, made in `dir` by one private authority.
fn certificate_files(dir: &Path) {
    let ca = Authority::new("deploy authority");
    ca.server(&["idem.internal"]).write(dir, "idem");
    ca.client("idem").write(dir, "client");
    for name in ["pg-ca", "upstream-ca"] {
        std::fs::write(dir.join(format!("{name}.crt")), &ca.pem).unwrap();
    }
}

#[test]
fn every_sample_config_passes_idem_check() {
    let samples: Vec<_> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "toml"))
        .collect();
    assert!(samples.len() >= 2, "{samples:?}");
    for sample in samples {
        let dir = tempfile::TempDir::new().unwrap();
        certificate_files(dir.path());
        let text = std::fs::read_to_string(&sample)
            .unwrap()
            .replace("/etc/idem/tls/", &format!("{}/", dir.path().display()))
            .replace("/var/lib/idem/", &format!("{}/", dir.path().display()));
        let config = dir.path().join("idem.toml");
        std::fs::write(&config, text).unwrap();
        let (ok, stdout, stderr) = idem(&["check", "--config", config.to_str().unwrap()]);
        assert!(ok, "{}: {stderr}", sample.display());
        assert!(stdout.starts_with("config ok"), "{}: {stdout}", sample.display());
        assert!(stdout.contains("\nroute "), "{}: {stdout}", sample.display());
    }
}

#[test]
fn the_three_node_sample_speaks_tls_on_every_link() {
    let dir = tempfile::TempDir::new().unwrap();
    certificate_files(dir.path());
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/three-nodes-postgres-tls.toml");
    let text =
        std::fs::read_to_string(sample).unwrap().replace("/etc/idem/tls/", &format!("{}/", dir.path().display()));
    let config = dir.path().join("idem.toml");
    std::fs::write(&config, text).unwrap();
    let (ok, stdout, stderr) = idem(&["check", "--config", config.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(!stdout.contains("data off") && !stdout.contains("admin off"), "{stdout}");
    assert!(stdout.contains("sslmode=verify-full"), "{stdout}");
    assert!(stdout.contains("upstream tls: 1 extra root(s), a client certificate"), "{stdout}");
    assert!(stdout.contains("telemetry     OTLP/HTTP"), "{stdout}");
}

#[test]
fn completions_and_the_manual_page_come_from_the_binary() {
    for shell in ["bash", "zsh", "fish"] {
        let (ok, stdout, stderr) = idem(&["completions", shell]);
        assert!(ok, "{shell}: {stderr}");
        assert!(stdout.contains("serve") && stdout.contains("requests"), "{shell}: {stdout}");
    }
    let (ok, stdout, _) = idem(&["completions", "tcsh"]);
    assert!(!ok && stdout.is_empty(), "an unknown shell is refused");
    let (ok, stdout, stderr) = idem(&["man"]);
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with(".ie") || stdout.contains(".TH idem"), "{}", &stdout[..stdout.len().min(200)]);
    assert!(stdout.contains("serve"), "the manual names the commands");
    for section in ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "ENVIRONMENT", "FILES", "EXIT STATUS", "EXAMPLES"] {
        assert!(stdout.contains(&format!(".SH {section}")), "no {section}");
    }
    // NAME does not repeat DESCRIPTION.
    let name = stdout.split(".SH NAME").nth(1).unwrap().split(".SH").next().unwrap();
    let description = stdout.split(".SH DESCRIPTION").nth(1).unwrap().split(".SH").next().unwrap();
    let summary = name.trim().trim_start_matches("idem \\- ");
    assert!(!description.contains(summary), "{summary:?} in {description:?}");

    // Every page idem(1) refers to is written beside it.
    let dir = tempfile::TempDir::new().unwrap();
    let (ok, _, stderr) = idem(&["man", "--dir", dir.path().to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let page = std::fs::read_to_string(dir.path().join("idem.1")).unwrap();
    // `idem\-serve(1)`, or `\fBidem\-check\fR(1)`.
    let referred: Vec<String> = page
        .match_indices("idem\\-")
        .filter_map(|(at, _)| {
            let rest = &page[at + "idem\\-".len()..];
            let name = &rest[..rest.find('(')?];
            let name = name.trim_end_matches("\\fR");
            rest[name.len()..].trim_start_matches("\\fR").starts_with("(1)").then(|| name.replace("\\-", "-"))
        })
        .collect();
    assert!(referred.len() >= 8, "{referred:?}");
    for name in referred {
        let file = dir.path().join(format!("idem-{name}.1"));
        assert!(file.is_file(), "idem(1) refers to {} but it was not written", file.display());
    }
}

/// What `idem serve` would refuse on this host though the file is right fails `idem check` too,
/// each named: a secret's environment variable unset, and a SQLite file whose directory does not
/// exist. A unit's `ExecStartPre=idem check` then stops the start instead of a start loop.
#[test]
fn idem_check_fails_on_what_serve_would_refuse_on_this_host_naming_each() {
    let dir = tempfile::TempDir::new().unwrap();
    let missing = dir.path().join("missing");
    let store = format!("sqlite://{}/idem.db", missing.display());
    let text = crate::common::TestConfig::new("http://127.0.0.1:9")
        .store(&store)
        .tables("[auth]\nadmin_token_env = \"IDEM_TEST_CHECK_UNSET_TOKEN\"")
        .text();
    let config = dir.path().join("idem.toml");
    std::fs::write(&config, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["check", "--config", config.to_str().unwrap()])
        .env_remove("IDEM_TEST_CHECK_UNSET_TOKEN")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("IDEM_TEST_CHECK_UNSET_TOKEN is not set"), "{stderr}");
    assert!(stderr.contains(&format!("the directory {} of the SQLite file", missing.display())), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");

    std::fs::create_dir(&missing).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["check", "--config", config.to_str().unwrap()])
        .env("IDEM_TEST_CHECK_UNSET_TOKEN", "s3cret")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("admin token required"));
}

/// The configuration file may come from `IDEM_CONFIG`, and a key of its tables from
/// `IDEM_<TABLE>__<KEY>`, over the file: `idem check` shows what `idem serve` would run.
#[test]
fn the_environment_names_the_file_and_overrides_its_keys() {
    let dir = tempfile::TempDir::new().unwrap();
    let config = dir.path().join("idem.toml");
    let file_store = format!("sqlite://{}/file.db", dir.path().display());
    std::fs::write(
        &config,
        crate::common::TestConfig::new("http://127.0.0.1:9").store(&file_store).worker("lease = \"15s\"").text(),
    )
    .unwrap();
    let env_store = format!("sqlite://{}/env.db", dir.path().display());
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("check")
        .env("IDEM_CONFIG", &config)
        .env("IDEM_STORE__URL", &env_store)
        .env("IDEM_WORKER__CONCURRENCY", "7")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(&env_store) && !stdout.contains(&file_store), "{stdout}");
    assert!(stdout.contains("concurrency 7, lease 15s"), "{stdout}");

    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["check", "--config", config.to_str().unwrap()])
        .env("IDEM_WORKER__NO_SUCH_KEY", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("unknown field `no_such_key`"), "{stderr}");
}

/// The systemd unit as shipped: `systemd-analyze verify` finds nothing wrong with it (its
/// binary put where the unit says), and `systemd-analyze security` rates its exposure OK or
/// better (below 2.0 of 10). From Debian's systemd package, which `.ci/run` installs.
#[test]
fn the_unit_verifies_and_its_exposure_is_rated_ok() {
    let Ok(analyze) = which("systemd-analyze") else {
        assert!(std::env::var_os("CI").is_none(), "systemd-analyze is missing under CI");
        eprintln!("skipped the_unit_verifies_and_its_exposure_is_rated_ok: no systemd-analyze");
        return;
    };
    let dir = tempfile::TempDir::new().unwrap();
    let unit = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/idem.service"))
        .unwrap()
        .replace("/usr/local/bin/idem", env!("CARGO_BIN_EXE_idem"));
    let path = dir.path().join("idem.service");
    std::fs::write(&path, unit).unwrap();
    let verify = Command::new(&analyze).args(["verify", "--man=no"]).arg(&path).output().unwrap();
    let said = String::from_utf8_lossy(&verify.stderr);
    assert!(verify.status.success() && said.trim().is_empty(), "{said}");
    let security =
        Command::new(&analyze).args(["security", "--offline=true", "--no-pager"]).arg(&path).output().unwrap();
    let report = String::from_utf8_lossy(&security.stdout);
    let level: f64 = report
        .split("Overall exposure level for idem.service: ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{report}{}", String::from_utf8_lossy(&security.stderr)));
    assert!(level < 2.0, "exposure {level}:\n{report}");
}

fn which(program: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
        .ok_or(())
}

/// `Type=notify`: a node tells the service manager it is ready once its store is open and its
/// listeners bound (its `/readyz` answers by then), and that it is stopping when SIGTERM comes.
#[tokio::test]
async fn the_node_tells_the_service_manager_when_it_is_ready_and_when_it_stops() {
    use crate::common::process::{node_config, Node};
    let dir = tempfile::TempDir::new().unwrap();
    let socket_path = dir.path().join("notify.sock");
    let socket = tokio::net::UnixDatagram::bind(&socket_path).unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let body = node_config(&store, crate::common::TestConfig::new("http://127.0.0.1:9")).body();
    let env = vec![("NOTIFY_SOCKET".to_string(), socket_path.display().to_string())];
    let mut node = Node::start_with_env("notified", &body, env).await;
    let mut buf = [0u8; 512];
    let said = |n: usize, buf: &[u8]| String::from_utf8_lossy(&buf[..n]).into_owned();
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), socket.recv(&mut buf)).await.unwrap().unwrap();
    let ready = said(n, &buf);
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready}");
    let answer = node.http.get(format!("{}/readyz", node.admin)).send().await.unwrap();
    assert_eq!(answer.status(), 200, "ready, as told");

    node.terminate();
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), socket.recv(&mut buf)).await.unwrap().unwrap();
    let stopping = said(n, &buf);
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping}");
    assert!(node.wait_exit(std::time::Duration::from_secs(15)).await.is_some_and(|s| s.success()));
}

/// `idem health`, a container's health check: it finds the node's admin listener in the config
/// it runs (an address on every interface asked on loopback), and exits 0 while the node
/// answers, 1 with the reason once it does not.
#[tokio::test]
async fn idem_health_asks_the_admin_listener_the_config_names() {
    use crate::common::process::{node_config, Node};
    let dir = tempfile::TempDir::new().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let body = node_config(&store, crate::common::TestConfig::new("http://127.0.0.1:9")).body();
    let mut node = Node::start("health", &body).await;
    // As a container's config says it: the admin listener on every interface.
    let config = std::fs::read_to_string(node.config_file())
        .unwrap()
        .replace("admin_listen = \"127.0.0.1:", "admin_listen = \"0.0.0.0:");
    let file = dir.path().join("as-in-the-container.toml");
    std::fs::write(&file, config).unwrap();
    let health = |ready: bool| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        command.args(["health", "--config", file.to_str().unwrap()]);
        if ready {
            command.arg("--ready");
        }
        async move {
            let out = command.output().await.unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    assert_eq!(health(false).await.0, Some(0));
    let (code, stdout, _) = health(true).await;
    assert_eq!((code, stdout.trim()), (Some(0), "ready"));
    node.terminate();
    node.wait_exit(std::time::Duration::from_secs(15)).await;
    let (code, _, stderr) = health(false).await;
    assert_eq!(code, Some(1));
    assert!(stderr.contains("did not answer") && stderr.contains("/healthz"), "{stderr}");
}
