use super::*;

fn canon(text: &str) -> Option<String> {
    canonical_json(text.as_bytes()).map(|v| String::from_utf8(v).unwrap())
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of("payments", "POST", "/payments", "", Some(b"application/json"), body.as_bytes())
}

#[test]
fn reserialised_json_has_the_same_fingerprint() {
    assert_eq!(fp(r#"{"a":1,"b":2}"#), fp("{ \"b\": 2,\n  \"a\": 1 }"));
    assert_eq!(
        fp(r#"{"x":{"z":[1,{"q":true,"p":null}],"y":"\u00e9"}}"#),
        fp(r#"{"x":{"y":"é","z":[1,{"p":null,"q":true}]}}"#)
    );
    assert_eq!(fp(r#"{"s":"a\/b"}"#), fp(r#"{"s":"a/b"}"#));
}

#[test]
fn any_change_in_meaning_changes_the_fingerprint() {
    let base = fp(r#"{"amount":100,"currency":"eur"}"#);
    assert_ne!(base, fp(r#"{"amount":101,"currency":"eur"}"#));
    assert_ne!(base, fp(r#"{"amount":100,"currency":"EUR"}"#));
    assert_ne!(base, fp(r#"{"amount":100}"#));
    assert_ne!(base, fp(r#"[{"amount":100,"currency":"eur"}]"#));
    // Numbers are compared as written: no float rounding can merge two different amounts.
    assert_ne!(fp(r#"{"n":12345678901234567890123}"#), fp(r#"{"n":12345678901234567890124}"#));
    assert_ne!(fp(r#"{"n":1.0}"#), fp(r#"{"n":1}"#));
    // Duplicate keys are kept, so a last-wins and a first-wins reading are not confused.
    assert_ne!(fp(r#"{"a":1,"a":2}"#), fp(r#"{"a":2}"#));
}

#[test]
fn route_method_path_and_query_are_part_of_the_fingerprint() {
    let f = |route, method, path, query| Fingerprint::of(route, method, path, query, None, b"{}");
    let base = f("payments", "POST", "/payments", "");
    assert_ne!(base, f("refunds", "POST", "/payments", ""));
    assert_ne!(base, f("payments", "PATCH", "/payments", ""));
    assert_ne!(base, f("payments", "POST", "/payments/1", ""));
    assert_ne!(base, f("payments", "POST", "/payments", "x=1"));
    // Length prefixes keep field boundaries: moving a character between fields matters.
    assert_ne!(f("a", "POST", "/bc", ""), f("ab", "POST", "/c", ""));
}

#[test]
fn non_json_bodies_are_hashed_as_bytes() {
    let text = |body: &str| Fingerprint::of("r", "POST", "/", "", Some(b"text/plain"), body.as_bytes());
    assert_ne!(text(r#"{"a":1,"b":2}"#), text(r#"{"b":2,"a":1}"#));
    assert_eq!(text("hello"), text("hello"));
    // Invalid JSON under a JSON content type falls back to bytes instead of failing.
    assert_ne!(fp("{not json"), fp("{not  json"));
    assert_eq!(fp("{not json"), fp("{not json"));
}

#[test]
fn json_content_types_are_recognised() {
    assert!(is_json(None));
    assert!(is_json(Some(b"application/json")));
    assert!(is_json(Some(b"Application/JSON; charset=utf-8")));
    assert!(is_json(Some(b"application/merge-patch+json")));
    assert!(!is_json(Some(b"text/plain")));
    assert!(!is_json(Some(b"application/x-www-form-urlencoded")));
}

#[test]
fn the_canonical_form_is_compact_sorted_and_escaped_one_way() {
    assert_eq!(canon(" { \"b\" : [ 1 , 2.50e+3 ] , \"a\" : \"x\\ty\" } ").unwrap(), r#"{"a":"x\ty","b":[1,2.50e+3]}"#);
    assert_eq!(canon(r#""\u0001\ud83d\ude00""#).unwrap(), "\"\\u0001😀\"");
    assert_eq!(canon("[]").unwrap(), "[]");
    assert_eq!(canon("{}").unwrap(), "{}");
    assert_eq!(canon("-0.5E-2").unwrap(), "-0.5E-2");
}

#[test]
fn malformed_json_is_not_canonicalised() {
    for bad in [
        "",
        "{",
        "[1,]",
        "{\"a\"}",
        "{\"a\":1,}",
        "01",
        "1.",
        "-",
        "+1",
        ".5",
        "1e",
        "tru",
        "nul",
        "\"abc",
        "\"\\x\"",
        "\"\\ud800\"",
        "\"\t\"",
        "[1] 2",
        "{\"a\":1}}",
    ] {
        assert_eq!(canon(bad), None, "{bad:?}");
    }
    let deep = "[".repeat(200) + &"]".repeat(200);
    assert_eq!(canon(&deep), None);
    let ok = "[".repeat(100) + &"]".repeat(100);
    assert!(canon(&ok).is_some());
}

#[test]
fn a_signed_or_short_unicode_escape_is_not_json_and_shares_no_fingerprint() {
    assert_eq!(canon(r#"{"s":"\u+041"}"#), None);
    assert_ne!(fp(r#"{"s":"\u+041"}"#), fp(r#"{"s":"A"}"#));
    for bad in [r#""\u-041""#, r#""\u 041""#, r#""\u04g1""#, r#""\u041""#, r#""\u""#, r#""\uD83D\u+E00""#] {
        assert_eq!(canon(bad), None, "{bad}");
    }
    assert_eq!(canon(r#""\u0041\u00e9\u00E9""#).unwrap(), "\"Aéé\"");
}

#[test]
fn surrogates_must_come_in_pairs() {
    assert_eq!(canon(r#""\ud83d\ude00""#).unwrap(), "\"😀\"");
    for lone in
        [r#""\ude00""#, r#""\ud83d""#, r#""\ud83dx""#, r#""\ud83d\n""#, r#""\ud83d\u0041""#, r#""\ud83d\ud83d""#]
    {
        assert_eq!(canon(lone), None, "{lone}");
    }
}

#[test]
fn numbers_follow_the_rfc_grammar_and_are_kept_as_written_whatever_their_magnitude() {
    for good in ["0", "-0", "10", "1.5", "1e5", "1E+5", "1e-5", "1.0e05", "-0.0e-0", "1e-400", "0e999999999999"] {
        assert_eq!(canon(good).as_deref(), Some(good), "{good}");
    }
    for bad in ["00", "-01", "+1", ".5", "1.", "1.e5", "1e", "1e+", "-", "--1", "0x10", "1_000", "NaN", "Infinity"] {
        assert_eq!(canon(bad), None, "{bad}");
    }
    // Beyond f64, where serde_json refuses: still numbers, kept digit for digit.
    let long = format!("1{}", "0".repeat(400));
    for huge in ["1e400", "-1e400", "1e999999", "1E+99999999999999999999", "0.1e310", long.as_str()] {
        assert_eq!(canon(huge).as_deref(), Some(huge), "{huge}");
    }
    assert_eq!(canon(r#"{"b":1e999999,"a":2}"#), canon(r#"{ "a":2, "b":1e999999 }"#));
    assert_ne!(canon("1e999999"), canon("1e999998"));
}

#[test]
fn only_json_whitespace_is_insignificant() {
    assert!(canon(" \t\r\n[ 1 ]\n").is_some());
    for bad in ["\u{feff}{}", "{}\u{0c}", "\u{a0}1", "[1,\u{0b}2]"] {
        assert_eq!(canon(bad), None, "{bad:?}");
    }
}

#[test]
fn nesting_stops_where_serde_json_stops() {
    let nest = |n: usize| "[".repeat(n) + &"]".repeat(n);
    assert!(canon(&nest(MAX_DEPTH)).is_some());
    assert_eq!(canon(&nest(MAX_DEPTH + 1)), None);
    assert!(serde_json::from_str::<serde_json::Value>(&nest(MAX_DEPTH)).is_ok());
    assert!(serde_json::from_str::<serde_json::Value>(&nest(MAX_DEPTH + 1)).is_err());
}

#[test]
fn duplicate_keys_are_kept_in_the_order_written() {
    assert_eq!(canon(r#"{"b":0,"a":1,"a":2}"#).unwrap(), r#"{"a":1,"a":2,"b":0}"#);
    assert_ne!(fp(r#"{"a":1,"a":2}"#), fp(r#"{"a":2,"a":1}"#));
    assert_eq!(canon(r#"{"\u0061":1,"a":2}"#).unwrap(), r#"{"a":1,"a":2}"#);
}

#[test]
fn object_keys_must_be_strings() {
    for bad in ["{1:2}", "{a:1}", "{null:1}", "{,}", "{\"a\":1,,\"b\":2}"] {
        assert_eq!(canon(bad), None, "{bad}");
    }
}
