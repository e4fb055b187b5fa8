//! Where log lines go: appended to a buffer that a thread of its own writes out in batches.
//!
//! A request that logs a line copies it under a lock and goes on. Nobody is woken per line: the
//! writer thread is woken by the first line after a quiet spell, gathers for [`GATHER`], and
//! writes everything in one call. Handing each line to a writer thread through a channel (as
//! `tracing-appender` does) costs a wake-up per line, and the woken thread spins before it
//! sleeps again: at two lines per new key, that thread alone took 26 µs of CPU per key at
//! concurrency 8, against 1 µs for this one.
//!
//! A writer that falls [`MAX_BUFFERED`] bytes behind (a stalled terminal or pipe) makes loggers
//! wait, but for the access log: a line per request gives way, dropped and counted
//! ([`access_lines_dropped`], `idem_access_lines_dropped_total`), rather than hold up the requests
//! it is about. Lines reach their destination within [`GATHER`] of being logged, or when the
//! [`Flushed`] guard is dropped; a process killed outright loses at most that much.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How long the writer thread gathers lines after the first of a batch.
pub const GATHER: Duration = Duration::from_millis(25);
/// Bytes buffered past which a logger waits for the writer thread.
pub const MAX_BUFFERED: usize = 8 << 20;
/// The longest an exit waits for the last lines to be written: a destination that takes
/// nothing (a stalled pipe) must not keep the process from ending.
const LAST_WRITE: Duration = Duration::from_secs(1);

/// The target of the access log's lines (`ingress::access`): the lines that give way.
pub const ACCESS_TARGET: &str = "idem::access";

/// Access lines dropped, since the process started, because the destination was behind.
static ACCESS_DROPPED: AtomicU64 = AtomicU64::new(0);

/// Access lines dropped since the process started because the destination was
/// [`MAX_BUFFERED`] bytes behind.
pub fn access_lines_dropped() -> u64 {
    ACCESS_DROPPED.load(Ordering::Relaxed)
}

/// A `MakeWriter` for `tracing-subscriber`: each line is appended to the shared buffer.
#[derive(Clone)]
pub struct Batched {
    shared: Arc<Shared>,
}

/// Keep it until exit: dropping it writes out what is buffered (waiting up to [`LAST_WRITE`])
/// and stops the writer thread.
#[must_use = "dropping the guard stops the log writer"]
pub struct Flushed {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Wakes the writer thread: a first line, a full buffer, or the end.
    work: Condvar,
    /// Wakes loggers waiting for room.
    room: Condvar,
}

#[derive(Default)]
struct State {
    lines: Vec<u8>,
    closed: bool,
    /// The writer thread has written its last batch.
    finished: bool,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held leaves whole lines or none: the buffer stays usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Starts the writer thread, which writes batches of lines to `sink`.
pub fn batched<W: Write + Send + 'static>(sink: W) -> std::io::Result<(Batched, Flushed)> {
    let shared = Arc::new(Shared { state: Mutex::default(), work: Condvar::new(), room: Condvar::new() });
    std::thread::Builder::new().name("idem-log-writer".into()).spawn({
        let shared = shared.clone();
        move || write_loop(&shared, sink)
    })?;
    Ok((Batched { shared: shared.clone() }, Flushed { shared }))
}

fn write_loop<W: Write>(shared: &Shared, mut sink: W) {
    let mut batch = Vec::new();
    loop {
        let mut state = shared.state();
        while state.lines.is_empty() && !state.closed {
            state = shared.work.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        if !state.closed && state.lines.len() < MAX_BUFFERED / 2 {
            // Let the batch gather; a full buffer or the end cuts the wait short.
            state = shared.work.wait_timeout(state, GATHER).unwrap_or_else(|p| p.into_inner()).0;
        }
        std::mem::swap(&mut batch, &mut state.lines);
        let closed = state.closed;
        drop(state);
        shared.room.notify_all();
        // Nowhere to report a failure to write a log line but the log itself.
        let _ = sink.write_all(&batch).and_then(|()| sink.flush());
        batch.clear();
        if closed {
            shared.state().finished = true;
            shared.room.notify_all();
            return;
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Batched {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Line<'a> {
        self.line(false)
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Line<'a> {
        self.line(meta.target() == ACCESS_TARGET)
    }
}

impl Batched {
    fn line(&self, gives_way: bool) -> Line<'_> {
        Line { shared: &self.shared, gives_way }
    }

    /// The writer of an access line: one that gives way.
    pub(crate) fn access_line(&self) -> Line<'_> {
        self.line(true)
    }
}

/// One event's writer: the formatter hands it the whole line in one `write_all`.
pub struct Line<'a> {
    shared: &'a Shared,
    /// Dropped, rather than waiting, when the buffer is full: an access line.
    gives_way: bool,
}

impl Write for Line<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let shared = self.shared;
        let mut state = shared.state();
        if self.gives_way && state.lines.len() >= MAX_BUFFERED && !state.closed {
            ACCESS_DROPPED.fetch_add(1, Ordering::Relaxed);
            shared.work.notify_one();
            return Ok(bytes.len());
        }
        while state.lines.len() >= MAX_BUFFERED && !state.closed {
            shared.work.notify_one();
            state = shared.room.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        let first = state.lines.is_empty();
        state.lines.extend_from_slice(bytes);
        drop(state);
        if first {
            shared.work.notify_one();
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Flushed {
    fn drop(&mut self) {
        let mut state = self.shared.state();
        state.closed = true;
        self.shared.work.notify_one();
        // A logger waiting for room behind a stalled destination goes on (its line is kept).
        self.shared.room.notify_all();
        let _ = self.shared.room.wait_timeout_while(state, LAST_WRITE, |s| !s.finished);
    }
}

/// An error and its causes in one line, for a log line, a problem's detail or a command's
/// message: each said once, so a wrapper that repeats its source (or that its source repeats)
/// is said in the longer of the two.
pub fn in_one_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut words: Vec<String> = Vec::new();
    let mut next = Some(error);
    while let Some(e) = next {
        let said = e.to_string();
        next = e.source();
        // Said already, by a wrapper or by an earlier cause: not again.
        if words.iter().any(|w| w.contains(&said)) {
            continue;
        }
        // A cause that says all its wrapper said and more replaces it.
        match words.last_mut() {
            Some(last) if said.contains(last.as_str()) => *last = said,
            _ => words.push(said),
        }
    }
    words.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tracing_subscriber::fmt::MakeWriter;

    /// A sink the test can read, and wait on, while the writer thread holds it.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>, Arc<Condvar>);

    impl Write for Sink {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            self.1.notify_all();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn every_line_from_every_thread_is_written_whole_and_in_each_threads_order() {
        let sink = Sink::default();
        let (writer, flushed) = batched(sink.clone()).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let writer = writer.clone();
                std::thread::spawn(move || {
                    for i in 0..2000 {
                        writer.make_writer().write_all(format!("thread {t} line {i}\n").as_bytes()).unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        drop(flushed);
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 8000);
        for t in 0..4 {
            let mine: Vec<usize> = text
                .lines()
                .filter_map(|l| l.strip_prefix(&format!("thread {t} line ")))
                .map(|n| n.parse().unwrap())
                .collect();
            assert_eq!(mine, (0..2000).collect::<Vec<_>>(), "thread {t}");
        }
    }

    #[test]
    fn a_line_is_written_within_the_gathering_time_without_a_flush() {
        let sink = Sink::default();
        let (writer, _flushed) = batched(sink.clone()).unwrap();
        writer.make_writer().write_all(b"one line\n").unwrap();
        let written = sink.1.wait_timeout_while(sink.0.lock().unwrap(), GATHER * 40, |s| s.is_empty()).unwrap().0;
        assert_eq!(&written[..], b"one line\n", "the line was never written");
    }

    /// A sink that takes nothing until it is opened, and tells when the writer thread has
    /// entered a write to it (holding a batch, stalled).
    #[derive(Clone)]
    struct Gate(Arc<(Mutex<bool>, Condvar)>, Sink, Arc<(Mutex<bool>, Condvar)>);

    impl Gate {
        fn new() -> Gate {
            Gate(Arc::default(), Sink::default(), Arc::default())
        }

        fn until_entered(&self) {
            let (entered, changed) = &*self.2;
            drop(changed.wait_while(entered.lock().unwrap(), |entered| !*entered).unwrap());
        }
    }

    impl Write for Gate {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            let (entered, changed) = &*self.2;
            *entered.lock().unwrap() = true;
            changed.notify_all();
            let (open, opened) = &*self.0;
            let _open = opened.wait_while(open.lock().unwrap(), |open| !*open).unwrap();
            self.1.write(bytes)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn behind_a_stalled_destination_access_lines_give_way_and_are_counted_while_others_wait() {
        let gate = Gate::new();
        let (writer, flushed) = batched(gate.clone()).unwrap();
        let line = vec![b'a'; 1 << 16];
        // The writer thread takes a first line and stalls on the destination with it: from
        // here on nothing leaves the buffer.
        writer.line(true).write_all(&line).unwrap();
        gate.until_entered();
        let before = access_lines_dropped();
        // Three times the bound of access lines: none waits, and what the buffer cannot hold is
        // dropped and counted.
        let logger = std::thread::spawn({
            let writer = writer.clone();
            let line = line.clone();
            move || {
                for _ in 0..3 * MAX_BUFFERED / line.len() {
                    writer.line(true).write_all(&line).unwrap();
                }
            }
        });
        let started = std::time::Instant::now();
        while !logger.is_finished() {
            assert!(started.elapsed() < Duration::from_secs(10), "an access line waited for the destination");
            std::thread::sleep(Duration::from_millis(5));
        }
        logger.join().unwrap();
        let dropped = access_lines_dropped() - before;
        assert_eq!(dropped, (2 * MAX_BUFFERED / line.len()) as u64, "the lines past the bound are counted");
        // Any other line still waits for room.
        let other = std::thread::spawn({
            let writer = writer.clone();
            move || writer.line(false).write_all(b"an error\n").unwrap()
        });
        std::thread::sleep(GATHER * 8);
        assert!(!other.is_finished(), "a line that does not give way went on past a full buffer");
        let (open, opened) = &*gate.0;
        *open.lock().unwrap() = true;
        opened.notify_all();
        other.join().unwrap();
        drop(flushed);
        let written = gate.1 .0.lock().unwrap();
        assert!(written.ends_with(b"an error\n"), "the waiting line was lost");
    }

    #[test]
    fn a_stalled_destination_makes_loggers_wait_past_the_bound_and_loses_nothing() {
        let gate = Gate::new();
        let (writer, flushed) = batched(gate.clone()).unwrap();
        let line = vec![b'x'; 1 << 16];
        let logger = std::thread::spawn({
            let writer = writer.clone();
            let line = line.clone();
            move || {
                // Three times the bound, with the destination stalled: one batch is held by the
                // stalled write, one fills the buffer, and the rest must wait.
                for _ in 0..(3 * MAX_BUFFERED / line.len()) {
                    writer.make_writer().write_all(&line).unwrap();
                }
            }
        });
        std::thread::sleep(GATHER * 8);
        assert!(!logger.is_finished(), "the logger went past the bound while nothing was written");
        assert!(writer.shared.state().lines.len() <= MAX_BUFFERED + line.len());
        let (open, opened) = &*gate.0;
        *open.lock().unwrap() = true;
        opened.notify_all();
        logger.join().unwrap();
        drop(flushed);
        assert_eq!(gate.1 .0.lock().unwrap().len(), 3 * MAX_BUFFERED);
    }

    #[test]
    fn a_destination_that_takes_nothing_does_not_keep_the_exit_waiting_past_its_bound() {
        let gate = Gate::new();
        let (writer, flushed) = batched(gate).unwrap();
        writer.make_writer().write_all(b"never written\n").unwrap();
        let started = Instant::now();
        let (dropped, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(flushed);
            let _ = dropped.send(());
        });
        assert!(ended.recv_timeout(LAST_WRITE * 5).is_ok(), "the exit waited on a destination that takes nothing");
        assert!(started.elapsed() >= LAST_WRITE, "the exit did not wait for the last write");
    }
}
