//! Several `idem serve` processes on one PostgreSQL database form one broker (docs/operations.md): any node
//! takes any request, duplicates across nodes see one record and one execution, and one node's
//! death loses nothing. PostgreSQL only: skipped without `IDEM_TEST_POSTGRES_URL` (never under CI).

use crate::common::process::{await_until, history_entries, kill_loop, node_config, KillLoop, Node, LEASE};
use crate::common::{backend, Answer, Backend, Db, Reply, TestConfig, Upstream};

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Three nodes on one fresh PostgreSQL database, in front of one fake upstream; `worker_extra`
/// goes into every node's `[worker]` section.
async fn cluster(route_extra: &str, worker_extra: &str) -> Option<(Upstream, Db, Vec<Node>)> {
    backend::postgres_server_url()?;
    let upstream = Upstream::start().await;
    let db = Db::new(Backend::Postgres).await;
    let mut nodes = Vec::new();
    for i in 0..3 {
        let body =
            node_config(&db.url, TestConfig::new(&upstream.url()).worker(worker_extra).route(route_extra)).body();
        nodes.push(Node::start(&format!("node{i}"), &body).await);
    }
    Some((upstream, db, nodes))
}

fn body_of(key: &str) -> String {
    format!(r#"{{"order":"{key}","amount":42}}"#)
}

/// What must be byte-identical between the answers for one key.
fn essence(a: &Answer) -> (u16, Option<String>, Vec<u8>) {
    (a.status, a.header("content-type").map(str::to_string), a.body.to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_spread_over_three_nodes_execute_once_and_get_the_same_bytes_everywhere() {
    let Some((upstream, _db, nodes)) = cluster("replay_safe = false", "").await else {
        return backend::skipped("duplicates_spread_over_three_nodes_execute_once_and_get_the_same_bytes_everywhere");
    };
    const KEYS: usize = 20;
    const COPIES: usize = 6;
    let nodes = Arc::new(nodes);
    let mut sent = Vec::new();
    for k in 0..KEYS {
        for c in 0..COPIES {
            let nodes = nodes.clone();
            let n = (k * COPIES + c) % nodes.len();
            sent.push(tokio::spawn(async move {
                let key = format!("dup-{k:02}");
                let request = nodes[n].post("/payments?delay_ms=200", &key, &body_of(&key)).header("prefer", "wait=5");
                (k, n, crate::common::send(request).await)
            }));
        }
    }
    let mut answers: Vec<Vec<(usize, Answer)>> = (0..KEYS).map(|_| Vec::new()).collect();
    for s in sent {
        let (k, n, answer) = s.await.unwrap();
        answers[k].push((n, answer));
    }

    for (k, answers) in answers.iter().enumerate() {
        let key = format!("dup-{k:02}");
        assert_eq!(upstream.hits(&key), 1, "{key} executed more than once");
        let first = &answers[0].1;
        assert_eq!(first.status, 201, "{key} from node{}: {:?}", answers[0].0, first.body);
        for (n, a) in answers {
            assert_eq!(essence(a), essence(first), "{key}: node{n} answered differently");
        }
        let fresh = answers.iter().filter(|(_, a)| a.header("idempotent-replayed").is_none()).count();
        assert_eq!(fresh, 1, "{key}: exactly one answer comes from the execution, the rest are replays");
        // Later replays, from every node, are the same bytes.
        for node in nodes.iter() {
            let replay = crate::common::send(node.post("/payments?delay_ms=200", &key, &body_of(&key))).await;
            assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{key} on {}", node.name);
            assert_eq!(essence(&replay), essence(first), "{key}: {} replayed different bytes", node.name);
        }
        assert_eq!(upstream.hits(&key), 1);
        let mut ids = Vec::new();
        for node in nodes.iter() {
            ids.push(node.record(&key).await.unwrap()["id"].clone());
        }
        assert!(ids.windows(2).all(|w| w[0] == w[1]), "{key}: the nodes show different records: {ids:?}");
    }

    // A request waiting on one node is woken by the outcome another node stores.
    upstream.script("far", vec![Reply::status(201).delay(Duration::from_millis(1500))]);
    let r = nodes[0].post("/payments", "far", &body_of("far")).header("prefer", "respond-async").send().await.unwrap();
    assert_eq!(r.status(), 202);
    await_until("the upstream to receive far", Duration::from_secs(10), || upstream.hits("far") == 1).await;
    let asked = Instant::now();
    let waited =
        crate::common::send(nodes[1].post("/payments", "far", &body_of("far")).header("prefer", "wait=5")).await;
    let took = asked.elapsed();
    assert_eq!(waited.status, 201, "{:?}", waited.body);
    assert_eq!(waited.header("idempotent-replayed"), Some("true"));
    assert!(took < Duration::from_secs(4), "the wait on node1 ran {took:?}: it did not hear the outcome");
    let record = nodes[2].record("far").await.unwrap();
    assert_eq!(record["response"]["body"], Value::String(String::from_utf8_lossy(&waited.body).into_owned()));
    assert_eq!(upstream.hits("far"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_with_work_in_flight_and_queued_is_taken_over_by_the_survivors() {
    // Each node executes two records at once; idle nodes take records queued elsewhere, so the
    // first wave fills every node, and what the first node accepts next waits in its own queue.
    let Some((upstream, _db, mut nodes)) = cluster("replay_safe = false", "concurrency = 2").await else {
        return backend::skipped("a_node_killed_with_work_in_flight_and_queued_is_taken_over_by_the_survivors");
    };
    let wave: Vec<String> = (1..=6).map(|i| format!("wave-{i}")).collect();
    let queued = ["queued-1", "queued-2", "queued-3"];
    for key in &wave {
        upstream.script(key, vec![Reply::status(201).delay(Duration::from_secs(3))]);
    }
    let accept =
        |node: &Node, key: &str| node.post("/payments", key, &body_of(key)).header("prefer", "respond-async").send();
    for key in &wave {
        assert_eq!(accept(&nodes[0], key).await.unwrap().status(), 202);
    }
    await_until("all six workers to hold an attempt", Duration::from_secs(10), || {
        wave.iter().all(|k| upstream.hits(k) == 1)
    })
    .await;
    for key in queued {
        assert_eq!(accept(&nodes[0], key).await.unwrap().status(), 202);
    }
    for key in queued {
        let record = nodes[0].record(key).await.unwrap();
        assert_eq!((record["state"].as_str(), record["queued"].as_bool()), (Some("not_started"), Some(true)));
    }

    nodes[0].kill();
    let survivor = &nodes[1];
    let within = 5 * LEASE + Duration::from_secs(10);
    // The dead node's two attempts may have executed: unknown. The survivors' four finish.
    let mut unknown = Vec::new();
    for key in &wave {
        let record = survivor.await_record(key, within, |r| r["state"] != "in_progress").await;
        match record["state"].as_str() {
            Some("done") => assert_eq!(record["response"]["status"], 201, "{record:#}"),
            Some("unknown") => {
                assert_eq!(record["stop_reason"], "unsafe_replay");
                assert_eq!(record["attempts"][0]["outcome"], "lost", "{record:#}");
                assert_eq!(history_entries(&record, "take-over").len(), 1, "{record:#}");
                unknown.push(key.clone());
            }
            _ => panic!("{key} ended neither done nor unknown: {record:#}"),
        }
    }
    assert_eq!(unknown.len(), 2, "the dead node held two attempts; unknown now: {unknown:?}");
    // What it had queued and not started is executed by a survivor.
    for key in queued {
        let record = survivor.await_record(key, within, |r| r["state"] == "done" || r["state"] == "unknown").await;
        assert_eq!(record["state"], "done", "{record:#}");
        assert_eq!(record["response"]["status"], 201);
    }

    // Several leases later, still one execution each, and the survivors agree on the answers.
    tokio::time::sleep(3 * LEASE).await;
    for node in &nodes[1..] {
        let lost = &unknown[0];
        crate::common::send(node.post("/payments", lost, &body_of(lost))).await.assert_problem(502, "outcome-unknown");
        let replay = crate::common::send(node.post("/payments", "queued-1", &body_of("queued-1"))).await;
        assert_eq!(replay.status, 201);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    }
    for key in wave.iter().map(String::as_str).chain(queued) {
        assert_eq!(upstream.hits(key), 1, "{key} was executed more than once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_killed_in_turn_under_load_lose_no_acknowledged_request_and_execute_none_twice() {
    let Some((upstream, _db, mut nodes)) = cluster("replay_safe = false", "").await else {
        return backend::skipped("nodes_killed_in_turn_under_load_lose_no_acknowledged_request_and_execute_none_twice");
    };
    // One node down at a time: the others keep serving and take over what it left.
    let plan = KillLoop {
        name: "three-node kill loop".into(),
        prefix: "spread",
        keys: 240,
        kills: 4,
        spacing: Duration::from_millis(35),
        upstream_delay_ms: 150,
        down_ms: 800,
    };
    kill_loop(plan, &mut nodes, &upstream).await;
}

/// How long a switch set (or cleared) on one node may take to be obeyed by every node (docs/operations.md).
const SWITCH_REACH: Duration = Duration::from_secs(2);

/// Sends a new key to `node` until its answer is `status` (each try a fresh key, so each is a new
/// execution or a refusal); fails if that takes longer than `SWITCH_REACH` after `since`.
async fn obeys(node: &Node, since: Instant, status: u16, what: &str) {
    let mut tries = 0;
    loop {
        tries += 1;
        let key = format!("{}-{what}-{tries}", node.name);
        let answer = crate::common::send(node.post("/payments", &key, &body_of(&key))).await;
        if answer.status == status {
            if status == 503 {
                answer.assert_problem(503, "circuit-open");
            }
            return;
        }
        assert!(
            since.elapsed() <= SWITCH_REACH,
            "{} did not obey ({what}) within {SWITCH_REACH:?}: still {} {:?}",
            node.name,
            answer.status,
            answer.body
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The rehearsal the retry-storm article asks for: an isolation set on one node is obeyed by
/// the two others within two seconds, and its clearing, done on another node, too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_set_on_one_node_is_obeyed_by_every_node_within_two_seconds() {
    let Some((upstream, _db, nodes)) = cluster("", "").await else {
        return backend::skipped("a_switch_set_on_one_node_is_obeyed_by_every_node_within_two_seconds");
    };
    for node in &nodes {
        obeys(node, Instant::now(), 201, "before").await;
    }

    let http = &nodes[0].http;
    let body = json!({"scope": "payments", "action": "isolate", "reason": "rehearsal", "actor": "alice"});
    let set = crate::common::send(http.post(format!("{}/admin/switches", nodes[0].admin)).json(&body)).await;
    assert_eq!(set.status, 201, "{:?}", set.body);
    let since = Instant::now();
    let id = set.json()["id"].as_str().unwrap().to_string();
    for node in &nodes {
        obeys(node, since, 503, "isolated").await;
    }
    let hits_while_isolated = upstream.received().len();
    crate::common::send(nodes[2].post("/payments", "still-isolated", &body_of("x")))
        .await
        .assert_problem(503, "circuit-open");
    assert_eq!(upstream.received().len(), hits_while_isolated, "nothing reaches the upstream");

    let clear = json!({"actor": "bob", "reason": "rehearsal over"});
    let cleared =
        crate::common::send(nodes[1].http.post(format!("{}/admin/switches/{id}/clear", nodes[1].admin)).json(&clear))
            .await;
    assert_eq!(cleared.status, 200, "{:?}", cleared.body);
    let since = Instant::now();
    for node in &nodes {
        obeys(node, since, 201, "cleared").await;
    }
}

/// A node paused (SIGSTOP) with its attempt in the upstream's own queue, past its lease: the
/// survivors make the record `unknown`, and the route's probe asks the upstream, which has not
/// executed the request yet: 404. That 404 is asked within the attempt's bound, so it frees
/// nothing, and the client's retry is told the outcome is unknown rather than executed again.
/// The upstream then executes the queued request; the paused node goes on, hears its answer, and
/// settles the record with it as a late outcome: one execution, and the answer replayed. A
/// killed node can never send late; a paused one can, which is what the bound is for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_nodes_queued_attempt_is_never_executed_twice() {
    let Some(_) = backend::postgres_server_url() else {
        return backend::skipped("a_paused_nodes_queued_attempt_is_never_executed_twice");
    };
    let upstream = Upstream::start().await;
    let db = Db::new(Backend::Postgres).await;
    let probe = "[routes.retry]\nper_try_timeout = \"8s\"\n\n[routes.probe]\nmethod = \"GET\"\n\
                 path = \"/payments/by-key/{idempotency_key}\"\nsettle = \"300ms\"\n";
    let worker = "send_window = \"200ms\"\nclock_margin = \"200ms\"";
    let mut nodes = Vec::new();
    for i in 0..3 {
        let config = TestConfig::new(&upstream.url()).worker(worker).route("replay_safe = false").tables(probe);
        nodes.push(Node::start(&format!("node{i}"), &node_config(&db.url, config).body()).await);
    }
    let (paused, survivor) = (&nodes[0], &nodes[1]);

    const QUEUED: &str = "/payments?queue_ms=3500";
    let waiting = tokio::spawn(crate::common::send(paused.post(QUEUED, "paused", &body_of("p"))));
    await_until("the attempt reaches the upstream's queue", Duration::from_secs(5), || upstream.queued("paused") == 1)
        .await;
    paused.pause();

    let unknown = survivor.await_record("paused", Duration::from_secs(5), |r| r["state"] == "unknown").await;
    assert_eq!(unknown["attempts"][0]["outcome"], "lost", "{unknown:#}");
    let asked =
        survivor.await_record("paused", Duration::from_secs(5), |r| !history_entries(r, "probe").is_empty()).await;
    let note = history_entries(&asked, "probe")[0]["note"].as_str().unwrap().to_string();
    assert!(note.contains("404") && note.contains("may still reach the upstream"), "{note}");
    let retried = crate::common::send(survivor.post(QUEUED, "paused", &body_of("p"))).await;
    retried.assert_problem(502, "outcome-unknown");

    await_until("the upstream executes the queued request", Duration::from_secs(5), || upstream.hits("paused") == 1)
        .await;
    paused.resume();
    let done = survivor.await_record("paused", Duration::from_secs(10), |r| r["state"] == "done").await;
    assert_eq!(done["response"]["status"], 201, "{done:#}");
    let replay = crate::common::send(survivor.post(QUEUED, "paused", &body_of("p"))).await;
    assert_eq!((replay.status, replay.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(upstream.hits("paused"), 1, "executed once");
    waiting.abort();
}
