//! Several `idem serve` processes on one PostgreSQL database form one broker (SPEC §6): any node
//! takes any request, duplicates across nodes see one record and one execution, and one node's
//! death loses nothing. PostgreSQL only: skipped without `IDEM_TEST_POSTGRES_URL` (never under CI).

mod common;

use common::process::{await_until, config_body, history_entries, Node, LEASE};
use common::{backend, Answer, Backend, Db, Reply, Upstream};

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Three nodes on one fresh PostgreSQL database, in front of one fake upstream; `worker_extra`
/// goes into the first node's `[worker]` section.
async fn cluster(route_extra: &str, first_worker_extra: &str) -> Option<(Upstream, Db, Vec<Node>)> {
    if backend::postgres_server_url().is_none() {
        return None;
    }
    let upstream = Upstream::start().await;
    let db = Db::new(Backend::Postgres).await;
    let mut nodes = Vec::new();
    for (i, worker_extra) in [first_worker_extra, "", ""].into_iter().enumerate() {
        let body = config_body(&db.url, &upstream.url(), worker_extra, route_extra, "");
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
                (k, n, common::send(request).await)
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
            let replay = common::send(node.post("/payments?delay_ms=200", &key, &body_of(&key))).await;
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
    let waited = common::send(nodes[1].post("/payments", "far", &body_of("far")).header("prefer", "wait=5")).await;
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
    // The first node executes two records at once: the rest of what it accepts waits in its queue.
    let Some((upstream, _db, mut nodes)) = cluster("replay_safe = false", "concurrency = 2").await else {
        return backend::skipped("a_node_killed_with_work_in_flight_and_queued_is_taken_over_by_the_survivors");
    };
    let in_flight = ["held-1", "held-2"];
    let queued = ["queued-1", "queued-2", "queued-3"];
    for key in in_flight {
        upstream.script(key, vec![Reply::hang()]);
    }
    let accept =
        |node: &Node, key: &str| node.post("/payments", key, &body_of(key)).header("prefer", "respond-async").send();
    for key in in_flight {
        assert_eq!(accept(&nodes[0], key).await.unwrap().status(), 202);
    }
    await_until("the upstream to hold both attempts", Duration::from_secs(10), || {
        in_flight.iter().all(|k| upstream.hits(k) == 1)
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
    for key in in_flight {
        let record = survivor.await_record(key, within, |r| r["state"] != "in_progress").await;
        assert_eq!(record["state"], "unknown", "{record:#}");
        assert_eq!(record["stop_reason"], "unsafe_replay");
        assert_eq!(record["attempts"][0]["outcome"], "lost", "{record:#}");
        assert_eq!(history_entries(&record, "take-over").len(), 1, "{record:#}");
    }
    for key in queued {
        let record = survivor.await_record(key, within, |r| r["state"] == "done" || r["state"] == "unknown").await;
        assert_eq!(record["state"], "done", "{record:#}");
        assert_eq!(record["response"]["status"], 201);
    }

    // Several leases later, still one execution each, and the survivors agree on the answers.
    tokio::time::sleep(3 * LEASE).await;
    for key in in_flight.iter().chain(&queued) {
        assert_eq!(upstream.hits(key), 1, "{key} was executed more than once");
    }
    for node in &nodes[1..] {
        common::send(node.post("/payments", "held-1", &body_of("held-1"))).await.assert_problem(502, "outcome-unknown");
        let replay = common::send(node.post("/payments", "queued-1", &body_of("queued-1"))).await;
        assert_eq!(replay.status, 201);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    }
    for key in in_flight.iter().chain(&queued) {
        assert_eq!(upstream.hits(key), 1, "{key} was executed more than once");
    }
}
