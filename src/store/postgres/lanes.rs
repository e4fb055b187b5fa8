//! Work that arrives together, done together: callers queue items, and a few lanes each take
//! whatever has queued up (waiting when nothing has) and hand it to one call. While some lanes
//! wait on PostgreSQL, the next batch fills up behind them.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Mutex};

use crate::store::StoreError;

/// Items waiting for a lane before callers wait to queue theirs.
const QUEUE: usize = 4096;
/// The most items in one call.
pub(super) const MAX_BATCH: usize = 128;
/// Calls in flight at once.
pub(super) const LANES: usize = 4;

/// Where a lane sends an item's result.
pub(super) type Reply<R> = oneshot::Sender<Result<R, StoreError>>;

pub(super) struct Lanes<T> {
    queue: mpsc::Sender<T>,
}

impl<T: Send + 'static> Lanes<T> {
    /// Starts `lanes` lanes, each handing at most `max_batch` items at a time to `work`. They
    /// stop once this is dropped and the queue has drained.
    pub(super) fn start<W, F>(lanes: usize, max_batch: usize, work: W) -> Lanes<T>
    where
        W: Fn(Vec<T>) -> F + Send + Sync + 'static,
        F: Future<Output = ()> + Send,
    {
        let (queue, waiting) = mpsc::channel(QUEUE);
        let waiting = Arc::new(Mutex::new(waiting));
        let work = Arc::new(work);
        for _ in 0..lanes {
            let (waiting, work) = (waiting.clone(), work.clone());
            tokio::spawn(async move {
                loop {
                    let mut batch = Vec::with_capacity(max_batch);
                    if waiting.lock().await.recv_many(&mut batch, max_batch).await == 0 {
                        return;
                    }
                    work(batch).await;
                }
            });
        }
        Lanes { queue }
    }

    /// Queues the item `make` builds around its reply, and waits for that reply.
    pub(super) async fn ask<R>(&self, make: impl FnOnce(Reply<R>) -> T) -> Result<R, StoreError> {
        let (reply, answer) = oneshot::channel();
        let closed = || StoreError::Unavailable("the store is shutting down".into());
        self.queue.send(make(reply)).await.map_err(|_| closed())?;
        answer.await.map_err(|_| closed())?
    }
}
