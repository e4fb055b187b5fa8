//! One commit of the SQLite store's writing connection: the writes of a batch applied in one
//! transaction, their results held until it commits and then delivered, and the checks that the
//! commit went to the store's own files. The writer thread and callers committing in place
//! ([`super::writer`]) take turns at the one [`Committer`].

use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;

use rusqlite::Connection;
use tokio::sync::oneshot;

use super::files::{io_failure, DatabaseFiles};
use super::{actions, writes};
use crate::domain::switch::Switch;
use crate::domain::{ClaimToken, Timestamp};
use crate::record::Record;
use crate::store::{
    Action, AddAnswerCounts, Admission, Admit, AttemptEnded, AttemptStarted, Cancel, Cancelled, ClaimQueued,
    ClaimUnclaimed, ClearSwitch, LeaseStatus, Probed, Renew, Resolve, Retry, StoreError, Sweep, SwitchCleared,
    TakeOver,
};

pub(super) type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

/// Declares [`Write`], one variant per command (its struct and the reply it gets), with what
/// applies it and what answers it when it never runs.
macro_rules! writes {
    ($($(#[$doc:meta])* $variant:ident($command:ty) -> $answer:ty = $apply:path;)*) => {
        pub(super) enum Write {
            $($(#[$doc])* $variant($command, Reply<$answer>),)*
        }

        fn apply(conn: &Connection, write: Write) -> Box<dyn Deliver> {
            match write {
                $(Write::$variant(command, reply) => pending(reply, $apply(conn, command)),)*
            }
        }

        /// A write that never ran; its reply carries `e`.
        fn fail(write: Write, e: &StoreError) -> Box<dyn Deliver> {
            match write {
                $(Write::$variant(_, reply) => pending(reply, Err(e.clone())),)*
            }
        }
    };
}

writes! {
    Admit(Admit) -> Admission = writes::admit;
    Claim(ClaimQueued) -> Option<ClaimToken> = writes::claim;
    AttemptStarted(AttemptStarted) -> LeaseStatus = writes::attempt_started;
    AttemptEnded(AttemptEnded) -> LeaseStatus = writes::attempt_ended;
    Renew(Renew) -> LeaseStatus = writes::renew;
    Cancel(Cancel) -> Cancelled = writes::cancel;
    Resolve(Resolve) -> Action = actions::resolve;
    Retry(Retry) -> Action = actions::retry;
    TakeOver(TakeOver) -> bool = writes::take_over;
    Probed(Probed) -> Action = actions::probed;
    ClaimUnclaimed(ClaimUnclaimed) -> Vec<Record> = writes::claim_unclaimed;
    Sweep(Sweep) -> u64 = writes::sweep_done;
    /// A write that changes nothing a record depends on, made to find out whether the database
    /// takes writes again after it was lost. The only write run while the store is lost.
    Probe(Timestamp) -> () = writes::probe;
    AddAnswerCounts(AddAnswerCounts) -> () = super::stats::add_answer_counts;
    SetSwitch(Switch) -> Option<Switch> = super::switches::set;
    ClearSwitch(ClearSwitch) -> SwitchCleared = super::switches::clear;
}

/// Commits between two nudges to the checkpointer.
const CHECKPOINT_EVERY: u32 = 32;

/// A write's result, held back until its transaction commits.
trait Deliver: Send {
    fn deliver(self: Box<Self>, commit: &Result<(), StoreError>);
}

struct Pending<T> {
    reply: Reply<T>,
    result: Result<T, StoreError>,
}

impl<T: Send> Deliver for Pending<T> {
    fn deliver(self: Box<Self>, commit: &Result<(), StoreError>) {
        let result = match commit {
            Ok(()) => self.result,
            Err(e) => Err(e.clone()),
        };
        let _ = self.reply.send(result);
    }
}

fn pending<T: Send + 'static>(reply: Reply<T>, result: Result<T, StoreError>) -> Box<dyn Deliver> {
    Box::new(Pending { reply, result })
}

/// The writing connection and what goes with every commit. The writer thread and callers
/// committing in place take turns at it.
pub(super) struct Committer {
    /// The only connection that writes.
    pub(super) conn: Connection,
    /// Checked before and after every commit: a commit into files the paths no longer name is
    /// lost.
    files: Arc<DatabaseFiles>,
    /// Nudges the checkpointer every [`CHECKPOINT_EVERY`] commits.
    checkpoint: std_mpsc::SyncSender<()>,
    commits: u32,
    /// Commits made by callers on their own thread rather than by the writer thread.
    pub(super) in_place: u64,
    /// When the last commit ended: what tells an idle store from a busy one.
    pub(super) last_commit: Instant,
    /// Results held until the commit, kept between commits for its capacity.
    done: Vec<Box<dyn Deliver>>,
}

impl Committer {
    pub(super) fn new(conn: Connection, files: Arc<DatabaseFiles>, checkpoint: std_mpsc::SyncSender<()>) -> Committer {
        Committer { conn, files, checkpoint, commits: 0, in_place: 0, last_commit: Instant::now(), done: Vec::new() }
    }

    /// Commits every write of `batch` in one transaction (leaving `batch` empty) and answers
    /// each.
    pub(super) fn commit(&mut self, batch: &mut Vec<Write>) {
        self.commits = self.commits.wrapping_add(1);
        if self.commits.is_multiple_of(CHECKPOINT_EVERY) {
            let _ = self.checkpoint.try_send(());
        }
        let commit = match self.files.check() {
            Ok(()) => {
                let (began, writes) = (Instant::now(), batch.len());
                let commit = commit_batch(&mut self.conn, batch, &mut self.done, &self.files);
                crate::observe::metrics::store_commit(began.elapsed(), writes);
                commit
            }
            Err(lost) => probe_batch(&mut self.conn, batch, &mut self.done, &self.files, lost),
        };
        // A commit into a file that the path no longer names is as good as lost: its writers
        // hear so before anything is sent upstream on the strength of it.
        let commit = commit.and_then(|()| self.files.verify());
        for d in self.done.drain(..) {
            d.deliver(&commit);
        }
        self.last_commit = Instant::now();
    }

    /// Puts the connection back in order after a commit panicked halfway (on a caller's thread):
    /// its transaction rolled back, so that the next one can begin, and its held results
    /// dropped, so that their writers hear the writer stopped.
    pub(super) fn recover(&mut self) {
        tracing::error!("a sqlite commit panicked; its writes are rolled back and refused");
        if !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        self.done.clear();
    }
}

/// Runs `sql`, one statement without parameters, prepared once per connection: `BEGIN` and
/// `COMMIT` come with every batch, and parsing them each time took about 1 % of the runtime
/// threads' samples at c=8.
fn run(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(drop)
}

/// Applies every write of `batch` in one transaction, leaving each one's result in `done`. An
/// I/O failure on the way loses the store's files.
fn commit_batch(
    conn: &mut Connection,
    batch: &mut Vec<Write>,
    done: &mut Vec<Box<dyn Deliver>>,
    files: &DatabaseFiles,
) -> Result<(), StoreError> {
    let failed = |e: rusqlite::Error, what: &str| {
        if io_failure(&e) {
            files.lose(format!("{what} of the SQLite database failed: {e}"))
        } else {
            StoreError::from(e)
        }
    };
    if let Err(e) = run(conn, "BEGIN IMMEDIATE") {
        let e = failed(e, "a transaction");
        done.extend(batch.drain(..).map(|w| fail(w, &e)));
        return Err(e);
    }
    let mut writes = batch.drain(..);
    while let Some(write) = writes.next() {
        done.push(apply(conn, write));
        if conn.is_autocommit() {
            // SQLite rolls the whole transaction back on some errors (I/O, a full disk): the
            // writes before this one are undone, and the rest must not run outside it.
            let e = files.lose("SQLite rolled a transaction back (an I/O error or a full disk)".into());
            done.extend(writes.map(|w| fail(w, &e)));
            return Err(e);
        }
    }
    run(conn, "COMMIT").map_err(|e| {
        let _ = conn.execute_batch("ROLLBACK");
        failed(e, "a commit")
    })
}

/// While the files are lost, runs only the probes in `batch`, and checkpoints after them: a
/// store lost to a failed checkpoint is back only when checkpoints work too. Every other write
/// is refused with `lost`.
fn probe_batch(
    conn: &mut Connection,
    batch: &mut Vec<Write>,
    done: &mut Vec<Box<dyn Deliver>>,
    files: &DatabaseFiles,
    lost: StoreError,
) -> Result<(), StoreError> {
    let (mut probes, refused): (Vec<Write>, Vec<Write>) = batch.drain(..).partition(|w| matches!(w, Write::Probe(..)));
    done.extend(refused.into_iter().map(|w| fail(w, &lost)));
    if probes.is_empty() {
        return Err(lost);
    }
    commit_batch(conn, &mut probes, done, files)?;
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
        .map_err(|e| StoreError::Unavailable(format!("a checkpoint of the SQLite database still fails: {e}")))
}
