//! The MCP front (docs/mcp.md), end to end with real parts: the official MCP Python SDK's
//! FastMCP server (`tests/mcp/server.py`, counting its side effects in a ledger file) behind a
//! route of `kind = "mcp"`, and the SDK's own Streamable HTTP client (`tests/mcp/client.py`),
//! unmodified, in front. A lost answer, twenty concurrent duplicates, a reused key, a server
//! that dies mid-call, read-only tools, sessions and `tools/list_changed`: each on both stores.
//!
//! The SDK comes from PyPI: `.ci/run` installs it in a virtual environment and names its
//! interpreter in `IDEM_TEST_PYTHON`. Elsewhere the tests run where `python3` has it, and say
//! they were skipped where it has not (under `CI` they fail instead).

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

use crate::common::{both_stores, send, Backend, Broker, Db};

/// The interpreter that has the MCP SDK, or `None` (skip) outside CI.
fn python() -> Option<String> {
    let python = std::env::var("IDEM_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_sdk =
        std::process::Command::new(&python).args(["-c", "import mcp"]).output().is_ok_and(|o| o.status.success());
    match has_sdk {
        true => Some(python),
        false if std::env::var_os("CI").is_some() => panic!("{python} cannot `import mcp`: .ci/run installs it"),
        false => {
            eprintln!("skipped the MCP test: {python} cannot `import mcp` (pip install \"mcp>=1.20,<2\", or set IDEM_TEST_PYTHON)");
            None
        }
    }
}

fn script(name: &str) -> String {
    format!("{}/tests/mcp/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// The FastMCP server on a port of its own, and its ledger of side effects.
struct Server {
    url: String,
    ledger: PathBuf,
    _process: Child,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start(python: &str) -> Server {
        let dir = tempfile::TempDir::new().unwrap();
        let ledger = dir.path().join("ledger.txt");
        std::fs::write(&ledger, "").unwrap();
        let mut process = Command::new(python)
            .arg(script("server.py"))
            .arg(&ledger)
            .stdout(Stdio::piped())
            // Its teardown logs the streams the test's clients left open: noise.
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(process.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await.expect("the server started");
        let port = line.unwrap().and_then(|l| l.strip_prefix("PORT ").map(str::to_string)).expect("PORT <n>");
        Server { url: format!("http://127.0.0.1:{port}"), ledger, _process: process, _dir: dir }
    }

    /// The side effects of `tool` so far.
    fn effects(&self, tool: &str) -> usize {
        let ledger = std::fs::read_to_string(&self.ledger).unwrap();
        ledger.lines().filter(|line| line.split(' ').next() == Some(tool)).count()
    }
}

/// The route in front of the server: `tools` at `/mcp`.
const ROUTE: &str = "[[routes]]\nname = \"tools\"\nkind = \"mcp\"\npath_prefix = \"/mcp\"\n";

async fn mcp_behind_idem(b: Backend, python: &str) -> (Server, Broker) {
    let server = Server::start(python).await;
    let db = Db::new(b).await;
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[store]\nurl = \"{}\"\n\
         {ROUTE}upstream = \"{}\"\n[routes.mcp]\nin_flight_wait = \"10s\"\n[routes.retry]\nper_try_timeout = \"10s\"\n",
        db.url, server.url
    );
    let broker = Broker::start_with(&db, config).await;
    (server, broker)
}

/// Starts a client scenario; its findings come line by line.
fn client(python: &str, broker: &Broker, scenario: &str, extra: &[&str]) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut process = Command::new(python)
        .arg(script("client.py"))
        .arg(format!("{}/mcp", broker.url))
        .arg(scenario)
        .args(extra)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let lines = BufReader::new(process.stdout.take().unwrap()).lines();
    (process, lines)
}

async fn next_finding(lines: &mut Lines<BufReader<ChildStdout>>, scenario: &str) -> Value {
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await;
    let line = line.unwrap_or_else(|_| panic!("{scenario}: no finding within a minute")).unwrap();
    let line = line.unwrap_or_else(|| panic!("{scenario}: the client ended without a finding (its stderr is above)"));
    serde_json::from_str(&line).unwrap_or_else(|_| panic!("{scenario}: not JSON: {line}"))
}

async fn run(python: &str, broker: &Broker, scenario: &str) -> Value {
    let (mut process, mut lines) = client(python, broker, scenario, &[]);
    let finding = next_finding(&mut lines, scenario).await;
    let _ = tokio::time::timeout(Duration::from_secs(20), process.wait()).await;
    finding
}

async fn records(broker: &Broker) -> Vec<Value> {
    let list = send(broker.http.get(format!("{}/admin/requests?route=tools&limit=100", broker.admin))).await;
    assert_eq!(list.status, 200, "{:?}", list.body);
    list.json()["items"].as_array().unwrap().clone()
}

fn structured(finding: &Value) -> &Value {
    &finding["result"]["structuredContent"]
}

async fn a_lost_answer_retried_with_its_key_gets_the_one_result(b: Backend) {
    let Some(python) = python() else { return };
    let (server, broker) = mcp_behind_idem(b, &python).await;
    let found = run(&python, &broker, "lost_answer").await;
    assert!(found["first"]["error"].is_object(), "the first read timed out: {found}");
    let retry = &found["retry"];
    assert_eq!(structured(retry)["amount"], json!(10), "{found}");
    assert_eq!(retry["result"]["_meta"]["io.idem/replayed"], json!(true), "{found}");
    assert_eq!(structured(&found["by_param"]), structured(retry), "params.idempotencyKey names the same call");
    assert_eq!(server.effects("create_payment"), 1, "{found}");
    // Progress streams through live to the caller that executes; its replay is the final result.
    assert_eq!(found["progress"], json!([1.0, 2.0, 3.0]), "{found}");
    let (export, again) = (&found["export"]["result"], &found["export_again"]["result"]);
    assert_eq!(again["content"], export["content"], "{found}");
    assert_eq!(again["_meta"]["io.idem/replayed"], json!(true));
    assert_eq!(server.effects("export_report"), 1);
    let records = records(&broker).await;
    let record = records.iter().find(|r| r["key"] == "lost-1").expect("lost-1 is recorded");
    assert_eq!(records.len(), 2, "lost-1 and export-1");
    assert_eq!((record["key"].as_str(), record["state"].as_str()), (Some("lost-1"), Some("done")));
    // The record names the tool called, for an operator.
    assert_eq!(record["tool"], json!("create_payment"), "{record:#}");
}

async fn twenty_concurrent_calls_with_one_key_execute_once(b: Backend) {
    let Some(python) = python() else { return };
    let (server, broker) = mcp_behind_idem(b, &python).await;
    let found = run(&python, &broker, "concurrent").await;
    let results = found["results"].as_array().unwrap();
    assert_eq!(results.len(), 20);
    let payments: std::collections::HashSet<String> =
        results.iter().map(|r| structured(r)["payment"].to_string()).collect();
    assert_eq!(payments.len(), 1, "every caller got the one payment: {found}");
    assert!(!payments.contains("null"), "{found}");
    assert_eq!(server.effects("create_payment"), 1);
}

async fn the_same_key_with_other_arguments_is_refused_and_runs_nothing(b: Backend) {
    let Some(python) = python() else { return };
    let (server, broker) = mcp_behind_idem(b, &python).await;
    let found = run(&python, &broker, "mismatch").await;
    assert_eq!(structured(&found["first"])["amount"], json!(30), "{found}");
    for refused in [&found["other"], &found["other_tool"]] {
        let error = &refused["error"];
        assert_eq!(error["code"], json!(-32009), "{found}");
        assert_eq!(error["data"]["type"], json!("urn:idem:problem:idempotency-key-reused"));
        assert_eq!(error["data"]["idempotencyKey"], json!("mm-1"));
        assert_eq!(error["data"]["state"], json!("done"));
    }
    assert_eq!(server.effects("create_payment"), 1);
    assert_eq!(server.effects("set_flag"), 0);
}

async fn a_server_that_dies_mid_call_leaves_an_unknown_outcome_an_operator_settles(b: Backend) {
    let Some(python) = python() else { return };
    let (server, broker) = mcp_behind_idem(b, &python).await;
    let dir = tempfile::TempDir::new().unwrap();
    let flag = dir.path().join("settled");
    let (mut process, mut lines) = client(&python, &broker, "unknown", &[flag.to_str().unwrap()]);
    let found = next_finding(&mut lines, "unknown").await;
    // The caller whose answer was streaming when the server died is told at once, in the stream.
    let first = &found["first"]["result"];
    assert_eq!(
        (first["isError"].clone(), first["structuredContent"]["state"].clone()),
        (json!(true), json!("unknown"))
    );
    let retry = &found["retry"]["result"];
    assert_eq!(retry["isError"], json!(true), "{found}");
    let text = retry["content"][0]["text"].as_str().unwrap_or("");
    assert!(text.contains("may have taken effect"), "{found}");
    let named = &retry["structuredContent"];
    assert_eq!((named["idempotencyKey"].as_str(), named["state"].as_str()), (Some("crash-1"), Some("unknown")));
    assert_eq!(server.effects("crash_midway"), 1);

    let id = named["recordId"].as_str().expect("the record is named").to_string();
    // What the tool would have answered: the SDK checks a result against the tool's output schema.
    let settled = json!({"jsonrpc": "2.0", "id": 0, "result": {
        "content": [{"type": "text", "text": "settled by hand"}], "structuredContent": {"result": "settled by hand"}}});
    let resolve = json!({"outcome": "executed", "note": "found in the ledger",
        "response": {"status": 200, "headers": {"content-type": "application/json"}, "body": settled.to_string()}});
    let r = send(broker.http.post(format!("{}/admin/requests/{id}/resolve", broker.admin)).json(&resolve)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    std::fs::write(&flag, "").unwrap();
    let after = next_finding(&mut lines, "unknown").await;
    let result = &after["settled"]["result"];
    assert_eq!(result["structuredContent"], json!({"result": "settled by hand"}), "{after}");
    assert_eq!(result["_meta"]["io.idem/replayed"], json!(true));
    assert_eq!(server.effects("crash_midway"), 1);
    let _ = tokio::time::timeout(Duration::from_secs(20), process.wait()).await;
}

async fn read_only_tools_are_never_recorded_and_idempotent_ones_are_replay_safe(b: Backend) {
    let Some(python) = python() else { return };
    let (server, broker) = mcp_behind_idem(b, &python).await;
    let found = run(&python, &broker, "read_only").await;
    assert_eq!(structured(&found["keyed"])["balance"], json!(100), "{found}");
    assert_eq!(server.effects("get_balance"), 3, "each read reached the server");
    assert_eq!(found["flag_again"]["result"]["_meta"]["io.idem/replayed"], json!(true), "{found}");
    assert_eq!(server.effects("set_flag"), 1);
    let records = records(&broker).await;
    assert_eq!(records.len(), 1, "only set_flag is recorded: {records:#?}");
    // Its attempts ran under the route's replay-safe policy, not the route's own.
    let config = idem::config::Config::parse_with_env(&broker.config_text, |_| None).unwrap();
    let route = &config.routes[0];
    let replay_safe = route.mcp.as_ref().unwrap().replay_safe_version.to_string();
    let shown =
        send(broker.http.get(format!("{}/admin/requests/{}", broker.admin, records[0]["id"].as_str().unwrap()))).await;
    assert_eq!(shown.json()["attempts"][0]["policy_version"], json!(replay_safe), "{:#}", shown.json());
}

async fn sessions_and_tool_list_changes_pass_through_and_initialize_says_idempotency(b: Backend) {
    let Some(python) = python() else { return };
    let (server, broker) = mcp_behind_idem(b, &python).await;
    let found = run(&python, &broker, "session_and_list_changed").await;
    assert_eq!(found["capabilities"]["tools"]["idempotency"], json!({"supported": true}), "{found}");
    let session = found["client_session"].as_str().expect("the server's session id reached the client");
    assert_eq!(found["server_saw"]["result"]["content"][0]["text"], json!(session), "{found}");
    assert_eq!(found["notified"], json!(true), "tools/list_changed reached the client: {found}");
    assert!(found["tools"].as_array().unwrap().contains(&json!("late_report")), "{found}");
    assert_eq!(found["report"]["result"]["content"][0]["text"], json!("report"), "{found}");
    assert_eq!(server.effects("late_report"), 1);
    let records = records(&broker).await;
    let keys: Vec<&str> = records.iter().filter_map(|r| r["key"].as_str()).collect();
    assert_eq!(keys, vec!["add-1"], "only add_report_tool is recorded; whoami and late_report are read-only");
}

/// A bare MCP upstream, answering in JSON rather than events, for what the SDK never sends: it
/// offers tools, lists one (`peek`, read-only), answers every call (`slow` after a second) and
/// counts the calls that reach it.
async fn bare_upstream() -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let answer = move |body: axum::Json<Value>| {
        let counted = counted.clone();
        async move {
            if body["method"] == "tools/call" {
                counted.fetch_add(1, Ordering::SeqCst);
                if body["params"]["name"] == "slow" {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
            let result = match body["method"].as_str() {
                Some("initialize") => json!({"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}}),
                Some("tools/list") => json!({"tools": [{"name": "peek", "annotations": {"readOnlyHint": true}}]}),
                _ => json!({"content": [{"type": "text", "text": "done"}]}),
            };
            axum::Json(json!({"jsonrpc": "2.0", "id": body["id"], "result": result}))
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().fallback(axum::routing::post(answer));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, calls)
}

fn tools_call(id: u32, tool: &str, key: Option<&str>) -> String {
    let mut params = json!({"name": tool, "arguments": {"n": 1}});
    if let Some(key) = key {
        params["idempotencyKey"] = json!(key);
    }
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params}).to_string()
}

/// A broker in front of [`bare_upstream`]: `tools` at `/mcp`, whose duplicates wait 100 ms, and
/// `runs` at `/runs/mcp`, whose keys may come from the `x-agent-run` header.
async fn bare_broker(b: Backend) -> (Broker, Arc<AtomicUsize>) {
    let (upstream, calls) = bare_upstream().await;
    let db = Db::new(b).await;
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[store]\nurl = \"{}\"\n\
         {ROUTE}upstream = \"{upstream}\"\n[routes.mcp]\nin_flight_wait = \"100ms\"\n\
         [[routes]]\nname = \"runs\"\nkind = \"mcp\"\npath_prefix = \"/runs\"\nupstream = \"{upstream}\"\n\
         key_from = [\"header:x-agent-run\"]\n",
        db.url
    );
    (Broker::start_with(&db, config).await, calls)
}

async fn a_call_in_flight_and_bodies_that_are_no_call_are_answered_in_json_rpc(b: Backend) {
    let (broker, calls) = bare_broker(b).await;
    let post = |body: String| {
        let request = broker.http.post(format!("{}/mcp", broker.url)).header("content-type", "application/json");
        send(request.header("accept", "application/json, text/event-stream").body(body))
    };

    let garbage = post("{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\":".into()).await;
    assert_eq!((garbage.status, garbage.json()["error"]["code"].clone()), (400, json!(-32700)));
    assert_eq!(garbage.json()["id"], Value::Null);
    let batch = post(format!("[{}]", tools_call(1, "pay", Some("b-1")))).await;
    assert_eq!((batch.status, batch.json()["error"]["code"].clone()), (400, json!(-32600)));
    let keyless = post(tools_call(2, "pay", None)).await.json();
    assert_eq!(keyless["error"]["code"], json!(-32602), "{keyless}");
    assert_eq!(keyless["id"], json!(2));
    assert_eq!(calls.load(Ordering::SeqCst), 0, "nothing reached the server");

    // Answers in JSON are read too: the capability added, the tools learned for the session.
    let initialize = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}});
    let init = post(initialize.to_string()).await.json();
    assert_eq!(init["result"]["capabilities"]["tools"]["idempotency"], json!({"supported": true}), "{init}");
    post(json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).to_string()).await;
    let peek = post(tools_call(2, "peek", None)).await.json();
    assert_eq!(peek["result"]["content"][0]["text"], json!("done"), "read-only: no key needed {peek}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    calls.store(0, Ordering::SeqCst);

    let first = tokio::spawn(post(tools_call(3, "slow", Some("slow-1"))));
    broker.await_record("slow-1", Duration::from_secs(5), |r| r["state"] == "in_progress").await;
    let busy = post(tools_call(4, "slow", Some("slow-1"))).await.json();
    assert_eq!(busy["id"], json!(4));
    assert_eq!(busy["error"]["code"], json!(-32010), "{busy}");
    assert_eq!(busy["error"]["data"]["retryable"], json!(true));
    assert!(busy["error"]["data"]["retryAfterMs"].as_u64().is_some_and(|ms| ms > 0), "{busy}");
    let first = first.await.unwrap().json();
    assert_eq!((first["id"].clone(), first["result"]["_meta"].clone()), (json!(3), Value::Null));
    let replay = post(tools_call(5, "slow", Some("slow-1"))).await.json();
    assert_eq!(replay["id"], json!(5));
    assert_eq!(replay["result"]["_meta"]["io.idem/replayed"], json!(true));
    assert_eq!(replay["result"]["content"], first["result"]["content"]);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

async fn a_run_id_and_the_call_make_the_key_of_a_call_that_sends_none(b: Backend) {
    let (broker, calls) = bare_broker(b).await;
    // Without a key, a run's id (the route's key_from) and the call make one: the same call in
    // the run executes once, other arguments are another operation.
    let in_run = |run: &str, body: String| {
        let request = broker.http.post(format!("{}/runs/mcp", broker.url)).header("content-type", "application/json");
        send(request.header("x-agent-run", run).body(body))
    };
    let pay = |n: u32| json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "pay", "arguments": {"n": n}}});
    assert_eq!(in_run("run-1", pay(1).to_string()).await.json()["result"]["_meta"], Value::Null);
    let again = in_run("run-1", pay(1).to_string()).await.json();
    assert_eq!(again["result"]["_meta"]["io.idem/replayed"], json!(true), "{again}");
    in_run("run-1", pay(2).to_string()).await;
    in_run("run-2", pay(1).to_string()).await;
    assert_eq!(calls.load(Ordering::SeqCst), 3, "three operations");
    let runs = send(broker.http.get(format!("{}/admin/requests?route=runs", broker.admin))).await.json();
    let keys: Vec<&str> = runs["items"].as_array().unwrap().iter().filter_map(|r| r["key"].as_str()).collect();
    assert!(keys.len() == 3 && keys.iter().all(|k| k.starts_with("derived:")), "{keys:?}");
    let missing = send(broker.http.post(format!("{}/runs/mcp", broker.url)).body(pay(3).to_string())).await.json();
    assert_eq!(missing["error"]["code"], json!(-32602), "{missing}");
}

/// Two nodes whose catalogs disagree about one tool: one was told `peek` is read-only (its
/// session listed tools through it), the other was told nothing, and records what it does not
/// know. The first decision made for a key, stored with it, wins on both: a keyed call the
/// second node recorded is answered from its record by the first, never passed through again.
async fn two_nodes_whose_catalogs_disagree_decide_a_keyed_call_once(b: Backend) {
    let (upstream, calls) = bare_upstream().await;
    let db = Db::new(b).await;
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[store]\nurl = \"{}\"\n{ROUTE}upstream = \"{upstream}\"\n",
        db.url
    );
    let (knows, blind) = (Broker::start_with(&db, config.clone()).await, Broker::start_with(&db, config).await);
    let post = |broker: &Broker, body: String| {
        let request = broker.http.post(format!("{}/mcp", broker.url)).header("content-type", "application/json");
        send(request.header("accept", "application/json, text/event-stream").body(body))
    };
    post(&knows, json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).to_string()).await;
    let passed = post(&knows, tools_call(2, "peek", Some("fresh"))).await.json();
    assert_eq!(passed["result"]["content"][0]["text"], json!("done"), "{passed}");
    assert!(records(&knows).await.is_empty(), "a read-only tool's call, new to the store, passes through");

    let recorded = post(&blind, tools_call(3, "peek", Some("peek-1"))).await.json();
    assert_eq!(recorded["result"]["_meta"], Value::Null, "executed: {recorded}");
    let replayed = post(&knows, tools_call(4, "peek", Some("peek-1"))).await.json();
    assert_eq!(replayed["id"], json!(4));
    assert_eq!(replayed["result"]["_meta"]["io.idem/replayed"], json!(true), "{replayed}");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the fresh call and the recorded one, each once");
}

both_stores!(
    two_nodes_whose_catalogs_disagree_decide_a_keyed_call_once,
    a_call_in_flight_and_bodies_that_are_no_call_are_answered_in_json_rpc,
    a_run_id_and_the_call_make_the_key_of_a_call_that_sends_none,
    a_lost_answer_retried_with_its_key_gets_the_one_result,
    twenty_concurrent_calls_with_one_key_execute_once,
    the_same_key_with_other_arguments_is_refused_and_runs_nothing,
    a_server_that_dies_mid_call_leaves_an_unknown_outcome_an_operator_settles,
    read_only_tools_are_never_recorded_and_idempotent_ones_are_replay_safe,
    sessions_and_tool_list_changes_pass_through_and_initialize_says_idempotency,
);
