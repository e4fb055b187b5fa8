//! An execution whose client waits for its outcome, run on the client's own task: the request's
//! future polls the execution itself while it waits to be told, and whatever remains of the
//! execution when it stops waiting is handed to a task of its own.
//!
//! Spawning every execution cost each new key a hand-off between threads: the spawn woke a
//! parked runtime worker for the execution's task, and the outcome came back through a channel
//! that woke the request's task in turn (docs/performance.md: at one request at a time, 27 % of
//! the process's samples were the kernel's thread switches and wake-ups). A client that waits
//! does nothing else meanwhile, so its task runs the execution instead, up to the outcome.
//!
//! Its client leaving never cancels it: a request's future dropped before the execution ended
//! (the client hung up, its patience ran out, it was told at a streamed answer's first byte and
//! the execution reads the body on, the server is shutting down) hands the execution, as it
//! stands, to `tokio::spawn`. The execution is the same future either way, with its span and its
//! place in the drain; only the task that polls it changes.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use super::Told;

/// An execution, made to run to its end on whichever task polls it.
pub(super) type Execution = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The outcome of an execution that its client waits for ([`Admitted::Executing`]): awaiting
/// it runs the execution on the awaiting task until the outcome is told. `None` when the
/// execution ended without telling one (the process was past running any, or it panicked): the
/// record is the answer then.
///
/// Dropped before the execution ended, it hands the rest of the execution to a task of its own
/// on the runtime it was made on, whichever thread drops it, so the execution ends whatever the
/// client does. One made outside a runtime (a test's) drops the rest, as a runtime that shuts
/// down drops the tasks it still holds.
///
/// [`Admitted::Executing`]: super::Admitted::Executing
#[must_use = "an execution nobody polls makes no progress until it is dropped"]
pub struct Awaited {
    told: oneshot::Receiver<Told>,
    /// The execution, until it ends.
    execution: Option<Execution>,
    /// The runtime it was made on, where the rest goes when it is dropped: whichever thread
    /// drops it.
    runtime: Option<tokio::runtime::Handle>,
}

impl Awaited {
    /// `execution`, which holds the only sender of `told` and tells its outcome on it, if ever,
    /// while it is polled: never from a task of its own.
    pub(super) fn new(told: oneshot::Receiver<Told>, execution: Execution) -> Awaited {
        Awaited { told, execution: Some(execution), runtime: tokio::runtime::Handle::try_current().ok() }
    }
}

impl Future for Awaited {
    type Output = Option<Told>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Told>> {
        let this = self.get_mut();
        let Some(mut execution) = this.execution.take() else {
            return Pin::new(&mut this.told).poll(cx).map(Result::ok);
        };
        // Taken out while it is polled: one that panics is dropped with its panic, never handed
        // to a task that would poll it again. Its panic stays its own, as in a task of its own:
        // the client is answered from the record.
        match std::panic::catch_unwind(AssertUnwindSafe(|| execution.as_mut().poll(cx))) {
            Ok(Poll::Pending) => this.execution = Some(execution),
            Ok(Poll::Ready(())) | Err(_) => {}
        }
        // The outcome can only have come during that poll, so it is taken without leaving a
        // wake-up on the channel: it would wake this very task as it runs, which the runtime
        // then queues again where a parked thread may be woken to take it. An execution that
        // ended has told its outcome or dropped the sender.
        match this.told.try_recv() {
            Ok(told) => Poll::Ready(Some(told)),
            Err(oneshot::error::TryRecvError::Empty) => Poll::Pending,
            Err(oneshot::error::TryRecvError::Closed) => Poll::Ready(None),
        }
    }
}

impl Drop for Awaited {
    fn drop(&mut self) {
        if let Some(execution) = self.execution.take() {
            if let Some(runtime) = &self.runtime {
                runtime.spawn(execution);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::sync::Notify;

    use super::*;
    use crate::worker::Outcome;

    fn told(attempts: u32) -> Told {
        Told { outcome: Outcome::Lost, laps: None, attempts }
    }

    /// Polls `future` once, on a waker that does nothing.
    fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        Pin::new(future).poll(&mut Context::from_waker(std::task::Waker::noop()))
    }

    /// An execution that tells its outcome at once, then waits for `release` before it ends,
    /// and says on `ended` that it did: a streamed answer, told at its first byte and read on.
    fn telling_then_held(reply: oneshot::Sender<Told>, release: Arc<Notify>, ended: oneshot::Sender<()>) -> Execution {
        Box::pin(async move {
            let _ = reply.send(told(1));
            release.notified().await;
            let _ = ended.send(());
        })
    }

    #[tokio::test]
    async fn dropped_mid_execution_the_rest_runs_on_a_task_of_its_own() {
        let (reply, receiver) = oneshot::channel();
        let (release, started) = (Arc::new(Notify::new()), Arc::new(AtomicBool::new(false)));
        let (ended, has_ended) = oneshot::channel();
        let execution: Execution = Box::pin({
            let (release, started) = (release.clone(), started.clone());
            async move {
                started.store(true, Ordering::SeqCst);
                release.notified().await;
                let _ = reply.send(told(1));
                let _ = ended.send(());
            }
        });
        let mut awaited = Awaited::new(receiver, execution);
        assert!(poll_once(&mut awaited).is_pending(), "the execution waits on the test");
        assert!(started.load(Ordering::SeqCst), "polled on the awaiting task");
        // The client leaves while the execution is held.
        drop(awaited);
        // A permit kept if the execution is not waiting yet: its release is never lost.
        release.notify_one();
        tokio::time::timeout(Duration::from_secs(10), has_ended)
            .await
            .expect("the execution ends without its client")
            .expect("the execution was not dropped");
    }

    #[tokio::test]
    async fn told_its_outcome_it_returns_it_and_the_execution_left_runs_on() {
        let (reply, receiver) = oneshot::channel();
        let release = Arc::new(Notify::new());
        let (ended, mut has_ended) = oneshot::channel();
        let mut awaited = Awaited::new(receiver, telling_then_held(reply, release.clone(), ended));
        match poll_once(&mut awaited) {
            Poll::Ready(Some(Told { outcome: Outcome::Lost, attempts: 1, .. })) => {}
            other => panic!("told at once, not {:?}", other.map(|told| told.map(|t| t.outcome))),
        }
        assert!(has_ended.try_recv().is_err(), "the execution has work left");
        drop(awaited);
        release.notify_one();
        tokio::time::timeout(Duration::from_secs(10), has_ended)
            .await
            .expect("the execution ends after its client was told")
            .expect("the execution was not dropped");
    }

    #[tokio::test]
    async fn an_execution_that_ends_in_one_go_is_awaited_to_its_outcome() {
        let (reply, receiver) = oneshot::channel();
        let awaited = Awaited::new(
            receiver,
            Box::pin(async move {
                tokio::task::yield_now().await;
                let _ = reply.send(told(2));
            }),
        );
        let told = awaited.await.expect("told");
        assert_eq!(told.attempts, 2);
    }

    #[tokio::test]
    async fn an_execution_that_ends_untold_or_panics_is_awaited_to_none() {
        let (reply, receiver) = oneshot::channel::<Told>();
        assert!(Awaited::new(receiver, Box::pin(async move { drop(reply) })).await.is_none());

        let (reply, receiver) = oneshot::channel::<Told>();
        let panicking = Box::pin(async move {
            let _reply = reply;
            panic!("a bug in the execution");
        });
        assert!(Awaited::new(receiver, panicking).await.is_none(), "the panic stays the execution's");
    }

    #[test]
    fn dropped_on_a_thread_outside_the_runtime_the_rest_still_runs_on_it() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let (reply, receiver) = oneshot::channel();
        let (ended, has_ended) = oneshot::channel();
        let release = Arc::new(Notify::new());
        let mut awaited =
            runtime.block_on(async { Awaited::new(receiver, telling_then_held(reply, release.clone(), ended)) });
        assert!(matches!(poll_once(&mut awaited), Poll::Ready(Some(_))));
        std::thread::spawn(move || drop(awaited)).join().unwrap();
        release.notify_one();
        runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), has_ended).await.expect("the rest ran").unwrap();
        });
    }

    #[test]
    fn made_outside_a_runtime_the_rest_is_dropped() {
        let (reply, receiver) = oneshot::channel();
        let (ended, mut has_ended) = oneshot::channel();
        let mut awaited = Awaited::new(receiver, telling_then_held(reply, Arc::new(Notify::new()), ended));
        assert!(matches!(poll_once(&mut awaited), Poll::Ready(Some(_))));
        drop(awaited);
        assert_eq!(has_ended.try_recv(), Err(oneshot::error::TryRecvError::Closed), "dropped, not run");
    }
}
