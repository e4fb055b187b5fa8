//! One streamed answer in flight: the parts of its body as they come from the upstream, kept for
//! the record and for duplicates that attach, and read by any number of readers, each at its own
//! pace.
//!
//! Memory is bounded twice. While the body is within the route's `max_stored_body`, every part is
//! kept: the record will store them all, so they are held anyway. Past it the answer will not be
//! stored, nobody can attach any more, and a part is dropped once every reader has passed it; the
//! upstream is read at most `window` bytes ahead of the slowest reader (as a proxy's buffers
//! would), so a slow client slows the read instead of filling memory. A reader that is dropped
//! (its client left) holds nothing back.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::{Bytes, BytesMut};
use tokio::sync::{watch, Notify};

/// How a stream ended, as its readers learn it after its last part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The upstream finished the body.
    Complete,
    /// The upstream cut the stream, stalled past `stream_idle_timeout`, or ran out of deadline:
    /// the body is partial. The text is the problem document a client is shown.
    Cut(Arc<str>),
}

pub(crate) struct Tap {
    inner: Mutex<Inner>,
    /// Bumped on every part and at the end: readers wait on it.
    grown: watch::Sender<u64>,
    /// Woken whenever a reader moves on or leaves: the writer, held back by the window, waits on it.
    drained: Notify,
    max_stored: u64,
    window: u64,
}

struct Inner {
    parts: VecDeque<Bytes>,
    /// The stream-wide index of `parts[0]`: parts before it were dropped.
    first: u64,
    /// Bytes received, and bytes held in `parts`.
    received: u64,
    held: u64,
    end: Option<End>,
    /// Each live reader's next part, by reader.
    readers: HashMap<u64, u64>,
    next_reader: u64,
}

impl Inner {
    fn stored(&self, max_stored: u64) -> bool {
        self.received <= max_stored
    }

    /// Drops the parts every reader has passed, once the body is past storing.
    fn trim(&mut self, max_stored: u64) {
        if self.stored(max_stored) {
            return;
        }
        let slowest = self.readers.values().copied().min().unwrap_or(self.first + self.parts.len() as u64);
        while self.first < slowest {
            let Some(part) = self.parts.pop_front() else { break };
            self.held -= part.len() as u64;
            self.first += 1;
        }
    }
}

impl Tap {
    /// A tap for one answer whose body is kept whole while within `max_stored` bytes, and read
    /// at most `window` bytes ahead of its slowest reader past that.
    pub(crate) fn new(max_stored: u64, window: u64) -> Arc<Tap> {
        Arc::new(Tap {
            inner: Mutex::new(Inner {
                parts: VecDeque::new(),
                first: 0,
                received: 0,
                held: 0,
                end: None,
                readers: HashMap::new(),
                next_reader: 0,
            }),
            grown: watch::channel(0).0,
            drained: Notify::new(),
            max_stored,
            window: window.max(1),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock leaves nothing half-written that a reader could trust
        // less than the parts themselves: carry on with them.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Adds the next part of the body. Past `max_stored`, waits first while the readers lag more
    /// than the window behind.
    pub(crate) async fn push(&self, part: Bytes) {
        if part.is_empty() {
            return;
        }
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            {
                let mut inner = self.lock();
                inner.trim(self.max_stored);
                let over = inner.received + part.len() as u64 > self.max_stored;
                if !over || inner.held < self.window || inner.readers.is_empty() {
                    inner.received += part.len() as u64;
                    inner.held += part.len() as u64;
                    inner.parts.push_back(part);
                    inner.trim(self.max_stored);
                    break;
                }
            }
            drained.await;
        }
        self.grown.send_modify(|n| *n += 1);
    }

    /// Ends the stream; later pushes are ignored by readers.
    pub(crate) fn finish(&self, end: End) {
        self.lock().end.get_or_insert(end);
        self.grown.send_modify(|n| *n += 1);
    }

    /// Bytes received from the upstream so far.
    pub(crate) fn received(&self) -> u64 {
        self.lock().received
    }

    /// The whole body, if it ended within `max_stored` bytes: what the record stores.
    pub(crate) fn body(&self) -> Option<Bytes> {
        let inner = self.lock();
        if !inner.stored(self.max_stored) {
            return None;
        }
        let mut body = BytesMut::with_capacity(inner.held as usize);
        inner.parts.iter().for_each(|p| body.extend_from_slice(p));
        Some(body.freeze())
    }

    /// A reader from the first byte, while the body is still whole (within `max_stored`);
    /// `None` once it is not, as nobody could then be given the same bytes.
    pub(crate) fn attach(self: &Arc<Self>) -> Option<Reader> {
        let mut inner = self.lock();
        if !inner.stored(self.max_stored) || inner.first != 0 {
            return None;
        }
        let id = inner.next_reader;
        inner.next_reader += 1;
        inner.readers.insert(id, 0);
        drop(inner);
        Some(Reader { tap: self.clone(), id, next: 0, grown: self.grown.subscribe() })
    }
}

/// What a reader gets next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    Part(Bytes),
    End(End),
}

/// One reader of a tap: the client the answer is for, or a duplicate attached to it.
pub struct Reader {
    tap: Arc<Tap>,
    id: u64,
    next: u64,
    grown: watch::Receiver<u64>,
}

impl Reader {
    /// The next part, waiting for it if need be; the end, once every part has been read.
    pub async fn next(&mut self) -> Next {
        loop {
            self.grown.borrow_and_update();
            {
                let mut inner = self.tap.lock();
                if self.next < inner.first + inner.parts.len() as u64 {
                    let part = inner.parts[(self.next - inner.first) as usize].clone();
                    self.next += 1;
                    inner.readers.insert(self.id, self.next);
                    drop(inner);
                    self.tap.drained.notify_waiters();
                    return Next::Part(part);
                }
                if let Some(end) = &inner.end {
                    return Next::End(end.clone());
                }
            }
            if self.grown.changed().await.is_err() {
                // The tap is gone without an end: read as a cut with nothing to say.
                return Next::End(End::Cut(Arc::from("")));
            }
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.tap.lock().readers.remove(&self.id);
        self.tap.drained.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn part(text: &str) -> Bytes {
        Bytes::copy_from_slice(text.as_bytes())
    }

    async fn read_all(mut reader: Reader) -> (Vec<Bytes>, End) {
        let mut parts = Vec::new();
        loop {
            match reader.next().await {
                Next::Part(p) => parts.push(p),
                Next::End(end) => return (parts, end),
            }
        }
    }

    #[tokio::test]
    async fn a_reader_attached_late_gets_every_part_from_the_first_then_follows_live() {
        let tap = Tap::new(1024, 64);
        let early = tap.attach().unwrap();
        tap.push(part("data: 1\n\n")).await;
        tap.push(part("data: 2\n\n")).await;
        let late = tap.attach().unwrap();
        let readers = tokio::spawn(async move { (read_all(early).await, read_all(late).await) });
        tap.push(part("data: [DONE]\n\n")).await;
        tap.finish(End::Complete);
        let ((early, end1), (late, end2)) = readers.await.unwrap();
        assert_eq!(early, late);
        assert_eq!(early.len(), 3);
        assert_eq!((end1, end2), (End::Complete, End::Complete));
        assert_eq!(tap.body().unwrap(), part("data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"));
    }

    #[tokio::test]
    async fn a_reader_waits_for_the_next_part() {
        let tap = Tap::new(1024, 64);
        let mut reader = tap.attach().unwrap();
        let next = tokio::spawn(async move { reader.next().await });
        tokio::task::yield_now().await;
        assert!(!next.is_finished());
        tap.push(part("x")).await;
        assert_eq!(next.await.unwrap(), Next::Part(part("x")));
    }

    #[tokio::test]
    async fn a_cut_reaches_readers_after_the_parts_before_it() {
        let tap = Tap::new(1024, 64);
        let reader = tap.attach().unwrap();
        tap.push(part("a")).await;
        tap.finish(End::Cut(Arc::from("{}")));
        tap.finish(End::Complete);
        let (parts, end) = read_all(reader).await;
        assert_eq!(parts, vec![part("a")]);
        assert_eq!(end, End::Cut(Arc::from("{}")));
    }

    #[tokio::test]
    async fn past_max_stored_the_body_is_not_kept_and_nobody_can_attach() {
        let tap = Tap::new(4, 64);
        let reader = tap.attach().unwrap();
        tap.push(part("abc")).await;
        assert!(tap.attach().is_some(), "still within the bound");
        tap.push(part("de")).await;
        assert!(tap.attach().is_none());
        tap.finish(End::Complete);
        assert_eq!(tap.body(), None);
        assert_eq!(tap.received(), 5);
        let (parts, _) = read_all(reader).await;
        assert_eq!(parts, vec![part("abc"), part("de")], "a reader already there still gets it all");
    }

    #[tokio::test]
    async fn past_max_stored_a_slow_reader_holds_the_writer_back_to_the_window() {
        let tap = Tap::new(0, 8);
        let mut reader = tap.attach().unwrap();
        // Four-byte parts: two fit in the window; the third waits for the reader.
        tap.push(part("0000")).await;
        tap.push(part("1111")).await;
        let writer = tokio::spawn({
            let tap = tap.clone();
            async move { tap.push(part("2222")).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!writer.is_finished(), "the window is full");
        assert_eq!(reader.next().await, Next::Part(part("0000")));
        writer.await.unwrap();
        assert!(tap.lock().held <= 8, "the part read was dropped");
    }

    #[tokio::test]
    async fn a_reader_that_leaves_holds_nothing_back() {
        let tap = Tap::new(0, 4);
        let reader = tap.attach().unwrap();
        tap.push(part("0000")).await;
        drop(reader);
        for _ in 0..100 {
            tap.push(part("1111")).await;
        }
        assert!(tap.lock().held <= 4);
        assert_eq!(tap.received(), 404);
    }
}
