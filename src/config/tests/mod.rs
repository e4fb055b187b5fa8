use super::*;
use secrecy::ExposeSecret;

mod serving;
mod store_sync;

const MINIMAL: &str = r#"
    [[routes]]
    name = "payments"
    path_prefix = "/payments"
    upstream = "http://127.0.0.1:9000"
"#;

fn no_env(_: &str) -> Option<String> {
    None
}

fn error_of(text: &str) -> String {
    Config::parse_with_env(text, no_env).unwrap_err().to_string()
}

fn with_route_line(line: &str) -> String {
    format!("{MINIMAL}{line}\n")
}

fn with_retry_line(line: &str) -> String {
    format!("{MINIMAL}[routes.retry]\n{line}\n")
}

#[test]
fn a_deadline_header_must_be_a_header_name_the_broker_does_not_use() {
    let c = Config::parse_with_env(&with_route_line("deadline_header = \"Request-Timeout-Ms\""), no_env).unwrap();
    assert_eq!(c.routes[0].deadline_header.as_ref().map(|h| h.as_str()), Some("request-timeout-ms"));
    assert!(Config::parse_with_env(MINIMAL, no_env).unwrap().routes[0].deadline_header.is_none());
    assert!(describe(&c).contains("deadline header: request-timeout-ms"), "{}", describe(&c));
    for bad in ["bad header", "", "Idempotency-Key", "Connection"] {
        let e = error_of(&with_route_line(&format!("deadline_header = \"{bad}\"")));
        assert!(e.contains("routes[0].deadline_header"), "{e}");
    }
}

#[test]
fn a_minimal_config_gets_the_documented_defaults() {
    let c = Config::parse_with_env(MINIMAL, no_env).unwrap();
    assert_eq!(c.server.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(c.server.admin_listen.to_string(), "127.0.0.1:8081");
    assert_eq!(c.store.url, "sqlite://idem.db");
    assert_eq!(c.store.retention, Duration::from_secs(86400));
    let r = &c.routes[0];
    assert_eq!(r.methods, vec![Method::POST, Method::PATCH]);
    assert!(!r.replay_safe);
    assert!(r.forward_idempotency_key);
    assert_eq!(r.max_body, 1024 * 1024);
    assert_eq!(r.max_stored_body, 8 * 1024 * 1024);
    assert_eq!(r.retry.stream_idle_timeout, Duration::from_secs(30));
    assert_eq!(r.max_concurrency, 256);
    assert_eq!(r.retry.max_attempts, 3);
    assert_eq!(r.retry.deadline, Duration::from_secs(30));
    assert_eq!(r.retry.not_processed, vec![429, 503]);
    assert_eq!(r.retry.ambiguous, vec![502, 504]);
    assert_eq!(r.retry.jitter, Jitter::Full);
    assert_eq!(c.worker.concurrency, 64);
    assert_eq!(c.worker.lease, Duration::from_secs(15));
    assert_eq!(c.worker.max_takeovers, 3);
    assert!(c.auth.admin_token.is_none() && c.auth.tenants.is_empty());
}

#[test]
fn bad_durations_name_their_key() {
    let e = error_of(&with_retry_line("deadline = \"soon\""));
    assert!(e.contains("routes[0].retry.deadline") && e.contains("soon"), "{e}");
    let e = error_of(&with_retry_line("per_try_timeout = \"0s\""));
    assert!(e.contains("routes[0].retry.per_try_timeout") && e.contains("greater than zero"), "{e}");
    let e = error_of(&with_retry_line("stream_idle_timeout = \"0s\""));
    assert!(e.contains("routes[0].retry.stream_idle_timeout") && e.contains("greater than zero"), "{e}");
    let e = error_of(&format!("[store]\nretention = \"-1h\"\n{MINIMAL}"));
    assert!(e.contains("store.retention"), "{e}");
}

#[test]
fn contradictory_retry_settings_are_refused() {
    let e = error_of(&with_retry_line("min_try = \"2s\"\nper_try_timeout = \"1s\""));
    assert!(e.contains("routes[0].retry.min_try"), "{e}");
    let e = error_of(&with_retry_line("max_attempts = 0"));
    assert!(e.contains("routes[0].retry.max_attempts") && e.contains("at least 1"), "{e}");
    let e = error_of(&with_retry_line("max_attempts = -2"));
    assert!(e.contains("max_attempts"), "{e}");
    let e = error_of(&with_retry_line("base = \"5s\"\ncap = \"1s\""));
    assert!(e.contains("routes[0].retry.base"), "{e}");
    let e = error_of(&with_retry_line("jitter = \"random\""));
    assert!(e.contains("routes[0].retry.jitter") && e.contains("random"), "{e}");
    let e = error_of(&with_retry_line("not_processed = [503]\nambiguous = [503]"));
    assert!(e.contains("routes[0].retry.ambiguous"), "{e}");
    let e = error_of(&with_retry_line("ambiguous = [700]"));
    assert!(e.contains("routes[0].retry.ambiguous") && e.contains("700"), "{e}");
    let e = error_of(&with_retry_line("budget_ratio = 1.5"));
    assert!(e.contains("budget_ratio"), "{e}");
    let e = error_of(&with_retry_line("budget_ratio = nan"));
    assert!(e.contains("budget_ratio"), "{e}");
    let e = error_of(&with_retry_line("budget_min_per_sec = -1"));
    assert!(e.contains("budget_min_per_sec"), "{e}");
}

#[test]
fn bad_route_fields_name_their_key() {
    let e = error_of(&with_route_line("max_body = \"lots\""));
    assert!(e.contains("routes[0].max_body"), "{e}");
    let e = error_of(&with_route_line("methods = [\"post\"]"));
    assert!(e.contains("routes[0].methods"), "{e}");
    let e = error_of(&with_route_line("max_concurrency = 0"));
    assert!(e.contains("routes[0].max_concurrency"), "{e}");
    let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"ftp://x\"\n");
    assert!(e.contains("routes[0].upstream"), "{e}");
    let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"p\"\nupstream = \"http://x\"\n");
    assert!(e.contains("routes[0].path_prefix"), "{e}");
    let e = error_of(&format!("{MINIMAL}{MINIMAL}"));
    assert!(e.contains("routes[1].name"), "{e}");
    let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/_idem/x\"\nupstream = \"http://x\"\n");
    assert!(e.contains("routes[0].path_prefix") && e.contains("/_idem"), "{e}");
    let e = error_of(&format!("{MINIMAL}[routes.circuit]\nopen_for = \"2m\"\n"));
    assert!(e.contains("routes[0].circuit.open_for"), "{e}");
    let e = error_of(&format!("{MINIMAL}[routes.circuit]\nfailures = 0\n"));
    assert!(e.contains("routes[0].circuit.failures"), "{e}");
}

#[test]
fn unknown_keys_and_wrong_types_are_refused() {
    let e = error_of(&with_route_line("replay_safe = \"yes\""));
    assert!(e.contains("replay_safe"), "{e}");
    let e = error_of(&with_route_line("retries = 3"));
    assert!(e.contains("retries"), "{e}");
    let e = error_of("[server]\nlisten = \"localhost\"\n");
    assert!(e.contains("server.listen"), "{e}");
    for bad in ["-1", "101", "\"3\""] {
        let e = error_of(&format!("[worker]\nmax_takeovers = {bad}\n{MINIMAL}"));
        assert!(e.contains("max_takeovers"), "{e}");
    }
    let c = Config::parse_with_env(&format!("[worker]\nmax_takeovers = 0\n{MINIMAL}"), no_env).unwrap();
    assert_eq!(c.worker.max_takeovers, 0, "never continued after a take-over");
    let e = error_of("[store]\nurl = \"mysql://x\"\n");
    assert!(e.contains("store.url"), "{e}");
    let e = error_of("[store]\nurl = \"postgres://idem:hunter2@db/idem\"\n");
    assert!(e.contains("store.url") && e.contains("PGPASSWORD") && !e.contains("hunter2"), "{e}");
}

#[test]
fn configs_that_cannot_be_right_are_refused_without_echoing_secrets() {
    let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"http://user:hunter2@up\"\n");
    assert!(e.contains("routes[0].upstream") && e.contains("user-info") && !e.contains("hunter2"), "{e}");
    let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"ftp://u:hunter2@up\"\n");
    assert!(e.contains("routes[0].upstream") && !e.contains("hunter2"), "{e}");
    let tenants = format!("{MINIMAL}[[auth.tenants]]\nname = \"acme\"\ntoken_sha256 = \"{}\"\n", "ab".repeat(32));
    let e = error_of(&tenants);
    assert!(e.contains("auth.admin_token_env") && e.contains("tenant"), "{e}");
    let twins = format!("{MINIMAL}[[routes]]\nname = \"p2\"\npath_prefix = \"/payments/\"\nupstream = \"http://x\"\n");
    let e = error_of(&twins);
    assert!(e.contains("routes[1].path_prefix"), "{e}");
    let e = error_of(&format!("[server]\nlisten = \"127.0.0.1:9000\"\nadmin_listen = \"127.0.0.1:9000\"\n{MINIMAL}"));
    assert!(e.contains("server.admin_listen"), "{e}");
    let e = error_of(&format!("[server]\nlisten = \"0.0.0.0:9000\"\nadmin_listen = \"127.0.0.1:9000\"\n{MINIMAL}"));
    assert!(e.contains("server.admin_listen"), "{e}");
    // Port 0 is any free port: two of them are fine.
    let any = format!("[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{MINIMAL}");
    assert!(Config::parse_with_env(&any, no_env).is_ok());
    let e = error_of(&format!("[store]\nretention = \"0s\"\n{MINIMAL}"));
    assert!(e.contains("store.retention") && e.contains("greater than zero"), "{e}");
    let e = error_of(&format!("[store]\nretention = \"1000years\"\n{MINIMAL}"));
    assert!(e.contains("store.retention") && e.contains("bound"), "{e}");
    let e = error_of(&with_retry_line("deadline = \"1000years\""));
    assert!(e.contains("routes[0].retry.deadline") && e.contains("bound"), "{e}");
    let e = error_of(&with_route_line("max_stored_body = \"0B\""));
    assert!(e.contains("routes[0].max_stored_body") && e.contains("greater than zero"), "{e}");
    let e = error_of(&with_route_line("max_stored_body = \"2GiB\""));
    assert!(e.contains("routes[0].max_stored_body") && e.contains("bound"), "{e}");
    let e = error_of(&with_route_line("max_body = \"100TiB\""));
    assert!(e.contains("routes[0].max_body") && e.contains("bound"), "{e}");
    let e = error_of(&with_route_line("max_concurrency = 100000000000"));
    assert!(e.contains("routes[0].max_concurrency") && e.contains("bound"), "{e}");
    let e = error_of(&format!("{MINIMAL}[routes.probe]\npath = \"/payments/status\"\n"));
    assert!(e.contains("routes[0].probe.path") && e.contains("{idempotency_key}"), "{e}");
    for empty in ["", "[server]\n", "[store]\nurl = \"sqlite://x.db\"\n"] {
        let e = error_of(empty);
        assert!(e.contains("config key `routes`") && e.contains("no route"), "{e}");
    }
}

#[test]
fn paths_that_a_parser_would_rewrite_are_refused_in_prefixes_and_upstreams() {
    let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/p/../admin\"\nupstream = \"http://x\"\n");
    assert!(e.contains("routes[0].path_prefix") && e.contains(".."), "{e}");
    let e = error_of("[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"http://x/api/../admin\"\n");
    assert!(e.contains("routes[0].upstream") && e.contains("rewrites"), "{e}");
    let c = Config::parse_with_env(
        "[[routes]]\nname = \"o\"\npath_prefix = \"/orders\"\nupstream = \"http://x:1/orders-api/\"\n",
        no_env,
    )
    .unwrap();
    let route = &c.routes[0];
    assert_eq!((route.upstream.as_str(), route.upstream_base.path()), ("http://x:1/orders-api", "/orders-api/"));
    // The base's trailing slash is not doubled: the path sent is its path without it, then the request's.
    assert_eq!(route.upstream_url("/orders/7", "").unwrap().as_str(), "http://x:1/orders-api/orders/7");
}

#[test]
fn a_read_error_states_its_reason_once() {
    let e = Config::load(Path::new("/nonexistent/idem.toml")).unwrap_err();
    let chain = format!("{:#}", anyhow::Error::new(e));
    assert_eq!(chain.matches("No such file or directory").count(), 1, "{chain}");
    assert!(chain.contains("/nonexistent/idem.toml"), "{chain}");
}

#[test]
fn secrets_come_from_the_environment() {
    let text = &format!("[auth]\nadmin_token_env = \"IDEM_TEST_TOKEN\"\n{MINIMAL}");
    let e = error_of(text);
    assert!(e.contains("auth.admin_token_env") && e.contains("IDEM_TEST_TOKEN"), "{e}");
    let c = Config::parse_with_env(text, |v| (v == "IDEM_TEST_TOKEN").then(|| "s3cret".into())).unwrap();
    assert_eq!(c.auth.admin_token.as_ref().map(|t| t.expose_secret()), Some("s3cret"));
    assert!(!format!("{:?}", c.auth).contains("s3cret"), "a token never shows in a debug print");
}

#[test]
fn a_command_that_does_not_serve_reads_the_config_without_its_secrets_and_names_those_missing() {
    let route = MINIMAL.replace(
        "[[routes]]",
        "[[routes]]\nupstream_headers_env = { \"x-api-key\" = \"IDEM_TEST_KEY\", \"x-org\" = \"IDEM_TEST_ORG\" }",
    );
    let text = &format!("[auth]\nadmin_token_env = \"IDEM_TEST_TOKEN\"\n{route}");
    let env = |v: &str| match v {
        "IDEM_TEST_ORG" => Some("org-1".to_string()),
        "IDEM_TEST_KEY" => Some(String::new()),
        _ => None,
    };
    assert!(Config::parse_with_env(text, env).is_err(), "serving needs every secret");
    let (c, unset) = Config::parse_offline(text, env).unwrap();
    assert_eq!(unset, ["IDEM_TEST_TOKEN", "IDEM_TEST_KEY"]);
    assert_eq!(c.routes[0].upstream_headers["x-org"], "org-1", "a secret that is set is read");
    // Everything that is not a secret is still checked.
    let broken = text.replace("[auth]", "[auth]\ntoken_header = \"bad header\"");
    assert!(Config::parse_offline(&broken, env).unwrap_err().to_string().contains("auth.token_header"));
}

#[test]
fn tenant_tokens_are_configured_as_digests() {
    let admin = "[auth]\nadmin_token_env = \"IDEM_TEST_TOKEN\"\n";
    let env = |v: &str| (v == "IDEM_TEST_TOKEN").then(|| "s3cret".to_string());
    let ok = format!("{admin}[[auth.tenants]]\nname = \"acme\"\ntoken_sha256 = \"{}\"\n{MINIMAL}", "ab".repeat(32));
    let c = Config::parse_with_env(&ok, env).unwrap();
    assert_eq!(c.auth.tenants[0].token_sha256, [0xab; 32]);
    let e = error_of("[[auth.tenants]]\nname = \"acme\"\ntoken_sha256 = \"plain-token\"\n");
    assert!(e.contains("auth.tenants[0].token_sha256"), "{e}");
}

#[test]
fn check_prints_the_effective_policy_of_every_route() {
    let text = format!("{MINIMAL}[routes.retry]\nmax_attempts = 5\njitter = \"equal\"\n[routes.probe]\npath = \"/p/{{idempotency_key}}\"\n");
    let out = describe(&Config::parse_with_env(&text, no_env).unwrap());
    assert!(out.starts_with("config ok"), "{out}");
    assert!(out.contains("route payments  /payments -> http://127.0.0.1:9000"), "{out}");
    assert!(out.contains("5 attempts within 30s") && out.contains("Equal jitter"), "{out}");
    assert!(out.contains("circuit: opens after 5 failures"), "{out}");
    assert!(out.contains("probe GET /p/{idempotency_key} after 5s"), "{out}");
    assert!(out.contains("lease 15s, max_takeovers 3"), "{out}");
    let config = Config::parse_with_env(&text, no_env).unwrap();
    assert!(out.contains(&format!("  policy_version {}\n", config.routes[0].policy_version)), "{out}");
}

#[test]
fn a_policy_version_belongs_to_the_policy_not_to_the_route_that_has_it() {
    let route = |name: &str, prefix: &str, retry: &str| {
        format!("[[routes]]\nname = \"{name}\"\npath_prefix = \"{prefix}\"\nupstream = \"http://127.0.0.1:9000\"\n{retry}\n")
    };
    let text = route("a", "/a", "") + &route("b", "/b", "") + &route("c", "/c", "replay_safe = true");
    let first = Config::parse_with_env(&text, no_env).unwrap();
    let again = Config::parse_with_env(&text, no_env).unwrap();
    let versions = |c: &Config| c.routes.iter().map(|r| r.policy_version.to_string()).collect::<Vec<_>>();
    // The same file read twice (a restart, another node) gives the same versions.
    assert_eq!(versions(&first), versions(&again));
    let [a, b, c] = versions(&first).try_into().unwrap();
    assert_eq!(a, b, "two routes with the same policy share its version");
    assert_ne!(a, c);
}

#[test]
fn a_route_cannot_be_named_all_which_is_every_route_to_a_switch() {
    let e = error_of(&MINIMAL.replace("name = \"payments\"", "name = \"all\""));
    assert!(e.contains("routes[0].name"), "{e}");
}

#[test]
fn the_longest_prefix_wins_on_segment_boundaries() {
    let text = r#"
        [[routes]]
        name = "everything"
        path_prefix = "/"
        upstream = "http://127.0.0.1:1"
        [[routes]]
        name = "payments"
        path_prefix = "/payments"
        upstream = "http://127.0.0.1:2"
        [[routes]]
        name = "refunds"
        path_prefix = "/payments/refunds/"
        upstream = "http://127.0.0.1:3"
    "#;
    let c = Config::parse_with_env(text, no_env).unwrap();
    let name = |p: &str| c.position_for(p).map(|i| c.routes[i].name.as_str());
    assert_eq!(name("/payments"), Some("payments"));
    assert_eq!(name("/payments/42"), Some("payments"));
    assert_eq!(name("/payments/refunds/9"), Some("refunds"));
    assert_eq!(name("/paymentsX"), Some("everything"));
    assert_eq!(name("/other"), Some("everything"));
    let c = Config::parse_with_env(MINIMAL, no_env).unwrap();
    assert!(c.position_for("/other").is_none());
}

const MCP_ROUTE: &str = r#"
    [[routes]]
    name = "tools"
    kind = "mcp"
    path_prefix = "/mcp"
    upstream = "http://127.0.0.1:9000"
"#;

#[test]
fn an_mcp_route_records_posted_tool_calls_with_rules_per_tool() {
    let text = format!(
        "{MCP_ROUTE}[routes.mcp]\nin_flight_wait = \"3s\"\n[routes.mcp.tools.\"get_report\"]\nrecorded = true\n\
         [routes.mcp.tools.\"send_email\"]\nreplay_safe = false\n"
    );
    let c = Config::parse_with_env(&text, no_env).unwrap();
    let r = &c.routes[0];
    assert_eq!(r.kind(), RouteKind::Mcp);
    assert_eq!(r.methods, vec![Method::POST]);
    let mcp = r.mcp.as_ref().unwrap();
    assert_eq!(mcp.in_flight_wait, Duration::from_secs(3));
    assert_eq!(mcp.tools["get_report"], ToolRule { recorded: Some(true), replay_safe: None });
    assert_eq!(mcp.tools["send_email"], ToolRule { recorded: None, replay_safe: Some(false) });
    assert_ne!(mcp.replay_safe_version, r.policy_version, "replay-safe calls run a policy of their own");
    let safe = r.policy_named(mcp.replay_safe_version.as_str()).unwrap();
    assert!(safe.replay_safe && !r.policy_named(r.policy_version.as_str()).unwrap().replay_safe);
    assert!(describe(&c).contains("kind mcp"), "{}", describe(&c));
    let plain = Config::parse_with_env(MINIMAL, no_env).unwrap();
    assert_eq!(plain.routes[0].kind(), RouteKind::Http);
    let defaults = Config::parse_with_env(MCP_ROUTE, no_env).unwrap();
    assert_eq!(defaults.routes[0].mcp.as_ref().unwrap().in_flight_wait, Duration::from_secs(10));
    assert_eq!(defaults.routes[0].retry.not_processed, vec![400, 404, 429, 503], "refused by the transport");
    let own = Config::parse_with_env(&format!("{MCP_ROUTE}[routes.retry]\nnot_processed = [503]\n"), no_env).unwrap();
    assert_eq!(own.routes[0].retry.not_processed, vec![503]);
}

#[test]
fn mcp_settings_that_cannot_be_right_name_their_key() {
    let e = error_of(&with_route_line("kind = \"grpc\""));
    assert!(e.contains("routes[0].kind") && e.contains("grpc"), "{e}");
    let e = error_of(&format!("{MINIMAL}[routes.mcp]\nin_flight_wait = \"1s\"\n"));
    assert!(e.contains("routes[0].mcp") && e.contains("kind = \"mcp\""), "{e}");
    let e = error_of(&format!("{MCP_ROUTE}replay_safe = true\n"));
    assert!(e.contains("routes[0].replay_safe") && e.contains("per tool"), "{e}");
    let e = error_of(&format!("{MCP_ROUTE}methods = [\"POST\", \"PATCH\"]\n"));
    assert!(e.contains("routes[0].methods"), "{e}");
    let e = error_of(&format!("{MCP_ROUTE}[routes.mcp.tools.\"x\"]\nrecorded = false\nreplay_safe = true\n"));
    assert!(e.contains("routes[0].mcp.tools.\"x\".replay_safe"), "{e}");
    let e = error_of(&format!("{MCP_ROUTE}[routes.mcp.tools.\"x\"]\nrecordd = true\n"));
    assert!(e.contains("recordd"), "{e}");
    let e = error_of(&format!("{MCP_ROUTE}[routes.mcp]\nin_flight_wait = \"0s\"\n"));
    assert!(e.contains("routes[0].mcp.in_flight_wait"), "{e}");
    let e = error_of(&format!("{MCP_ROUTE}[routes.canary]\npercent = 10\n"));
    assert!(e.contains("routes[0].canary"), "{e}");
}

#[test]
fn an_attempt_carries_its_claim_in_idem_attempt_unless_renamed_or_turned_off() {
    let header = |line: &str| {
        Config::parse_with_env(&with_route_line(line), no_env).unwrap().routes[0]
            .attempt_header
            .as_ref()
            .map(|h| h.as_str().to_string())
    };
    assert_eq!(header(""), Some("idem-attempt".into()));
    assert_eq!(header("attempt_header = true"), Some("idem-attempt".into()));
    assert_eq!(header("attempt_header = \"X-Claim\""), Some("x-claim".into()));
    assert_eq!(header("attempt_header = false"), None);
    let c = Config::parse_with_env(&with_route_line("attempt_header = false"), no_env).unwrap();
    assert!(describe(&c).contains("attempt header: off"), "{}", describe(&c));
    for bad in ["\"bad header\"", "\"Idempotency-Key\"", "\"Connection\"", "3"] {
        let e = error_of(&with_route_line(&format!("attempt_header = {bad}")));
        assert!(e.contains("attempt_header"), "{bad}: {e}");
    }
    let clash = error_of(&with_route_line("deadline_header = \"X-Claim\"\nattempt_header = \"X-Claim\""));
    assert!(clash.contains("routes[0].attempt_header") && clash.contains("deadline_header"), "{clash}");
}

#[test]
fn a_marked_attempt_has_a_send_window_and_clocks_a_margin_within_the_lease() {
    let worker = |lines: &str| Config::parse_with_env(&format!("[worker]\n{lines}\n{MINIMAL}"), no_env);
    let c = worker("").unwrap();
    assert_eq!((c.worker.send_window, c.worker.clock_margin), (Duration::from_secs(1), Duration::from_secs(1)));
    assert!(describe(&c).contains("send_window 1s, clock_margin 1s"), "{}", describe(&c));
    let short = worker("lease = \"1s\"").unwrap();
    let fifth = Duration::from_millis(200);
    assert_eq!((short.worker.send_window, short.worker.clock_margin), (fifth, fifth), "a fifth of a short lease");
    let set = worker("send_window = \"250ms\"\nclock_margin = \"2s\"").unwrap();
    assert_eq!((set.worker.send_window, set.worker.clock_margin), (Duration::from_millis(250), Duration::from_secs(2)));
    let e = worker("lease = \"3s\"\nsend_window = \"2s\"\nclock_margin = \"1s\"").unwrap_err().to_string();
    assert!(e.contains("worker.send_window") && e.contains("shorter than lease"), "{e}");
    for key in ["send_window", "clock_margin"] {
        let e = worker(&format!("{key} = \"0s\"")).unwrap_err().to_string();
        assert!(e.contains(&format!("worker.{key}")), "{e}");
    }
}

/// `[server] drain_readiness`: none by default (SIGTERM drains at once, as before), a duration
/// when set, zero spelt as "0s", and a bad value refused naming the key.
#[test]
fn drain_readiness_is_none_by_default_and_a_duration_when_set() {
    let c = Config::parse_with_env(MINIMAL, no_env).unwrap();
    assert_eq!(c.server.drain_readiness, Duration::ZERO);
    let with = |value: &str| format!("[server]\ndrain_readiness = \"{value}\"\n{MINIMAL}");
    let c = Config::parse_with_env(&with("5s"), no_env).unwrap();
    assert_eq!(c.server.drain_readiness, Duration::from_secs(5));
    assert!(describe(&c).contains("(after 5s of failing readiness on SIGTERM)"), "{}", describe(&c));
    assert_eq!(Config::parse_with_env(&with("0s"), no_env).unwrap().server.drain_readiness, Duration::ZERO);
    let e = error_of(&with("soon"));
    assert!(e.contains("server.drain_readiness") && e.contains("not a duration"), "{e}");
}

/// `idem check` spells durations and sizes as a file does: `24h`, not `1day`; `256MiB`, not
/// `268435456 B`.
#[test]
fn durations_and_sizes_are_printed_as_a_file_spells_them() {
    use super::described::{size, span};
    assert_eq!(span(Duration::from_secs(24 * 3600)), "24h");
    assert_eq!(span(Duration::from_secs(5400)), "1h30m");
    assert_eq!(span(Duration::from_millis(250)), "250ms");
    assert_eq!(span(Duration::from_millis(1500)), "1500ms");
    assert_eq!(span(Duration::ZERO), "0s");
    assert_eq!(size(256 << 20), "256MiB");
    assert_eq!(size(512 << 10), "512KiB");
    assert_eq!(size(1000), "1000B");
    let described = describe(&Config::parse_with_env(MINIMAL, no_env).unwrap());
    assert!(described.contains("(retention 24h)") && described.contains("max_buffered_bodies 256MiB"), "{described}");
}
