//! Who is calling (docs/configuration.md `[auth]`, docs/agents.md): the tenant a request's token names, read the ways
//! SDKs send one — `Authorization: Bearer`, Basic with the token as user name or password, or a
//! header of the operator's choosing — and the scope of keys when the client's own credential
//! goes upstream.

use base64::Engine;
use http::{header, HeaderMap};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::Config;
use crate::domain::Tenant;
use crate::problem::Problem;

/// The tenant of a request: "default" without tenants (or, when keys are scoped by credential,
/// the digest of the client's `Authorization`); else the tenant whose token digest matches.
pub(crate) fn tenant(config: &Config, headers: &HeaderMap) -> Result<Tenant, Problem> {
    if !config.uses_tenants() {
        if config.scopes_by_credential() {
            if let Some(credential) = headers.get(header::AUTHORIZATION) {
                return Ok(credential_scope(credential.as_bytes()));
            }
        }
        return Ok(Tenant::default());
    }
    let mut candidates = tokens(config, headers);
    let found = candidates.find_map(|token| {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        config.auth.tenants.iter().find(|t| bool::from(t.token_sha256.ct_eq(&digest))).map(|t| t.name.clone())
    });
    found.ok_or_else(Problem::unauthorized)
}

/// A tenant name for the holder of a credential: its digest, so the credential itself is never
/// stored, and two credentials never share a scope.
fn credential_scope(credential: &[u8]) -> Tenant {
    let digest = Sha256::digest(credential);
    Tenant::from(format!("credential:{}", hex::encode(&digest[..16])))
}

/// Every token the request offers: the configured header's, then `Authorization`'s.
fn tokens<'a>(config: &Config, headers: &'a HeaderMap) -> impl Iterator<Item = String> + 'a {
    let from_header =
        config.auth.token_header.as_ref().and_then(|name| headers.get(name)).and_then(|v| v.to_str().ok());
    let from_authorization = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    from_header
        .map(|t| t.trim().to_string())
        .into_iter()
        .chain(from_authorization.into_iter().flat_map(authorization_tokens))
}

/// The tokens an `Authorization` value may carry: a bearer token, or a Basic pair's user name
/// and password (SDKs put an API key in either).
pub(crate) fn authorization_tokens(value: &str) -> Vec<String> {
    let Some((scheme, rest)) = scheme_and_credentials(value) else { return vec![] };
    if scheme.eq_ignore_ascii_case("bearer") {
        return vec![rest.to_string()];
    }
    if !scheme.eq_ignore_ascii_case("basic") {
        return vec![];
    }
    let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(rest) else { return vec![] };
    let Ok(pair) = String::from_utf8(decoded) else { return vec![] };
    let (user, password) = pair.split_once(':').unwrap_or((&pair, ""));
    [user, password].into_iter().filter(|t| !t.is_empty()).map(str::to_string).collect()
}

/// The bearer token of a request, if it has one.
pub(crate) fn bearer(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = scheme_and_credentials(value)?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.to_string())
}

/// An `Authorization` value's scheme and what follows it, trimmed; `None` without both.
fn scheme_and_credentials(value: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    Some((scheme, rest.trim()))
}

/// Compares two secrets in time that depends on neither: their digests are compared, so a
/// length mismatch does not return early either.
pub(crate) fn same_secret(given: &str, expected: &str) -> bool {
    let given: [u8; 32] = Sha256::digest(given.as_bytes()).into();
    let expected: [u8; 32] = Sha256::digest(expected.as_bytes()).into();
    given.ct_eq(&expected).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(pair: &str) -> String {
        format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair))
    }

    #[test]
    fn a_token_is_read_from_bearer_or_either_half_of_basic() {
        assert_eq!(authorization_tokens("Bearer sk_1"), ["sk_1"]);
        assert_eq!(authorization_tokens("bearer   sk_1 "), ["sk_1"]);
        assert_eq!(authorization_tokens(&basic("sk_1:")), ["sk_1"]);
        assert_eq!(authorization_tokens(&basic(":sk_1")), ["sk_1"]);
        assert_eq!(authorization_tokens(&basic("acct:sk_1")), ["acct", "sk_1"]);
        assert!(authorization_tokens("Basic not-base64!").is_empty());
        assert!(authorization_tokens("Digest x").is_empty());
        assert!(authorization_tokens("sk_1").is_empty());
    }

    #[test]
    fn secrets_are_compared_whole() {
        assert!(same_secret("s3cret", "s3cret"));
        assert!(!same_secret("s3cre", "s3cret"));
        assert!(!same_secret("", "s3cret"));
    }

    #[test]
    fn two_credentials_get_two_scopes_and_the_credential_is_not_in_its_name() {
        let a = credential_scope(b"Bearer sk_a");
        assert_ne!(a, credential_scope(b"Bearer sk_b"));
        assert_eq!(a, credential_scope(b"Bearer sk_a"));
        assert!(a.starts_with("credential:") && !a.contains("sk_a"), "{a}");
    }
}
