//! The interleavings that once sent a record twice, played step by step: the time in leases is a
//! manual clock, the workers and the route's places are held by the test, and the upstream keeps
//! a ledger of what it executed. Leases are a minute long, so no renewal (every 20 s of real
//! time) falls inside a test; every lease that runs out here does so because the test moved the
//! clock.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};

use super::admission::tests::{request, NOW};
use super::Worker;
use crate::config::Config;
use crate::domain::clock::{Clock, ManualClock};
use crate::domain::{ClaimToken, HistoryAction, Phase, RecordId, Timestamp};
use crate::record::Record;
use crate::store::{Admission, Admit, NewRecord, Store};
use crate::upkeep::Sweeper;

const LEASE: Duration = Duration::from_secs(60);

/// An upstream that counts what it executed. With its gate closed, a request that arrives waits
/// (counted as arrived, not executed) until the test lets it through.
#[derive(Default)]
struct Ledger {
    arrived: AtomicUsize,
    executed: AtomicUsize,
    news: Notify,
    gate: Option<Semaphore>,
}

impl Ledger {
    fn gated() -> Arc<Ledger> {
        Arc::new(Ledger { gate: Some(Semaphore::new(0)), ..Ledger::default() })
    }

    fn open(&self) {
        if let Some(gate) = &self.gate {
            gate.add_permits(Semaphore::MAX_PERMITS / 2);
        }
    }

    async fn serve(self: Arc<Ledger>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let ledger = self.clone();
        let app = axum::Router::new().route(
            "/payments",
            axum::routing::post(move || {
                let ledger = ledger.clone();
                async move {
                    ledger.arrived.fetch_add(1, Ordering::SeqCst);
                    ledger.news.notify_waiters();
                    if let Some(gate) = &ledger.gate {
                        gate.acquire().await.unwrap().forget();
                    }
                    let n = ledger.executed.fetch_add(1, Ordering::SeqCst) + 1;
                    (http::StatusCode::CREATED, format!("charge {n}"))
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    /// Waits for the `n`th request to arrive.
    async fn arrivals(&self, n: usize) {
        loop {
            let news = self.news.notified();
            tokio::pin!(news);
            news.as_mut().enable();
            if self.arrived.load(Ordering::SeqCst) >= n {
                return;
            }
            news.await;
        }
    }
}

/// Nodes of one broker: one SQLite store, one clock, one upstream.
struct Cluster {
    store: Arc<dyn Store>,
    clock: Arc<ManualClock>,
    config: Arc<Config>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Two workers a node, a route `payments` with two places for attempts in flight, a lease of
    /// a minute and a deadline of ten.
    async fn new(upstream: &str) -> Cluster {
        let dir = tempfile::TempDir::new().unwrap();
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let text = format!(
            "[store]\nurl = \"{url}\"\n[worker]\nconcurrency = 2\nlease = \"60s\"\n\n[[routes]]\n\
             name = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"{upstream}\"\nmax_concurrency = 2\n\
             [routes.retry]\ndeadline = \"10m\"\nper_try_timeout = \"5m\"\n"
        );
        let config = Arc::new(Config::parse_with_env(&text, |_| None).unwrap());
        let store = crate::store::open(&url).await.unwrap();
        Cluster { store, clock: Arc::new(ManualClock::new(NOW)), config, _dir: dir }
    }

    fn node(&self, name: &str) -> Worker {
        Worker::on(self.store.clone(), (*self.config).clone(), name, self.clock.clone())
    }

    /// A new request for `payments`, recorded and queued at `NOW` by a node that then died.
    async fn queued(&self, key: &str) -> RecordId {
        let new = NewRecord { deadline_at: NOW + Duration::from_secs(600), ..request(key) };
        let Admission::Created(record) =
            self.store.admit(Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap()
        else {
            panic!("a new key is created")
        };
        record.id
    }

    async fn record(&self, id: RecordId) -> Record {
        self.store.get(id).await.unwrap().unwrap()
    }

    /// One take-over pass of `node`, with the clock moved on by `by` first.
    async fn sweep(&self, node: &Worker, by: Duration) {
        self.clock.advance(by);
        Sweeper::new(self.store.clone(), node.clone()).pass(&self.config, self.clock.now()).await.unwrap();
    }

    /// Waits until `id` is claimed with `token`: a claim made by a spawned execution lands when
    /// that execution runs.
    async fn claimed(&self, id: RecordId, token: ClaimToken) -> Record {
        let wait = async {
            loop {
                let record = self.record(id).await;
                if record.phase() == Phase::InProgress && record.claim == token {
                    return record;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), wait).await.expect("the record is claimed")
    }
}

impl Worker {
    /// Holds both of the route's places for attempts in flight until the permit is dropped:
    /// every execution of this node then waits before marking an attempt.
    fn hold_places(&self) -> tokio::sync::OwnedSemaphorePermit {
        let route = self.inner.config.served().route_named("payments").unwrap();
        route.guard().attempts.clone().try_acquire_many_owned(2).expect("both places are free")
    }
}

#[tokio::test]
async fn a_busy_node_claims_no_queued_record_it_has_no_worker_for() {
    let ledger = Arc::new(Ledger::default());
    let cluster = Cluster::new(&ledger.clone().serve().await).await;
    let node = cluster.node("node-1");
    let x = cluster.queued("queued-1").await;

    let busy = node.free_workers(usize::MAX);
    assert_eq!(busy.len(), 2, "the test holds both of the node's workers");
    cluster.sweep(&node, LEASE + Duration::from_millis(1)).await;
    assert_eq!(cluster.record(x).await.phase(), Phase::Queued, "no worker, no claim: no lease runs out unheld");

    drop(busy);
    cluster.sweep(&node, Duration::from_millis(1)).await;
    node.idle().await;
    let done = cluster.record(x).await;
    assert_eq!((done.phase(), done.claim), (Phase::Done, ClaimToken(1)));
    assert_eq!(ledger.executed.load(Ordering::SeqCst), 1);
}

/// The interleaving seen on a busy node: its sweep claims a record whose execution (A) then
/// waits; the lease runs out; the record is taken back to the queue and claimed again by the
/// same node (B). When the node frees up, only B may send.
#[tokio::test]
async fn a_busy_nodes_stale_claim_sends_nothing_once_it_claimed_the_record_again() {
    let ledger = Ledger::gated();
    let cluster = Cluster::new(&ledger.clone().serve().await).await;
    let node = cluster.node("node-1");
    let x = cluster.queued("queued-1").await;
    let places = node.hold_places();

    cluster.sweep(&node, LEASE + Duration::from_millis(1)).await;
    cluster.claimed(x, ClaimToken(1)).await;
    // A waits for a place; its lease runs out; the same node takes the record back to the queue
    // and its second execution (B) claims it.
    cluster.sweep(&node, LEASE + Duration::from_millis(1)).await;
    cluster.claimed(x, ClaimToken(2)).await;

    drop(places);
    ledger.arrivals(1).await;
    ledger.open();
    node.idle().await;
    assert_eq!(ledger.executed.load(Ordering::SeqCst), 1, "executed once, by the claim that holds it");
    let done = cluster.record(x).await;
    assert_eq!((done.phase(), done.claim, done.attempts.len()), (Phase::Done, ClaimToken(2), 1));
}

/// The same with two nodes, as a multi-node take-over met it: node 1's execution (A) waits,
/// node 2 takes the record back to the queue but has no worker to run it, node 1's sweep claims
/// it again (B).
#[tokio::test]
async fn a_claim_taken_back_by_another_node_and_given_again_sends_only_under_the_new_one() {
    let ledger = Ledger::gated();
    let cluster = Cluster::new(&ledger.clone().serve().await).await;
    let (node1, node2) = (cluster.node("node-1"), cluster.node("node-2"));
    let x = cluster.queued("queued-1").await;
    let places = node1.hold_places();
    let node2_busy = node2.free_workers(usize::MAX);

    cluster.sweep(&node1, LEASE + Duration::from_millis(1)).await;
    cluster.claimed(x, ClaimToken(1)).await;
    cluster.sweep(&node2, LEASE + Duration::from_millis(1)).await;
    assert_eq!(cluster.record(x).await.phase(), Phase::Queued, "node 2 took it back, and waits for a worker");
    cluster.sweep(&node1, LEASE + Duration::from_millis(1)).await;
    cluster.claimed(x, ClaimToken(2)).await;

    drop(places);
    ledger.arrivals(1).await;
    ledger.open();
    node1.idle().await;
    drop(node2_busy);
    node2.idle().await;
    assert_eq!(ledger.executed.load(Ordering::SeqCst), 1, "executed once, by the claim that holds it");
    let done = cluster.record(x).await;
    assert_eq!((done.phase(), done.claim, done.attempts.len()), (Phase::Done, ClaimToken(2), 1));
}

/// A node marks attempt 1 and sends it, then stalls past its lease before the upstream acts on
/// it (a pause, a stalled store): a survivor moves the record to `unknown`, as it must. When the
/// upstream executes and answers, that answer settles the record instead of being thrown away.
#[tokio::test]
async fn a_paused_nodes_late_outcome_settles_the_record_its_survivor_made_unknown() {
    let ledger = Ledger::gated();
    let cluster = Cluster::new(&ledger.clone().serve().await).await;
    let (paused, survivor) = (cluster.node("node-1"), cluster.node("node-2"));
    let x = cluster.queued("queued-1").await;

    cluster.sweep(&paused, LEASE + Duration::from_millis(1)).await;
    ledger.arrivals(1).await;
    let sent = cluster.record(x).await;
    assert_eq!((sent.claim, sent.in_flight.map(|(n, _)| n)), (ClaimToken(1), Some(1)));
    cluster.sweep(&survivor, LEASE + Duration::from_millis(1)).await;
    let unknown = cluster.record(x).await;
    assert_eq!(unknown.phase(), Phase::Unknown, "attempt 1 may have executed: nothing can tell yet");
    assert_eq!(unknown.attempts.iter().map(|a| a.outcome.as_str()).collect::<Vec<_>>(), ["lost"]);

    ledger.open();
    paused.idle().await;
    let settled = cluster.record(x).await;
    assert_eq!(settled.phase(), Phase::Done, "{settled:#?}");
    let response = settled.response.expect("the upstream's answer is kept");
    assert_eq!((response.status, &response.body[..]), (201, &b"charge 1"[..]));
    assert_eq!(settled.attempts.iter().map(|a| a.outcome.as_str()).collect::<Vec<_>>(), ["success"]);
    let noted = settled.history.last().unwrap();
    assert_eq!(
        (noted.actor.to_string().as_str(), noted.action),
        ("node:node-1", HistoryAction::LateOutcome(Phase::Done))
    );
    assert_eq!(ledger.executed.load(Ordering::SeqCst), 1);
}

/// Within one process, a newer claim's execution of a record takes the older one's place: the
/// older is told it is superseded (it stops before its next write), a cancel reaches the newer,
/// and the older's end does not unregister the newer.
#[tokio::test]
async fn a_newer_claim_running_here_supersedes_the_older_and_a_cancel_reaches_the_newer() {
    let cluster = Cluster::new("http://127.0.0.1:9").await;
    let node = cluster.node("node-1");
    let id = RecordId::new();
    let older = node.inner.running.start(id, ClaimToken(1));
    assert!(!older.is_superseded());
    let newer = node.inner.running.start(id, ClaimToken(2));
    assert!(older.is_superseded() && !newer.is_superseded());
    node.inner.running.stopped(id, ClaimToken(1));
    node.cancel(id);
    assert!(newer.raised.load(Ordering::SeqCst), "the cancel reaches the claim that holds the record");
    assert!(!older.raised.load(Ordering::SeqCst));
    node.inner.running.stopped(id, ClaimToken(2));
    assert!(node.inner.running.signal(id).is_none(), "nothing runs here any more");
}
