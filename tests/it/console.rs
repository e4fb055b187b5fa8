//! The operator console in a real browser: headless Chromium, driven over the DevTools protocol.
//! In the queue view it selects an `unknown` record, fills the resolution form and clicks
//! "Resolve: executed" with real mouse events; then the record must be `done` and replay what
//! was typed. In the Health view, the default one, it reads the charts of a retry storm.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{send, Backend, Broker, Db, Reply, TestConfig, Upstream};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

const CHROMIUM: &str = "/usr/bin/chromium";

/// A headless Chromium with its own profile, killed when dropped.
struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
    port: u16,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Browser {
    async fn start() -> Option<Browser> {
        if !Path::new(CHROMIUM).exists() {
            assert!(std::env::var_os("CI").is_none(), "{CHROMIUM} is missing: .ci/run must install chromium");
            eprintln!("skipped: {CHROMIUM} is not installed (apt-get install chromium)");
            return None;
        }
        let profile = tempfile::TempDir::new().unwrap();
        let child = Command::new(CHROMIUM)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--remote-debugging-port=0",
                "--window-size=1400,1000",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Chromium writes the port it chose into the profile.
        let file = profile.path().join("DevToolsActivePort");
        let until = Instant::now() + Duration::from_secs(30);
        let port = loop {
            if let Some(port) = std::fs::read_to_string(&file).ok().and_then(|t| t.lines().next()?.parse().ok()) {
                break port;
            }
            assert!(Instant::now() < until, "chromium did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        Some(Browser { child, _profile: profile, port })
    }
}

/// One page, spoken to over its DevTools websocket.
struct Page {
    ws: tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    next_id: u64,
}

impl Page {
    async fn open(browser: &Browser, url: &str) -> Page {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let target: Value = http
            .put(format!("http://127.0.0.1:{}/json/new?{}", browser.port, url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let (ws, _) = tokio_tungstenite::connect_async(target["webSocketDebuggerUrl"].as_str().unwrap()).await.unwrap();
        let mut page = Page { ws, next_id: 0 };
        // A new tab starts on about:blank, which is already complete: a script run there (a hash
        // set, say) would be lost when the console replaces it. Wait for the console itself.
        page.until(&format!("location.href.startsWith({url:?}) && document.readyState === 'complete'")).await;
        page
    }

    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        self.ws
            .send(Message::Text(json!({"id": id, "method": method, "params": params}).to_string().into()))
            .await
            .unwrap();
        loop {
            let msg = self.ws.next().await.unwrap().unwrap();
            let Message::Text(text) = msg else { continue };
            let v: Value = serde_json::from_str(&text).unwrap();
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method} failed: {v}");
                return v["result"].clone();
            }
        }
    }

    async fn eval(&mut self, expression: &str) -> Value {
        let r = self
            .call("Runtime.evaluate", json!({"expression": expression, "returnByValue": true, "awaitPromise": true}))
            .await;
        assert!(r.get("exceptionDetails").is_none(), "{expression}: {r}");
        r["result"]["value"].clone()
    }

    /// Waits until `expression` is true in the page.
    async fn until(&mut self, expression: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let guarded = format!("(() => {{ try {{ return {expression}; }} catch (e) {{ return false; }} }})()");
        while self.eval(&guarded).await != json!(true) {
            if Instant::now() > deadline {
                let message = self
                    .eval("[location.hash, document.getElementById('message').textContent, document.getElementById('health-message').textContent].join(' | ')")
                    .await;
                panic!("the page never satisfied `{expression}`; it says {message}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A real click: mouse pressed and released at the element's centre.
    async fn click(&mut self, selector: &str) {
        self.until(&format!("document.querySelector({selector:?}) !== null")).await;
        let js = format!(
            "(() => {{ const e = document.querySelector({selector:?}); e.scrollIntoView({{block: 'center'}}); \
             const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
        );
        let at = self.eval(&js).await;
        let (x, y) = (at[0].as_f64().unwrap(), at[1].as_f64().unwrap());
        for kind in ["mousePressed", "mouseReleased"] {
            self.call(
                "Input.dispatchMouseEvent",
                json!({"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}),
            )
            .await;
        }
    }

    /// Focuses a field, clears it, and types `text` as key events.
    async fn type_into(&mut self, selector: &str, text: &str) {
        self.click(selector).await;
        self.eval(&format!(
            "document.querySelector({selector:?}).select ? document.querySelector({selector:?}).select() : null"
        ))
        .await;
        self.call("Input.insertText", json!({"text": text})).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_resolves_an_unknown_record_from_the_console() {
    let Some(browser) = Browser::start().await else { return };
    std::env::set_var("IDEM_TEST_CONSOLE_TOKEN", "console-secret");
    let upstream = Upstream::start().await;
    let broker = Broker::start(
        &Db::new(Backend::Sqlite).await,
        TestConfig::new(&upstream.url()).tables("[auth]\nadmin_token_env = \"IDEM_TEST_CONSOLE_TOKEN\"\n"),
    )
    .await;
    upstream.script("charge-7", vec![Reply::status(504)]);
    send(broker.post("/payments", "charge-7", r#"{"amount":7}"#)).await.assert_problem(502, "outcome-unknown");
    send(broker.post("/payments", "fine", r#"{"amount":1}"#)).await;

    let mut page = Page::open(&browser, &format!("{}/", broker.admin)).await;
    page.eval("location.hash = '#queue'").await;
    // Without the token the API refuses, and the page says so.
    page.until("document.getElementById('message').textContent.includes('Unauthorized')").await;
    page.type_into("#token", "console-secret").await;
    page.eval("document.getElementById('token').dispatchEvent(new Event('change'))").await;

    // The queue shows the unknown record (and only it: the done one is not in the queue).
    page.until("document.querySelectorAll('tr.record').length === 1").await;
    assert_eq!(page.eval("document.querySelector('tr.record').textContent.includes('charge-7')").await, json!(true));
    page.click("tr.record").await;
    page.until("!document.getElementById('record').hidden").await;
    assert_eq!(page.eval("document.getElementById('attempts').textContent.includes('ambiguous')").await, json!(true));

    page.type_into("#status", "201").await;
    page.type_into("#body", r#"{"id":"pay_7","status":"succeeded"}"#).await;
    page.type_into("#note", "found in the provider dashboard").await;
    // `IDEM_CONSOLE_SCREENSHOT=docs/console.png` refreshes the README's picture of this moment.
    if let Some(path) = std::env::var_os("IDEM_CONSOLE_SCREENSHOT") {
        use base64::Engine;
        let shot = page.call("Page.captureScreenshot", json!({"format": "png"})).await;
        let png = base64::engine::general_purpose::STANDARD.decode(shot["data"].as_str().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
    page.click("#resolve-executed").await;
    page.until("document.getElementById('message').className === 'ok'").await;
    page.until("document.querySelector('#facts .state').textContent === 'done'").await;

    // The broker agrees: done, with the operator's response replayed to duplicates.
    let record = broker.record_json("charge-7").await;
    assert_eq!(record["state"], "done");
    let last = record["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["action"], "resolve executed");
    assert_eq!(last["note"], "found in the provider dashboard");
    let dup = send(broker.post("/payments", "charge-7", r#"{"amount":7}"#)).await;
    assert_eq!(dup.status, 201);
    assert_eq!(&dup.body[..], br#"{"id":"pay_7","status":"succeeded"}"#);
    assert_eq!(dup.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits("charge-7"), 1);
}

/// What a person sees in the chart of `curve` for `route`: the value beside it, as the page
/// keeps it in `data-last`.
fn chart(curve: &str, route: &str) -> String {
    format!("document.querySelector('figure.chart[data-curve=\"{curve}\"][data-route=\"{route}\"]')")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_health_view_shows_the_storm_route_amplified_and_the_calm_one_not() {
    let Some(browser) = Browser::start().await else { return };
    std::env::set_var("IDEM_TEST_HEALTH_TOKEN", "health-secret");
    let upstream = Upstream::start().await;
    let extra = format!(
        "[routes.retry]\nbase = \"10ms\"\ncap = \"20ms\"\n\n\
         [[routes]]\nname = \"ledger\"\npath_prefix = \"/ledger\"\nupstream = \"{}\"\n\n\
         [auth]\nadmin_token_env = \"IDEM_TEST_HEALTH_TOKEN\"\n",
        upstream.url()
    );
    let broker = Broker::start(&Db::new(Backend::Sqlite).await, TestConfig::new(&upstream.url()).tables(&extra)).await;
    let body = r#"{"amount":1}"#;
    // The storm: every payment is refused with a 503 at first and succeeds on its retry; one
    // may have executed and waits in the reconciliation queue. Every ledger call succeeds.
    upstream.script("lost", vec![Reply::status(504)]);
    send(broker.post("/payments", "lost", body)).await.assert_problem(502, "outcome-unknown");
    for i in 0..8 {
        let key = format!("storm-{i}");
        upstream.script(&key, vec![Reply::status(503)]);
        assert_eq!(send(broker.post("/payments", &key, body)).await.status, 201);
        assert_eq!(send(broker.post("/ledger", &format!("calm-{i}"), body)).await.status, 201);
    }

    let mut page = Page::open(&browser, &format!("{}/", broker.admin)).await;
    page.until("!document.getElementById('health-view').hidden").await;
    page.until("document.getElementById('health-message').textContent.includes('Unauthorized')").await;
    page.type_into("#token", "health-secret").await;
    page.eval("document.getElementById('token').dispatchEvent(new Event('change'))").await;

    // A chart per curve and route: thirteen curves, two routes.
    page.until("document.querySelectorAll('figure.chart').length === 26").await;
    let amplification = chart("amplification", "payments");
    page.until(&format!("parseFloat({amplification}.dataset.last) > 1")).await;
    let shown = page.eval(&format!("{amplification}.querySelector('.value').textContent")).await;
    assert!(shown.as_str().is_some_and(|s| s.starts_with('×') && s != "×1.00"), "{shown}");
    assert_eq!(page.eval(&format!("{}.dataset.last", chart("amplification", "ledger"))).await, "1");
    assert_eq!(page.eval(&format!("{}.dataset.last", chart("first_try_success", "ledger"))).await, "1");
    assert_eq!(page.eval(&format!("{}.dataset.last", chart("retry_salvaged", "ledger"))).await, "0");
    let series = page.eval(&format!("JSON.parse({amplification}.dataset.series).length")).await;
    assert_eq!(series, 90, "15 minutes in steps of 10 s");
    assert_eq!(page.eval(&format!("{amplification}.querySelectorAll('svg path, svg circle').length > 0")).await, true);
    // This node's retry budgets, a row each: the storm's 8 retries were payments', none ledger's.
    let row = |name: &str| format!(r#"document.querySelector('#budgets tr[data-scope="route"][data-name="{name}"]')"#);
    page.until(&format!("{} !== null", row("payments"))).await;
    assert_eq!(page.eval(&format!("{}.cells[3].textContent", row("payments"))).await, "8");
    assert_eq!(page.eval(&format!("{}.cells[3].textContent", row("ledger"))).await, "0");
    // Everything on the page came from the broker itself.
    let foreign = "performance.getEntriesByType('resource').filter(e => !e.name.startsWith(location.origin)).length";
    assert_eq!(page.eval(foreign).await, 0);

    // The queue's depth links to the queue, which lists the record waiting there.
    let depth = chart("unknown_depth", "payments");
    assert_eq!(page.eval(&format!("{depth}.dataset.last")).await, "1");
    page.click(r#"figure.chart[data-curve="unknown_depth"][data-route="payments"] a"#).await;
    page.until("location.hash === '#queue' && !document.getElementById('queue-view').hidden").await;
    page.until("document.querySelectorAll('tr.record').length === 1").await;
    assert_eq!(page.eval("document.querySelector('tr.record').textContent.includes('lost')").await, true);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_isolates_a_route_and_clears_it_again_from_the_console() {
    let Some(browser) = Browser::start().await else { return };
    let upstream = Upstream::start().await;
    let broker = Broker::start(&Db::new(Backend::Sqlite).await, TestConfig::new(&upstream.url())).await;
    let body = r#"{"amount":1}"#;

    let mut page = Page::open(&browser, &format!("{}/", broker.admin)).await;
    page.click("#nav-switches").await;
    page.until("!document.getElementById('switches-view').hidden").await;
    page.until("!document.getElementById('no-switches').hidden").await;
    // Routes are offered for the scope.
    page.until("[...document.querySelectorAll('#switch-routes option')].some(o => o.value === 'payments')").await;

    page.type_into("#switch-scope", "payments").await;
    page.eval("document.getElementById('switch-action').value = 'isolate'").await;
    page.type_into("#switch-reason", "upstream is melting").await;
    page.type_into("#switch-expires", "30m").await;
    page.click("#switch-set").await;
    page.until("document.getElementById('switch-message').className === 'ok'").await;
    page.until("document.querySelectorAll('tr.switch[data-status=\"active\"]').length === 1").await;
    page.until("!document.getElementById('switch-banner').hidden").await;
    let banner = page.eval("document.getElementById('switch-banner').textContent").await;
    assert!(banner.as_str().is_some_and(|b| b.contains("isolate on payments")), "{banner}");

    // The broker obeys what was set in the page.
    send(broker.post("/payments", "while-isolated", body)).await.assert_problem(503, "circuit-open");
    assert_eq!(upstream.hits("while-isolated"), 0);

    // Clearing without a reason is refused, and the page says why.
    page.click("button.clear-switch").await;
    page.until("document.getElementById('switch-message').textContent.includes('reason')").await;
    page.type_into("#clear-reason", "upstream recovered").await;
    page.click("button.clear-switch").await;
    page.until("document.getElementById('switch-message').className === 'ok'").await;
    page.until("document.querySelectorAll('tr.switch').length === 0").await;
    page.until("document.getElementById('switch-banner').hidden").await;
    assert_eq!(send(broker.post("/payments", "after", body)).await.status, 201);

    // The history shows who set it and who cleared it, and why.
    page.click("#switch-history").await;
    page.until("document.querySelectorAll('tr.switch[data-status=\"cleared\"]').length === 1").await;
    let row = page.eval("document.querySelector('tr.switch').textContent").await;
    let row = row.as_str().unwrap();
    assert!(row.contains("upstream is melting") && row.contains("console: upstream recovered"), "{row}");
}

/// An upstream answer that came while the store was lost shows in the banner, on every view,
/// until the store has taken it.
#[tokio::test(flavor = "multi_thread")]
async fn the_banner_shows_outcomes_waiting_for_the_store_until_it_takes_them() {
    let Some(browser) = Browser::start().await else { return };
    let upstream = Upstream::start().await;
    let db = Db::new(Backend::Sqlite).await;
    let broker = Broker::start(&db, TestConfig::new(&upstream.url())).await;
    let path = std::path::PathBuf::from(db.url.strip_prefix("sqlite://").unwrap());
    let aside = path.with_extension("aside");
    let mut page = Page::open(&browser, &format!("{}/", broker.admin)).await;
    page.until("document.getElementById('unrecorded-banner').hidden").await;

    let gate = crate::common::Gate::closed();
    upstream.script("executed", vec![Reply::status(201).held_by(&gate)]);
    let client = tokio::spawn(send(broker.post("/payments", "executed", r#"{"amount":1}"#)));
    upstream.await_hits("executed", 1).await;
    std::fs::rename(&path, &aside).unwrap();
    // Noticed lost (the metric is the process's, shared with other brokers: ask this one).
    let noticed = async {
        while broker.http.get(format!("{}/readyz", broker.admin)).send().await.unwrap().status() != 503 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), noticed).await.expect("the lost file was not noticed within 10 s");
    gate.open();
    assert_eq!(client.await.unwrap().header("idem-recorded"), Some("false"));

    page.until("!document.getElementById('unrecorded-banner').hidden").await;
    let banner = page.eval("document.getElementById('unrecorded-banner').textContent").await;
    assert!(banner.as_str().is_some_and(|b| b.starts_with("1 executed outcome waiting for the store")), "{banner}");
    std::fs::rename(&aside, &path).unwrap();
    // Written again within 5 s of the store's return; the banner follows within its refresh.
    broker.await_record("executed", Duration::from_secs(15), |r| r["state"] == "done").await;
    page.until("document.getElementById('unrecorded-banner').hidden").await;
}
