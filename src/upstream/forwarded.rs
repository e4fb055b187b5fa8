//! The client's address, told to the upstream (docs/configuration.md#server): `X-Forwarded-For`,
//! `X-Forwarded-Proto` and `Forwarded` (RFC 7239) on what goes upstream, as a reverse proxy
//! adds them. Set when the request arrives and stored with it, so every attempt, a take-over's
//! on another node included, names the client that sent it.
//!
//! What a client sends in these headers is its own word: it is replaced, so that no client can
//! pose as another address. Only a trusted proxy in front of Idem (`[server] trusted_proxies`)
//! has its list kept and extended with its own address.

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::config::Forwarding;
use crate::domain::Origin;
use crate::record::{header_bytes, header_text};

const FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const FORWARDED: HeaderName = http::header::FORWARDED;

/// `headers` (the request's, as forwarded upstream) with the forwarding headers set for a
/// request from `origin`. With forwarding off they are left as the client sent them; a request
/// with no origin (made in-process, never through a listener) has the client's removed.
pub(crate) fn forward(headers: &mut impl Carried, origin: Option<&Origin>, config: &Forwarding) {
    if !config.enabled {
        return;
    }
    let Some(origin) = origin else {
        for name in [FOR, PROTO, FORWARDED] {
            headers.remove_all(&name);
        }
        return;
    };
    let peer = origin.peer.ip().to_canonical();
    let trusted = config.trusted_proxies.iter().any(|net| net.contains(&peer));
    let proto = if origin.tls { "https" } else { "http" };
    // The scheme the first client used, as the first proxy in front of Idem said it.
    let first_proto = |all: Option<String>| all.and_then(|all| all.split(',').next().map(|p| p.trim().to_string()));
    let (chain, forwarded, sent_proto) = match trusted {
        true => (headers.joined(&FOR), headers.joined(&FORWARDED), first_proto(headers.joined(&PROTO))),
        false => (None, None, None),
    };
    // A trusted proxy that sent only `X-Forwarded-For`: `Forwarded` says the same addresses, so
    // that the two never contradict each other.
    let forwarded = forwarded.or_else(|| {
        let chain = chain.as_ref()?;
        Some(chain.split(',').map(|hop| format!("for={}", node_text(hop.trim()))).collect::<Vec<_>>().join(", "))
    });
    let element = format!("for={};proto={proto}", node(peer));
    let joined = |before: Option<String>, this: String| match before {
        Some(before) => format!("{before}, {this}"),
        None => this,
    };
    for name in [FOR, PROTO, FORWARDED] {
        headers.remove_all(&name);
    }
    headers.add(FOR, joined(chain, peer.to_string()));
    headers.add(PROTO, sent_proto.unwrap_or_else(|| proto.into()));
    headers.add(FORWARDED, joined(forwarded, element));
}

/// The headers a request carries upstream, as [`forward`] reads and sets the forwarding ones in
/// them: the stored list, or hyper's own map for a call never recorded. Values are read and
/// written as the stored list holds them (`record::header_text`).
pub(crate) trait Carried {
    /// Every value sent under `name`, joined with `, ` into one; `None` when none was.
    fn joined(&self, name: &HeaderName) -> Option<String>;
    fn remove_all(&mut self, name: &HeaderName);
    fn add(&mut self, name: HeaderName, value: String);
}

impl Carried for Vec<(String, String)> {
    fn joined(&self, name: &HeaderName) -> Option<String> {
        let values: Vec<&str> = self.iter().filter(|(n, _)| n == name.as_str()).map(|(_, v)| v.as_str()).collect();
        (!values.is_empty()).then(|| values.join(", "))
    }

    fn remove_all(&mut self, name: &HeaderName) {
        self.retain(|(n, _)| n != name.as_str());
    }

    fn add(&mut self, name: HeaderName, value: String) {
        self.push((name.as_str().into(), value));
    }
}

impl Carried for HeaderMap {
    fn joined(&self, name: &HeaderName) -> Option<String> {
        let values: Vec<String> = self.get_all(name).iter().map(|v| header_text(v.as_bytes())).collect();
        (!values.is_empty()).then(|| values.join(", "))
    }

    fn remove_all(&mut self, name: &HeaderName) {
        self.remove(name);
    }

    /// A value the stored list would hold and the send would then leave out (one that is no
    /// header value) is left out here too.
    fn add(&mut self, name: HeaderName, value: String) {
        if let Ok(value) = HeaderValue::from_bytes(&header_bytes(&value)) {
            self.append(name, value);
        }
    }
}

/// The client's address, as the access log names it: the first address a trusted proxy in
/// front of Idem forwarded for (`X-Forwarded-For`, or `Forwarded`'s first `for=`), or the
/// peer's own when it is no trusted proxy (or forwarding is off). Read only when written.
pub(crate) fn client_address(headers: &axum::http::HeaderMap, origin: &Origin, config: &Forwarding) -> ClientAddress {
    let peer = origin.peer.ip().to_canonical();
    let trusted = config.enabled && config.trusted_proxies.iter().any(|net| net.contains(&peer));
    let forwarded = trusted.then(|| (headers.get(FOR).cloned(), headers.get(FORWARDED).cloned()));
    ClientAddress { peer, forwarded }
}

/// See [`client_address`].
pub(crate) struct ClientAddress {
    peer: IpAddr,
    /// A trusted proxy's `X-Forwarded-For` and `Forwarded`, as it sent them.
    forwarded: Option<(Option<axum::http::HeaderValue>, Option<axum::http::HeaderValue>)>,
}

impl ClientAddress {
    /// The peer's address, when that is what the client's address is: no trusted proxy told
    /// another.
    pub(crate) fn peer_only(&self) -> Option<IpAddr> {
        self.forwarded.is_none().then_some(self.peer)
    }
}

impl std::fmt::Display for ClientAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let first = |value: &Option<axum::http::HeaderValue>| -> Option<String> {
            let first = value.as_ref()?.to_str().ok()?.split(',').next()?.trim();
            (!first.is_empty()).then(|| first.to_string())
        };
        let forwarded_for = |value: &Option<axum::http::HeaderValue>| -> Option<String> {
            let element = first(value)?;
            let value = element.split(';').find_map(|pair| pair.trim().strip_prefix("for="))?.trim_matches('"');
            // `[2001:db8::1]:4711`, `192.0.2.1:4711`: the address without its port.
            let host = match value.strip_prefix('[') {
                Some(v6) => v6.split(']').next().unwrap_or(v6),
                None if value.matches(':').count() == 1 => value.split(':').next().unwrap_or(value),
                None => value,
            };
            Some(host.to_string())
        };
        let told = self.forwarded.as_ref().and_then(|(xff, rfc)| first(xff).or_else(|| forwarded_for(rfc)));
        match told {
            Some(client) => f.write_str(&client),
            None => self.peer.fmt(f),
        }
    }
}

/// A hop of `X-Forwarded-For` as RFC 7239 writes a node: an address as [`node`] does, anything
/// else (a name, `unknown`) quoted.
fn node_text(hop: &str) -> String {
    match hop.parse::<IpAddr>() {
        Ok(ip) => node(ip),
        Err(_) => format!("\"{}\"", hop.replace(['"', '\\'], "")),
    }
}

/// An address as RFC 7239 writes a node: an IPv6 address in brackets, quoted.
fn node(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("\"[{v6}]\""),
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    fn origin(peer: &str, tls: bool) -> Origin {
        Origin { peer: SocketAddr::new(peer.parse().unwrap(), 50000), tls }
    }

    fn sent(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()
    }

    fn value<'a>(headers: &'a [(String, String)], name: &str) -> Vec<&'a str> {
        headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_str()).collect()
    }

    fn config(trusted: &[&str]) -> Forwarding {
        Forwarding { enabled: true, trusted_proxies: trusted.iter().map(|t| t.parse().unwrap()).collect() }
    }

    #[test]
    fn a_client_is_named_by_its_connection_and_what_it_claims_is_replaced() {
        let mut headers = sent(&[
            ("x-forwarded-for", "6.6.6.6"),
            ("forwarded", "for=6.6.6.6"),
            ("x-forwarded-proto", "https"),
            ("x-other", "kept"),
        ]);
        forward(&mut headers, Some(&origin("192.0.2.10", false)), &config(&[]));
        assert_eq!(value(&headers, "x-forwarded-for"), ["192.0.2.10"]);
        assert_eq!(value(&headers, "x-forwarded-proto"), ["http"]);
        assert_eq!(value(&headers, "forwarded"), ["for=192.0.2.10;proto=http"]);
        assert_eq!(value(&headers, "x-other"), ["kept"]);
    }

    #[test]
    fn a_trusted_proxys_list_is_kept_and_extended_with_the_proxy() {
        let mut headers = sent(&[
            ("x-forwarded-for", "203.0.113.5"),
            ("x-forwarded-for", "198.51.100.1"),
            ("forwarded", "for=203.0.113.5;proto=https"),
            ("x-forwarded-proto", "https"),
        ]);
        forward(&mut headers, Some(&origin("10.1.2.3", false)), &config(&["10.0.0.0/8"]));
        assert_eq!(value(&headers, "x-forwarded-for"), ["203.0.113.5, 198.51.100.1, 10.1.2.3"]);
        assert_eq!(value(&headers, "x-forwarded-proto"), ["https"], "the first client's scheme");
        assert_eq!(value(&headers, "forwarded"), ["for=203.0.113.5;proto=https, for=10.1.2.3;proto=http"]);
    }

    #[test]
    fn ipv6_is_bracketed_and_quoted_in_forwarded_and_mapped_ipv4_is_plain() {
        let mut headers = Vec::new();
        forward(&mut headers, Some(&origin("2001:db8::7", true)), &config(&[]));
        assert_eq!(value(&headers, "x-forwarded-for"), ["2001:db8::7"]);
        assert_eq!(value(&headers, "forwarded"), ["for=\"[2001:db8::7]\";proto=https"]);
        let mut headers = Vec::new();
        forward(&mut headers, Some(&origin("::ffff:192.0.2.1", false)), &config(&["192.0.2.0/24"]));
        assert_eq!(value(&headers, "x-forwarded-for"), ["192.0.2.1"], "{headers:?}");
    }

    #[test]
    fn off_nothing_is_touched_and_without_an_origin_the_clients_claims_go() {
        let before = sent(&[("x-forwarded-for", "6.6.6.6"), ("x-other", "kept")]);
        let mut headers = before.clone();
        forward(&mut headers, Some(&origin("192.0.2.10", false)), &Forwarding { enabled: false, ..config(&[]) });
        assert_eq!(headers, before);
        forward(&mut headers, None, &config(&[]));
        assert_eq!(headers, sent(&[("x-other", "kept")]));
    }

    #[test]
    fn a_trusted_proxys_chain_of_schemes_gives_the_first() {
        let mut headers = sent(&[("x-forwarded-proto", "https, http")]);
        forward(&mut headers, Some(&origin("10.1.2.3", false)), &config(&["10.0.0.0/8"]));
        assert_eq!(value(&headers, "x-forwarded-proto"), ["https"]);
    }

    /// A trusted proxy that sends only `X-Forwarded-For`: `Forwarded` names the same hops, so the
    /// two never contradict each other.
    #[test]
    fn a_trusted_proxys_x_forwarded_for_alone_is_said_in_forwarded_too() {
        let mut headers = sent(&[("x-forwarded-for", "203.0.113.9, 2001:db8::1, unknown")]);
        forward(&mut headers, Some(&origin("10.1.2.3", true)), &config(&["10.0.0.0/8"]));
        assert_eq!(value(&headers, "x-forwarded-for"), ["203.0.113.9, 2001:db8::1, unknown, 10.1.2.3"]);
        assert_eq!(
            value(&headers, "forwarded"),
            ["for=203.0.113.9, for=\"[2001:db8::1]\", for=\"unknown\", for=10.1.2.3;proto=https"]
        );
    }

    /// The access log's client: the first hop a trusted proxy forwarded for, else the peer.
    #[test]
    fn the_client_address_is_the_first_hop_behind_a_trusted_proxy_and_the_peer_otherwise() {
        let headers = |pairs: &[(&str, &str)]| {
            let mut map = axum::http::HeaderMap::new();
            for (name, value) in pairs {
                map.append(axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
            }
            map
        };
        let trusted = config(&["10.0.0.0/8"]);
        let via = origin("10.1.2.3", false);
        let xff = headers(&[("x-forwarded-for", "203.0.113.9, 10.9.9.9")]);
        assert_eq!(client_address(&xff, &via, &trusted).to_string(), "203.0.113.9");
        let rfc = headers(&[("forwarded", "for=\"[2001:db8::1]:4711\";proto=https, for=10.9.9.9")]);
        assert_eq!(client_address(&rfc, &via, &trusted).to_string(), "2001:db8::1");
        assert_eq!(
            client_address(&xff, &origin("192.0.2.7", false), &trusted).to_string(),
            "192.0.2.7",
            "not a trusted proxy"
        );
        assert_eq!(client_address(&headers(&[]), &via, &trusted).to_string(), "10.1.2.3", "nothing forwarded");
    }

    proptest::proptest! {
        /// A call never recorded has its forwarding headers set in hyper's map; a recorded one in
        /// its stored list. Both say the same.
        #[test]
        fn the_map_and_the_stored_list_are_forwarded_alike(
            sent in proptest::collection::vec((0..4usize, 0..5usize), 0..6),
            peer in proptest::sample::select(vec!["10.1.2.3", "192.0.2.10", "2001:db8::7", "::ffff:10.0.0.1"]),
            tls: bool,
            enabled: bool,
            from_listener: bool,
        ) {
            const NAMES: [&str; 4] = ["x-forwarded-for", "forwarded", "x-forwarded-proto", "x-other"];
            const VALUES: [&str; 5] = ["203.0.113.5", "for=203.0.113.5;proto=https", "https, http", "unknown", "caf\u{e9}"];
            let pairs: Vec<(String, String)> =
                sent.iter().map(|&(n, v)| (NAMES[n].to_string(), VALUES[v].to_string())).collect();
            let mut map = HeaderMap::new();
            for (name, value) in &pairs {
                map.append(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_bytes(&header_bytes(value)).unwrap());
            }
            let forwarding = Forwarding { enabled, ..config(&["10.0.0.0/8"]) };
            let origin = origin(peer, tls);
            let origin = from_listener.then_some(&origin);
            let mut listed = pairs;
            forward(&mut listed, origin, &forwarding);
            forward(&mut map, origin, &forwarding);
            let mut from_map: Vec<(String, String)> =
                map.iter().map(|(n, v)| (n.as_str().to_string(), header_text(v.as_bytes()))).collect();
            listed.sort();
            from_map.sort();
            proptest::prop_assert_eq!(from_map, listed);
        }
    }
}
