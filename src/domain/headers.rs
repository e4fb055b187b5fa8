//! The header names the broker owns on the way upstream: those it sets, strips or adds itself,
//! which the proxy leaves out of what it forwards and a route's own headers may not take.

/// Hop-by-hop headers (RFC 9110 §7.6.1): meaningful for one connection only, never forwarded or
/// stored. `content-length` is recomputed from the body we send.
pub(crate) const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

/// Request headers that belong to the broker or to the client's session with it, not upstream.
pub(crate) const CLIENT_ONLY: [&str; 4] = ["authorization", "cookie", "host", "prefer"];

/// Is this a header the broker or the connection already sets or strips, which a header of the
/// route's own (the deadline it tells the upstream) would clash with?
pub(crate) fn is_reserved(name: &str) -> bool {
    HOP_BY_HOP.contains(&name) || CLIENT_ONLY.contains(&name) || name == "content-type" || name == super::key::HEADER
}

/// The header an attempt carries its claim in unless its route names another (docs/guarantees.md).
pub(crate) const ATTEMPT_HEADER: http::HeaderName = http::HeaderName::from_static("idem-attempt");
