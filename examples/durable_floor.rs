//! The floor under a durable broker on Idem's stack: what a new key costs when nothing stands
//! between the request and its two syncs but hyper and an append-only log. Each new key is
//! fingerprinted, appended to the log and synced before it is sent; its answer is appended and
//! synced before the client hears it. Syncs are shared: one covers every record appended since
//! the last. A key whose answer is durable is answered from memory (status and body only); a
//! duplicate that comes while the first is in flight is sent again, and fingerprints are never
//! compared. There is no recovery, no retention, no retry, no state machine and no query: this
//! is a bound for `benches/wrk/compare`, not a broker.
//!
//! `cargo run --release --example durable_floor -- 127.0.0.1:18006 127.0.0.1:18001 /tmp/floor`
//!
//! - By default it has Idem's shape: one multi-threaded runtime, one log.
//! - `DURABLE_FLOOR_PER_CORE=1`: a thread per core instead, each with its own runtime, listening
//!   socket on the shared port (`SO_REUSEPORT`), upstream connections and log, so that a
//!   request is never handed from one thread to another.
//! - `DURABLE_FLOOR_SYNC=inline|aside`: where a sync is made. By default a sync that carries one
//!   record is made in place, on the runtime's thread that runs the log's task (no hand-off; on
//!   the multi-threaded runtime the other threads go on), and one that carries more goes to a
//!   thread of the blocking pool, while the runtime's thread goes on.
//! - `DURABLE_FLOOR_APPLY=1`: each durable record is also applied, off the request's path, to a
//!   SQLite database made by Idem's migrations, with the statements Idem's store makes for an
//!   admission and an outcome (WAL, no sync per commit: the log is what is durable), in batches
//!   gathered for `DURABLE_FLOOR_APPLY_EVERY_MS` (10). It measures what keeping SQLite up to
//!   date behind the log costs. A request that finds the applier 65,536 records behind waits.
//!
//! Every 5,000 syncs a log prints the records its last 5,000 syncs carried, each on average.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fs::File;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{HeaderMap, Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use sha2::{Digest, Sha256};
use tokio::net::TcpSocket;
use tokio::sync::{oneshot, Notify};

/// The log is written round and round over a preallocated file, as SQLite's WAL is once it has
/// been checkpointed: a sync never extends the file.
const LOG_BYTES: u64 = 64 << 20;
/// The largest request or answer body kept: a batch of records always fits in the log.
const MAX_BODY: usize = 1 << 20;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream), Some(dir)) = (args.next(), args.next(), args.next()) else {
        eprintln!("usage: durable_floor <listen address> <upstream address> <log folder>");
        std::process::exit(2);
    };
    let listen: SocketAddr = listen.parse().map_err(std::io::Error::other)?;
    std::fs::create_dir_all(&dir)?;
    let applier = match std::env::var_os("DURABLE_FLOOR_APPLY") {
        Some(_) => Some(start_applier(&format!("{dir}/records.db"))?),
        None => None,
    };
    if std::env::var_os("DURABLE_FLOOR_PER_CORE").is_none() {
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        return runtime.block_on(serve(listen, false, upstream, format!("{dir}/log"), applier));
    }
    // The first core's thread to fail stops the whole: a floor on fewer cores would mislead.
    let (ended, first_end) = std::sync::mpsc::channel();
    for n in 0..std::thread::available_parallelism().map_or(1, |n| n.get()) {
        let (upstream, path, applier, ended) =
            (upstream.clone(), format!("{dir}/log-{n}"), applier.clone(), ended.clone());
        std::thread::spawn(move || {
            let served = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .and_then(|runtime| runtime.block_on(serve(listen, true, upstream, path, applier)));
            let _ = ended.send(served);
        });
    }
    first_end.recv().map_err(std::io::Error::other)?
}

/// What every request on one runtime shares.
struct Floor {
    client: Client<HttpConnector, Full<Bytes>>,
    upstream: String,
    log: Log,
    answers: Mutex<HashMap<String, (StatusCode, Bytes)>>,
    applier: Option<SyncSender<Entry>>,
}

/// Serves on the runtime it is called on, with a listening socket, a log and upstream
/// connections of its own; `shared_port` when other runtimes listen on the same port.
async fn serve(
    listen: SocketAddr,
    shared_port: bool,
    upstream: String,
    path: String,
    applier: Option<SyncSender<Entry>>,
) -> std::io::Result<()> {
    // The log first, so that a port that takes connections is ready to serve them.
    let log = Log::open(&path)?;
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseport(shared_port)?;
    socket.set_reuseaddr(true)?;
    socket.bind(listen)?;
    let listener = socket.listen(1024)?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new()).build(connector);
    let floor = Arc::new(Floor { client, upstream, log, answers: Mutex::default(), applier });
    tokio::spawn(floor.clone().sync_loop());
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let floor = floor.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| floor.clone().forward(request));
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// Records appended to a batch in memory, written and synced by one task for all that came
/// since its last sync.
struct Log {
    file: Arc<File>,
    batch: Mutex<Batch>,
    appended: Notify,
}

#[derive(Default)]
struct Batch {
    bytes: Vec<u8>,
    waiting: Vec<oneshot::Sender<()>>,
}

impl Log {
    fn open(path: &str) -> std::io::Result<Log> {
        let file = File::options().read(true).write(true).create(true).truncate(false).open(path)?;
        if file.metadata()?.len() < LOG_BYTES {
            let zeros = vec![0u8; 1 << 20];
            for n in 0..LOG_BYTES >> 20 {
                file.write_all_at(&zeros, n << 20)?;
            }
            file.sync_all()?;
        }
        Ok(Log { file: Arc::new(file), batch: Mutex::default(), appended: Notify::new() })
    }

    /// Appends a record, length first; resolves once it is on disk.
    async fn append(&self, record: &[u8]) {
        let (done, durable) = oneshot::channel();
        {
            let mut batch = self.batch.lock().unwrap_or_else(|e| e.into_inner());
            batch.bytes.extend_from_slice(&(record.len() as u32).to_le_bytes());
            batch.bytes.extend_from_slice(record);
            batch.waiting.push(done);
        }
        self.appended.notify_one();
        let _ = durable.await;
    }
}

impl Floor {
    /// Woken by appends. One sync covers every record appended since the last: those of the
    /// tasks that ran before this one, on its thread or another, and all that came during the
    /// sync before.
    async fn sync_loop(self: Arc<Self>) {
        let forced = std::env::var("DURABLE_FLOOR_SYNC").ok();
        let (mut offset, mut syncs, mut carried) = (0u64, 0u64, 0u64);
        loop {
            self.log.appended.notified().await;
            let Batch { bytes, waiting } =
                std::mem::take(&mut *self.log.batch.lock().unwrap_or_else(|e| e.into_inner()));
            if waiting.is_empty() {
                continue;
            }
            if bytes.len() as u64 > LOG_BYTES {
                fail(std::io::Error::other("a batch larger than the log"));
            }
            if offset + bytes.len() as u64 > LOG_BYTES {
                offset = 0;
            }
            let aside = match forced.as_deref() {
                Some("aside") => true,
                Some("inline") => false,
                _ => waiting.len() > 1,
            };
            let at = offset;
            offset += bytes.len() as u64;
            let written = if aside {
                let file = self.log.file.clone();
                tokio::task::spawn_blocking(move || write_and_sync(&file, &bytes, at))
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e)))
            } else {
                write_and_sync(&self.log.file, &bytes, at)
            };
            if let Err(e) = written {
                fail(e);
            }
            let records = waiting.len() as u64;
            for done in waiting {
                let _ = done.send(());
            }
            (syncs, carried) = (syncs + 1, carried + records);
            if syncs.is_multiple_of(5_000) {
                eprintln!("log: {syncs} syncs; the last 5,000 carried {:.2} records each", carried as f64 / 5_000.0);
                carried = 0;
            }
        }
    }

    /// A new key: its record durable, then sent, then its answer durable, then answered.
    async fn forward(self: Arc<Self>, request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
        let (mut parts, body) = request.into_parts();
        let body = match Limited::new(body, MAX_BODY).collect().await {
            Ok(body) => body.to_bytes(),
            Err(_) => return Ok(status(StatusCode::PAYLOAD_TOO_LARGE)),
        };
        let Some(key) = parts.headers.get("idempotency-key").and_then(|k| k.to_str().ok()).map(str::to_owned) else {
            return Ok(status(StatusCode::BAD_REQUEST));
        };
        if let Some((code, body)) = self.answers.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(answer(*code, body.clone()));
        }
        // The record as a broker keeps it: key, fingerprint, path, headers and body.
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
        let fingerprint =
            Sha256::new().chain_update(parts.method.as_str()).chain_update(&path).chain_update(&body).finalize();
        let mut record = Vec::with_capacity(512 + body.len());
        record.extend_from_slice(key.as_bytes());
        record.extend_from_slice(&fingerprint);
        record.extend_from_slice(path.as_bytes());
        for (name, value) in &parts.headers {
            record.extend_from_slice(name.as_str().as_bytes());
            record.extend_from_slice(value.as_bytes());
        }
        record.extend_from_slice(&body);
        self.log.append(&record).await;
        let id = uuid::Uuid::now_v7();
        if let Some(applier) = &self.applier {
            let headers = headers_json(&parts.headers);
            let admitted = Entry::Admitted {
                id,
                key: key.clone(),
                fingerprint: fingerprint.to_vec(),
                path: path.clone(),
                headers,
                body: body.clone(),
            };
            let _ = applier.send(admitted);
        }

        let Ok(uri) = format!("http://{}{path}", self.upstream).parse::<Uri>() else {
            return Ok(status(StatusCode::BAD_REQUEST));
        };
        parts.uri = uri;
        parts.headers.remove(hyper::header::HOST);
        parts.headers.remove("idempotency-key");
        let Ok(answered) = self.client.request(Request::from_parts(parts, Full::new(body))).await else {
            return Ok(status(StatusCode::BAD_GATEWAY));
        };
        let (parts, body) = answered.into_parts();
        let Ok(body) = Limited::new(body, MAX_BODY).collect().await.map(|b| b.to_bytes()) else {
            return Ok(status(StatusCode::BAD_GATEWAY));
        };
        let mut outcome = Vec::with_capacity(64 + body.len());
        outcome.extend_from_slice(key.as_bytes());
        outcome.extend_from_slice(&parts.status.as_u16().to_le_bytes());
        outcome.extend_from_slice(&body);
        self.log.append(&outcome).await;
        if let Some(applier) = &self.applier {
            let headers = headers_json(&parts.headers);
            let _ = applier.send(Entry::Ended { id, status: parts.status.as_u16(), headers, body: body.clone() });
        }
        self.answers.lock().unwrap_or_else(|e| e.into_inner()).insert(key, (parts.status, body.clone()));
        Ok(Response::from_parts(parts, Full::new(body)))
    }
}

fn write_and_sync(file: &File, bytes: &[u8], offset: u64) -> std::io::Result<()> {
    file.write_all_at(bytes, offset)?;
    file.sync_data()
}

/// A log that cannot be written makes every answer a lie: the floor stops.
fn fail(e: std::io::Error) -> ! {
    eprintln!("durable_floor: the log cannot be written: {e}");
    std::process::exit(1)
}

/// Headers as Idem's store keeps them: JSON `[[name, value], ...]`.
fn headers_json(headers: &HeaderMap) -> String {
    let pairs: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (n.as_str(), v.to_str().unwrap_or(""))).collect();
    serde_json::to_string(&pairs).unwrap_or_default()
}

fn answer(code: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = code;
    response
}

fn status(code: StatusCode) -> Response<Full<Bytes>> {
    answer(code, Bytes::new())
}

/// A durable record, to be applied to the database behind the log.
enum Entry {
    Admitted { id: uuid::Uuid, key: String, fingerprint: Vec<u8>, path: String, headers: String, body: Bytes },
    Ended { id: uuid::Uuid, status: u16, headers: String, body: Bytes },
}

/// A thread that applies entries to a SQLite database made by Idem's migrations, with the
/// statements Idem's store makes for a new key's admission and its outcome.
fn start_applier(path: &str) -> std::io::Result<SyncSender<Entry>> {
    let to_io = |e: rusqlite::Error| std::io::Error::other(e.to_string());
    let _ = std::fs::remove_file(path);
    let conn = rusqlite::Connection::open(path).map_err(to_io)?;
    conn.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;").map_err(to_io)?;
    let mut migrations: Vec<_> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/sqlite"))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    migrations.sort();
    for migration in migrations {
        conn.execute_batch(&std::fs::read_to_string(migration)?).map_err(to_io)?;
    }
    let gather = std::time::Duration::from_millis(
        std::env::var("DURABLE_FLOOR_APPLY_EVERY_MS").ok().and_then(|ms| ms.parse().ok()).unwrap_or(10),
    );
    let (sender, entries) = std::sync::mpsc::sync_channel::<Entry>(1 << 16);
    std::thread::Builder::new().name("floor-applier".into()).spawn(move || {
        while let Ok(first) = entries.recv() {
            // Behind the log, no one waits for the database: a batch that gathers for a while
            // rewrites each page it touches once for many records.
            std::thread::sleep(gather);
            let batch: Vec<Entry> = std::iter::once(first).chain(entries.try_iter()).collect();
            if let Err(e) = apply_batch(&conn, batch) {
                eprintln!("durable_floor: cannot apply: {e}");
                std::process::exit(1);
            }
        }
    })?;
    Ok(sender)
}

fn apply_batch(conn: &rusqlite::Connection, batch: Vec<Entry>) -> rusqlite::Result<()> {
    use rusqlite::params;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    conn.execute_batch("BEGIN IMMEDIATE")?;
    for entry in batch {
        match entry {
            Entry::Admitted { id, key, fingerprint, path, headers, body } => {
                conn.prepare_cached(
                    "INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint, request_headers,
                         request_body, state, queued, deadline_at, created_at, updated_at, lease_owner,
                         lease_expires_at, in_flight_number, in_flight_started_at, policy_version, claim_token)
                     VALUES (?1, 'default', ?2, 'payments', 'POST', ?3, '', ?4, ?5, ?6, 'in_progress', 0, ?7, ?8, ?8,
                         'floor', ?7, 1, ?8, 'v1', 1)
                     ON CONFLICT DO NOTHING",
                )?
                .execute(params![
                    id.to_string(),
                    key,
                    path,
                    fingerprint,
                    headers,
                    &body[..],
                    now + 30_000,
                    now
                ])?;
            }
            Entry::Ended { id, status, headers, body } => {
                conn.prepare_cached(
                    "UPDATE records SET
                        attempts = json_insert(attempts, '$[#]', json(?2)),
                        in_flight_number = NULL, in_flight_started_at = NULL, state = 'done', queued = 0,
                        lease_owner = NULL, lease_expires_at = NULL, stop_reason = 'succeeded',
                        response_status = ?3, response_headers = ?4, response_body = ?5, done_at = ?6, updated_at = ?6
                     WHERE id = ?1 AND state = 'in_progress' AND claim_token = 1",
                )?
                .execute(params![
                    id.to_string(),
                    format!(
                        r#"{{"number":1,"started_at":{now},"ended_at":{now},"outcome":"answered","status":{status}}}"#
                    ),
                    status,
                    headers,
                    &body[..],
                    now
                ])?;
            }
        }
    }
    conn.execute_batch("COMMIT")
}
