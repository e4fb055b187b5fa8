//! A database that goes away: requests are refused with a clear problem, nothing is sent
//! upstream, readiness says so — and nothing panics.

use crate::common::{backend, send, Backend, Broker, Db, TestConfig, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_database_refuses_requests_without_sending_anything() {
    if backend::postgres_server_url().is_none() {
        backend::skipped("a_lost_database_refuses_requests_without_sending_anything");
        return;
    }
    let upstream = Upstream::start().await;
    let db = Db::new(Backend::Postgres).await;
    let broker = Broker::start(&db, TestConfig::new(&upstream.url())).await;
    assert_eq!(send(broker.post("/payments", "before", "{}")).await.status, 201);

    // The database disappears under the running broker (its connections are terminated).
    backend::drop_postgres_db(&db.url).await;

    let r = send(broker.post("/payments", "during", "{}")).await;
    r.assert_problem(503, "store-unavailable");
    assert!(r.header("retry-after").is_some());
    assert_eq!(upstream.hits("during"), 0, "nothing is sent that could not be recorded");
    let ready = send(broker.http.get(format!("{}/readyz", broker.admin))).await;
    ready.assert_problem(503, "not-ready");
    assert!(ready.json()["detail"].as_str().is_some_and(|d| d.contains("store")), "{:?}", ready.body);
    // The data plane still answers what needs no database.
    send(broker.post("/elsewhere", "x", "{}")).await.assert_problem(404, "no-route");
}
