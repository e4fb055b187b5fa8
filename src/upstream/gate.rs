//! The gates an attempt passes before its first byte leaves: a connection made within the
//! connect limit, and the attempt's send window (docs/guarantees.md), checked three times, the
//! last as close to the wire as each case allows: before the request is handed to the client;
//! when a new connection is ready (`TimedConnect`, told the window through a task-local by the
//! attempt's own task, which the pool calls it from); and by the body, as the connection asks
//! for it (`Outgoing`), after hyper has written the head into its buffer and before it flushes
//! anything. An empty body is written with the head without being asked for: its last check is
//! the connection's.

use std::time::Duration;

use bytes::Bytes;

use super::{Client, Failure, Unreachable};
use crate::domain::clock::Moment;
use crate::policy::Observed;

/// Hands `request` to the client if its window (`send_by`) has not passed yet, with the window
/// in the task-local the connector reads; what a failure tells is [`observed`].
pub(super) async fn send_within(
    client: &Client,
    request: http::Request<Outgoing>,
    send_by: Option<Moment>,
) -> Result<http::Response<hyper::body::Incoming>, Failure> {
    if send_by.is_some_and(Moment::passed) {
        return Err(Observed::NotSent.into());
    }
    SEND_BY.scope(send_by, client.request(request)).await.map_err(|e| failure(&e))
}

/// What a failed send tells, and why no connection could be made when none could.
fn failure(e: &hyper_util::client::legacy::Error) -> Failure {
    let observed = observed(e);
    let cause = (observed == Observed::ConnectFailed).then(|| Unreachable {
        why: why_unreachable(e),
        // The client's own words ("client error (Connect)") say nothing its sources do not.
        detail: match std::error::Error::source(e) {
            Some(source) => crate::observe::logs::in_one_line(source),
            None => e.to_string(),
        },
    });
    Failure { observed, cause }
}

/// Why a connection could not be made, in a few words that tell a client nothing of the
/// network behind Idem (the names a certificate carries, addresses): the kind of failure only.
fn why_unreachable(e: &(dyn std::error::Error + 'static)) -> &'static str {
    use rustls::CertificateError as Refused;
    let mut source = Some(e);
    while let Some(cause) = source {
        match tls_error(cause) {
            Some(rustls::Error::InvalidCertificate(refused)) => {
                return match refused {
                    Refused::UnknownIssuer => "its certificate is not from an authority the route trusts",
                    Refused::NotValidForName | Refused::NotValidForNameContext { .. } => {
                        "its certificate is not for its name"
                    }
                    Refused::Expired | Refused::ExpiredContext { .. } => "its certificate has expired",
                    _ => "its certificate was refused",
                };
            }
            Some(rustls::Error::AlertReceived(_)) => return "it refused the TLS handshake",
            Some(_) => return "the TLS handshake failed",
            None => {}
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return "the connection was refused";
            }
        }
        if cause.to_string().starts_with("dns error") {
            return "its name does not resolve";
        }
        if cause.to_string().starts_with(NO_CONNECTION) {
            return "no connection within the connect limit";
        }
        source = cause.source();
    }
    "no connection could be made"
}

/// A rustls error, met directly or inside io::Errors (the connector wraps the handshake's in
/// another), whose `source` is their inner error's source, never the inner error itself.
fn tls_error<'e>(mut cause: &'e (dyn std::error::Error + 'static)) -> Option<&'e rustls::Error> {
    loop {
        if let Some(tls) = cause.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        cause = cause.downcast_ref::<std::io::Error>()?.get_ref()?;
    }
}

/// What a failed send tells us: only a failure to connect (TCP, or the TLS handshake, refused
/// even after the request was written: [`handshake_refused`]), or a request given up before its
/// first byte ([`TooLate`]), proves nothing was sent. A request the pool found its connection
/// closed for before writing it is sent again on a fresh one by the client itself, so what fails
/// after that may have been sent.
fn observed(e: &hyper_util::client::legacy::Error) -> Observed {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if cause.is::<TooLate>() {
            return Observed::NotSent;
        }
        if handshake_refused(cause) {
            return Observed::ConnectFailed;
        }
        source = cause.source();
    }
    match e.is_connect() {
        true => Observed::ConnectFailed,
        false => Observed::Broken,
    }
}

/// The alerts by which a TLS server refuses a handshake: the client's certificate (missing,
/// untrusted, expired) or the handshake as a whole.
const REFUSALS: [rustls::AlertDescription; 9] = [
    rustls::AlertDescription::CertificateRequired,
    rustls::AlertDescription::BadCertificate,
    rustls::AlertDescription::UnsupportedCertificate,
    rustls::AlertDescription::CertificateRevoked,
    rustls::AlertDescription::CertificateExpired,
    rustls::AlertDescription::CertificateUnknown,
    rustls::AlertDescription::UnknownCA,
    rustls::AlertDescription::AccessDenied,
    rustls::AlertDescription::HandshakeFailure,
];

/// An upstream that refused the TLS handshake. In TLS 1.3 a client writes its request right
/// after its own last handshake message, before the server has accepted its certificate, so
/// the refusal arrives where a broken send would; but a server that refused the handshake
/// never read a byte of the request.
fn handshake_refused(cause: &(dyn std::error::Error + 'static)) -> bool {
    matches!(tls_error(cause), Some(rustls::Error::AlertReceived(alert)) if REFUSALS.contains(alert))
}

/// How a connect that took too long is said.
const NO_CONNECTION: &str = "no connection within";

/// A connector that gives up after `limit`: the TCP connector's own timeout would leave a TLS
/// handshake that stalls to the attempt's limit, and a send that times out there would count as
/// one that may have executed, where nothing can have been sent. Its failure is a connect error.
#[derive(Clone)]
pub(super) struct TimedConnect<C> {
    inner: C,
    limit: Duration,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> TimedConnect<C> {
    pub(super) fn new(inner: C, limit: Duration) -> TimedConnect<C> {
        TimedConnect { inner, limit }
    }
}

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
            let until = send_by.map_or(limit_at, |by| by.instant().min(limit_at));
            match tokio::time::timeout_at(until, connecting).await {
                Ok(Ok(_)) if send_by.is_some_and(Moment::passed) => Err(BoxError::from(TooLate)),
                Ok(connected) => connected.map_err(Into::into),
                Err(_) if until < limit_at => Err(BoxError::from(TooLate)),
                Err(_) => Err(format!("{NO_CONNECTION} {limit:?}").into()),
            }
        })
    }
}

tokio::task_local! {
    /// The send window of the attempt whose request is being sent from this task, for the
    /// connector the pool calls on its behalf.
    static SEND_BY: Option<Moment>;
}

impl Outgoing {
    pub(super) fn new(body: Bytes, send_by: Option<Moment>) -> Outgoing {
        Outgoing { data: Some(body), send_by }
    }
}

/// A request's body, as the connection asks for it. With `send_by`, it is the last gate before
/// the wire: the connection writes the request's head into its buffer, asks the body for its
/// first part, and only then writes anything out, so a body that refuses here (too late) lets
/// nothing of the request leave, and the connection is closed unused.
pub(crate) struct Outgoing {
    data: Option<Bytes>,
    send_by: Option<Moment>,
}

/// The send window of an attempt had passed when its connection was ready to write it.
#[derive(Debug)]
pub(crate) struct TooLate;

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
            if by.passed() {
                return std::task::Poll::Ready(Some(Err(TooLate)));
            }
        }
        let data = self.data.take().filter(|d| !d.is_empty());
        std::task::Poll::Ready(data.map(|d| Ok(hyper::body::Frame::data(d))))
    }

    /// An empty body is written with the head, without being asked for (hyper's encoder for a
    /// length of 0 is done before it starts): its window was checked before the request and at
    /// connect, and that is the last check it gets.
    fn is_end_stream(&self) -> bool {
        self.data.as_ref().is_none_or(Bytes::is_empty)
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::tests::post;
    use super::super::Upstream;
    use super::*;

    #[tokio::test]
    async fn a_tls_handshake_that_stalls_is_a_failed_connect_not_a_send_that_timed_out() {
        // Accepts the connection and never answers its ClientHello.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/payments", listener.local_addr().unwrap());
        let held = tokio::spawn(async move { listener.accept().await.unwrap() });
        let started = tokio::time::Instant::now();
        let sent = Upstream::connecting_within(Duration::from_millis(200))
            .send(post(&url, b""), Duration::from_secs(10))
            .await;
        assert_eq!(sent.unwrap_err().observed, Observed::ConnectFailed);
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

    /// An attempt whose window has passed by the time it is handed to the client is not sent at
    /// all, whether a connection is pooled or not; one within its window goes. (The later checks
    /// have tests of their own: the body's, and a connection made too late.)
    #[tokio::test]
    async fn an_attempt_past_its_send_window_when_handed_over_is_not_sent() {
        let (url, (received, _)) = recording_server().await;
        let upstream = Upstream::new();
        let send = |send_by: Moment, body: &'static [u8]| {
            let until = tokio::time::Instant::now() + Duration::from_secs(5);
            let (upstream, url) = (upstream.clone(), url.clone());
            async move {
                let head = upstream
                    .send_head(post(&url, body), until, Some(send_by))
                    .await
                    .map_err(|failure| failure.observed)?;
                head.whole(until).await
            }
        };
        let past = Moment::from(tokio::time::Instant::now() - Duration::from_millis(1));
        assert_eq!(send(past, b"{}").await.unwrap_err(), Observed::NotSent, "no connection yet");
        // A request within its window goes, and leaves its connection in the pool.
        let later = Moment::now() + Duration::from_secs(5);
        assert_eq!(send(later, b"{\"n\":1}").await.unwrap().response.status, 201);
        assert_eq!(send(past, b"").await.unwrap_err(), Observed::NotSent, "a connection pooled, an empty body");
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
        let past = Moment::from(tokio::time::Instant::now() - Duration::from_millis(1));
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
        let (until, send_by) = (started + Duration::from_secs(10), Moment::from(started) + Duration::from_millis(200));
        let sent = Upstream::new().send_head(post(&url, b""), until, Some(send_by)).await;
        assert_eq!(sent.unwrap_err().observed, Observed::NotSent);
        assert!(started.elapsed() < Duration::from_secs(2), "given up at its window: {:?}", started.elapsed());
        drop(held);
    }
}
