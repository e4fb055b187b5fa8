//! Never twice in a real deployment (docs/guarantees.md): the paths a fault soak rarely takes,
//! each played step by step. Every node here is a `Worker` of its own, on connections of its own
//! to one database, in front of one fake upstream that counts what reaches it; faults are played
//! at the very store call a node makes ([`Faulty`]). Leases and bounds are counted on a manual
//! clock the test moves (but for the PostgreSQL clock test, which runs on the database's own);
//! renewals and send windows run on tokio's time, a fraction of a second long.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::common::faulty::{Faults, Faulty, Renewals};
use crate::common::{both_stores, Backend, Db, Gate, Reply, Upstream};
use idem::config::Config;
use idem::domain::clock::{Clock, ManualClock, SharedClock};
use idem::domain::fingerprint::Fingerprint;
use idem::domain::key::IdempotencyKey;
use idem::domain::{Actor, Arrival, ClaimToken, Phase, RecordId, Timestamp};
use idem::record::{Record, StoredRequest};
use idem::store::{Admission, Admit, NewRecord, Store};
use idem::test_support::upkeep::{probe_once, Sweeper};
use idem::test_support::worker::{self, Admitted, Outcome, Parts, Settled, Told, Worker};
use idem::test_support::Live;
use idem::test_support::Switches;
use idem::test_support::Upstream as Client;

/// The lease every node trusts and renews. A minute of the manual clock, so no lease runs out
/// but when the test moves the clock; its renewals come every 20 s of tokio's time, after
/// every test here is over, unless a test sets a short lease of its own.
const LEASE: Duration = Duration::from_secs(60);
/// `per_try_timeout`: longer than the lease, as the worst case of the probe's hole was.
const PER_TRY: Duration = Duration::from_secs(300);
const SEND_WINDOW: Duration = Duration::from_millis(100);
/// A lease whose renewals, every third of it, come while an attempt is in flight.
const SHORT_LEASE: Duration = Duration::from_secs(3);
const MARGIN: Duration = Duration::from_millis(100);
const SETTLE: Duration = Duration::from_secs(1);

/// Nodes of one broker on one database: one manual clock, one upstream, one configuration.
struct Cluster {
    db: Db,
    clock: Arc<ManualClock>,
    config: Arc<Config>,
    upstream: Upstream,
}

/// One node: its worker, its own connections to the database, and the faults in front of them.
struct Node {
    worker: Worker,
    /// What the node serves: the route its requests are admitted on.
    live: Arc<Live>,
    store: Arc<dyn Store>,
    faults: Arc<Faults>,
}

impl Cluster {
    /// A route `payments` with a probe, `route` lines added to it, and a lease of `lease`.
    async fn new(backend: Backend, route: &str, lease: Duration) -> Cluster {
        Cluster::sending_within(backend, route, lease, SEND_WINDOW).await
    }

    /// The same, with a send window of `send_window`.
    async fn sending_within(backend: Backend, route: &str, lease: Duration, send_window: Duration) -> Cluster {
        let worker = format!("lease = \"{}ms\"", lease.as_millis());
        let db = Db::new(backend).await;
        let upstream = Upstream::start().await;
        let text = format!(
            "[store]\nurl = \"{}\"\n[worker]\nconcurrency = 2\nsend_window = \"{}ms\"\n\
             clock_margin = \"{}ms\"\n{worker}\n\n[[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\n\
             upstream = \"{}\"\n{route}\n[routes.retry]\ndeadline = \"10m\"\nper_try_timeout = \"{}s\"\n\
             base = \"10ms\"\ncap = \"10ms\"\n[routes.probe]\nmethod = \"GET\"\n\
             path = \"/payments/by-key/{{idempotency_key}}\"\nsettle = \"{}s\"\n",
            db.url,
            send_window.as_millis(),
            MARGIN.as_millis(),
            upstream.url(),
            PER_TRY.as_secs(),
            SETTLE.as_secs(),
        );
        let config = Arc::new(Config::parse_with_env(&text, |_| None).unwrap());
        Cluster { db, clock: Arc::new(ManualClock::starting_now()), config, upstream }
    }

    async fn node(&self, name: &str) -> Node {
        self.node_on(name, self.db.store().await, self.clock.clone())
    }

    fn node_on(&self, name: &str, store: Arc<dyn Store>, clock: SharedClock) -> Node {
        let faults = Arc::new(Faults::default());
        let store = Faulty::wrap(store, faults.clone());
        let live = Arc::new(Live::new((*self.config).clone(), clock.clone()));
        let worker = Worker::new(Parts {
            store: store.clone(),
            upstream: Client::new(),
            config: live.clone(),
            owner: name.into(),
            settled: Arc::new(Settled::default()),
            switches: Arc::new(Switches::new(clock.clone())),
            clock,
        });
        Node { worker, live, store, faults }
    }

    fn now(&self) -> Timestamp {
        self.clock.now()
    }

    /// A request for `payments` under `key`, as the ingress reads it at the clock's now.
    fn request(&self, key: &str) -> worker::Request {
        worker::Request {
            tenant: "default".into(),
            key: IdempotencyKey::parse(key).unwrap(),
            method: http::Method::POST,
            path: "/payments".into(),
            query: String::new(),
            fingerprint: Fingerprint::of("payments", "POST", "/payments", "", None, b"{}"),
            stored: StoredRequest {
                headers: vec![("idempotency-key".into(), key.into())],
                body: bytes::Bytes::from_static(b"{}"),
            },
            deadline_at: self.now() + Duration::from_secs(600),
            arrival: Arrival { at: self.now(), monotonic: std::time::Instant::now() },
        }
    }

    /// `key` sent by a client to `node`, which waits for the outcome on a task of its own from
    /// now on, as the ingress does: its waiting runs the execution.
    async fn send(&self, node: &Node, key: &str) -> tokio::task::JoinHandle<Option<Told>> {
        let route = node.live.served().route_named("payments").unwrap();
        let admit = worker::Submission {
            route: &route,
            policy: route.policy_for(&"default".into(), &IdempotencyKey::parse(key).unwrap(), true),
            request: self.request(key),
            url: None,
            headers: &http::HeaderMap::new(),
            awaits: true,
        };
        match node.worker.admit(admit).await.unwrap() {
            Admitted::Executing { outcome: Some(outcome), .. } => tokio::spawn(outcome),
            Admitted::Executing { outcome: None, .. } => panic!("a client that waits is told"),
            Admitted::Existing(record) => panic!("{key} has a record already: {record:?}"),
            Admitted::Refused(_) => panic!("{key} was shed"),
        }
    }

    /// `key`, recorded and queued at the clock's now by a node that then died.
    async fn queued(&self, store: &Arc<dyn Store>, key: &str) -> RecordId {
        match store.admit(Admit { new: self.new_record(key), retention_cutoff: Timestamp::EPOCH }).await.unwrap() {
            Admission::Created(record) => record.id,
            other => panic!("a new key is created, not {other:?}"),
        }
    }

    /// The record of a request for `payments` under `key`, made at the clock's now, unclaimed.
    fn new_record(&self, key: &str) -> NewRecord {
        let route = &self.config.routes[0];
        NewRecord {
            id: RecordId::new(),
            tenant: "default".into(),
            key: IdempotencyKey::parse(key).unwrap(),
            route: route.name.clone(),
            method: http::Method::POST,
            path: "/payments".into(),
            query: String::new(),
            fingerprint: Fingerprint::of("payments", "POST", "/payments", "", None, b"{}"),
            request: StoredRequest {
                headers: vec![("idempotency-key".into(), key.into())],
                body: bytes::Bytes::from_static(b"{}"),
            },
            deadline_at: self.now() + Duration::from_secs(600),
            now: self.now(),
            policy_version: Some(route.policy_version.clone()),
            claim: None,
            tombstone_cutoff: None,
        }
    }

    /// One take-over pass of `node`, with the clock moved on by `by` first.
    async fn sweep(&self, node: &Node, by: Duration) {
        self.clock.advance(by);
        Sweeper::new(node.store.clone(), node.worker.clone()).pass(&self.config, self.now()).await.unwrap();
    }

    /// One probe pass of `node`, with the clock moved on by `by` first.
    async fn probe(&self, node: &Node, by: Duration) {
        self.clock.advance(by);
        probe_once(&*node.store, &Client::new(), &self.config.routes[0], &node.worker, &*self.clock).await.unwrap();
    }

    async fn record(&self, id: RecordId) -> Record {
        self.db.store().await.get(id).await.unwrap().expect("the record exists")
    }

    /// Waits, ten seconds at most, for `id` to stand as `pred` says.
    async fn until(&self, id: RecordId, what: &str, pred: impl Fn(&Record) -> bool) -> Record {
        let store = self.db.store().await;
        let wait = async {
            loop {
                let record = store.get(id).await.unwrap().expect("the record exists");
                if pred(&record) {
                    return record;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait).await.unwrap_or_else(|_| panic!("{what}: not within 10 s"))
    }
}

/// What a client was told, within ten seconds.
async fn told(outcome: tokio::task::JoinHandle<Option<Told>>) -> Outcome {
    tokio::time::timeout(Duration::from_secs(10), outcome)
        .await
        .expect("the client is told within ten seconds")
        .expect("the client's task ends without a panic")
        .expect("the execution tells its client")
        .outcome
}

/// A node marks attempt 1 and freezes before sending it, past its lease. A survivor makes the
/// record `unknown`, and the route's probe asks the upstream, which has seen nothing: 404. That
/// 404 is not trusted before the attempt's bound (its mark + `send_window` + its time limit +
/// `clock_margin`), since the frozen node may still send it; after the bound it frees the key,
/// the client's retry executes, and the frozen node, thawing long after its send window,
/// sends nothing.
async fn a_probes_404_frees_a_record_only_once_its_marked_attempt_can_no_longer_be_sent(b: Backend) {
    let cluster = Cluster::new(b, "", LEASE).await;
    let (frozen, survivor) = (cluster.node("frozen").await, cluster.node("survivor").await);
    let id = cluster.queued(&survivor.store, "frozen").await;

    frozen.faults.hold_marks();
    cluster.sweep(&frozen, LEASE + Duration::from_millis(1)).await;
    frozen.faults.until("marks", 1, |f| f.marks.load(Ordering::SeqCst)).await;
    let marked_at = tokio::time::Instant::now();
    assert_eq!(cluster.record(id).await.in_flight.map(|(n, _)| n), Some(1), "attempt 1 is marked");

    cluster.sweep(&survivor, LEASE + Duration::from_millis(1)).await;
    assert_eq!(cluster.record(id).await.phase(), Phase::Unknown, "it may have been sent: unknown");
    cluster.probe(&survivor, SETTLE).await;
    let asked = cluster.record(id).await;
    assert_eq!(asked.phase(), Phase::Unknown, "a 404 before the attempt's bound frees nothing");
    let note = asked.history.last().and_then(|h| h.note.clone()).unwrap_or_default();
    assert!(note.contains("404") && note.contains("may still reach the upstream"), "{note}");
    assert_eq!(cluster.upstream.received(), ["GET /payments/by-key/frozen"], "only the probe reached it");

    // Past the bound (and the next probe it set), the 404 is believed.
    cluster.probe(&survivor, PER_TRY + SEND_WINDOW + MARGIN + SETTLE).await;
    assert_eq!(cluster.record(id).await.phase(), Phase::Free, "past the bound, a 404 frees the key");

    // The client's retry executes, once.
    let retried = cluster.send(&survivor, "frozen").await;
    assert!(matches!(told(retried).await, Outcome::Done(..)));
    assert_eq!(cluster.upstream.hits("frozen"), 1);

    // The frozen node thaws, well past its send window: it sends nothing.
    tokio::time::sleep_until(marked_at + SEND_WINDOW + Duration::from_millis(50)).await;
    frozen.faults.release_marks();
    frozen.worker.idle().await;
    assert_eq!(cluster.upstream.hits("frozen"), 1, "executed once: the thawed attempt was never sent");
    let done = cluster.record(id).await;
    assert_eq!((done.phase(), done.claim), (Phase::Done, ClaimToken(2)), "the retry's claim settled it");
}

/// Without the probe, the frozen node's own attempt is the only one: thawing within its send
/// window, it sends, and its answer settles the record its survivor made `unknown`; thawing
/// after it, it sends nothing, and says so: the record is freed by that very outcome. The window
/// of the first round is long enough that the survivor's sweep, however slow, ends within it.
async fn a_thawed_attempt_is_sent_within_its_window_and_given_up_after_it(b: Backend) {
    let rounds = [
        ("within", Duration::from_secs(20), Duration::ZERO, 1),
        ("after", SEND_WINDOW, SEND_WINDOW + Duration::from_millis(50), 0),
    ];
    for (key, send_window, thaw_after, executed) in rounds {
        let cluster = Cluster::sending_within(b, "", LEASE, send_window).await;
        let (frozen, survivor) = (cluster.node("frozen").await, cluster.node("survivor").await);
        let id = cluster.queued(&survivor.store, key).await;
        frozen.faults.hold_marks();
        cluster.sweep(&frozen, LEASE + Duration::from_millis(1)).await;
        frozen.faults.until("marks", 1, |f| f.marks.load(Ordering::SeqCst)).await;
        let marked_at = tokio::time::Instant::now();
        cluster.sweep(&survivor, LEASE + Duration::from_millis(1)).await;
        assert_eq!(cluster.record(id).await.phase(), Phase::Unknown);
        tokio::time::sleep_until(marked_at + thaw_after).await;
        frozen.faults.release_marks();
        frozen.worker.idle().await;
        let settled = cluster.record(id).await;
        assert_eq!(cluster.upstream.hits(key) as usize, executed, "{key}");
        let attempt = settled.attempts.last().unwrap();
        match executed {
            1 => assert_eq!((settled.phase(), attempt.status), (Phase::Done, Some(201)), "{key}"),
            _ => {
                assert_eq!(settled.phase(), Phase::Free, "{key}: its own outcome says it was not sent");
                assert_eq!(attempt.error.map(|e| e.as_str()), Some("not_sent"), "{key}");
            }
        }
    }
}

/// An upstream's gateway answers 504 at once, while the service behind it may still execute the
/// request within the attempt's time limit: the answer is ambiguous, the record `unknown`. It
/// ends nothing of the attempt's life, so the record keeps its whole bound (mark + `send_window`
/// + the attempt's limit + `clock_margin`), and a probe's 404 within it frees nothing; past it,
/// the 404 frees the key. Had the 504 brought the bound down to its own time, the first 404
/// would have freed the key while the original could still execute, and the client's retry
/// would have executed it a second time.
async fn an_ambiguous_answer_keeps_its_attempts_whole_bound_so_a_404_within_it_frees_nothing(b: Backend) {
    let cluster = Cluster::new(b, "", LEASE).await;
    cluster.upstream.script("gateway", vec![Reply::status(504)]);
    let node = cluster.node("node").await;
    let marked_at = cluster.now();
    let outcome = cluster.send(&node, "gateway").await;
    assert!(matches!(told(outcome).await, Outcome::Unknown(_)), "a 504 on a route that is not replay-safe");
    let id = cluster.until_key("gateway").await;
    let unknown = cluster.record(id).await;
    assert_eq!(unknown.attempts.last().map(|a| (a.outcome.as_str(), a.status)), Some(("ambiguous", Some(504))));
    let bound = marked_at + SEND_WINDOW + PER_TRY + MARGIN;
    assert_eq!(unknown.in_flight_until, Some(bound), "the 504 kept the attempt's whole bound");

    cluster.probe(&node, SETTLE).await;
    let asked = cluster.record(id).await;
    assert_eq!(asked.phase(), Phase::Unknown, "a 404 within the bound frees nothing");
    let note = asked.history.last().and_then(|h| h.note.clone()).unwrap_or_default();
    assert!(note.contains("404") && note.contains("may still reach the upstream"), "{note}");

    cluster.probe(&node, PER_TRY + SEND_WINDOW + MARGIN + SETTLE).await;
    assert_eq!(cluster.record(id).await.phase(), Phase::Free, "past the bound, a 404 frees the key");
    assert_eq!(cluster.upstream.hits("gateway"), 1);
}

/// A probe's 404 speaks of what had reached the upstream when it was asked, so it is judged
/// against the bound as of then, however late its answer comes. A node marks attempt 1 and
/// freezes before sending it; a survivor makes the record `unknown` and probes it within the
/// bound; the upstream decides 404 as the probe arrives, but answers only long past the bound.
/// The 404 frees nothing: when it was asked, the frozen attempt could still be sent. The frozen
/// node thaws within its (long) send window, sends, and its answer settles the record: one
/// execution. Had the 404 been judged when it came back, it would have freed the key, and the
/// client's retry would have executed it a second time.
async fn a_probes_404_counts_as_of_its_asking_however_late_it_comes_back(b: Backend) {
    let cluster = Cluster::sending_within(b, "", LEASE, Duration::from_secs(20)).await;
    let gate = Gate::closed();
    cluster.upstream.hold_probe_answers(&gate);
    let (frozen, survivor) = (cluster.node("frozen").await, cluster.node("survivor").await);
    let id = cluster.queued(&survivor.store, "late").await;

    frozen.faults.hold_marks();
    cluster.sweep(&frozen, LEASE + Duration::from_millis(1)).await;
    frozen.faults.until("marks", 1, |f| f.marks.load(Ordering::SeqCst)).await;
    let bound = cluster.record(id).await.in_flight_until.expect("a marked attempt has a bound");
    cluster.sweep(&survivor, LEASE + Duration::from_millis(1)).await;
    assert_eq!(cluster.record(id).await.phase(), Phase::Unknown);

    // The probe is asked within the bound; its 404 comes back long after it.
    cluster.clock.advance(SETTLE);
    assert!(cluster.now() < bound, "asked within the bound");
    let probing = {
        let (store, worker, clock, route) =
            (survivor.store.clone(), survivor.worker.clone(), cluster.clock.clone(), cluster.config.routes[0].clone());
        tokio::spawn(async move { probe_once(&*store, &Client::new(), &route, &worker, &*clock).await.unwrap() })
    };
    cluster.until_received("GET /payments/by-key/late").await;
    cluster.clock.set(bound + Duration::from_secs(60));
    gate.open();
    probing.await.unwrap();
    let answered = cluster.record(id).await;
    assert_eq!(answered.phase(), Phase::Unknown, "a 404 asked within the bound frees nothing, however late");
    let note = answered.history.last().and_then(|h| h.note.clone()).unwrap_or_default();
    assert!(note.contains("404") && note.contains("when the probe was asked"), "{note}");

    // The frozen node thaws within its window: its attempt goes out, and its answer settles it.
    frozen.faults.release_marks();
    frozen.worker.idle().await;
    let settled = cluster.until(id, "settled by the late outcome", |r| r.phase() == Phase::Done).await;
    assert_eq!(settled.attempts.last().and_then(|a| a.status), Some(201));
    assert_eq!(cluster.upstream.hits("late"), 1, "executed once");
}

/// A renewal that hangs while an attempt is in flight holds nothing back: the answer comes,
/// is stored and told, while the renewal still waits on the store.
async fn a_renewal_that_hangs_never_holds_back_the_attempt_it_serves(b: Backend) {
    let cluster = Cluster::new(b, "", SHORT_LEASE).await;
    let node = cluster.node("node").await;
    let gate = Gate::closed();
    cluster.upstream.script("slow", vec![Reply::status(201).held_by(&gate)]);
    node.faults.renewals(Renewals::Hang);
    let outcome = cluster.send(&node, "slow").await;
    node.faults.until("renewals", 1, |f| f.renews.load(Ordering::SeqCst)).await;
    gate.open();
    assert!(matches!(told(outcome).await, Outcome::Done(..)), "answered while the renewal hangs");
    assert_eq!(node.faults.renews.load(Ordering::SeqCst), 1, "the renewal is still hanging");
    node.faults.renewals(Renewals::Pass);
}

/// A renewal that fails while an attempt is in flight is acted on: the attempt finishes and is
/// stored, but no further attempt goes under that claim. The record is handed back, and the
/// retry its 503 asked for goes under a new claim, as the upstream can see.
async fn a_renewal_that_fails_mid_attempt_ends_the_claim_after_that_attempt(b: Backend) {
    // The process's metrics recorder, installed before anything is counted.
    let metrics = idem::test_support::metrics_handle();
    let cluster = Cluster::new(b, "", SHORT_LEASE).await;
    let node = cluster.node("node").await;
    let gate = Gate::closed();
    cluster.upstream.script("doubted", vec![Reply::status(503).held_by(&gate), Reply::status(201)]);
    node.faults.renewals(Renewals::Fail);
    let outcome = cluster.send(&node, "doubted").await;
    // The second renewal starts only once the first one's failure was taken in.
    node.faults.until("renewals", 2, |f| f.renews.load(Ordering::SeqCst)).await;
    node.faults.renewals(Renewals::Pass);
    gate.open();
    assert!(matches!(told(outcome).await, Outcome::Lost), "handed back: the record is the answer");
    let id = cluster.db.store().await.lookup(&"default".into(), &IdempotencyKey::parse("doubted").unwrap()).await;
    let id = id.unwrap().unwrap().id;
    let handed_back = cluster.record(id).await;
    assert_eq!((handed_back.phase(), handed_back.claim, handed_back.attempts.len()), (Phase::Queued, ClaimToken(1), 1));
    assert_eq!(cluster.upstream.attempts("doubted"), [format!("{id}; claim=1; attempt=1")]);

    cluster.sweep(&node, LEASE).await;
    let done = cluster.until(id, "done under a new claim", |r| r.phase() == Phase::Done).await;
    assert_eq!(done.claim, ClaimToken(2));
    assert_eq!(
        cluster.upstream.attempts("doubted"),
        [format!("{id}; claim=1; attempt=1"), format!("{id}; claim=2; attempt=2")],
        "no second attempt under the claim in doubt"
    );
    let metrics = metrics.render();
    assert!(metrics.contains("idem_lease_renewals_failed_total{route=\"payments\",why=\"error\"}"), "counted");
}

/// On a replay-safe route, a node's answer that the store could not take (it was out of reach)
/// is told to its client. The store comes back after the node's lease ran out: a survivor that
/// saw the outage takes nothing over for a lease, and the node writes the answer it told in
/// that time. Never executed again, never a second answer; the claim was kept alive meanwhile.
async fn an_answer_told_but_not_recorded_is_never_executed_again_after_its_lease_runs_out(b: Backend) {
    let cluster = Cluster::new(b, "replay_safe = true", LEASE).await;
    let (teller, survivor) = (cluster.node("teller").await, cluster.node("survivor").await);
    let gate = Gate::closed();
    cluster.upstream.script("told", vec![Reply::status(201).held_by(&gate)]);
    let outcome = cluster.send(&teller, "told").await;
    let id = cluster.until_key("told").await;

    // The store goes out of reach for both nodes while the upstream answers.
    teller.faults.outage(true);
    survivor.faults.outage(true);
    gate.open();
    let Outcome::Unrecorded(answer) = told(outcome).await else { panic!("told as not recorded") };
    let Outcome::Done(_, response) = *answer else { panic!("told the upstream's answer") };
    // The teller has tried to write it three times: its next try is at least 400 ms away.
    teller.faults.until("outcome writes", 3, |f| f.outcomes.load(Ordering::SeqCst)).await;
    assert!(teller.faults.renews.load(Ordering::SeqCst) >= 1, "the claim's renewal is tried between tries");

    let mut sweeper = Sweeper::new(survivor.store.clone(), survivor.worker.clone());
    cluster.clock.advance(LEASE + Duration::from_millis(1));
    assert!(sweeper.pass(&cluster.config, cluster.now()).await.is_err(), "the survivor sees the outage");
    teller.faults.outage(false);
    survivor.faults.outage(false);
    sweeper.pass(&cluster.config, cluster.now()).await.unwrap();
    assert_ne!(cluster.record(id).await.phase(), Phase::Queued, "nothing taken over within a lease of the outage");

    let done = cluster.until(id, "the told answer stored", |r| r.phase() == Phase::Done).await;
    assert_eq!(done.response.map(|r| r.body), Some(response.body), "the answer told is the answer kept");
    survivor.worker.idle().await;
    assert_eq!(cluster.upstream.hits("told"), 1, "executed once");
}

impl Cluster {
    /// Waits, ten seconds at most, until the upstream has received `request`.
    async fn until_received(&self, request: &str) {
        let wait = async {
            while !self.upstream.received().iter().any(|r| r == request) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap_or_else(|_| panic!("{request}: not within 10 s"))
    }

    /// The id of `key`'s record, once it has one.
    async fn until_key(&self, key: &str) -> RecordId {
        let store = self.db.store().await;
        let key = IdempotencyKey::parse(key).unwrap();
        let wait = async {
            loop {
                if let Some(record) = store.lookup(&"default".into(), &key).await.unwrap() {
                    return record.id;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait).await.expect("recorded within 10 s")
    }
}

both_stores!(
    a_probes_404_frees_a_record_only_once_its_marked_attempt_can_no_longer_be_sent,
    an_ambiguous_answer_keeps_its_attempts_whole_bound_so_a_404_within_it_frees_nothing,
    a_probes_404_counts_as_of_its_asking_however_late_it_comes_back,
    a_thawed_attempt_is_sent_within_its_window_and_given_up_after_it,
    a_renewal_that_hangs_never_holds_back_the_attempt_it_serves,
    a_renewal_that_fails_mid_attempt_ends_the_claim_after_that_attempt,
    an_answer_told_but_not_recorded_is_never_executed_again_after_its_lease_runs_out,
    after_the_stores_server_changed_nothing_is_taken_over_for_a_lease_and_the_clock_margin,
);

/// After the store's server changed under a node (a failover to a standby: the leases it reads
/// were set in the old primary's clock, and are judged in the new one's), the node takes nothing
/// over for a lease and the clock margin, however far past its expiry a lease reads; then it
/// does. The hold runs on the node's monotonic clock: the test waits it out.
async fn after_the_stores_server_changed_nothing_is_taken_over_for_a_lease_and_the_clock_margin(b: Backend) {
    use idem::store::Claim;
    let cluster = Cluster::new(b, "", SHORT_LEASE).await;
    let node = cluster.node("survivor").await;
    let claim = Claim { owner: "gone".into(), marked_at: cluster.now(), lease: SHORT_LEASE, reach: MARGIN };
    let new = NewRecord { claim: Some(claim), ..cluster.new_record("failed-over") };
    let Admission::Created(admitted) =
        cluster.db.store().await.admit(Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap()
    else {
        panic!("a new key is created")
    };
    let mut sweeper = Sweeper::new(node.store.clone(), node.worker.clone());
    node.faults.serve_another();
    cluster.clock.advance(10 * SHORT_LEASE);
    sweeper.pass(&cluster.config, cluster.now()).await.unwrap();
    assert_eq!(cluster.record(admitted.id).await.phase(), Phase::InProgress, "held back after the change");
    tokio::time::sleep(SHORT_LEASE + MARGIN).await;
    sweeper.pass(&cluster.config, cluster.now()).await.unwrap();
    assert_eq!(cluster.record(admitted.id).await.phase(), Phase::Unknown, "taken over once the hold is past");
}

/// What only PostgreSQL has: a clock of its own for every node to share.
mod postgres_only {
    use super::*;
    use idem::domain::{HistoryAction, StopReason};
    use idem::record::HistoryEntry;
    use idem::store::{Action, Claim, Resolution, Resolve, TakeOver, TakeOverTo};

    /// Leases are set and compared in the database's clock. A node whose own clock runs two
    /// leases ahead takes over no live lease; once the lease has run out by the database's clock,
    /// any node takes it over, even one whose clock runs behind.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_whose_clock_runs_two_leases_ahead_takes_over_nothing_live() {
        if crate::common::backend::postgres_server_url().is_none() {
            return crate::common::backend::skipped("a_node_whose_clock_runs_two_leases_ahead_takes_over_nothing_live");
        }
        let lease = Duration::from_secs(2);
        let cluster = Cluster::new(Backend::Postgres, "", lease).await;
        // A live node admits a request claimed, its first attempt marked as sent.
        let holder = cluster.db.deployed_store().await;
        let now = Timestamp::now();
        let new = NewRecord {
            now,
            claim: Some(Claim { owner: "holder".into(), marked_at: now, lease, reach: Duration::from_secs(1) }),
            ..cluster.new_record("live")
        };
        let Admission::Created(admitted) =
            holder.admit(Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap()
        else {
            panic!("a new key is created")
        };

        let ahead = Arc::new(ManualClock::new(now + 2 * lease));
        let node = cluster.node_on("ahead", cluster.db.deployed_store().await, ahead.clone());
        let mut sweeper = Sweeper::new(node.store.clone(), node.worker.clone());
        sweeper.pass(&cluster.config, ahead.now()).await.unwrap();
        let live = cluster.record(admitted.id).await;
        assert_eq!((live.phase(), live.claim), (Phase::InProgress, ClaimToken::FIRST), "a live lease is left alone");
        let expires_at = live.lease.expect("leased").expires_at;
        assert!(expires_at < ahead.now(), "by the node's own clock it had run out: {expires_at:?}");

        // Once it has run out by the database's clock, it is taken over, whatever the node's says.
        tokio::time::sleep(lease + Duration::from_millis(100)).await;
        ahead.set(now - 10 * lease);
        sweeper.pass(&cluster.config, ahead.now()).await.unwrap();
        assert_eq!(cluster.record(admitted.id).await.phase(), Phase::Unknown, "its attempt may have run: unknown");
    }

    /// A probe's 404 is judged as of its asking in the database's clock, not as of its write. A
    /// record is `unknown`, its attempt's bound still running in the database's clock; a probe
    /// asks, the upstream answers 404 at once, and the prober pauses before it writes, until the
    /// bound has passed. Written then, the 404 frees nothing; asked again past the bound, it does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_probers_404_is_judged_as_of_its_asking_in_the_databases_clock() {
        if crate::common::backend::postgres_server_url().is_none() {
            return crate::common::backend::skipped(
                "a_paused_probers_404_is_judged_as_of_its_asking_in_the_databases_clock",
            );
        }
        let cluster = Cluster::new(Backend::Postgres, "", LEASE).await;
        let store = cluster.db.deployed_store().await;
        let (lease, reach) = (Duration::from_millis(200), Duration::from_millis(1_500));
        let claim = Claim { owner: "gone".into(), marked_at: Timestamp::EPOCH, lease, reach };
        let new = NewRecord { claim: Some(claim), ..cluster.new_record("paused-prober") };
        let Admission::Created(admitted) =
            store.admit(Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap()
        else {
            panic!("a new key is created")
        };
        let marked = tokio::time::Instant::now();
        tokio::time::sleep(lease + Duration::from_millis(50)).await;
        let prober = cluster.node_on("prober", cluster.db.deployed_store().await, cluster.clock.clone());
        cluster.sweep(&prober, Duration::ZERO).await;
        assert_eq!(cluster.record(admitted.id).await.phase(), Phase::Unknown, "its attempt may have run");

        prober.faults.hold_probes();
        cluster.clock.advance(SETTLE);
        let probing = {
            let (store, worker, clock, route) =
                (prober.store.clone(), prober.worker.clone(), cluster.clock.clone(), cluster.config.routes[0].clone());
            tokio::spawn(async move { probe_once(&*store, &Client::new(), &route, &worker, &*clock).await.unwrap() })
        };
        prober.faults.until("probe writes", 1, |f| f.probes.load(Ordering::SeqCst)).await;
        assert!(marked.elapsed() < reach, "asked within the bound");
        tokio::time::sleep_until(marked + reach + Duration::from_millis(200)).await;
        prober.faults.release_probes();
        probing.await.unwrap();
        let written = cluster.record(admitted.id).await;
        assert_eq!(written.phase(), Phase::Unknown, "asked within the bound, written past it: frees nothing");
        let note = written.history.last().and_then(|h| h.note.clone()).unwrap_or_default();
        assert!(note.contains("404") && note.contains("when the probe was asked"), "{note}");

        cluster.probe(&prober, Duration::from_secs(60)).await;
        assert_eq!(cluster.record(admitted.id).await.phase(), Phase::Free, "asked past the bound, a 404 frees it");
    }

    /// A done record's age is judged in the database's clock, where its completion was stamped.
    /// A node whose clock runs a day ahead neither admits the same key as a new record nor sweeps
    /// the done one away, within its retention of a minute by the database's clock: its answer
    /// is replayed, never executed again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_whose_clock_runs_ahead_ends_no_done_records_retention_early() {
        if crate::common::backend::postgres_server_url().is_none() {
            return crate::common::backend::skipped(
                "a_node_whose_clock_runs_ahead_ends_no_done_records_retention_early",
            );
        }
        use idem::store::{AttemptEnd, AttemptEnded, RouteSweep, Sweep, SweepPlan};
        let cluster = Cluster::new(Backend::Postgres, "", LEASE).await;
        let store = cluster.db.deployed_store().await;
        let now = Timestamp::now();
        let lease = Duration::from_secs(60);
        let claim = Claim { owner: "holder".into(), marked_at: now, lease, reach: Duration::from_secs(1) };
        let new = NewRecord { now, claim: Some(claim), ..cluster.new_record("aged") };
        let Admission::Created(admitted) =
            store.admit(Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap()
        else {
            panic!("a new key is created")
        };
        let response = idem::record::StoredResponse { status: 201, headers: vec![], body: "paid".into() };
        let done = AttemptEnded {
            id: admitted.id,
            holder: idem::domain::Holder { owner: "holder".into(), token: ClaimToken::FIRST },
            attempt: None,
            then: AttemptEnd::Done(StopReason::Success, response),
            stream: None,
            now,
        };
        assert!(store.attempt_ended(done).await.unwrap().is_held());

        let retention = Duration::from_secs(60);
        let ahead = now + Duration::from_secs(86_400);
        let again = NewRecord { now: ahead, ..cluster.new_record("aged") };
        match store.admit(Admit { new: again, retention_cutoff: ahead - retention }).await.unwrap() {
            Admission::Existing(record) => assert_eq!(record.id, admitted.id, "the done record answers"),
            other => panic!("within its retention by the database's clock, the record stays: {other:?}"),
        }
        let payments = RouteSweep { route: "payments".into(), cutoff: ahead - retention, tombstone_after: None };
        let plan = SweepPlan { now: ahead, routes: vec![payments], others_cutoff: ahead - retention };
        assert_eq!(store.sweep_done(Sweep { plan, limit: 10 }).await.unwrap(), 0, "nothing swept");
        assert_eq!(cluster.record(admitted.id).await.phase(), Phase::Done);
    }

    /// The bound of a marked attempt is kept in the database's clock too: an operator's
    /// `not_executed` is refused while it runs, told how long is left, and applied after.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_attempts_bound_runs_in_the_databases_clock() {
        if crate::common::backend::postgres_server_url().is_none() {
            return crate::common::backend::skipped("an_attempts_bound_runs_in_the_databases_clock");
        }
        let cluster = Cluster::new(Backend::Postgres, "", LEASE).await;
        let store = cluster.db.deployed_store().await;
        let (lease, reach) = (Duration::from_millis(200), Duration::from_millis(800));
        let claim = Claim { owner: "gone".into(), marked_at: Timestamp::EPOCH, lease, reach };
        let new = NewRecord { claim: Some(claim), ..cluster.new_record("bounded") };
        let Admission::Created(admitted) =
            store.admit(Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap()
        else {
            panic!("a new key is created")
        };
        // Its node is gone: once its lease has run out by the database's clock, it is taken over.
        tokio::time::sleep(lease + Duration::from_millis(50)).await;
        let seen = store.expired_leases(Timestamp::EPOCH, 10).await.unwrap().remove(0);
        let expired = seen.lease.clone().unwrap();
        let lost = seen.in_flight.map(|(number, _)| number);
        let to = TakeOverTo::Unknown(StopReason::UnsafeReplay);
        let entry = HistoryEntry {
            at: Timestamp::now(),
            actor: Actor::parse("node:here"),
            action: HistoryAction::TakeOver(to.phase()),
            note: None,
        };
        let take_over =
            TakeOver { id: admitted.id, expired, claim: seen.claim, in_flight: lost, to, lost: None, entry };
        assert!(store.take_over(take_over).await.unwrap());

        let resolve = || Resolve {
            id: admitted.id,
            resolution: Resolution::NotExecuted,
            entry: HistoryEntry {
                at: Timestamp::EPOCH,
                actor: Actor::Operator("ops".into()),
                action: HistoryAction::ResolveNotExecuted,
                note: None,
            },
        };
        let left = match store.resolve(resolve()).await.unwrap() {
            Action::InFlight(_, left) => left,
            other => panic!("refused while the attempt may still be on its way, not {other:?}"),
        };
        assert!(left > Duration::ZERO && left <= reach, "{left:?} of {reach:?} left");
        tokio::time::sleep(left + Duration::from_millis(50)).await;
        let Action::Applied(freed) = store.resolve(resolve()).await.unwrap() else { panic!("applied after the bound") };
        assert_eq!(freed.phase(), Phase::Free);
    }
}
