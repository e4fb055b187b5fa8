//! A listener's table of open connections, so that a full one can make room, as nginx does with
//! its reusable connections: a connection with no request in the handler (idle between
//! keep-alive requests, or still waiting for its first head, a slowloris's included) can be
//! closed for a new client, longest idle first. One busy with a request is never touched.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use tokio::sync::Notify;

/// The open connections of one listener.
pub(super) struct Table {
    open: Mutex<HashMap<u64, Arc<Connection>>>,
    next: AtomicU64,
    epoch: Instant,
}

/// One open connection, as the table sees it.
pub(super) struct Connection {
    /// Requests in the handler, or whose answer is still being written.
    busy: AtomicUsize,
    /// When it last had no request, in microseconds since the table's epoch.
    idle_since: AtomicU64,
    /// Told when the table closes it to make room; `told` keeps it from being told (and
    /// counted) twice while it closes, and is taken back by [`Connection::stays`] when a
    /// request got in first.
    pub(super) reclaimed: Notify,
    told: AtomicBool,
    epoch: Instant,
}

impl Table {
    pub(super) fn new() -> Table {
        Table { open: Mutex::new(HashMap::new()), next: AtomicU64::new(0), epoch: Instant::now() }
    }

    /// Enters a new connection, idle from now; it leaves the table when the entry is dropped.
    pub(super) fn enter(self: &Arc<Self>) -> Entry {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let connection = Arc::new(Connection {
            busy: AtomicUsize::new(0),
            idle_since: AtomicU64::new(micros_since(self.epoch)),
            reclaimed: Notify::new(),
            told: AtomicBool::new(false),
            epoch: self.epoch,
        });
        self.lock().insert(id, connection.clone());
        Entry { table: self.clone(), id, connection }
    }

    /// Tells up to `most` idle connections, longest idle first, to close; returns how many.
    pub(super) fn reclaim(&self, most: usize) -> usize {
        let mut idle: Vec<(u64, Arc<Connection>)> = self
            .lock()
            .values()
            .filter(|c| c.is_idle() && !c.told.load(Ordering::SeqCst))
            .map(|c| (c.idle_since.load(Ordering::Relaxed), c.clone()))
            .collect();
        idle.sort_unstable_by_key(|(since, _)| *since);
        idle.truncate(most);
        for (_, connection) in &idle {
            connection.told.store(true, Ordering::SeqCst);
            connection.reclaimed.notify_one();
        }
        idle.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Connection>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn micros_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
}

impl Connection {
    pub(super) fn is_idle(&self) -> bool {
        self.busy.load(Ordering::SeqCst) == 0
    }

    /// A reclaimed connection that a request reached first stays, and may be reclaimed again
    /// once idle.
    pub(super) fn stays(&self) {
        self.told.store(false, Ordering::SeqCst);
    }

    /// Counts a request from its arrival in the handler until hyper drops its answer's body (the
    /// answer may still be in the write buffer then: a reclaim closes gracefully, see `edge`).
    pub(super) fn busy(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::SeqCst);
        Busy(self.clone())
    }
}

/// A connection's place in the table.
pub(super) struct Entry {
    table: Arc<Table>,
    id: u64,
    pub(super) connection: Arc<Connection>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.table.lock().remove(&self.id);
    }
}

/// One request of a connection, until its answer is written.
pub(super) struct Busy(Arc<Connection>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.idle_since.store(micros_since(self.0.epoch), Ordering::Relaxed);
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

pin_project_lite::pin_project! {
    /// The handler's answer, with the connection counted busy until its body is written.
    pub(super) struct Handled<F> {
        #[pin]
        inner: F,
        busy: Option<Busy>,
    }
}

impl<F> Handled<F> {
    pub(super) fn new(inner: F, busy: Busy) -> Handled<F> {
        Handled { inner, busy: Some(busy) }
    }
}

impl<F: Future<Output = Result<Response, Infallible>>> Future for Handled<F> {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Ok(response) = ready!(this.inner.poll(cx));
        let busy = this.busy.take();
        Poll::Ready(Ok(response.map(|inner| Body::new(Answering { inner, _busy: busy }))))
    }
}

pin_project_lite::pin_project! {
    /// An answer's body; the connection is busy until it is written whole or dropped.
    struct Answering {
        #[pin]
        inner: Body,
        _busy: Option<Busy>,
    }
}

impl HttpBody for Answering {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_idle_connections_are_reclaimed_and_busy_ones_never() {
        let table = Arc::new(Table::new());
        let oldest = table.enter();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let busy = table.enter();
        let _request = busy.connection.busy();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let newest = table.enter();
        assert!(!busy.connection.is_idle());

        assert_eq!(table.reclaim(1), 1);
        assert!(told(&oldest), "the longest idle goes first");
        assert!(!told(&newest));
        assert_eq!(table.reclaim(10), 1, "every idle one not told yet, the busy one never");
        assert!(told(&newest) && !told(&busy));
        assert_eq!(table.reclaim(10), 0, "one told is not told (nor counted) again while it closes");
        drop(_request);
        drop(oldest);
        assert_eq!(table.reclaim(10), 1, "the busy one once idle; one that closed has left the table");
    }

    #[test]
    fn a_connection_is_idle_again_once_its_answer_is_written() {
        let table = Arc::new(Table::new());
        let entry = table.enter();
        let (first, second) = (entry.connection.busy(), entry.connection.busy());
        drop(first);
        assert!(!entry.connection.is_idle(), "pipelined: one answer still to write");
        drop(second);
        assert!(entry.connection.is_idle());
    }

    #[test]
    fn a_reclaimed_connection_that_stays_may_be_reclaimed_again() {
        let table = Arc::new(Table::new());
        let entry = table.enter();
        assert_eq!(table.reclaim(1), 1);
        assert!(told(&entry));
        // A request came before the connection read its notice: it stays.
        let request = entry.connection.busy();
        entry.connection.stays();
        assert_eq!(table.reclaim(1), 0, "never while busy");
        drop(request);
        assert_eq!(table.reclaim(1), 1, "idle again, it can give its place up");
        assert!(told(&entry));
    }

    /// Whether the connection was told to close (consuming the notice).
    fn told(entry: &Entry) -> bool {
        let notified = entry.connection.reclaimed.notified();
        futures_util::FutureExt::now_or_never(notified).is_some()
    }
}
