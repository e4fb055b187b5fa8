//! Property tests of the config parser: whatever the file says, `Config::parse_with_env`
//! accepts it or refuses it with a message that names the key and the problem (or, for a file
//! that is not TOML of the right shape, says where it goes wrong), and never panics.

use crate::mutate::{edits, mutated};
use idem::config::{Config, ConfigError};
use proptest::prelude::*;

/// A config that sets every key, each line a place for the generator to put another value.
const FULL: &str = r#"[server]
listen = "127.0.0.1:8080"
admin_listen = "127.0.0.1:8081"
header_timeout = "10s"
body_timeout = "30s"
max_connections = 1000
admin_max_connections = 64
max_buffered_bodies = "256MiB"
[store]
url = "sqlite://idem.db"
sync = "full"
retention = "24h"
[auth]
admin_token_env = "IDEM_ADMIN_TOKEN"
token_header = "x-api-key"
[[auth.tenants]]
name = "acme"
token_sha256 = "abababababababababababababababababababababababababababababababab"
[[routes]]
name = "payments"
path_prefix = "/payments"
upstream = "http://127.0.0.1:9000"
methods = ["POST", "PATCH", "DELETE"]
replay_safe = false
forward_idempotency_key = true
max_body = "1MiB"
max_stored_body = "8MiB"
max_concurrency = 256
require_key = true
forward_authorization = false
upstream_headers_env = { Authorization = "IDEM_TOKEN" }
retention = "72h"
tombstone = "30d"
key_from = ["header:x-agent-run", "json:/tool"]
fingerprint_ignore = ["/timestamp"]
[routes.retry]
max_attempts = 3
deadline = "30s"
per_try_timeout = "10s"
min_try = "100ms"
base = "100ms"
cap = "2s"
jitter = "full"
not_processed = [429, 503]
ambiguous = [502, 504]
budget_ratio = 0.1
budget_min_per_sec = 10
stream_idle_timeout = "30s"
[routes.circuit]
failures = 5
open_for = "5s"
max_open_for = "60s"
trials = 1
[routes.probe]
method = "GET"
path = "/payments/by-key/{idempotency_key}"
settle = "5s"
[worker]
concurrency = 64
lease = "15s"
"#;

/// Every key a config error may name, with list indices written `[]`.
const KEYS: &[&str] = &[
    "server.listen",
    "server.admin_listen",
    "server.header_timeout",
    "server.body_timeout",
    "server.max_connections",
    "server.admin_max_connections",
    "server.max_buffered_bodies",
    "store.url",
    "store.sync",
    "store.retention",
    "auth.admin_token_env",
    "auth.token_header",
    "auth.tenants[].name",
    "auth.tenants[].token_sha256",
    "worker.concurrency",
    "worker.lease",
    "routes[].name",
    "routes[].path_prefix",
    "routes[].upstream",
    "routes[].methods",
    "routes[].replay_safe",
    "routes[].forward_idempotency_key",
    "routes[].max_body",
    "routes[].max_stored_body",
    "routes[].max_concurrency",
    "routes[].forward_authorization",
    "routes[].upstream_headers_env",
    "routes[].retention",
    "routes[].tombstone",
    "routes[].key_from",
    "routes[].fingerprint_ignore",
    "routes",
    "routes[].retry.max_attempts",
    "routes[].retry.deadline",
    "routes[].retry.per_try_timeout",
    "routes[].retry.min_try",
    "routes[].retry.base",
    "routes[].retry.cap",
    "routes[].retry.jitter",
    "routes[].retry.not_processed",
    "routes[].retry.ambiguous",
    "routes[].retry.budget_ratio",
    "routes[].retry.budget_min_per_sec",
    "routes[].retry.stream_idle_timeout",
    "routes[].circuit.failures",
    "routes[].circuit.open_for",
    "routes[].circuit.max_open_for",
    "routes[].circuit.trials",
    "routes[].probe.method",
    "routes[].probe.path",
    "routes[].probe.settle",
];

/// The key an error names, its list indices blanked: `routes[3].retry.cap` → `routes[].retry.cap`.
fn template(key: &str) -> String {
    let mut out = String::new();
    let mut in_index = false;
    for c in key.chars() {
        match c {
            '[' => in_index = true,
            ']' => {
                in_index = false;
                out.push_str("[]");
            }
            _ if in_index => {}
            _ => out.push(c),
        }
    }
    out
}

/// Values of every kind of a config line, valid and not.
fn value(kind: char) -> BoxedStrategy<String> {
    let strings = proptest::sample::select(vec![
        "\"250ms\"",
        "\"0s\"",
        "\"-1h\"",
        "\"soon\"",
        "\"1000years\"",
        "\"99999999999999999999s\"",
        "\"\"",
        "\"1KiB\"",
        "\"0B\"",
        "\"100TiB\"",
        "\"lots\"",
        "\"equal\"",
        "\"random\"",
        "\"none\"",
        "\"post\"",
        "\"GET\"",
        "\"x y\"",
        "\"/\"",
        "\"/_idem\"",
        "\"p\"",
        "\"ftp://x\"",
        "\"http://h/base/\"",
        "\"http://h?q\"",
        "\"https://[::1]:1\"",
        "\"postgres://u:pw@h/db\"",
        "\"postgres://h/db\"",
        "\"mysql://x\"",
        "\"sqlite://idem.db?synchronous=full\"",
        "\"sqlite://idem.db?synchronous=off\"",
        "\"normal\"",
        "\"fast\"",
        "\"localhost\"",
        "\"[::1]:0\"",
        "\"0.0.0.0:8081\"",
        "\"IDEM_TOKEN\"",
        "\"UNSET_VAR\"",
        "\"acme\"",
    ])
    .prop_map(str::to_string);
    match kind {
        '"' => prop_oneof![4 => strings, 1 => "\"[ -~&&[^\"\\\\]]{0,12}\""].boxed(),
        '0' => prop_oneof![
            proptest::sample::select(vec![
                "-1",
                "0",
                "1",
                "2",
                "1000001",
                "9223372036854775807",
                "-9223372036854775808"
            ])
            .prop_map(str::to_string),
            any::<i64>().prop_map(|n| n.to_string()),
        ]
        .boxed(),
        '.' => prop_oneof![
            proptest::sample::select(vec!["0.0", "0.5", "1.5", "-1.0", "nan", "inf", "-inf", "1e300"])
                .prop_map(str::to_string),
            any::<f64>().prop_map(|f| match f {
                f if f.is_nan() => "nan".to_string(),
                f if f.is_infinite() => (if f > 0.0 { "inf" } else { "-inf" }).to_string(),
                f => format!("{f:?}"),
            }),
        ]
        .boxed(),
        '[' => proptest::sample::select(vec![
            "[]",
            "[200]",
            "[429, 429]",
            "[99, 600]",
            "[503]",
            "[502, 504]",
            "[\"POST\"]",
            "[\"POST\", \"post\"]",
            "[\"\"]",
        ])
        .prop_map(str::to_string)
        .boxed(),
        'b' => prop_oneof![Just("true".to_string()), Just("false".to_string())].boxed(),
        _ => prop_oneof![
            value('"'),
            value('0'),
            value('.'),
            value('['),
            value('b'),
            Just("{ a = 1 }".to_string()),
            Just("1979-05-27T07:32:00Z".to_string()),
        ]
        .boxed(),
    }
}

/// The kind of value a line of `FULL` holds: `"` string, `0` integer, `.` float, `[` array,
/// `b` boolean.
fn kind_of(value: &str) -> char {
    match value.as_bytes()[0] {
        b'"' => '"',
        b'[' => '[',
        b't' | b'f' => 'b',
        _ if value.contains('.') => '.',
        _ => '0',
    }
}

/// `FULL` with some lines given other values (mostly of their own kind, so that validation
/// rather than deserialisation meets them), some dropped and some repeated.
fn config_text() -> impl Strategy<Value = String> {
    let lines: Vec<String> = FULL.lines().map(str::to_string).collect();
    proptest::collection::vec((0..lines.len(), 0..10u8), 0..6)
        .prop_flat_map(move |changes| {
            let values: Vec<BoxedStrategy<String>> = changes
                .iter()
                .map(|&(at, what)| match lines[at].split_once(" = ") {
                    Some((_, v)) if what < 6 => value(kind_of(v)),
                    _ => value('*'),
                })
                .collect();
            (Just(lines.clone()), Just(changes), values)
        })
        .prop_map(|(mut lines, changes, values)| {
            for ((at, what), value) in changes.into_iter().zip(values) {
                // Earlier changes may have removed lines.
                let at = at.min(lines.len() - 1);
                let line = lines[at].clone();
                match (what, line.split_once(" = ")) {
                    (0..=7, Some((key, _))) => lines[at] = format!("{key} = {value}"),
                    (8, _) => {
                        lines.remove(at);
                    }
                    (9, _) => lines.insert(at, line),
                    _ => {}
                }
            }
            lines.join("\n")
        })
}

fn env(name: &str) -> Option<String> {
    (name == "IDEM_ADMIN_TOKEN" || name == "IDEM_TOKEN").then(|| "s3cret".to_string())
}

/// A config is accepted or refused with a message that names the key and the problem, or (for
/// a file that is not TOML of the right shape) says where the text goes wrong.
fn refused_with_reason(text: &str) -> Result<(), TestCaseError> {
    match Config::parse_with_env(text, env) {
        Ok(config) => {
            prop_assert!(!idem::config::describe(&config).is_empty());
        }
        Err(ConfigError::Invalid { key, problem }) => {
            prop_assert!(KEYS.contains(&template(&key).as_str()), "unknown key {key:?} in {text}");
            prop_assert!(!problem.trim().is_empty(), "no problem stated for {key}");
            let message = ConfigError::Invalid { key: key.clone(), problem }.to_string();
            prop_assert!(message.starts_with(&format!("config key `{key}`: ")), "{message}");
        }
        Err(ConfigError::Syntax(message)) => prop_assert!(!message.trim().is_empty(), "{text}"),
        Err(e @ ConfigError::Read { .. }) => prop_assert!(false, "nothing is read from disk: {e}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_config_with_any_values_is_accepted_or_refused_naming_key_and_problem(text in config_text()) {
        refused_with_reason(&text)?;
    }

    #[test]
    fn a_mutated_or_random_config_is_refused_with_a_message_never_a_panic(
        text in prop_oneof![
            3 => config_text().prop_flat_map(|t| (Just(t), edits())).prop_map(|(t, e)| String::from_utf8_lossy(&mutated(t.as_bytes(), &e)).into_owned()),
            1 => "\\PC{0,120}",
            1 => "(\\[{1,2}[a-z.]{0,10}\\]{0,2}\n|[a-z_]{1,8} ?= ?[\"0-9\\[{]{0,3}[a-z0-9]{0,4}[\"\\]}]{0,2}\n){0,6}",
        ]
    ) {
        refused_with_reason(&text)?;
    }
}

#[test]
fn a_deeply_nested_config_is_refused_without_overflowing_the_stack() {
    for open in ["[", "{ a = "] {
        let text = format!("x = {}", open.repeat(100_000));
        assert!(matches!(Config::parse_with_env(&text, env), Err(ConfigError::Syntax(m)) if !m.is_empty()));
    }
}
