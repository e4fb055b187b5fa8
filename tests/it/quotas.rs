//! Retry quotas per tenant and per upstream (docs/concepts.md, retry budgets): one tenant's storm
//! leaves the others' retries to them; routes that name one upstream share its budget and its
//! breaker; a reload changes a quota; metrics and `/admin/stats` say whose budget ran dry. The
//! brokers' clocks stand still, so that no budget's window slides while a test runs.

use std::sync::Arc;

use idem::domain::clock::ManualClock;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::common::{both_stores, send, Backend, Broker, Db, Reply, TestConfig, Upstream};

both_stores!(
    one_tenants_storm_leaves_the_other_tenants_retries_to_them,
    without_a_tenant_quota_one_tenants_storm_spends_the_routes_retries,
    routes_that_name_one_upstream_share_its_budget_and_its_breaker,
    a_reload_changes_a_tenants_quota,
    a_forwarded_credential_rate_limited_does_not_open_the_breaker_for_everyone
);

const BODY: &str = r#"{"amount":1}"#;
const ADMIN_TOKEN: &str = "quotas-admin-secret";

/// A broker on `db` whose clock stands still.
async fn start(db: &Db, config: TestConfig) -> Broker {
    Broker::start_with_clock(db, config, Arc::new(ManualClock::starting_now())).await
}

/// Two retries at most, quick backoff; the route's budget is 20 retries a window (a floor of
/// 2/s, no share of first attempts) and its breaker is kept out of the way.
const RETRY: &str = "[routes.retry]\nmax_attempts = 2\nbase = \"1ms\"\ncap = \"5ms\"\nbudget_ratio = 0.0\n\
                     budget_min_per_sec = 2.0\n[routes.circuit]\nfailures = 1000\n";

/// Tenants `<test>-storm-<backend>` and `<test>-calm-<backend>` (their tokens are their names),
/// with `quota` lines in `[auth]`. Names are the test's own: the metrics are the process's.
fn tenants(test: &str, backend: Backend, quota: &str) -> (String, String, String) {
    std::env::set_var("IDEM_TEST_QUOTAS_ADMIN_TOKEN", ADMIN_TOKEN);
    let (storm, calm) = (format!("{test}-storm-{backend:?}"), format!("{test}-calm-{backend:?}"));
    let digest = |t: &str| hex::encode(Sha256::digest(t.as_bytes()));
    let auth = format!(
        "[auth]\nadmin_token_env = \"IDEM_TEST_QUOTAS_ADMIN_TOKEN\"\n{quota}\n\
         [[auth.tenants]]\nname = \"{storm}\"\ntoken_sha256 = \"{}\"\n\
         [[auth.tenants]]\nname = \"{calm}\"\ntoken_sha256 = \"{}\"\n",
        digest(&storm),
        digest(&calm)
    );
    (auth, storm, calm)
}

/// `storm` sends 40 requests that fail every attempt, then `calm` sends 10 that fail once and
/// then succeed: how many of calm's the broker salvaged.
async fn storm_then_calm(broker: &Broker, upstream: &Upstream, storm: &str, calm: &str) -> usize {
    for i in 0..40 {
        let key = format!("{storm}-{i}");
        upstream.script(&key, vec![Reply::status(503), Reply::status(503)]);
        assert_eq!(send(broker.post("/payments", &key, BODY).bearer_auth(storm)).await.status, 503);
    }
    let mut salvaged = 0;
    for i in 0..10 {
        let key = format!("{calm}-{i}");
        upstream.script(&key, vec![Reply::status(503), Reply::status(201)]);
        if send(broker.post("/payments", &key, BODY).bearer_auth(calm)).await.status == 201 {
            salvaged += 1;
        }
    }
    salvaged
}

async fn stop_reason(broker: &Broker, key: &str, token: &str) -> Value {
    let url = format!("{}/_idem/requests/{key}", broker.url);
    send(broker.http.get(url).bearer_auth(token)).await.json()["stop_reason"].clone()
}

async fn budgets(broker: &Broker) -> Vec<Value> {
    budgets_of(broker, "").await
}

/// `/admin/stats`' budgets, for `query` (`?route=NAME`, or nothing).
async fn budgets_of(broker: &Broker, query: &str) -> Vec<Value> {
    let url = format!("{}/admin/stats{query}", broker.admin);
    let stats = send(broker.http.get(url).bearer_auth(ADMIN_TOKEN)).await;
    assert_eq!(stats.status, 200);
    stats.json()["budgets"].as_array().unwrap().clone()
}

fn budget<'a>(budgets: &'a [Value], scope: &str, name: &str) -> &'a Value {
    budgets
        .iter()
        .find(|b| b["scope"] == scope && b["name"] == name)
        .unwrap_or_else(|| panic!("no {scope} budget {name}: {budgets:#?}"))
}

async fn one_tenants_storm_leaves_the_other_tenants_retries_to_them(backend: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(backend).await;
    // Each tenant may retry 10 times a window: half of what the route allows.
    let (auth, storm, calm) =
        tenants("quota", backend, "tenant_retry_budget_ratio = 0.0\ntenant_retry_budget_min_per_sec = 1.0");
    let broker = start(&db, TestConfig::new(&upstream.url()).tables(RETRY).tables(&auth)).await;

    let salvaged = storm_then_calm(&broker, &upstream, &storm, &calm).await;
    assert_eq!(salvaged, 10, "every one of calm's requests got the retry it needed");
    assert_eq!(stop_reason(&broker, &format!("{storm}-0"), &storm).await, "attempt_cap", "storm's first ones retried");
    assert_eq!(stop_reason(&broker, &format!("{storm}-39"), &storm).await, "tenant_budget");
    assert_eq!(stop_reason(&broker, &format!("{calm}-9"), &calm).await, "success");

    broker
        .await_metric(&format!(
            "idem_retry_budget_exhausted_total{{route=\"payments\",tenant=\"{storm}\",scope=\"tenant\"}} 30"
        ))
        .await;
    let budgets = budgets(&broker).await;
    let (storming, calm_budget) = (budget(&budgets, "tenant", &storm), budget(&budgets, "tenant", &calm));
    assert_eq!((storming["retries"].as_u64(), storming["refused_total"].as_u64()), (Some(10), Some(30)));
    assert_eq!((calm_budget["retries"].as_u64(), calm_budget["refused_total"].as_u64()), (Some(10), Some(0)));
    assert_eq!(budget(&budgets, "route", "payments")["retries"], 20);
}

/// The same storm with no tenant quota: the storm spends the route's budget, and the calm
/// tenant's requests fail with it. The test above fails this way without the quota.
async fn without_a_tenant_quota_one_tenants_storm_spends_the_routes_retries(backend: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(backend).await;
    let (auth, storm, calm) = tenants("no-quota", backend, "");
    let broker = start(&db, TestConfig::new(&upstream.url()).tables(RETRY).tables(&auth)).await;

    let salvaged = storm_then_calm(&broker, &upstream, &storm, &calm).await;
    assert_eq!(salvaged, 0, "the storm took all 20 of the route's retries");
    assert_eq!(stop_reason(&broker, &format!("{calm}-0"), &calm).await, "retry_budget");
}

async fn routes_that_name_one_upstream_share_its_budget_and_its_breaker(backend: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(backend).await;
    // The provider allows 5 retries a window over both routes; each route alone would allow 100.
    // The second route's name is the test's own: the metrics are the process's.
    let refunds = format!("refunds-{backend:?}");
    let tables = format!(
        "[routes.retry]\nmax_attempts = 2\nbase = \"1ms\"\ncap = \"5ms\"\n[routes.circuit]\nfailures = 3\nopen_for = \"30s\"\n\
         [[routes]]\nname = \"{refunds}\"\npath_prefix = \"/refunds\"\nupstream = \"provider\"\n\
         [routes.retry]\nmax_attempts = 2\nbase = \"1ms\"\ncap = \"5ms\"\n[routes.circuit]\nfailures = 3\nopen_for = \"30s\"\n\
         [[upstreams]]\nname = \"provider\"\nurl = \"{}\"\nbudget_ratio = 0.0\nbudget_min_per_sec = 0.5\n",
        upstream.url()
    );
    let broker = start(&db, TestConfig::new("provider").tables(&tables)).await;

    let mut salvaged = Vec::new();
    for path in ["/payments", "/refunds"] {
        for i in 0..3 {
            let key = format!("{}-{i}", &path[1..]);
            upstream.script(&key, vec![Reply::status(503), Reply::status(201)]);
            salvaged.push(send(broker.post(path, &key, BODY)).await.status == 201);
        }
    }
    assert_eq!(salvaged, [true, true, true, true, true, false], "five retries between the two routes");
    assert_eq!(broker.record_json("refunds-2").await["stop_reason"], "upstream_budget");
    broker
        .await_metric(&format!(
            "idem_retry_budget_exhausted_total{{route=\"{refunds}\",tenant=\"default\",scope=\"upstream\"}} 1"
        ))
        .await;
    let budgets = budgets(&broker).await;
    assert_eq!(budget(&budgets, "upstream", "provider")["retries"], 5);
    // One route's stats list the budgets its retries spend: its own and its upstream's.
    let spent_by_refunds = budgets_of(&broker, &format!("?route={refunds}")).await;
    let named: Vec<(&str, &str)> =
        spent_by_refunds.iter().map(|b| (b["scope"].as_str().unwrap(), b["name"].as_str().unwrap())).collect();
    assert_eq!(named, [("route", refunds.as_str()), ("upstream", "provider")], "{spent_by_refunds:#?}");

    // Failures on payments open the provider's circuit for refunds too: it is down for both.
    for i in 0..3 {
        let key = format!("down-{i}");
        upstream.script(&key, vec![Reply::status(500)]);
        send(broker.post("/payments", &key, BODY)).await;
    }
    send(broker.post("/refunds", "after-down", BODY)).await.assert_problem(503, "circuit-open");
    assert_eq!(upstream.hits("after-down"), 0);
}

async fn a_reload_changes_a_tenants_quota(backend: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(backend).await;
    let (auth, storm, _) =
        tenants("reload", backend, "tenant_retry_budget_ratio = 0.0\ntenant_retry_budget_min_per_sec = 0.3");
    let config = TestConfig::new(&upstream.url()).tables(RETRY).tables(&auth);
    let broker = start(&db, config).await;
    let failing_once = |round: &str, i: usize| {
        let key = format!("{storm}-{round}-{i}");
        upstream.script(&key, vec![Reply::status(503), Reply::status(201)]);
        key
    };
    let mut salvaged = 0;
    for i in 0..5 {
        let key = failing_once("before", i);
        salvaged += usize::from(send(broker.post("/payments", &key, BODY).bearer_auth(&storm)).await.status == 201);
    }
    assert_eq!(salvaged, 3, "a quota of 3 retries a window");

    broker.write_config(
        &broker.config_text.replace("tenant_retry_budget_min_per_sec = 0.3", "tenant_retry_budget_min_per_sec = 1.5"),
    );
    assert_eq!(broker.reload(Some(ADMIN_TOKEN)).await.status, 200);
    let mut salvaged = 0;
    for i in 0..5 {
        let key = failing_once("after", i);
        salvaged += usize::from(send(broker.post("/payments", &key, BODY).bearer_auth(&storm)).await.status == 201);
    }
    assert_eq!(salvaged, 5, "the new quota, 15 a window, applies without a restart");
    let budgets = budgets(&broker).await;
    assert_eq!(budget(&budgets, "tenant", &storm)["min_per_sec"], 1.5);
}

/// On a route that forwards the client's credential, 429s answered to one credential are that
/// credential's own: the breaker, shared by everyone, does not open on them.
async fn a_forwarded_credential_rate_limited_does_not_open_the_breaker_for_everyone(backend: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(backend).await;
    let tables = "[routes.retry]\nmax_attempts = 1\n[routes.circuit]\nfailures = 3\nopen_for = \"30s\"\n";
    let broker =
        start(&db, TestConfig::new(&upstream.url()).route("forward_authorization = true").tables(tables)).await;
    for i in 0..5 {
        let key = format!("limited-{i}");
        upstream.script(&key, vec![Reply::status(429)]);
        let answer = send(broker.post("/payments", &key, BODY).bearer_auth("one-customer")).await;
        assert_eq!(answer.status, 429, "the rate limit is passed on to its credential");
    }
    let other = send(broker.post("/payments", "another-customer", BODY).bearer_auth("another")).await;
    assert_eq!(other.status, 201, "another credential is served: the circuit stayed closed");

    // The upstream failing for everyone still opens it.
    for i in 0..3 {
        let key = format!("failing-{i}");
        upstream.script(&key, vec![Reply::status(500)]);
        send(broker.post("/payments", &key, BODY).bearer_auth("one-customer")).await;
    }
    send(broker.post("/payments", "refused", BODY).bearer_auth("another")).await.assert_problem(503, "circuit-open");
}
