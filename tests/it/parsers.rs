//! Property tests of the parsers of what clients and upstreams send: the `Idempotency-Key` and
//! `Prefer` request headers and an upstream's `Retry-After`. None may panic on any input, and
//! each refusal must say what is wrong.

use std::time::{Duration, SystemTime};

use crate::mutate::{edits, mutated};
use idem::domain::key::{IdempotencyKey, KeyError, MAX_LEN};
use idem::test_support::{parse_retry_after, MAX_RETRY_AFTER};
use idem::test_support::{Prefer, MAX_WAIT_SECS};
use proptest::prelude::*;

// ---- Idempotency-Key --------------------------------------------------------------------------

/// `key` written as an sf-string.
fn quoted(key: &str) -> String {
    format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Mostly short, as keys are; sometimes at the length limit.
fn visible_key() -> impl Strategy<Value = String> {
    prop_oneof![4 => "[!-~]{1,24}", 1 => "[!-~]{240,255}"]
}

/// Parameters as RFC 8941 writes them: `;name` or `;name=bare-item`, spaces allowed after `;`.
fn parameters() -> impl Strategy<Value = String> {
    let value = prop_oneof![
        "-?[0-9]{1,15}",
        "-?[0-9]{1,12}\\.[0-9]{1,3}",
        "[A-Za-z*][A-Za-z0-9!#$%&'*+.^_`|~:/-]{0,8}",
        (proptest::collection::vec(any::<u8>(), 0..9), any::<bool>()).prop_map(|(bytes, padded)| {
            use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
            use base64::Engine;
            format!(":{}:", if padded { STANDARD.encode(&bytes) } else { STANDARD_NO_PAD.encode(&bytes) })
        }),
        Just("?0".to_string()),
        Just("?1".to_string()),
        visible_key().prop_map(|s| quoted(&s[..s.len().min(8)])),
    ];
    let parameter = (" {0,2}", "[a-z*][a-z0-9_.*-]{0,6}", proptest::option::of(value))
        .prop_map(|(sp, name, value)| format!(";{sp}{name}{}", value.map(|v| format!("={v}")).unwrap_or_default()));
    proptest::collection::vec(parameter, 0..4).prop_map(|p| p.concat())
}

fn header_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..300),
        "[ -~]{0,40}".prop_map(String::into_bytes),
        // Structured-field lookalikes, mostly almost right.
        "[ (]?\"([!-~]|\\\\[\"\\\\a]){0,12}\"?( ?[;,] ?[a-zA-Z*0-9]{0,4}(=[-?:\"a-z0-9.]{0,6})?){0,3}\\)?"
            .prop_map(String::into_bytes),
    ]
}

/// What every answer of the key parser must satisfy.
fn well_behaved(raw: &[u8], parsed: &Result<IdempotencyKey, KeyError>) -> Result<(), TestCaseError> {
    match parsed {
        Ok(key) => {
            let key = key.as_str();
            prop_assert!((1..=MAX_LEN).contains(&key.len()), "{raw:?} gave a key of {} bytes", key.len());
            prop_assert!(key.bytes().all(|b| b.is_ascii_graphic()), "{raw:?} gave {key:?}");
            // Quoting a key (as a client switching to the sf-string form would) keeps it the same.
            let again = IdempotencyKey::parse_header(quoted(key).as_bytes());
            prop_assert_eq!(again.as_ref().ok().map(IdempotencyKey::as_str), Some(key));
        }
        Err(KeyError::Missing) => prop_assert!(false, "a header value is never a missing header"),
        Err(KeyError::Invalid(why)) => {
            prop_assert!(why.contains("Idempotency-Key"), "{raw:?} refused with {why:?}");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn any_key_header_is_accepted_as_a_visible_key_or_refused_with_a_reason(raw in header_value()) {
        well_behaved(&raw, &IdempotencyKey::parse_header(&raw))?;
    }

    #[test]
    fn every_visible_key_round_trips_through_an_sf_string_with_any_parameters(key in visible_key(), params in parameters()) {
        let header = format!("{}{params}", quoted(&key));
        let parsed = IdempotencyKey::parse_header(header.as_bytes());
        prop_assert_eq!(parsed.as_ref().map(IdempotencyKey::as_str), Ok(key.as_str()), "{}", header);
    }

    #[test]
    fn a_bare_key_that_cannot_be_read_as_a_list_or_parameters_is_taken_whole(key in visible_key()) {
        let parsed = IdempotencyKey::parse_header(key.as_bytes());
        well_behaved(key.as_bytes(), &parsed)?;
        let plain = !key.contains([',', ';']) && !key.starts_with(['(', '"']);
        if plain {
            prop_assert_eq!(parsed.as_ref().ok().map(IdempotencyKey::as_str), Some(key.as_str()));
        } else {
            prop_assert!(parsed.is_err() || key.starts_with('"'));
        }
    }

    #[test]
    fn a_mutated_valid_header_is_still_parsed_sanely(key in visible_key(), params in parameters(), edits in edits()) {
        let raw = mutated(format!("{}{params}", quoted(&key)).as_bytes(), &edits);
        well_behaved(&raw, &IdempotencyKey::parse_header(&raw))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn two_keys_are_a_list_and_refused_as_one(a in visible_key(), b in visible_key(), sp in "[ \t]{0,2}", bare in any::<bool>()) {
        let header = if bare { format!("{a},{sp}{b}") } else { format!("{},{sp}{}", quoted(&a), quoted(&b)) };
        match IdempotencyKey::parse_header(header.as_bytes()) {
            Err(KeyError::Invalid(why)) => prop_assert!(!why.is_empty()),
            other => prop_assert!(false, "{header:?} gave {other:?}"),
        }
    }
}

// ---- Prefer -----------------------------------------------------------------------------------

/// One preference as generated, with what it should mean.
#[derive(Debug, Clone)]
struct Preference {
    text: String,
    name: String,
    value: Option<String>,
}

fn preference() -> impl Strategy<Value = Preference> {
    let name = prop_oneof![
        Just("wait".to_string()),
        Just("WAIT".to_string()),
        Just("respond-async".to_string()),
        Just("Respond-Async".to_string()),
        "[a-z][a-z0-9!#$%&'*+.^_`|~-]{0,8}",
    ];
    // A value is a token or a quoted string, which may hide commas, semicolons and preferences.
    let value = prop_oneof![
        "[0-9]{1,22}".prop_map(|v| (v.clone(), v)),
        "[+-]?[0-9a-z.]{1,6}".prop_map(|v| (v.clone(), v)),
        "[ -~]{0,12}".prop_map(|v| (format!("\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")), v)),
        Just(("\"x, wait=5; respond-async\"".to_string(), "x, wait=5; respond-async".to_string())),
    ];
    let parameter = ("[a-z]{1,5}", proptest::option::of(prop_oneof!["[a-z0-9]{1,4}", Just("\"a,b;c\"".to_string())]))
        .prop_map(|(n, v)| v.map(|v| format!("{n}={v}")).unwrap_or(n));
    (name, proptest::option::of(value), proptest::collection::vec(parameter, 0..3), "[ \t]{0,2}", "[ \t]{0,2}")
        .prop_map(|(name, value, params, bws, ows)| {
            let mut text = name.clone();
            if let Some((written, _)) = &value {
                text.push_str(&format!("{bws}={bws}{written}"));
            }
            for p in params {
                text.push_str(&format!("{ows};{ows}{p}"));
            }
            let value = value.map(|(_, meant)| meant).filter(|v| !v.is_empty());
            Preference { text, name, value }
        })
}

/// What RFC 7240 makes of a list of preferences: the first instance of each counts.
fn meaning(preferences: &[Preference]) -> Prefer {
    let first = |name: &str| preferences.iter().find(|p| p.name.eq_ignore_ascii_case(name));
    let wait = first("wait").and_then(|p| p.value.as_deref()).filter(|v| v.bytes().all(|b| b.is_ascii_digit()));
    Prefer {
        respond_async: first("respond-async").is_some(),
        wait: wait.map(|v| Duration::from_secs(v.parse::<u64>().unwrap_or(u64::MAX).min(MAX_WAIT_SECS))),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn any_prefer_header_is_read_without_panic_and_waits_at_most_the_maximum(
        lines in proptest::collection::vec(prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..60),
            "[ -~]{0,40}".prop_map(String::into_bytes),
            "([ ,;=\"\\\\]|wait|respond-async|[0-9]){0,16}".prop_map(String::into_bytes),
        ], 0..3)
    ) {
        let prefer = Prefer::parse(lines.iter().map(Vec::as_slice));
        prop_assert!(prefer.wait.is_none_or(|w| w <= Duration::from_secs(MAX_WAIT_SECS)));
    }

    #[test]
    fn well_formed_preferences_mean_what_rfc_7240_says_on_one_line_or_many(
        preferences in proptest::collection::vec(preference(), 0..5),
        ows in "[ \t]{0,2}",
        breaks in proptest::collection::vec(any::<bool>(), 5),
    ) {
        let joined = preferences.iter().map(|p| p.text.as_str()).collect::<Vec<_>>().join(&format!("{ows},{ows}"));
        prop_assert_eq!(Prefer::parse([joined.as_bytes()]), meaning(&preferences), "{}", joined);
        // The same list spread over several field lines.
        let mut lines = vec![String::new()];
        for (p, next_line) in preferences.iter().zip(&breaks) {
            if *next_line {
                lines.push(String::new());
            }
            let line = lines.last_mut().unwrap();
            line.push_str(&format!("{},{ows}", p.text));
        }
        prop_assert_eq!(Prefer::parse(lines.iter().map(|l| l.as_bytes())), meaning(&preferences), "{:?}", lines);
    }
}

// ---- Retry-After ------------------------------------------------------------------------------

/// 2001-09-09, a Sunday; the dates generated are around it, from 1970 on.
const NOW: u64 = 1_000_000_000;

fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(NOW)
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`) rewritten in asctime's form.
fn asctime(imf: &str) -> String {
    let p: Vec<&str> = imf.split(' ').collect();
    let day = p[1].trim_start_matches('0');
    format!("{} {} {day:>2} {} {}", &p[0][..3], p[2], p[4], p[3])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn any_retry_after_is_read_without_panic_and_bounded(
        value in prop_oneof![
            "\\PC{0,40}",
            "[ \t]?[A-Za-z]{3}, [0-9]{2} [A-Za-z]{3} [0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2} GMT[ \t]?",
            "[ \t+-]?[0-9]{0,25}[ .s]?",
        ],
        now in 0u64..300_000_000_000,
    ) {
        let parsed = parse_retry_after(&value, SystemTime::UNIX_EPOCH + Duration::from_secs(now));
        prop_assert!(parsed.is_none_or(|d| d <= MAX_RETRY_AFTER));
        if value.trim_matches([' ', '\t']).starts_with(['+', '-']) {
            prop_assert_eq!(parsed, None, "a sign is not delay-seconds: {:?}", value);
        }
    }

    #[test]
    fn delay_seconds_are_read_exactly_up_to_the_ceiling(secs: u64, zeros in "0{0,3}", ows in "[ \t]{0,2}") {
        let parsed = parse_retry_after(&format!("{ows}{zeros}{secs}{ows}"), now());
        prop_assert_eq!(parsed, Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER)));
    }

    #[test]
    fn an_http_date_is_the_time_until_it_in_any_of_its_three_forms(at in 0u64..253_402_300_799) {
        let when = SystemTime::UNIX_EPOCH + Duration::from_secs(at);
        let expected = Duration::from_secs(at.saturating_sub(NOW)).min(MAX_RETRY_AFTER);
        let imf = httpdate::fmt_http_date(when);
        prop_assert_eq!(parse_retry_after(&imf, now()), Some(expected), "{}", imf);
        prop_assert_eq!(parse_retry_after(&asctime(&imf), now()), Some(expected), "{}", asctime(&imf));
    }
}

// ---- MCP: a POSTed JSON-RPC body ---------------------------------------------------------------

/// A `tools/call` as an agent sends it: an id, a tool, arguments, maybe a key in either place.
fn tool_call() -> impl Strategy<Value = String> {
    let id = prop_oneof![any::<u32>().prop_map(|n| n.to_string()), "\"[a-z0-9-]{1,12}\""];
    let key = prop_oneof![
        Just(String::new()),
        "[!-~&&[^\"\\\\]]{1,20}".prop_map(|k| format!(",\"idempotencyKey\":\"{k}\"")),
        "[!-~&&[^\"\\\\]]{1,20}".prop_map(|k| format!(",\"_meta\":{{\"io.idem/idempotencyKey\":\"{k}\"}}")),
    ];
    (id, "[a-z_]{1,12}", any::<i64>(), key).prop_map(|(id, tool, amount, key)| {
        format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":{id},\"method\":\"tools/call\",\"params\":{{\"name\":\"{tool}\",\
             \"arguments\":{{\"amount\":{amount}}}{key}}}}}"
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// No body panics the reader; a refusal is one of the three codes documented.
    #[test]
    fn the_json_rpc_reader_never_panics_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Err(refused) = idem::test_support::read_mcp_message(&bytes) {
            prop_assert!([-32700, -32600, -32602].contains(&refused.code), "{refused:?}");
        }
        let _ = idem::record::tool_called(&bytes);
    }

    /// A tool call read as written, and any edit of it read without a panic: a refusal answers
    /// with the request's id whenever it reads one, so that the client can match it.
    #[test]
    fn a_tool_call_is_read_as_sent_and_its_mutations_never_panic(call in tool_call(), edits in edits()) {
        match idem::test_support::read_mcp_message(call.as_bytes()) {
            Ok(idem::test_support::Incoming::ToolCall(read)) => {
                let sent: serde_json::Value = serde_json::from_str(&call).unwrap();
                prop_assert_eq!(&read.tool, &sent["params"]["name"]);
                prop_assert_eq!(&read.id, &sent["id"]);
                prop_assert_eq!(idem::record::tool_called(call.as_bytes()), Some(read.tool.clone()));
            }
            other => prop_assert!(false, "{call}: {other:?}"),
        }
        let mutated = mutated(call.as_bytes(), &edits);
        if let Err(refused) = idem::test_support::read_mcp_message(&mutated) {
            prop_assert!([-32700, -32600, -32602].contains(&refused.code), "{refused:?}");
        }
    }
}
