//! The SQLite store's only writing connection. Under load, writes queue up for an OS thread
//! that commits whatever has queued in one transaction (group commit), so one fsync covers many
//! requests. When nothing has queued, a caller on the multi-threaded runtime commits its write
//! itself, on its own thread, instead of waking the writer and being woken back (with
//! `synchronous = FULL`, only when the store is idle).
//!
//! It drives SQLite through rusqlite, synchronously, rather than through sqlx: sqlx runs every
//! statement on a worker thread of its own and hands it over through a channel, which costs a
//! thread wake-up per statement. Here a batch runs back to back, and the only hand-offs are the
//! batch coming in and each reply going out.
//!
//! No write is answered before its committer has checked that the commit went to the files the
//! store's paths still name ([`DatabaseFiles`]); once they are lost, every write is refused but
//! the probes that ask whether the store may resume.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rusqlite::Connection;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::{mpsc, oneshot};

use super::checkpointer;
use super::committer::Committer;
pub(super) use super::committer::{Reply, Write};
use super::files::DatabaseFiles;
use super::synchronous;
use crate::config::Synchronous;
use crate::store::{DurabilityInForce, StoreError};

/// Most writes committed in one transaction. Bounds the latency a batch adds to its first write.
const MAX_BATCH: usize = 256;

/// How long the writer keeps looking for the next write, after a batch of one, before it sleeps.
/// Waking a sleeping thread costs tens of microseconds (more on a virtual machine), and at low
/// load a request's next write usually comes sooner: the upstream answers, or the client sends
/// its next request. It yields between looks, so a thread with work to do gets the CPU; but
/// under load each look is a system call and often a context switch, and the next bunch of
/// writes pays for its wake-up many times over: after a batch of several, the writer sleeps at
/// once (measured: 8–10 % less CPU per new key at c=64, the same latency at c=1).
const LINGER: Duration = Duration::from_micros(100);
/// How long after a commit a store that syncs at every commit counts as busy: a write that
/// comes sooner queues for the writer thread and may share its next sync; a later one, at low
/// load, commits in place. As long as the writer thread lingers, which is when it would pick
/// such a write up without a wake-up.
const IDLE_AFTER: Duration = LINGER;
/// WAL pages past which the writer checkpoints by itself, in the commit that crosses the mark.
/// SQLite writes the log from its start again only after a checkpoint has copied all of it, and
/// under steady load the checkpointer never quite has: commits land while it runs. Until the
/// writer's own checkpoint, every commit extends the log; on raw writes here, a sync that
/// extends a file costs a third more than one that overwrites. So the mark is low, 8 MiB: the log
/// stays small and is soon overwritten in place, for the price of a checkpoint (the few pages the
/// checkpointer has not copied yet, and a flush of the database file) in one commit per 2,048
/// pages written.
const WAL_RESTART_PAGES: u32 = 2_048;

/// Declares, on the writing connection, the store protocol this build speaks: the store's
/// triggers refuse a write to `records` from a connection that declares another, or none
/// (`migrations/sqlite`).
pub(super) fn declare_protocol(conn: &Connection) -> Result<(), StoreError> {
    use rusqlite::functions::FunctionFlags;
    conn.create_scalar_function(
        "idem_store_protocol",
        0,
        FunctionFlags::SQLITE_UTF8 | FunctionFlags::SQLITE_DETERMINISTIC,
        |_| Ok(crate::store::protocol::STORE_PROTOCOL),
    )?;
    Ok(())
}

/// Starts the writer thread, and the checkpointer beside it, on the database at `path` (which
/// the migrations have prepared, and `files` watches); both stop when the [`Writer`] is dropped.
pub(super) fn start(path: &Path, synchronous: Synchronous, files: Arc<DatabaseFiles>) -> Result<Writer, StoreError> {
    let conn = Connection::open(path)?;
    declare_protocol(&conn)?;
    conn.busy_timeout(Duration::from_secs(10))?;
    // Room for every statement the writes prepare (some thirty), so that a rare one (a sweep,
    // a switch) never pushes a hot one out to be parsed again.
    conn.set_prepared_statement_cache_capacity(64);
    conn.execute_batch(&format!(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = {}; PRAGMA foreign_keys = ON;
         PRAGMA wal_autocheckpoint = {WAL_RESTART_PAGES};",
        synchronous.pragma()
    ))?;
    let durability = synchronous::in_force(&conn)?;
    // A read makes this connection hold the log open, so no other connection's close deletes it.
    conn.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))?;
    files.learn_log()?;
    let cannot = |e: std::io::Error| StoreError::Unavailable(format!("cannot start the sqlite writer: {e}"));
    let nudge = checkpointer::start(Connection::open(path)?, files.clone()).map_err(cannot)?;
    let committer = Arc::new(Mutex::new(Committer::new(conn, files, nudge)));
    let (queue, queued) = mpsc::channel(4 * MAX_BATCH);
    std::thread::Builder::new()
        .name("idem-sqlite-writer".into())
        .spawn({
            let committer = committer.clone();
            move || write_loop(&committer, queued)
        })
        .map_err(cannot)?;
    Ok(Writer { queue, committer, durability, syncs_at_commit: synchronous != Synchronous::Normal })
}

/// The way into the one writing connection.
pub(super) struct Writer {
    /// To the writer thread, for writes that come while the store is busy.
    queue: mpsc::Sender<Write>,
    /// The connection itself, for a write that finds the store idle.
    committer: Arc<Mutex<Committer>>,
    /// What its commits survive, as the connection reported it once set.
    durability: DurabilityInForce,
    /// Whether a commit waits for the disk (`FULL`, `EXTRA`) or only hands its pages to the
    /// operating system (`NORMAL`): what decides where a write commits.
    syncs_at_commit: bool,
}

impl Writer {
    pub(super) fn durability(&self) -> &DurabilityInForce {
        &self.durability
    }

    /// Commits the write `op` builds and returns its result, once the commit is durable.
    pub(super) async fn write<T>(&self, op: impl FnOnce(Reply<T>) -> Write) -> Result<T, StoreError> {
        let stopped = || StoreError::Unavailable("the sqlite writer has stopped".into());
        let (reply, result) = oneshot::channel();
        if let Err(write) = self.commit_in_place(op(reply)) {
            self.queue.send(write).await.map_err(|_| stopped())?;
        }
        result.await.map_err(|_| stopped())?
    }

    /// Commits `write` on the calling thread, or gives it back for the writer thread. A write
    /// handed to the writer thread waits for it to wake, and then for its reply to wake the
    /// caller: two thread wake-ups on the request's way, tens of microseconds each (more on a
    /// virtual machine). So a write commits here, with no hand-off at all, when the connection
    /// is free and nothing has queued before it; and, if its commit waits for the disk
    /// (`synchronous = FULL`), only when the store is idle too: no commit for [`IDLE_AFTER`]. A
    /// sync shared by a batch costs less than one each, and under load writes come sooner and
    /// gather into the writer thread's commits. With `NORMAL` a commit waits for nothing but
    /// the CPU (the log is synced at checkpoints only), and the writer thread batches only what
    /// queues while the connection is taken: fewer pages written per write.
    ///
    /// Here, the runtime's worker thread does the commit's work itself, disk wait included,
    /// rather than hand its other tasks over to another thread first (`block_in_place`): that
    /// hand-off wakes a thread per commit, and measured, cost more than the wait (at c=8 with
    /// `FULL`, 75 µs of CPU per new key and a sixth of the rate). The connection's lock bounds
    /// the stall: one thread at a time commits, so at most one of the runtime's workers waits
    /// for the disk, for one commit. With `FULL` that is only at low load; with `NORMAL`, only
    /// in the commit that crosses [`WAL_RESTART_PAGES`] and checkpoints.
    ///
    /// A batch the writer thread has taken from the queue but not yet started is not seen; the
    /// write committed here then only goes first.
    ///
    /// Only on a runtime of two worker threads or more (a machine of one core gets one): with
    /// one, a commit here would stall every task (measured with `TOKIO_WORKER_THREADS=1`: half
    /// the rate at c=64).
    // The error is the write itself, handed back unboxed: boxing it would cost every write an
    // allocation to save a move.
    #[allow(clippy::result_large_err)]
    fn commit_in_place(&self, write: Write) -> Result<(), Write> {
        let workers = Handle::try_current().map_or(0, |h| {
            if h.runtime_flavor() == RuntimeFlavor::MultiThread {
                h.metrics().num_workers()
            } else {
                0
            }
        });
        if workers < 2 || self.queue.capacity() < self.queue.max_capacity() {
            return Err(write);
        }
        // A poisoned lock is left to the writer thread, which recovers the connection first.
        let Ok(mut committer) = self.committer.try_lock() else {
            return Err(write);
        };
        if self.syncs_at_commit && committer.last_commit.elapsed() < IDLE_AFTER {
            return Err(write);
        }
        committer.commit(&mut vec![write]);
        committer.in_place += 1;
        Ok(())
    }
}

/// Commits what the queue brings until every sender is gone.
fn write_loop(committer: &Mutex<Committer>, mut queue: mpsc::Receiver<Write>) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut linger = LINGER;
    while next_batch(&mut queue, &mut batch, linger) {
        let mut committer = committer.lock().unwrap_or_else(|poisoned| {
            committer.clear_poison();
            let mut committer = poisoned.into_inner();
            committer.recover();
            committer
        });
        // Writes that queued while a caller committed in place join this commit.
        take_queued(&mut queue, &mut batch);
        linger = if batch.len() == 1 { LINGER } else { Duration::ZERO };
        committer.commit(&mut batch);
    }
}

/// Fills `batch` with what has queued up, waiting (lingering for up to `linger` first) if
/// nothing has. False once every sender is gone.
fn next_batch(queue: &mut mpsc::Receiver<Write>, batch: &mut Vec<Write>, linger: Duration) -> bool {
    let since = Instant::now();
    loop {
        take_queued(queue, batch);
        if !batch.is_empty() {
            return true;
        }
        if since.elapsed() >= linger {
            return queue.blocking_recv_many(batch, MAX_BATCH) > 0;
        }
        std::thread::yield_now();
    }
}

/// Moves what has queued up into `batch`, up to [`MAX_BATCH`].
fn take_queued(queue: &mut mpsc::Receiver<Write>, batch: &mut Vec<Write>) {
    while batch.len() < MAX_BATCH {
        match queue.try_recv() {
            Ok(write) => batch.push(write),
            Err(_) => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Timestamp;

    /// A writer on a fresh database holding the one table its probes write to.
    fn writer(dir: &Path) -> Arc<Writer> {
        writer_syncing(dir, Synchronous::Full)
    }

    fn writer_syncing(dir: &Path, synchronous: Synchronous) -> Arc<Writer> {
        let path = dir.join("idem.db");
        Connection::open(&path)
            .unwrap()
            .execute_batch(
                "PRAGMA journal_mode = WAL;
                 CREATE TABLE liveness (id INTEGER PRIMARY KEY, written_at INTEGER NOT NULL);",
            )
            .unwrap();
        let files = Arc::new(DatabaseFiles::opened(&path).unwrap());
        Arc::new(start(&path, synchronous, files).unwrap())
    }

    async fn probe(writer: &Writer) -> Result<(), StoreError> {
        writer.write(|reply| Write::Probe(Timestamp::now(), reply)).await
    }

    /// Past [`IDLE_AFTER`], the next write may commit in place.
    async fn let_the_store_go_idle() {
        tokio::time::sleep(IDLE_AFTER * 10).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    // The test takes the connection, as a commit in place would, while the writes queue.
    #[allow(clippy::await_holding_lock)]
    async fn writes_that_queue_while_the_connection_is_taken_all_commit_once_it_is_free() {
        let dir = tempfile::TempDir::new().unwrap();
        let writer = writer(dir.path());
        let held = writer.committer.lock().unwrap();
        let writes: Vec<_> = (0..20)
            .map(|_| {
                let writer = writer.clone();
                tokio::spawn(async move { probe(&writer).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(writes.iter().all(|w| !w.is_finished()), "no write commits while the connection is taken");
        drop(held);
        for write in writes {
            write.await.unwrap().unwrap();
        }
        let_the_store_go_idle().await;
        probe(&writer).await.unwrap();
    }

    fn in_place(writer: &Writer) -> u64 {
        writer.committer.lock().unwrap().in_place
    }

    /// How many commits in place one write on an idle store made, on the runtime it runs on.
    async fn in_place_on_an_idle_store() -> u64 {
        let dir = tempfile::TempDir::new().unwrap();
        let writer = writer(dir.path());
        let_the_store_go_idle().await;
        probe(&writer).await.unwrap();
        in_place(&writer)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_on_an_idle_store_commits_on_its_own_thread() {
        assert_eq!(in_place_on_an_idle_store().await, 1);
    }

    #[tokio::test]
    async fn on_a_single_threaded_runtime_a_write_on_an_idle_store_goes_to_the_writer_thread() {
        // In place, its commit would stall the runtime's only thread.
        assert_eq!(in_place_on_an_idle_store().await, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn on_a_runtime_of_one_worker_a_write_on_an_idle_store_goes_to_the_writer_thread() {
        assert_eq!(in_place_on_an_idle_store().await, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_on_a_busy_store_commits_in_place_only_if_commits_are_not_synced() {
        for (synchronous, in_place_expected) in [(Synchronous::Normal, 1), (Synchronous::Full, 0)] {
            let dir = tempfile::TempDir::new().unwrap();
            let writer = writer_syncing(dir.path(), synchronous);
            // However slow this machine, the store is not idle when the write comes.
            writer.committer.lock().unwrap().last_commit = Instant::now() + Duration::from_secs(3600);
            probe(&writer).await.unwrap();
            assert_eq!(in_place(&writer), in_place_expected, "{synchronous:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_commit_that_panicked_halfway_leaves_the_connection_usable() {
        let dir = tempfile::TempDir::new().unwrap();
        let writer = writer(dir.path());
        let poisoner = writer.clone();
        let panicked = std::thread::spawn(move || {
            let committer = poisoner.committer.lock().unwrap();
            committer.conn.execute_batch("BEGIN IMMEDIATE").unwrap();
            panic!("a commit panics with its transaction open");
        })
        .join();
        assert!(panicked.is_err() && writer.committer.is_poisoned());
        let_the_store_go_idle().await;
        probe(&writer).await.unwrap();
        probe(&writer).await.unwrap();
    }
}
