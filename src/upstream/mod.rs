//! Talking to upstreams: one HTTP attempt, reported as what the broker can know about it. The
//! header rules shared by the recorded and the plain proxy paths are in `headers`; what an
//! attempt passes before its first byte leaves (the connect limit, its send window) is in `gate`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::{Route, UpstreamTls};
use crate::policy::Observed;
use crate::record::{header_text, StoredResponse};

/// The HTTP client for every upstream: hyper-util's pooled client, HTTP/1.1 over TCP or TLS. It
/// follows no redirect (a 3xx is the upstream's answer) and takes no proxy from the environment
/// (only configured upstreams are ever called). reqwest would add nothing an upstream call needs
/// and cost a third of a proxied request's CPU time: measured on unrecorded requests at c=64,
/// 133–142 µs through reqwest against 90–97 µs straight through hyper-util.
#[derive(Clone)]
pub struct Upstream {
    /// For upstreams checked against the built-in Mozilla roots, with no client certificate.
    client: Client,
    /// For routes with TLS settings of their own, one per distinct profile (`UpstreamTls::id`),
    /// made when first needed: equal settings share a pool, changed files get a new one.
    tuned: Arc<Mutex<HashMap<[u8; 32], Client>>>,
    connect_limit: Duration,
}

type Client = hyper_util::client::legacy::Client<TimedConnect<HttpsConnector<HttpConnector>>, Outgoing>;

pub(crate) mod forwarded;
mod gate;
mod headers;
pub(crate) use forwarded::forward;
pub use headers::to_header_map;
pub(crate) use headers::{
    client_deadline, forwardable_request_headers, keep_forwardable, storable_response_headers, tell_attempt,
    tell_deadline,
};

use gate::{Outgoing, TimedConnect};

/// A client speaking TLS as `tls` says (the built-in Mozilla roots, when it says nothing),
/// sending and checking its server name instead of the URL's host when it names one.
fn client(tls: Option<&UpstreamTls>, connect_limit: Duration) -> Client {
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_nodelay(true);
    let config = tls.map_or_else(crate::config::default_upstream_tls, |tls| (*tls.config).clone());
    let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config).https_or_http();
    let builder = match tls.and_then(|tls| tls.server_name.clone()) {
        Some(name) => builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name)),
        None => builder,
    };
    let connector = builder.enable_http1().wrap_connector(tcp);
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE)
        .pool_timer(TokioTimer::new())
        .build(TimedConnect::new(connector, connect_limit))
}

/// The longest a connection may take to open, TCP and TLS handshake together; past it, nothing
/// was sent.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle pooled connection to an upstream is kept.
const POOL_IDLE: Duration = Duration::from_secs(30);

/// One request for an upstream, as an attempt, a probe or a plain proxied call sends it.
pub struct Outbound<'a> {
    pub method: &'a Method,
    pub url: url::Url,
    /// The request's own headers, as stored or as a call never recorded passes them.
    pub headers: ClientHeaders<'a>,
    /// The route's TLS settings towards its upstream, if it has any of its own.
    pub tls: Option<&'a UpstreamTls>,
    /// Headers added at the send and never stored: the route's credentials, the client's
    /// forwarded `Authorization`, an attempt's deadline and claim.
    pub added: &'a HeaderMap,
    pub body: Bytes,
}

impl<'a> Outbound<'a> {
    /// A request for `route`'s upstream, sent with the route's own TLS settings: `headers` as
    /// the request carries them, `added` as [`route_credentials`] made them (and an attempt's
    /// deadline and claim, for an attempt).
    pub(crate) fn for_route(
        route: &'a Route,
        method: &'a Method,
        url: url::Url,
        headers: &'a [(String, String)],
        added: &'a HeaderMap,
        body: Bytes,
    ) -> Outbound<'a> {
        Outbound { method, url, headers: ClientHeaders::Stored(headers), tls: route.upstream_tls.as_ref(), added, body }
    }

    /// A call never recorded for `route`'s upstream: the client's own header map, with what may
    /// go upstream left in it (`headers::keep_forwardable`) and its forwarding headers set.
    pub(crate) fn passed(
        route: &'a Route,
        method: &'a Method,
        url: url::Url,
        headers: HeaderMap,
        added: &'a HeaderMap,
        body: Bytes,
    ) -> Outbound<'a> {
        Outbound { method, url, headers: ClientHeaders::Passed(headers), tls: route.upstream_tls.as_ref(), added, body }
    }
}

/// A request's own headers on their way upstream.
pub enum ClientHeaders<'a> {
    /// As stored, made into a map at each send.
    Stored(&'a [(String, String)]),
    /// A call never recorded: hyper's map of them, sent as it is.
    Passed(HeaderMap),
}

/// What a route adds to every request it sends, never stored: its `upstream_headers`, and the
/// client's `Authorization` when the route forwards it.
pub(crate) fn route_credentials(route: &Route, authorization: Option<&HeaderValue>) -> HeaderMap {
    let mut added = route.upstream_headers.clone();
    if let Some(credential) = authorization.filter(|_| route.forward_authorization) {
        added.insert(header::AUTHORIZATION, credential.clone());
    }
    added
}

/// A send that failed: what the broker can know of it, and why when no connection could be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub observed: Observed,
    pub cause: Option<Unreachable>,
}

/// Why no connection could be made, said twice: in a few words a client may read (the kind of
/// failure: a refused connection, an untrusted certificate), and in the connection's own, for
/// the operator who must fix it (which may name hosts and addresses behind Idem).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreachable {
    pub why: &'static str,
    pub detail: String,
}

impl From<Observed> for Failure {
    fn from(observed: Observed) -> Failure {
        Failure { observed, cause: None }
    }
}

/// A complete upstream answer, as received within the attempt's limit.
#[derive(Debug, Clone)]
pub struct Answer {
    pub response: StoredResponse,
    pub retry_after: Option<String>,
}

impl Upstream {
    pub fn new() -> Upstream {
        Upstream::connecting_within(CONNECT_TIMEOUT)
    }

    fn connecting_within(limit: Duration) -> Upstream {
        Upstream { client: client(None, limit), tuned: Arc::default(), connect_limit: limit }
    }

    /// Drops the clients (and their pooled connections) of TLS profiles that no route of
    /// `config` uses any more: a reload that changed a route's files leaves none behind.
    pub fn keep_clients_of(&self, config: &crate::config::Config) {
        let used: Vec<[u8; 32]> = config.routes.iter().filter_map(|r| r.upstream_tls.as_ref().map(|t| t.id)).collect();
        self.tuned.lock().unwrap_or_else(|p| p.into_inner()).retain(|id, _| used.contains(id));
    }

    /// The client for a route's `tls` settings.
    fn client_for(&self, tls: Option<&UpstreamTls>) -> Client {
        let Some(tls) = tls else { return self.client.clone() };
        let mut tuned = self.tuned.lock().unwrap_or_else(|p| p.into_inner());
        tuned.entry(tls.id).or_insert_with(|| client(Some(tls), self.connect_limit)).clone()
    }

    /// Sends one request and waits at most `limit` for the whole answer, body included. A
    /// response that would arrive later is dropped with the connection: it is never used.
    pub async fn send(&self, request: Outbound<'_>, limit: Duration) -> Result<Answer, Failure> {
        let until = tokio::time::Instant::now() + limit;
        Ok(self.send_head(request, until, None).await?.whole(until).await?)
    }

    /// Sends one request and waits until `until` for its status and headers; the body is left
    /// to read, whole or part by part. With `send_by`, the request's first byte leaves before
    /// that instant or not at all (see `gate`), and it is answered [`Observed::NotSent`] when it
    /// is too late.
    pub async fn send_head(
        &self,
        request: Outbound<'_>,
        until: tokio::time::Instant,
        send_by: Option<crate::domain::clock::Moment>,
    ) -> Result<Head, Failure> {
        let response = self.exchange(request, until, send_by).await?;
        let (parts, body) = response.into_parts();
        let status = parts.status.as_u16();
        let retry_after = parts.headers.get(http::header::RETRY_AFTER).map(|v| header_text(v.as_bytes()));
        let streamed = crate::stream::is_streamed(&parts.headers);
        let event_stream = crate::stream::is_event_stream(&parts.headers);
        let headers = storable_response_headers(&parts.headers);
        Ok(Head { status, headers, retry_after, streamed, event_stream, body })
    }

    /// Sends a call that is never recorded and waits at most `limit` for the whole answer, which
    /// is passed on as it came: its status, its end-to-end headers in hyper's own map, its body.
    /// Nothing of it is stored, so nothing is copied out into the stored form and back.
    pub async fn pass(&self, request: Outbound<'_>, limit: Duration) -> Result<http::Response<Bytes>, Failure> {
        let until = tokio::time::Instant::now() + limit;
        let is_head = request.method == Method::HEAD;
        let (mut parts, body) = self.exchange(request, until, None).await?.into_parts();
        // An answer's length is the length of the body passed on, and is set again for it; a
        // HEAD's answer has no body but says the length a GET's would have.
        let length = if is_head { parts.headers.get(http::header::CONTENT_LENGTH).cloned() } else { None };
        headers::keep_end_to_end(&mut parts.headers);
        if let Some(length) = length {
            parts.headers.insert(http::header::CONTENT_LENGTH, length);
        }
        // The upstream connection's own version and extensions (a reason phrase, its address)
        // are not the client's answer's.
        parts.version = http::Version::default();
        parts.extensions = http::Extensions::new();
        let body = match tokio::time::timeout_at(until, body.collect()).await {
            Ok(body) => body.map_err(|_| Failure::from(Observed::Broken))?.to_bytes(),
            Err(_) => return Err(Observed::TimedOut.into()),
        };
        Ok(http::Response::from_parts(parts, body))
    }

    /// Sends `request` and waits until `until` for the answer's head (see [`Upstream::send_head`]).
    async fn exchange(
        &self,
        request: Outbound<'_>,
        until: tokio::time::Instant,
        send_by: Option<crate::domain::clock::Moment>,
    ) -> Result<http::Response<Incoming>, Failure> {
        let Outbound { method, url, headers, tls, added, body } = request;
        let client = self.client_for(tls);
        // It cannot fail on what reaches here (a URL that parsed); were it to, the request was
        // not sent.
        let uri: http::Uri = url.as_str().parse().map_err(|_| Failure::from(Observed::ConnectFailed))?;
        let mut request = http::Request::new(Outgoing::new(body, send_by));
        *request.method_mut() = method.clone();
        *request.uri_mut() = uri;
        let headers_sent = request.headers_mut();
        *headers_sent = match headers {
            ClientHeaders::Stored(stored) => to_header_map(stored),
            ClientHeaders::Passed(passed) => passed,
        };
        // Credentials (and the attempt's own headers) are added at the send, never to what is
        // stored.
        headers_sent.extend(added.clone());
        // The attempt's own trace context, replacing any the client sent, when spans go out.
        crate::observe::telemetry::tell_trace(headers_sent);
        match tokio::time::timeout_at(until, gate::send_within(&client, request, send_by)).await {
            Ok(sent) => sent,
            Err(_) => Err(Observed::TimedOut.into()),
        }
    }
}

/// An upstream answer whose status and headers have arrived. From here on, any failure may
/// follow an execution.
#[derive(Debug)]
pub struct Head {
    pub status: u16,
    /// The end-to-end headers, as stored and returned.
    pub headers: Vec<(String, String)>,
    pub retry_after: Option<String>,
    /// Its body is passed on as it arrives (docs/concepts.md): server-sent events, chunked, or long.
    pub streamed: bool,
    pub event_stream: bool,
    body: Incoming,
}

impl Head {
    /// The whole body, if it arrives before `until`.
    pub async fn whole(self, until: tokio::time::Instant) -> Result<Answer, Observed> {
        let Head { status, headers, retry_after, body, .. } = self;
        let body = match tokio::time::timeout_at(until, body.collect()).await {
            Ok(body) => body.map_err(|_| Observed::Broken)?.to_bytes(),
            Err(_) => return Err(Observed::TimedOut),
        };
        // A small body arrives as a slice of the connection's read buffer, and would keep all of
        // it (8 KiB or more) alive for as long as the answer is cached for replays; the
        // connection would allocate a new buffer for every response. A copy is the body's size.
        let body = Bytes::copy_from_slice(&body);
        Ok(Answer { response: StoredResponse { status, headers, body }, retry_after })
    }

    /// The next part of the body, as it comes; `None` at its end. An error is a cut.
    pub async fn part(&mut self) -> Result<Option<Bytes>, Observed> {
        loop {
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(_)) => return Err(Observed::Broken),
                // Trailers carry no body; an empty part says nothing.
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => return Ok(Some(data)),
                    _ => continue,
                },
            }
        }
    }
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream::new()
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderName;

    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (n, v) in pairs {
            m.append(HeaderName::from_bytes(n.as_bytes()).unwrap(), v.parse().unwrap());
        }
        m
    }

    /// A POST of `body` to `url`, with nothing added.
    pub(super) fn post(url: &str, body: &'static [u8]) -> Outbound<'static> {
        static NOTHING: std::sync::OnceLock<HeaderMap> = std::sync::OnceLock::new();
        let added = NOTHING.get_or_init(HeaderMap::new);
        Outbound {
            method: &Method::POST,
            url: url.parse().unwrap(),
            headers: ClientHeaders::Stored(&[]),
            tls: None,
            added,
            body: Bytes::from_static(body),
        }
    }

    fn names(pairs: &[(String, String)]) -> Vec<&str> {
        pairs.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn credentials_hop_by_hop_and_broker_headers_are_not_forwarded() {
        let h = map(&[
            ("authorization", "Bearer t"),
            ("cookie", "s=1"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("prefer", "respond-async"),
            ("host", "broker"),
            ("idempotency-key", "k1"),
            ("content-type", "application/json"),
            ("x-request-id", "abc"),
        ]);
        assert_eq!(names(&forwardable_request_headers(&h, true)), ["idempotency-key", "content-type", "x-request-id"]);
        assert_eq!(names(&forwardable_request_headers(&h, false)), ["content-type", "x-request-id"]);
    }

    #[test]
    fn stored_responses_keep_end_to_end_headers_only() {
        let h = map(&[
            ("content-type", "application/json"),
            ("content-length", "12"),
            ("connection", "close"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
            ("location", "/payments/1"),
        ]);
        let kept = storable_response_headers(&h);
        assert_eq!(names(&kept), ["content-type", "set-cookie", "set-cookie", "location"]);
        let back = to_header_map(&kept);
        assert_eq!(back.get_all("set-cookie").iter().count(), 2);
    }

    #[test]
    fn a_client_deadline_is_whole_milliseconds_or_ignored() {
        let name = HeaderName::from_static("request-timeout-ms");
        let of = |value: &str| client_deadline(&map(&[("request-timeout-ms", value)]), Some(&name));
        assert_eq!(of("300"), Some(Duration::from_millis(300)));
        assert_eq!(of(" 25 "), Some(Duration::from_millis(25)));
        for bad in ["", "-5", "1.5", "3s", "99999999999999999999999"] {
            assert_eq!(of(bad), None, "{bad}");
        }
        let two = map(&[("request-timeout-ms", "1"), ("request-timeout-ms", "2")]);
        assert_eq!(client_deadline(&two, Some(&name)), None);
        assert_eq!(client_deadline(&map(&[("request-timeout-ms", "300")]), None), None);

        let mut sent = HeaderMap::new();
        tell_deadline(&mut sent, Some(&name), Duration::from_micros(1_250_900));
        assert_eq!(sent.get(&name).unwrap(), "1250");
    }

    #[tokio::test]
    async fn an_https_upstream_is_spoken_to_in_tls_and_a_failed_handshake_sent_nothing() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A server that reads what the client opens with, then answers in plain HTTP.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/payments", listener.local_addr().unwrap());
        let opened = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut first = [0u8; 3];
            socket.read_exact(&mut first).await.unwrap();
            let _ = socket.write_all(b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n").await;
            first
        });
        let sent = Upstream::new().send(post(&url, b"{}"), Duration::from_secs(5)).await;
        assert_eq!(sent.unwrap_err().observed, Observed::ConnectFailed, "the request cannot have been sent");
        // A TLS handshake record (22), version 3.x: a ClientHello, not an HTTP request.
        let first = opened.await.unwrap();
        assert_eq!(&first[..2], &[0x16, 0x03], "{first:?}");
    }

    #[tokio::test]
    async fn an_answer_owns_its_body_rather_than_a_slice_of_the_connection_buffer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/payments", listener.local_addr().unwrap());
        let app = axum::Router::new().fallback(|| async { (http::StatusCode::CREATED, r#"{"id":"pay_1"}"#) });
        tokio::spawn(async move { axum::serve(listener, app).await });

        let upstream = Upstream::new();
        for _ in 0..3 {
            let answer = upstream.send(post(&url, b"{}"), Duration::from_secs(5)).await.unwrap();
            let body = answer.response.body;
            assert_eq!(&body[..], br#"{"id":"pay_1"}"#);
            // A slice of the pooled connection's read buffer would keep all of it alive.
            let owned = body.try_into_mut().expect("the body shares its allocation");
            assert!(owned.capacity() < 1024, "the body holds a {} byte buffer", owned.capacity());
        }
    }

    #[test]
    fn a_reload_drops_the_clients_of_tls_profiles_no_route_uses_any_more() {
        let dir = tempfile::TempDir::new().unwrap();
        let config_trusting = |name: &str| {
            let issued = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
            let ca = dir.path().join(format!("{name}.crt"));
            std::fs::write(&ca, issued.cert.pem()).unwrap();
            let text = format!(
                "[[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\n\
                 upstream = \"https://127.0.0.1:9443\"\nca_file = {ca:?}\n"
            );
            crate::config::Config::parse_with_env(&text, |_| None).unwrap()
        };
        let (before, after) = (config_trusting("old-authority"), config_trusting("new-authority"));
        let tls_of = |c: &crate::config::Config| c.routes[0].upstream_tls.clone().unwrap();
        let upstream = Upstream::new();
        upstream.client_for(Some(&tls_of(&before)));
        upstream.keep_clients_of(&before);
        assert_eq!(upstream.tuned.lock().unwrap().len(), 1, "a profile in use was dropped");

        upstream.client_for(Some(&tls_of(&after)));
        upstream.keep_clients_of(&after);
        let tuned = upstream.tuned.lock().unwrap();
        assert_eq!(tuned.keys().collect::<Vec<_>>(), [&tls_of(&after).id], "the old profile's client is kept");
    }
}
