//! Keys for clients that send none, and fingerprints that ignore what changes on every retry
//! (docs/agents.md). A tool-calling agent mints a new call id each turn and stamps its arguments with
//! the time: its true retries share neither a key nor a body. The route says which parts of the
//! request name the operation (`key_from`) and which parts do not count (`fingerprint_ignore`).

use http::HeaderMap;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::config::{KeySource, Route};
use crate::domain::fingerprint::canonical_json;
use crate::domain::key::{IdempotencyKey, MissingSource, DERIVED_PREFIX as PREFIX};
use crate::domain::Tenant;

/// The key of a request without one: a digest of the route, the tenant and each source's
/// canonical value (a header's bytes; a JSON value with its object keys sorted), so that the same
/// tool call with re-serialised arguments gets the same key, and two tenants never share one.
pub(crate) fn key(
    route: &Route,
    tenant: &Tenant,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<IdempotencyKey, MissingSource> {
    let missing = |source: &KeySource| MissingSource(source.to_string());
    let document = || serde_json::from_slice::<Value>(body).ok();
    let mut parsed: Option<Option<Value>> = None;
    let mut digest = Sha256::new();
    for part in ["idem derived key", &route.name, tenant] {
        digest.update((part.len() as u64).to_be_bytes());
        digest.update(part.as_bytes());
    }
    for source in &route.key_from {
        let value = match source {
            KeySource::Header(name) => headers.get(name).ok_or_else(|| missing(source))?.as_bytes().to_vec(),
            KeySource::Json(pointer) => {
                let document = parsed.get_or_insert_with(document).as_ref().ok_or_else(|| missing(source))?;
                let value = document.pointer(pointer).ok_or_else(|| missing(source))?;
                let text = serde_json::to_vec(value).map_err(|_| missing(source))?;
                canonical_json(&text).unwrap_or(text)
            }
        };
        digest.update((value.len() as u64).to_be_bytes());
        digest.update(&value);
    }
    let key = format!("{PREFIX}{}", hex::encode(digest.finalize()));
    Ok(IdempotencyKey::parse(&key).expect("a prefix and 64 hex digits make a valid key"))
}

/// The body with every `pointers` member removed, re-serialised; `None` when nothing changes
/// (no pointer given, the body is not JSON, or none of them is there).
pub(crate) fn without_ignored(body: &[u8], pointers: &[String]) -> Option<Vec<u8>> {
    if pointers.is_empty() {
        return None;
    }
    let mut document: Value = serde_json::from_slice(body).ok()?;
    let removed = pointers.iter().filter(|p| remove(&mut document, p)).count();
    if removed == 0 {
        return None;
    }
    serde_json::to_vec(&document).ok()
}

/// Removes what an RFC 6901 pointer names; false if it names nothing (or the whole document).
fn remove(document: &mut Value, pointer: &str) -> bool {
    let Some((parent, last)) = pointer.rsplit_once('/') else { return false };
    let last = last.replace("~1", "/").replace("~0", "~");
    match document.pointer_mut(parent) {
        Some(Value::Object(members)) => members.shift_remove(&last).is_some(),
        Some(Value::Array(items)) => match last.parse::<usize>() {
            Ok(i) if i < items.len() => {
                items.remove(i);
                true
            }
            _ => false,
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn route(extra: &str) -> Route {
        let text =
            format!("[[routes]]\nname = \"tools\"\npath_prefix = \"/tools\"\nupstream = \"http://x\"\n{extra}\n");
        Config::parse_with_env(&text, |_| None).unwrap().routes.remove(0)
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        pairs.iter().map(|(n, v)| (http::HeaderName::from_static(n), v.parse().unwrap())).collect()
    }

    #[test]
    fn a_derived_key_follows_the_sources_not_their_spelling() {
        let r = route(r#"key_from = ["header:x-agent-run", "json:/tool", "json:/arguments"]"#);
        let h = headers(&[("x-agent-run", "run-7")]);
        let a =
            key(&r, &"default".into(), &h, br#"{"tool":"refund","arguments":{"order":1,"amount":5},"call_id":"c1"}"#)
                .unwrap();
        let b = key(
            &r,
            &"default".into(),
            &h,
            br#"{ "call_id":"c2", "arguments": {"amount":5, "order":1}, "tool":"refund" }"#,
        )
        .unwrap();
        assert_eq!(a, b, "another call id and key order: the same operation");
        assert!(a.as_str().starts_with(PREFIX) && a.as_str().len() == PREFIX.len() + 64, "{a}");
        let other_args =
            key(&r, &"default".into(), &h, br#"{"tool":"refund","arguments":{"order":2,"amount":5}}"#).unwrap();
        assert_ne!(a, other_args);
        let other_run = key(
            &r,
            &"default".into(),
            &headers(&[("x-agent-run", "run-8")]),
            br#"{"tool":"refund","arguments":{"order":1,"amount":5}}"#,
        )
        .unwrap();
        assert_ne!(a, other_run);
        let other_tenant =
            key(&r, &"acme".into(), &h, br#"{"tool":"refund","arguments":{"order":1,"amount":5}}"#).unwrap();
        assert_ne!(a, other_tenant);
    }

    #[test]
    fn a_missing_source_is_named() {
        let r = route(r#"key_from = ["header:x-agent-run", "json:/tool"]"#);
        let body = br#"{"tool":"refund"}"#;
        assert_eq!(key(&r, &"t".into(), &HeaderMap::new(), body), Err(MissingSource("header:x-agent-run".into())));
        let h = headers(&[("x-agent-run", "r")]);
        assert_eq!(key(&r, &"t".into(), &h, b"{}"), Err(MissingSource("json:/tool".into())));
        assert_eq!(key(&r, &"t".into(), &h, b"not json"), Err(MissingSource("json:/tool".into())));
    }

    #[test]
    fn ignored_members_are_removed_wherever_they_are() {
        let pointers = vec!["/timestamp".to_string(), "/metadata/nonce".into(), "/items/0".into(), "/a~1b".into()];
        let body = br#"{"timestamp":1,"metadata":{"nonce":"x","keep":true},"items":[9,8],"a/b":0,"v":1}"#;
        let out = without_ignored(body, &pointers).unwrap();
        assert_eq!(out, br#"{"metadata":{"keep":true},"items":[8],"v":1}"#);
        assert_eq!(without_ignored(br#"{"v":1}"#, &pointers), None, "nothing to remove");
        assert_eq!(without_ignored(b"plain text", &pointers), None);
        assert_eq!(without_ignored(body, &[]), None);
    }
}
