//! The SQLite store's checkpointer: a thread of its own that copies the WAL back into the
//! database file. Left to SQLite, that would run inside whichever commit crosses the threshold,
//! and its fsyncs would be that request's latency. The writer nudges it every few commits.

use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use rusqlite::Connection;

use super::files::{io_failure, DatabaseFiles};

/// The longest the checkpointer sleeps without a nudge.
const CHECKPOINT_IDLE: Duration = Duration::from_secs(1);

/// Starts the checkpointer on `conn`; it checkpoints at each nudge sent through what this
/// returns, and once more, truncating the log, when that is dropped.
pub(super) fn start(conn: Connection, files: Arc<DatabaseFiles>) -> std::io::Result<SyncSender<()>> {
    let (nudge, nudges) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("idem-sqlite-checkpoints".into())
        .spawn(move || checkpoint_loop(conn, nudges, &files))?;
    Ok(nudge)
}

/// A passive checkpoint never blocks the writer. A checkpoint that fails with
/// an I/O error loses the store; while it is lost, the probes check checkpoints instead.
fn checkpoint_loop(conn: Connection, nudges: mpsc::Receiver<()>, files: &DatabaseFiles) {
    loop {
        let stopping = matches!(nudges.recv_timeout(CHECKPOINT_IDLE), Err(RecvTimeoutError::Disconnected));
        if !stopping && !files.is_available() {
            continue;
        }
        let mode = if stopping { "TRUNCATE" } else { "PASSIVE" };
        let done = conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |_| Ok(()));
        match done {
            Err(e) if io_failure(&e) => drop(files.lose(format!("a checkpoint of the SQLite database failed: {e}"))),
            Err(e) => tracing::warn!(error = %e, "sqlite checkpoint failed; the WAL keeps growing until one succeeds"),
            Ok(()) => {}
        }
        if stopping {
            return;
        }
    }
}
