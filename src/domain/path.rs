//! Request paths at the edge (docs/security.md): the path a route matches is the path stored and the
//! path sent upstream, byte for byte.
//!
//! A URL parser between the broker and the upstream's handler — the HTTP client's, a framework's,
//! a servlet container's — resolves `..` and `.` segments, and many decode `%2e` first. A path
//! matched as `/payments/../admin` would then reach `/admin`, outside its route. So a path that
//! any of them could rewrite is refused before it is matched, recorded or sent; and the upstream
//! URL is checked after it is built, so that what the client parser did to it cannot pass unseen.

use percent_encoding::percent_decode_str;

/// Why a request path is refused: said to the client in a 400 problem `invalid-path`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidPath {
    #[error("the path has a `.` or `..` segment (literal or percent-encoded), which could take it outside its route")]
    DotSegment,
    #[error("the path contains characters that must be percent-encoded, so it would not reach the upstream as sent")]
    NotAsSent,
}

/// Refuses a path with a dot-segment in any spelling that some parser on the way resolves:
/// `..`, `.`, `%2e%2E`, `.%2e`; one hidden behind an encoded or back slash (`%2e%2e%2f`,
/// `..\`); and one followed by a matrix parameter (`..;x`), which servlet containers strip.
pub(crate) fn check(path: &str) -> Result<(), InvalidPath> {
    if path.split('/').any(segment_may_climb) {
        return Err(InvalidPath::DotSegment);
    }
    Ok(())
}

fn segment_may_climb(segment: &str) -> bool {
    // Most segments have no dot and nothing encoded: nothing to decode.
    if !segment.bytes().any(|b| matches!(b, b'.' | b'%' | b'\\')) {
        return false;
    }
    let decoded = percent_decode_str(segment).decode_utf8_lossy();
    decoded.split(['/', '\\']).any(|part| {
        let part = part.split(';').next().unwrap_or(part);
        part == "." || part == ".."
    })
}

/// Whether a path (already [`check`]ed) reaches the upstream as it is, known without building
/// its URL: every byte one that a URL's path keeps as written, whatever base it follows. For such
/// a path [`upstream_url`] cannot refuse, so a duplicate answered from memory never pays for a URL
/// it would not send.
pub(crate) fn sent_as_is(path: &str) -> bool {
    // `*` (an `OPTIONS *`) and the empty path of an authority-form request become `/…` in a URL.
    path.starts_with('/') && path.bytes().all(|b| b.is_ascii_alphanumeric() || b"/-._~!$&'()*+,;=:@%".contains(&b))
}

/// The upstream URL for a request path (already [`check`]ed) and query: `base` with its path
/// replaced by its own path (without its trailing slash) followed by `path`, and the query set.
/// Refused if the URL's path is not then exactly that: the HTTP client would send something
/// other than what was matched and recorded.
pub(crate) fn upstream_url(base: &url::Url, path: &str, query: &str) -> Result<url::Url, InvalidPath> {
    let base_path = base.path().trim_end_matches('/');
    let mut url = base.clone();
    url.set_path(&format!("{base_path}{path}"));
    url.set_query((!query.is_empty()).then_some(query));
    let sent = url.path();
    let as_matched = sent.len() == base_path.len() + path.len() && sent.starts_with(base_path) && sent.ends_with(path);
    if !as_matched {
        return Err(InvalidPath::NotAsSent);
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_segments_are_refused_in_every_spelling() {
        for path in [
            "/payments/../admin",
            "/payments/./x",
            "/payments/..",
            "/payments/.",
            "/payments/%2e%2e/secret",
            "/payments/%2E%2E/secret",
            "/payments/.%2e/secret",
            "/payments/%2E./secret",
            "/payments/%2e/x",
            "/payments/%2e%2e%2fsecret",
            "/payments/%2e%2e%2Fsecret",
            "/payments/..%5csecret",
            "/payments/..\\secret",
            "/payments\\..\\secret",
            "/payments/..;jsessionid=1/secret",
            "/orders/../../x",
            "/..",
        ] {
            assert_eq!(check(path), Err(InvalidPath::DotSegment), "{path}");
        }
    }

    #[test]
    fn dots_inside_a_segment_are_ordinary_characters() {
        for path in
            ["/payments/a.b", "/payments/...", "/payments/.well-known", "/payments/v1.2/x..y", "/", "/p/%2e%2e%2e"]
        {
            assert_eq!(check(path), Ok(()), "{path}");
        }
    }

    fn base(text: &str) -> url::Url {
        text.parse().unwrap()
    }

    #[test]
    fn the_url_sent_has_the_path_matched() {
        let url = upstream_url(&base("http://up:9000"), "/payments/42", "a=1").unwrap();
        assert_eq!(url.as_str(), "http://up:9000/payments/42?a=1");
        let url = upstream_url(&base("http://up/orders-api"), "/orders/7", "").unwrap();
        assert_eq!(url.path(), "/orders-api/orders/7");
        // Percent-encoded bytes stay as they came.
        let url = upstream_url(&base("http://up"), "/payments/a%2Fb%20c", "").unwrap();
        assert_eq!(url.path(), "/payments/a%2Fb%20c");
    }

    #[test]
    fn a_path_the_client_would_rewrite_is_refused() {
        // Unchecked dot-segments would leave the base path; a parser rewrites them.
        assert_eq!(upstream_url(&base("http://up/orders-api"), "/orders/../../x", ""), Err(InvalidPath::NotAsSent));
        // Characters a URL parser percent-encodes, and back slashes it turns into slashes.
        assert_eq!(upstream_url(&base("http://up"), "/payments/{x}", ""), Err(InvalidPath::NotAsSent));
        assert_eq!(upstream_url(&base("http://up"), "/payments\\x", ""), Err(InvalidPath::NotAsSent));
    }

    proptest::proptest! {
        /// Setting the path and query on a copy of the parsed base gives what parsing the whole
        /// URL gave: the same URL, or the same refusal.
        #[test]
        fn a_copy_of_the_base_agrees_with_parsing_the_whole_url(
            base_path in proptest::sample::select(vec!["", "/orders-api", "/v1/a%2Fb"]),
            path in "/[a-zA-Z0-9%./\\;:@!$&'()*+,=~_{}|^`\\[\\] -]{0,24}",
            query in "[a-zA-Z0-9%=&/?:@ +-]{0,12}",
        ) {
            // What reaches it comes from a request's URI.
            let uri = if query.is_empty() { path.clone() } else { format!("{path}?{query}") };
            proptest::prop_assume!(uri.parse::<http::Uri>().is_ok_and(|u| u.path() == path));
            let text = format!("http://up:9000{base_path}");
            let whole = if query.is_empty() { format!("{text}{path}") } else { format!("{text}{path}?{query}") };
            let expected = url::Url::parse(&whole).ok().filter(|url| url.path() == format!("{base_path}{path}"));
            let got = upstream_url(&base(&text), &path, &query).ok();
            proptest::prop_assert_eq!(got, expected);
        }

        /// A path said to reach the upstream as it is does, after any base.
        #[test]
        fn a_path_sent_as_is_is_never_refused(
            base_path in proptest::sample::select(vec!["", "/", "/orders-api", "/orders-api/", "/v1/a%2Fb", "/a.b/..c"]),
            path in "/?[a-zA-Z0-9%./\\;:@!$&'()*+,=~_{}|^`\\[\\] -]{0,12}",
        ) {
            proptest::prop_assume!(check(&path).is_ok());
            let url = upstream_url(&base(&format!("http://up:9000{base_path}")), &path, "");
            proptest::prop_assert!(!sent_as_is(&path) || url.is_ok(), "{path} after {base_path}: {url:?}");
        }
    }

    #[test]
    fn a_path_a_parser_would_encode_is_not_said_to_be_sent_as_is() {
        assert!(sent_as_is("/payments/v1.2/a%2Fb;x=1"));
        for path in ["/payments/{x}", "/payments\\x", "/payments/a b", "/payments/é", "/payments/a|b", "/p/`", "*", ""]
        {
            assert!(!sent_as_is(path), "{path}");
        }
    }
}
