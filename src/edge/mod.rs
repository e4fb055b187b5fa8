//! The edge: what stands between the network and the handlers (docs/security.md). Each listener holds
//! at most its budget of open connections, so idle sockets cannot starve `accept` of file
//! descriptors; a new one past the budget takes the place of idle ones (`table`), and is
//! answered 503 and closed at once only when every connection is busy with a request. It gives
//! a client `header_timeout` for each request head (and so for the wait between keep-alive
//! requests, and for a TLS handshake: [`tls`]) and `body_timeout` between body parts ([`body`]),
//! and at shutdown stops accepting and lets each connection finish the answer it is writing.

use std::convert::Infallible;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use crate::domain::Origin;
use crate::observe::metrics;
use crate::problem::Problem;

pub(crate) mod body;
pub(crate) mod process;
mod table;
pub(crate) mod tls;

use body::TimedBody;
use table::{Handled, Table};

/// How one listener treats its clients.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ListenerLimits {
    /// Names the listener in logs and metrics: `data` or `admin`.
    pub name: &'static str,
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
}

/// After an accept error that is not one connection's (out of file descriptors, of memory), the
/// listener pauses this long: retrying at once would only spin on the same error.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The largest read buffer of a connection, and so the largest request head.
const READ_BUFFER_MAX: usize = 64 * 1024;

/// A condition that can repeat thousands of times a second is logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// A full table closes at most this many idle connections at once (nginx closes 32): the new
/// connection takes one place, and those that follow find the others free.
const RECLAIM_AT_ONCE: usize = 32;

/// How long a new connection waits for a place that idle connections were told to give up.
const RECLAIM_WAIT: Duration = Duration::from_millis(100);

/// Serves `service` on `listener`, over TLS when `tls` is given, until `stopped` turns true (or
/// its sender goes), then waits for the open connections to finish their answers.
pub(crate) async fn serve<S: AlwaysReady>(
    listener: TcpListener,
    service: S,
    limits: ListenerLimits,
    tls: Option<TlsAcceptor>,
    mut stopped: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let table = Arc::new(Table::new());
    let plain = tls.is_none();
    let connections = Arc::new(Connections::new(service, &limits, tls));
    let mut accept_errors = Rarely::default();
    let mut refusals = Rarely::default();
    let mut reclaims = Rarely::default();
    loop {
        let accepted = tokio::select! {
            _ = stop_requested(&mut stopped) => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let slot = match slots.clone().try_acquire_owned() {
                    Ok(slot) => Some(slot),
                    Err(_) => make_room(&table, &slots, &limits, &mut reclaims).await,
                };
                let Some(slot) = slot else {
                    // A TLS client would read the plain answer as a broken handshake: it is
                    // closed, which reads the same, without the cost of a handshake.
                    if plain {
                        refuse(stream);
                    }
                    metrics::connection_refused(limits.name);
                    if let Some(more) = refusals.due(Instant::now()) {
                        tracing::warn!(
                            listener = limits.name,
                            max_connections = limits.max_connections,
                            refused_since_last_report = more,
                            "connection refused: every connection the listener may hold is busy with a request"
                        );
                    }
                    continue;
                };
                // A streamed answer is written part by part. With Nagle's algorithm on, a part
                // written while the previous one is still unacknowledged waits for that ack,
                // which a client on a kept-alive connection delays by up to 40 ms. Answers are
                // written whole or part by part as they come, so there is nothing for Nagle to
                // gather anyway.
                let _ = stream.set_nodelay(true);
                let origin = Origin { peer, tls: !plain };
                // A plain connection enters the table here, in the order of arrival, so that the
                // next one's `make_room` already sees it; a TLS one once its handshake is done.
                let entry = plain.then(|| table.enter());
                tokio::spawn(connections.clone().serve(stream, origin, slot, entry, table.clone(), stopped.clone()));
            }
            Err(e) if lost_in_accept(&e) => {}
            Err(e) => {
                if let Some(more) = accept_errors.due(Instant::now()) {
                    tracing::error!(listener = limits.name, error = %e, errors_since_last_report = more, "accept failed; pausing");
                }
                tokio::select! {
                    _ = stop_requested(&mut stopped) => break,
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                }
            }
        }
    }
    drop(listener);
    // Each open connection holds a slot: when all are back, every connection has finished.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = slots.acquire_many(all).await;
}

/// A place for a new connection in a full table: idle connections, longest idle first, are told
/// to close, and the new one takes the first place they give up. `None` when none is idle.
async fn make_room(
    table: &Table,
    slots: &Arc<Semaphore>,
    limits: &ListenerLimits,
    reclaims: &mut Rarely,
) -> Option<OwnedSemaphorePermit> {
    let reclaimed = table.reclaim(RECLAIM_AT_ONCE);
    if reclaimed == 0 {
        return None;
    }
    metrics::connections_reclaimed(limits.name, reclaimed);
    if let Some(more) = reclaims.due(Instant::now()) {
        tracing::info!(
            listener = limits.name,
            max_connections = limits.max_connections,
            reclaimed,
            reclaims_since_last_report = more,
            "the connection table is full: idle connections closed to make room"
        );
    }
    tokio::time::timeout(RECLAIM_WAIT, slots.clone().acquire_owned()).await.ok()?.ok()
}

/// Resolves once a stop is asked for, or when nobody can ask any more.
async fn stop_requested(stopped: &mut watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

/// Errors about one incoming connection that went away before it was accepted: the listener
/// itself is fine.
fn lost_in_accept(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted | WouldBlock)
}

/// The answer to a connection past the budget, written without waiting for its request: a
/// client told 503 with Retry-After comes back later, where a bare reset reads as a failure.
static REFUSAL: LazyLock<Vec<u8>> = LazyLock::new(|| {
    let body = Problem::new(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "overloaded",
        "Too many connections",
        "The broker holds as many client connections as it may. Nothing was recorded or sent: retry after the \
         indicated time with the same key.",
    )
    .document();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
});

/// What a listener serves: axum's router, or the data plane's own service. Its `poll_ready` is
/// never called: it must be ready at once, as both are.
pub(crate) trait AlwaysReady:
    tower_service::Service<Request, Response = Response, Error = Infallible, Future: Send + 'static>
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> AlwaysReady for S where
    S: tower_service::Service<Request, Response = Response, Error = Infallible, Future: Send + 'static>
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// Answers a connection past the budget and closes it, without ever waiting on it: a write
/// that does not fit at once is dropped with the socket.
fn refuse(stream: TcpStream) {
    let _ = stream.try_write(&REFUSAL);
}

/// What every connection of one listener shares.
struct Connections<S> {
    http: http1::Builder,
    service: S,
    /// Set on a listener that speaks TLS.
    tls: Option<TlsAcceptor>,
    header_timeout: Duration,
    body_timeout: Duration,
    name: &'static str,
}

impl<S: AlwaysReady> Connections<S> {
    fn new(service: S, limits: &ListenerLimits, tls: Option<TlsAcceptor>) -> Connections<S> {
        let mut http = http1::Builder::new();
        // hyper's header timeout runs from the moment a head is awaited, which on a keep-alive
        // connection is as soon as the previous answer went out: idle connections are cut too.
        http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
        // A connection's read buffer grows to this while a large body streams through, and keeps
        // that size until the connection closes: hyper's default (about 400 KiB) made 150 held
        // uploads cost 57 MB more. It also bounds a request head.
        http.max_buf_size(READ_BUFFER_MAX);
        Connections {
            http,
            service,
            tls,
            header_timeout: limits.header_timeout,
            body_timeout: limits.body_timeout,
            name: limits.name,
        }
    }

    /// Serves one connection from `origin`, holding its place (`_slot`) until it closes. It is
    /// in the table of connections that may be reclaimed (`entry`, when it entered as it was
    /// accepted) only once it speaks HTTP: a TLS handshake is bounded by `header_timeout` and
    /// cut by a shutdown instead.
    async fn serve(
        self: Arc<Self>,
        stream: TcpStream,
        origin: Origin,
        _slot: OwnedSemaphorePermit,
        entry: Option<table::Entry>,
        table: Arc<Table>,
        mut stopped: watch::Receiver<bool>,
    ) {
        metrics::connection_opened(self.name);
        match &self.tls {
            None => self.http(stream, origin, entry.unwrap_or_else(|| table.enter()), stopped).await,
            // The handshake is the first thing a client owes, so it has the head's time.
            Some(tls) => {
                let handshake = tokio::time::timeout(self.header_timeout, tls.accept(stream));
                let shaken = tokio::select! {
                    shaken = handshake => shaken,
                    _ = stop_requested(&mut stopped) => {
                        metrics::connection_closed(self.name);
                        return;
                    }
                };
                match shaken {
                    Ok(Ok(stream)) => self.http(stream, origin, table.enter(), stopped).await,
                    Ok(Err(e)) => tracing::debug!(listener = self.name, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(listener = self.name, "TLS handshake timed out"),
                }
            }
        }
        metrics::connection_closed(self.name);
    }

    /// HTTP/1.1 on `stream` until either end closes it; each request from `origin`.
    async fn http<T>(&self, stream: T, origin: Origin, entry: table::Entry, mut stopped: watch::Receiver<bool>)
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let handler = Handler {
            service: self.service.clone(),
            body_timeout: self.body_timeout,
            connection: entry.connection.clone(),
            origin,
        };
        let connection = self.http.serve_connection(TokioIo::new(stream), handler);
        tokio::pin!(connection);
        let ended = loop {
            tokio::select! {
                ended = connection.as_mut() => break ended,
                _ = stop_requested(&mut stopped) => {
                    connection.as_mut().graceful_shutdown();
                    break connection.await;
                }
                // Closed as a shutdown would close it: it has no request in the handler, so it
                // ends at once, once any answer still in its write buffer is out (one that came
                // since it was told is served, and the connection stays, to be reclaimed again
                // once idle).
                _ = entry.connection.reclaimed.notified() => if entry.connection.is_idle() {
                    connection.as_mut().graceful_shutdown();
                    break connection.await;
                } else {
                    entry.connection.stays();
                },
            }
        };
        // Timeouts and clients that vanish are routine at the edge: not worth more than debug.
        if let Err(e) = ended {
            tracing::debug!(listener = self.name, error = %e, "connection ended");
        }
    }
}

/// The service, with every request body under `body_timeout`, and the connection counted busy
/// from each request's arrival until its answer is written.
#[derive(Clone)]
struct Handler<S> {
    service: S,
    body_timeout: Duration,
    connection: Arc<table::Connection>,
    /// Put in each request's extensions: who sent it.
    origin: Origin,
}

impl<S: AlwaysReady> hyper::service::Service<Request<Incoming>> for Handler<S> {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = Handled<S::Future>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let busy = self.connection.busy();
        let mut request = request.map(|body| Body::new(TimedBody::new(body, self.body_timeout)));
        request.extensions_mut().insert(self.origin);
        Handled::new(self.service.clone().call(request), busy)
    }
}

/// Lets a condition that may repeat very often be reported now and then, with a count of what
/// happened in between.
#[derive(Default)]
struct Rarely {
    last: Option<Instant>,
    skipped: u64,
}

impl Rarely {
    /// `Some(skipped)` when a report is due: the first time, and then once per `LOG_EVERY`.
    fn due(&mut self, now: Instant) -> Option<u64> {
        if self.last.is_some_and(|last| now - last < LOG_EVERY) {
            self.skipped += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.skipped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_condition_is_reported_once_per_period() {
        let start = Instant::now();
        let mut rarely = Rarely::default();
        assert_eq!(rarely.due(start), Some(0));
        assert_eq!(rarely.due(start), None);
        assert_eq!(rarely.due(start + LOG_EVERY / 2), None);
        assert_eq!(rarely.due(start + LOG_EVERY), Some(2));
        assert_eq!(rarely.due(start + LOG_EVERY), None);
    }

    #[test]
    fn the_refusal_is_a_complete_problem_answer() {
        let text = String::from_utf8(REFUSAL.clone()).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
        let problem: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(problem["type"], "urn:idem:problem:overloaded");
    }
}
