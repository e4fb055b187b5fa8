//! Request bodies, read under two limits: a body that stops arriving is cut after `body_timeout`
//! ([`TimedBody`]), and the bytes held in memory by all requests at once stay within
//! `max_buffered_bodies` ([`BodyBudget`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("the body is larger than {0} bytes")]
    TooLarge(usize),
    #[error("the body stopped arriving")]
    TimedOut,
    #[error("the broker holds as many request bodies as it may")]
    Overloaded,
    #[error("the body could not be read: {0}")]
    Unreadable(BoxError),
}

/// The error a [`TimedBody`] ends with when its client falls silent.
#[derive(Debug, thiserror::Error)]
#[error("no body bytes arrived for {0:?}")]
pub(crate) struct BodyTimedOut(Duration);

pin_project_lite::pin_project! {
    /// A body that fails when no part of it arrives for `idle`. The clock runs only while the
    /// reader waits, from the first wait after a part arrived; a body that is already there
    /// costs nothing. The timer lives inline: no allocation per request.
    pub struct TimedBody<B> {
        #[pin]
        inner: B,
        idle: Duration,
        // Created at the first wait and reused after; `waiting` says whether it is armed.
        #[pin]
        timer: Option<Sleep>,
        waiting: bool,
    }
}

impl<B> TimedBody<B> {
    pub(crate) fn new(inner: B, idle: Duration) -> TimedBody<B> {
        TimedBody { inner, idle, timer: None, waiting: false }
    }
}

impl<B> HttpBody for TimedBody<B>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if let Poll::Ready(frame) = this.inner.poll_frame(cx) {
            *this.waiting = false;
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if !*this.waiting {
            let deadline = Instant::now() + *this.idle;
            match this.timer.as_mut().as_pin_mut() {
                Some(timer) => timer.reset(deadline),
                None => this.timer.set(Some(tokio::time::sleep_until(deadline))),
            }
            *this.waiting = true;
        }
        match this.timer.as_pin_mut().map(|timer| timer.poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(Some(Err(Box::new(BodyTimedOut(*this.idle))))),
            _ => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The request body bytes held in memory at once, and their bound.
#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    held: AtomicUsize,
}

/// A share of the [`BodyBudget`], given back when dropped: keep it as long as the body it covers.
#[derive(Debug)]
pub struct Held<'a> {
    budget: &'a BodyBudget,
    bytes: usize,
}

impl BodyBudget {
    pub fn new(limit: usize) -> BodyBudget {
        BodyBudget { limit, held: AtomicUsize::new(0) }
    }

    /// Bytes held right now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub fn reserve(&self, bytes: usize) -> Option<Held<'_>> {
        let mut held = Held { budget: self, bytes: 0 };
        held.cover(bytes).then_some(held)
    }

    fn take(&self, bytes: usize) -> bool {
        let mut current = self.held.load(Ordering::Relaxed);
        loop {
            let Some(next) = current.checked_add(bytes).filter(|n| *n <= self.limit) else {
                return false;
            };
            match self.held.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(now) => current = now,
            }
        }
    }
}

impl Held<'_> {
    /// Grows this share to at least `total` bytes; false (and unchanged) if the budget is spent.
    pub fn cover(&mut self, total: usize) -> bool {
        if total <= self.bytes {
            return true;
        }
        if !self.budget.take(total - self.bytes) {
            return false;
        }
        self.bytes = total;
        true
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.held.fetch_sub(self.bytes, Ordering::Relaxed);
        }
    }
}

/// Reads a whole body of at most `limit` bytes under `budget`. A declared length is reserved
/// before the first byte is read (and refused at once when too large); a body of unknown length
/// reserves as it arrives. The bytes and their share of the budget are returned together.
pub(crate) async fn read(mut body: Body, limit: usize, budget: &BodyBudget) -> Result<(Bytes, Held<'_>), ReadError> {
    let declared = body.size_hint().exact();
    let declared = match declared.map(usize::try_from) {
        Some(Ok(n)) if n <= limit => Some(n),
        Some(_) => {
            discard_the_rest(body);
            return Err(ReadError::TooLarge(limit));
        }
        None => None,
    };
    let mut held = budget.reserve(declared.unwrap_or(0)).ok_or(ReadError::Overloaded)?;
    let mut parts = Parts::None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            let e = e.into_inner();
            if e.is::<BodyTimedOut>() {
                ReadError::TimedOut
            } else {
                ReadError::Unreadable(e)
            }
        })?;
        let Ok(data) = frame.into_data() else { continue };
        let total = parts.len() + data.len();
        if total > limit {
            discard_the_rest(body);
            return Err(ReadError::TooLarge(limit));
        }
        if !held.cover(total) {
            return Err(ReadError::Overloaded);
        }
        parts.push(data, declared);
    }
    Ok((parts.into_bytes(), held))
}

/// Most bytes of a refused body read and thrown away after its answer, and for how long.
const DISCARD_AT_MOST: usize = 8 << 20;
const DISCARD_FOR: Duration = Duration::from_secs(5);

/// Reads what is left of a body refused as too large, and throws it away, in the background
/// while its answer goes out: up to [`DISCARD_AT_MOST`] bytes, for up to [`DISCARD_FOR`]. A
/// connection closed with bytes unread is reset by the kernel, and a client still sending its
/// body then sees the reset, not the `413` that came before it (nginx's lingering close does
/// the same). A body past either bound is cut, and its connection with it.
fn discard_the_rest(mut body: Body) {
    tokio::spawn(async move {
        let mut left = DISCARD_AT_MOST;
        let _ = tokio::time::timeout(DISCARD_FOR, async {
            while let Some(Ok(frame)) = body.frame().await {
                let Ok(data) = frame.into_data() else { continue };
                match left.checked_sub(data.len()) {
                    Some(still) => left = still,
                    None => break,
                }
            }
        })
        .await;
    });
}

/// A body's parts as they arrive: most bodies come in one part, kept as it is; more are copied
/// into one buffer, of the declared size when there is one.
enum Parts {
    None,
    One(Bytes),
    Many(BytesMut),
}

impl Parts {
    fn len(&self) -> usize {
        match self {
            Parts::None => 0,
            Parts::One(b) => b.len(),
            Parts::Many(b) => b.len(),
        }
    }

    fn push(&mut self, data: Bytes, declared: Option<usize>) {
        if data.is_empty() {
            return;
        }
        *self = match std::mem::replace(self, Parts::None) {
            Parts::None => Parts::One(data),
            Parts::One(first) => {
                let mut buffer = BytesMut::with_capacity(declared.unwrap_or(0).max(first.len() + data.len()));
                buffer.extend_from_slice(&first);
                buffer.extend_from_slice(&data);
                Parts::Many(buffer)
            }
            Parts::Many(mut buffer) => {
                buffer.extend_from_slice(&data);
                Parts::Many(buffer)
            }
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Parts::None => Bytes::new(),
            Parts::One(b) => b,
            // A buffer that grew by doubling may be twice the body: do not keep the slack for
            // as long as the request lives.
            Parts::Many(b) if b.capacity() > b.len() + b.len() / 4 => Bytes::copy_from_slice(&b),
            Parts::Many(b) => b.freeze(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_of(parts: &[&'static str]) -> Body {
        let frames: Vec<Result<Frame<Bytes>, std::io::Error>> =
            parts.iter().map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes())))).collect();
        Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(frames)))
    }

    #[test]
    fn the_budget_is_shared_and_given_back() {
        let budget = BodyBudget::new(100);
        let a = budget.reserve(60).unwrap();
        assert!(budget.reserve(41).is_none());
        let mut b = budget.reserve(40).unwrap();
        assert!(!b.cover(41), "past the bound");
        assert_eq!(budget.held(), 100);
        drop(a);
        assert!(b.cover(90));
        assert_eq!(budget.held(), 90);
        drop(b);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn a_body_in_parts_is_read_whole_and_held_until_released() {
        let budget = BodyBudget::new(100);
        let (bytes, held) = read(body_of(&["ab", "cd", "e"]), 10, &budget).await.unwrap();
        assert_eq!(&bytes[..], b"abcde");
        assert_eq!(budget.held(), 5);
        drop(held);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn a_body_past_the_route_limit_or_the_budget_is_refused() {
        let budget = BodyBudget::new(4);
        assert!(matches!(read(body_of(&["abc", "def"]), 5, &budget).await, Err(ReadError::TooLarge(5))));
        assert!(matches!(read(body_of(&["abc", "de"]), 10, &budget).await, Err(ReadError::Overloaded)));
        assert_eq!(budget.held(), 0, "a refused body gives its share back");
        let declared = Body::from("too long");
        assert!(matches!(read(declared, 5, &budget).await, Err(ReadError::TooLarge(5))));
    }

    #[tokio::test]
    async fn a_body_that_stops_arriving_times_out() {
        let (tx, rx) = channel_body();
        tx.push("part");
        let idle = Duration::from_millis(50);
        let budget = BodyBudget::new(100);
        let started = Instant::now();
        let outcome = read(Body::new(TimedBody::new(rx, idle)), 100, &budget).await;
        assert!(matches!(outcome, Err(ReadError::TimedOut)), "{outcome:?}");
        assert!(started.elapsed() >= idle);
        assert_eq!(budget.held(), 0);
        drop(tx);
    }

    #[tokio::test]
    async fn a_body_whose_parts_keep_coming_is_not_cut_however_long_it_takes() {
        let (tx, rx) = channel_body();
        let feed = tokio::spawn(async move {
            for _ in 0..6 {
                tx.push("ab");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        let idle = Duration::from_millis(200);
        let budget = BodyBudget::new(100);
        let (bytes, _) = read(Body::new(TimedBody::new(rx, idle)), 100, &budget).await.unwrap();
        assert_eq!(&bytes[..], b"abababababab");
        feed.await.unwrap();
    }

    /// A body fed by hand, one part at a time, that ends when its sender goes.
    fn channel_body() -> (Sender, ChannelBody) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Sender(tx), ChannelBody(rx))
    }

    struct Sender(tokio::sync::mpsc::UnboundedSender<Bytes>);

    impl Sender {
        fn push(&self, part: &'static str) {
            let _ = self.0.send(Bytes::from_static(part.as_bytes()));
        }
    }

    struct ChannelBody(tokio::sync::mpsc::UnboundedReceiver<Bytes>);

    impl HttpBody for ChannelBody {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0.poll_recv(cx).map(|part| part.map(|p| Ok(Frame::data(p))))
        }
    }
}
