//! Talking to upstreams: one HTTP attempt, reported as what the broker can know about it, and
//! the header rules shared by the recorded and the plain proxy paths.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::policy::Observed;
use crate::record::{header_bytes, header_text, StoredResponse};

/// Hop-by-hop headers (RFC 9110 §7.6.1): meaningful for one connection only, never forwarded or
/// stored. `content-length` is recomputed from the body we send.
const HOP_BY_HOP: [&str; 10] = [
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
const CLIENT_ONLY: [&str; 4] = ["authorization", "cookie", "host", "prefer"];

/// Is this a header the broker or the connection already sets or strips, which a header of the
/// route's own (the deadline it tells the upstream) would clash with?
pub fn is_reserved(name: &str) -> bool {
    HOP_BY_HOP.contains(&name) || CLIENT_ONLY.contains(&name) || name == "content-type" || name == crate::key::HEADER
}

/// The request headers to send upstream (and to store, so a retry or take-over sends the same).
/// The client's credentials and cookies are never forwarded nor stored; the Idempotency-Key goes
/// along only when the route says so.
pub fn forwardable_request_headers(headers: &HeaderMap, forward_key: bool) -> Vec<(String, String)> {
    let listed = connection_listed(headers);
    headers
        .iter()
        .filter(|(name, _)| {
            let n = name.as_str();
            !HOP_BY_HOP.contains(&n)
                && !CLIENT_ONLY.contains(&n)
                && !listed.iter().any(|l| l == n)
                && (forward_key || n != crate::key::HEADER)
        })
        .map(|(name, value)| (name.as_str().to_string(), header_text(value.as_bytes())))
        .collect()
}

/// The response headers to store and return: everything end-to-end.
pub fn storable_response_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    let listed = connection_listed(headers);
    headers
        .iter()
        .filter(|(name, _)| !HOP_BY_HOP.contains(&name.as_str()) && !listed.iter().any(|l| l == name.as_str()))
        .map(|(name, value)| (name.as_str().to_string(), header_text(value.as_bytes())))
        .collect()
}

/// Header names that the `Connection` header marks as hop-by-hop for this message.
fn connection_listed(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
}

/// Headers the broker adds to a map built from stored pairs: its status headers on an answer,
/// credentials and the deadline on a send. Room for them is made at once, since a map that
/// grows rehashes every entry (about 3 % of a replay's CPU time, measured).
const ADDED_HEADERS: usize = 4;

pub fn to_header_map(pairs: &[(String, String)]) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(pairs.len() + ADDED_HEADERS);
    for (name, value) in pairs {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(&header_bytes(value)))
        {
            map.append(n, v);
        }
    }
    map
}

/// The header an attempt carries its claim in unless its route names another (docs/guarantees.md).
pub const ATTEMPT_HEADER: &str = "idem-attempt";

/// Puts an attempt's claim in the route's attempt header: `<record id>; claim=<token>;
/// attempt=<n>`. An upstream that keeps the highest claim it has seen per key can refuse an
/// attempt of an older claim that arrives late (docs/guarantees.md). Added at the send, never
/// stored.
pub fn tell_attempt(
    headers: &mut HeaderMap,
    name: Option<&HeaderName>,
    record: crate::domain::RecordId,
    claim: crate::domain::ClaimToken,
    attempt: u32,
) {
    if let Some(name) = name {
        let value = format!("{record}; claim={claim}; attempt={attempt}");
        headers.insert(name.clone(), HeaderValue::try_from(value).expect("a uuid and two numbers are a header value"));
    }
}

/// Puts an attempt's limit, in whole milliseconds, in the route's deadline header: added at the
/// send like the credentials, never stored, since every attempt has a limit of its own.
pub fn tell_deadline(headers: &mut HeaderMap, name: Option<&HeaderName>, limit: Duration) {
    if let Some(name) = name {
        let ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
        headers.insert(name.clone(), HeaderValue::from(ms));
    }
}

/// The time a client gives its request in the route's deadline header: whole milliseconds, as
/// ASCII digits. Anything else (a sign, a fraction, several values) is not understood and is
/// ignored, so a client's typo never shortens its deadline to nothing.
pub fn client_deadline(headers: &HeaderMap, name: Option<&HeaderName>) -> Option<Duration> {
    let mut values = headers.get_all(name?).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let text = value.to_str().ok()?.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse::<u64>().ok().map(Duration::from_millis)
}

/// The HTTP client for every upstream: hyper-util's pooled client, HTTP/1.1 over TCP or TLS. It
/// follows no redirect (a 3xx is the upstream's answer) and takes no proxy from the environment
/// (only configured upstreams are ever called). reqwest would add nothing an upstream call needs
/// and cost a third of a proxied request's CPU time: measured on unrecorded requests at c=64,
/// 133–142 µs through reqwest against 90–97 µs straight through hyper-util.
#[derive(Clone)]
pub struct Upstream {
    client: Client,
}

type Client = hyper_util::client::legacy::Client<TimedConnect<HttpsConnector<HttpConnector>>, Outgoing>;

/// The longest a connection may take to open, TCP and TLS handshake together; past it, nothing
/// was sent.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle pooled connection to an upstream is kept.
const POOL_IDLE: Duration = Duration::from_secs(30);

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
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        // Certificates are checked against the Mozilla roots built in, as browsers do.
        let roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(tcp);
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_timer(TokioTimer::new())
            .build(TimedConnect { inner: connector, limit });
        Upstream { client }
    }

    /// Sends one attempt and waits at most `limit` for the whole answer, body included. A
    /// response that would arrive later is dropped with the connection: it is never used.
    pub async fn send(
        &self,
        method: &Method,
        url: url::Url,
        headers: &[(String, String)],
        credentials: &HeaderMap,
        body: Bytes,
        limit: Duration,
    ) -> Result<Answer, Observed> {
        let until = tokio::time::Instant::now() + limit;
        self.send_head(method, url, headers, credentials, body, until, None).await?.whole(until).await
    }

    /// Sends one attempt and waits until `until` for its status and headers; the body is left
    /// to read, whole or part by part. With `send_by`, the request's first byte leaves before
    /// that instant or not at all: checked just before the connection writes it, after any
    /// connect, and answered [`Observed::NotSent`] when it is too late.
    #[allow(clippy::too_many_arguments)]
    pub async fn send_head(
        &self,
        method: &Method,
        url: url::Url,
        headers: &[(String, String)],
        credentials: &HeaderMap,
        body: Bytes,
        until: tokio::time::Instant,
        send_by: Option<tokio::time::Instant>,
    ) -> Result<Head, Observed> {
        // It cannot fail on what reaches here (a URL that parsed); were it to, the request was
        // not sent.
        let uri: http::Uri = url.as_str().parse().map_err(|_| Observed::ConnectFailed)?;
        let mut request = http::Request::new(Outgoing { data: Some(body), send_by });
        *request.method_mut() = method.clone();
        *request.uri_mut() = uri;
        let headers_sent = request.headers_mut();
        *headers_sent = to_header_map(headers);
        // Credentials are added at the send, never to what is stored.
        headers_sent.extend(credentials.clone());
        // The send window is checked three times, the last as close to the wire as each case
        // allows: here, before anything; when a new connection is ready (`TimedConnect`); and by
        // the body, as the connection asks for it (`Outgoing`) — but an empty body, which hyper
        // writes with the head without asking for it.
        if send_by.is_some_and(|by| tokio::time::Instant::now() >= by) {
            return Err(Observed::NotSent);
        }
        let sending = SEND_BY.scope(send_by, self.client.request(request));
        let response = match tokio::time::timeout_at(until, sending).await {
            Ok(sent) => sent.map_err(|e| observed(&e))?,
            Err(_) => return Err(Observed::TimedOut),
        };
        let (parts, body) = response.into_parts();
        let status = parts.status.as_u16();
        let retry_after = parts.headers.get(http::header::RETRY_AFTER).map(|v| header_text(v.as_bytes()));
        let streamed = crate::stream::is_streamed(&parts.headers);
        let event_stream = crate::stream::is_event_stream(&parts.headers);
        let headers = storable_response_headers(&parts.headers);
        Ok(Head { status, headers, retry_after, streamed, event_stream, body })
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

/// A connector that gives up after `limit`: the TCP connector's own timeout would leave a TLS
/// handshake that stalls to the attempt's limit, and a send that times out there would count as
/// one that may have executed, where nothing can have been sent. Its failure is a connect error.
#[derive(Clone)]
struct TimedConnect<C> {
    inner: C,
    limit: Duration,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower_service::Service<http::Uri> for TimedConnect<C>
where
    C: tower_service::Service<http::Uri>,
    C::Error: Into<BoxError>,
    C::Future: Send + 'static,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    /// Connects within the limit, and within the send window of the attempt it connects for:
    /// a connection made after the window is given up before a byte is written on it. (The
    /// pool calls this from the attempt's own task, which holds its window in [`SEND_BY`].)
    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let (connecting, limit) = (self.inner.call(uri), self.limit);
        let send_by = SEND_BY.try_with(|by| *by).ok().flatten();
        Box::pin(async move {
            let limit_at = tokio::time::Instant::now() + limit;
            let until = send_by.map_or(limit_at, |by| by.min(limit_at));
            match tokio::time::timeout_at(until, connecting).await {
                Ok(Ok(_)) if send_by.is_some_and(|by| tokio::time::Instant::now() >= by) => {
                    Err(BoxError::from(TooLate))
                }
                Ok(connected) => connected.map_err(Into::into),
                Err(_) if until < limit_at => Err(BoxError::from(TooLate)),
                Err(_) => Err(format!("no connection within {limit:?}").into()),
            }
        })
    }
}

tokio::task_local! {
    /// The send window of the attempt whose request is being sent from this task, for the
    /// connector the pool calls on its behalf.
    static SEND_BY: Option<tokio::time::Instant>;
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream::new()
    }
}

/// What a failed send tells us: only a failure to connect (TCP, or the TLS handshake), or a
/// request given up before its first byte ([`TooLate`]), proves nothing was sent. A request the
/// pool found its connection closed for before writing it is sent again on a fresh one by the
/// client itself, so what fails after that may have been sent.
fn observed(e: &hyper_util::client::legacy::Error) -> Observed {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if cause.is::<TooLate>() {
            return Observed::NotSent;
        }
        source = cause.source();
    }
    match e.is_connect() {
        true => Observed::ConnectFailed,
        false => Observed::Broken,
    }
}

/// A request's body, as the connection asks for it. With `send_by`, it is the last gate before
/// the wire: the connection writes the request's head into its buffer, asks the body for its
/// first part, and only then writes anything out, so a body that refuses here (too late) lets
/// nothing of the request leave, and the connection is closed unused.
pub struct Outgoing {
    data: Option<Bytes>,
    send_by: Option<tokio::time::Instant>,
}

/// The send window of an attempt had passed when its connection was ready to write it.
#[derive(Debug)]
pub struct TooLate;

impl std::fmt::Display for TooLate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the attempt's send window had passed before its first byte: not sent")
    }
}

impl std::error::Error for TooLate {}

impl hyper::body::Body for Outgoing {
    type Data = Bytes;
    type Error = TooLate;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, TooLate>>> {
        if let Some(by) = self.send_by.take() {
            if tokio::time::Instant::now() >= by {
                return std::task::Poll::Ready(Some(Err(TooLate)));
            }
        }
        let data = self.data.take().filter(|d| !d.is_empty());
        std::task::Poll::Ready(data.map(|d| Ok(hyper::body::Frame::data(d))))
    }

    /// An empty body with a gate is still asked for, once: the gate is the point.
    fn is_end_stream(&self) -> bool {
        self.send_by.is_none() && self.data.as_ref().is_none_or(Bytes::is_empty)
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (n, v) in pairs {
            m.append(HeaderName::from_bytes(n.as_bytes()).unwrap(), v.parse().unwrap());
        }
        m
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
        let sent = Upstream::new()
            .send(
                &Method::POST,
                url.parse().unwrap(),
                &[],
                &HeaderMap::new(),
                Bytes::from_static(b"{}"),
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(sent.unwrap_err(), Observed::ConnectFailed, "the request cannot have been sent");
        // A TLS handshake record (22), version 3.x: a ClientHello, not an HTTP request.
        let first = opened.await.unwrap();
        assert_eq!(&first[..2], &[0x16, 0x03], "{first:?}");
    }

    #[tokio::test]
    async fn a_tls_handshake_that_stalls_is_a_failed_connect_not_a_send_that_timed_out() {
        // Accepts the connection and never answers its ClientHello.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/payments", listener.local_addr().unwrap());
        let held = tokio::spawn(async move { listener.accept().await.unwrap() });
        let started = tokio::time::Instant::now();
        let sent = Upstream::connecting_within(Duration::from_millis(200))
            .send(&Method::POST, url.parse().unwrap(), &[], &HeaderMap::new(), Bytes::new(), Duration::from_secs(10))
            .await;
        assert_eq!(sent.unwrap_err(), Observed::ConnectFailed);
        assert!(started.elapsed() < Duration::from_secs(5), "gave up after {:?}", started.elapsed());
        drop(held);
    }

    /// What a [`recording_server`] was sent, per connection, and a permit for each connection
    /// it saw closed.
    type Received = (Arc<std::sync::Mutex<Vec<Vec<u8>>>>, Arc<tokio::sync::Semaphore>);

    /// A server that answers 201 to every request and keeps every byte it was sent, per
    /// connection.
    async fn recording_server() -> (String, Received) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/payments", listener.local_addr().unwrap());
        let received = Arc::new(std::sync::Mutex::new(Vec::new()));
        let closed = Arc::new(tokio::sync::Semaphore::new(0));
        let (kept, closes) = (received.clone(), closed.clone());
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                let (kept, closes) = (kept.clone(), closes.clone());
                tokio::spawn(async move {
                    let index = {
                        let mut kept = kept.lock().unwrap();
                        kept.push(Vec::new());
                        kept.len() - 1
                    };
                    let mut buffer = [0u8; 4096];
                    while let Ok(n @ 1..) = socket.read(&mut buffer).await {
                        kept.lock().unwrap()[index].extend_from_slice(&buffer[..n]);
                        let answer = b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok";
                        if socket.write_all(answer).await.is_err() {
                            break;
                        }
                    }
                    closes.add_permits(1);
                });
            }
        });
        (url, (received, closed))
    }

    #[tokio::test]
    async fn an_attempt_past_its_send_window_leaves_nothing_on_the_wire_fresh_or_pooled() {
        let (url, (received, _)) = recording_server().await;
        let upstream = Upstream::new();
        let send = |send_by: tokio::time::Instant, body: &'static [u8]| {
            let until = tokio::time::Instant::now() + Duration::from_secs(5);
            let (upstream, url) = (upstream.clone(), url.parse().unwrap());
            async move {
                let head = upstream
                    .send_head(
                        &Method::POST,
                        url,
                        &[],
                        &HeaderMap::new(),
                        Bytes::from_static(body),
                        until,
                        Some(send_by),
                    )
                    .await?;
                head.whole(until).await
            }
        };
        let past = tokio::time::Instant::now() - Duration::from_millis(1);
        // A fresh connection: opened, then given up before its first byte.
        assert_eq!(send(past, b"{}").await.unwrap_err(), Observed::NotSent);
        // A request within its window goes, and leaves its connection in the pool.
        let later = tokio::time::Instant::now() + Duration::from_secs(5);
        assert_eq!(send(later, b"{\"n\":1}").await.unwrap().response.status, 201);
        // A pooled connection, and an empty body: given up all the same.
        assert_eq!(send(past, b"").await.unwrap_err(), Observed::NotSent);
        let received = received.lock().unwrap().clone();
        let sent: Vec<String> = received.iter().map(|bytes| String::from_utf8_lossy(bytes).into_owned()).collect();
        assert_eq!(sent.iter().filter(|s| s.starts_with("POST /payments")).count(), 1, "{sent:?}");
        assert!(
            sent.iter().all(|s| s.is_empty() || s.ends_with("{\"n\":1}")),
            "only the one within its window: {sent:?}"
        );
    }

    /// The body is the last gate: hyper writes a request's head into its buffer, asks the body
    /// for its first part, and flushes only then. A body past its window leaves nothing on the
    /// wire, on a connection that nothing else checks (hyper's own, with no pool in front).
    #[tokio::test]
    async fn a_body_past_its_send_window_lets_no_byte_of_its_request_out() {
        let (url, (received, closed)) = recording_server().await;
        let authority = url.parse::<http::Uri>().unwrap().authority().unwrap().to_string();
        let stream = tokio::net::TcpStream::connect(&authority).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.unwrap();
        let driven = tokio::spawn(connection);
        let past = tokio::time::Instant::now() - Duration::from_millis(1);
        let body = Outgoing { data: Some(Bytes::from_static(b"{}")), send_by: Some(past) };
        let request = http::Request::post(&url).header("host", &authority).body(body).unwrap();
        let refused = sender.send_request(request).await.unwrap_err();
        assert!(std::error::Error::source(&refused).is_some_and(|e| e.is::<TooLate>()), "{refused:?}");
        let _ = driven.await;
        // Whatever was written is read before the server sees the connection closed.
        closed.acquire().await.unwrap().forget();
        assert!(received.lock().unwrap().iter().all(Vec::is_empty), "bytes left: {:?}", received.lock().unwrap());
    }

    #[tokio::test]
    async fn a_connection_made_after_the_send_window_is_given_up_as_not_sent() {
        // Accepts the connection and never answers its ClientHello: the connect outlasts the window.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/payments", listener.local_addr().unwrap());
        let held = tokio::spawn(async move { listener.accept().await.unwrap() });
        let started = tokio::time::Instant::now();
        let (until, send_by) = (started + Duration::from_secs(10), started + Duration::from_millis(200));
        let sent = Upstream::new()
            .send_head(&Method::POST, url.parse().unwrap(), &[], &HeaderMap::new(), Bytes::new(), until, Some(send_by))
            .await;
        assert_eq!(sent.unwrap_err(), Observed::NotSent);
        assert!(started.elapsed() < Duration::from_secs(2), "given up at its window: {:?}", started.elapsed());
        drop(held);
    }

    #[tokio::test]
    async fn an_answer_owns_its_body_rather_than_a_slice_of_the_connection_buffer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/payments", listener.local_addr().unwrap());
        let app = axum::Router::new().fallback(|| async { (http::StatusCode::CREATED, r#"{"id":"pay_1"}"#) });
        tokio::spawn(async move { axum::serve(listener, app).await });

        let upstream = Upstream::new();
        for _ in 0..3 {
            let answer = upstream
                .send(&Method::POST, url.parse().unwrap(), &[], &HeaderMap::new(), Bytes::new(), Duration::from_secs(5))
                .await
                .unwrap();
            let body = answer.response.body;
            assert_eq!(&body[..], br#"{"id":"pay_1"}"#);
            // A slice of the pooled connection's read buffer would keep all of it alive.
            let owned = body.try_into_mut().expect("the body shares its allocation");
            assert!(owned.capacity() < 1024, "the body holds a {} byte buffer", owned.capacity());
        }
    }
}
