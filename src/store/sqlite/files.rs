//! The files the SQLite store writes to, and whether they are still the ones it opened.
//!
//! SQLite writes through the descriptors it holds: a database file deleted or replaced under a
//! running broker still takes commits, into a file nobody will open again. After a restart the
//! records acknowledged since are gone, and their keys execute a second time. So the store
//! compares the device and inode behind its paths with those of the files it opened — after
//! every commit, before the commit's writers are answered, and on every health check — and
//! refuses every read and write once they differ, once the database can no longer be read and
//! written by this process, or once a write or a checkpoint fails with an I/O error.
//!
//! It resumes by itself only when the paths name its own files again (a file moved back,
//! permissions restored) and a probe write commits (a disk no longer full). A different file at
//! the path — a fresh one, or a copy restored from a backup — is never adopted: it may lack
//! records acknowledged before the loss, and serving from it would forget their keys and execute
//! them again. Opening it is the operator's decision, made by restarting the broker. Nor is a
//! missing database ever created afresh under a running broker, for the same reason.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::store::StoreError;

/// A file as the operating system knows it, whatever path names it. Public for the benchmark
/// that times the check after each commit (`benches/store.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    device: u64,
    inode: u64,
}

impl FileId {
    /// Asks for the inode alone, not the file's times as `std::fs::metadata` does. On Linux 6.13
    /// and later, a read of a file's change time makes the next write to it stamp a
    /// fine-grained one, where the file system keeps them; on ext4 without a journal the next
    /// `fdatasync` then writes the inode as well. The log is checked after every commit, so
    /// that was one more write to the disk in every commit's sync (docs/performance.md, "The
    /// file checks").
    #[cfg(all(target_os = "linux", any(target_env = "gnu", target_env = "musl")))]
    pub fn of(path: &Path) -> std::io::Result<FileId> {
        let c_path = c_path(path)?;
        // SAFETY: `statx` is plain integers, for which all zeroes is a valid value.
        let mut answer: libc::statx = unsafe { std::mem::zeroed() };
        // The system call itself, as the standard library makes it: glibc has a `statx` function
        // only from 2.28 on.
        // SAFETY: `c_path` is a valid NUL-terminated string and `answer` a buffer of the type the
        // call fills; both outlive the call.
        let result = unsafe {
            let flags: libc::c_int = 0;
            let answer: *mut libc::statx = &mut answer;
            libc::syscall(libc::SYS_statx, libc::AT_FDCWD, c_path.as_ptr(), flags, libc::STATX_INO, answer)
        };
        if result != 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                // A kernel before 4.11, or a sandbox that forbids the call.
                Some(libc::ENOSYS | libc::EPERM) => Self::of_metadata(path),
                _ => Err(e),
            };
        }
        if answer.stx_mask & libc::STATX_INO == 0 {
            return Self::of_metadata(path);
        }
        let device = libc::makedev(answer.stx_dev_major, answer.stx_dev_minor);
        Ok(FileId { device, inode: answer.stx_ino })
    }

    #[cfg(all(unix, not(all(target_os = "linux", any(target_env = "gnu", target_env = "musl")))))]
    pub fn of(path: &Path) -> std::io::Result<FileId> {
        Self::of_metadata(path)
    }

    #[cfg(unix)]
    fn of_metadata(path: &Path) -> std::io::Result<FileId> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path)?;
        Ok(FileId { device: meta.dev(), inode: meta.ino() })
    }

    /// Without inodes, only a missing file can be told apart.
    #[cfg(not(unix))]
    pub fn of(path: &Path) -> std::io::Result<FileId> {
        std::fs::metadata(path).map(|_| FileId { device: 0, inode: 0 })
    }
}

pub(super) struct DatabaseFiles {
    database: PathBuf,
    /// The write-ahead log, where commits land before a checkpoint copies them into the
    /// database: it must be the opened one as much as the database itself.
    wal: PathBuf,
    opened: FileId,
    /// Learnt when the log is first seen: SQLite creates it with the first connection.
    wal_opened: Mutex<Option<FileId>>,
    /// Checked before every read and write; `lost` says why it is false.
    available: AtomicBool,
    /// Why the store is lost, and what brings it back, as refusals report it.
    lost: Mutex<Option<String>>,
}

impl DatabaseFiles {
    /// The files at `database` (which the migrations have just opened) as they are now.
    pub(super) fn opened(database: &Path) -> Result<DatabaseFiles, StoreError> {
        let opened = FileId::of(database)
            .map_err(|e| StoreError::Unavailable(format!("cannot inspect {}: {e}", database.display())))?;
        let mut wal = database.as_os_str().to_owned();
        wal.push("-wal");
        let files = DatabaseFiles {
            database: database.to_path_buf(),
            wal: PathBuf::from(wal),
            opened,
            wal_opened: Mutex::new(None),
            available: AtomicBool::new(true),
            lost: Mutex::new(None),
        };
        // Not the log yet: another connection to the database, closing now (a broker restarted in
        // this process, a migration), may still delete it and leave the next one to SQLite. The
        // writer learns it once its own connection holds the database open (see `learn_log`).
        files.verify_database()?;
        Ok(files)
    }

    /// Called by the writer once its connection has read the database: from then on that
    /// connection keeps the log in place, so the log seen now is the store's own.
    pub(super) fn learn_log(&self) -> Result<(), StoreError> {
        self.verify()
    }

    /// Refuses work while the files are lost.
    pub(super) fn check(&self) -> Result<(), StoreError> {
        if self.available.load(Ordering::Acquire) {
            return Ok(());
        }
        let message = self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone();
        // Restored in between: this one call is refused all the same.
        Err(StoreError::Unavailable(message.unwrap_or_else(|| "the SQLite database was lost".into())))
    }

    pub(super) fn is_available(&self) -> bool {
        self.available.load(Ordering::Acquire)
    }

    /// Do the paths still name the opened files? Two calls that read each file's inode, cheap
    /// enough for every commit. A mismatch marks the files lost.
    pub(super) fn verify(&self) -> Result<(), StoreError> {
        self.verify_database()?;
        self.verify_log()
    }

    /// Does the path still name the opened database file? (Not yet the log: see `learn_log`.)
    pub(super) fn verify_database(&self) -> Result<(), StoreError> {
        let database = match FileId::of(&self.database) {
            Ok(id) if id == self.opened => None,
            Ok(_) => Some("was replaced by another file".to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some("was deleted".to_string()),
            Err(e) => Some(format!("cannot be inspected ({e})")),
        };
        match database {
            Some(what) => Err(self.lose(format!("the SQLite database {} {what}", self.database.display()))),
            None => Ok(()),
        }
    }

    fn verify_log(&self) -> Result<(), StoreError> {
        let mut wal_opened = self.wal_opened.lock().unwrap_or_else(|p| p.into_inner());
        let wal = match (FileId::of(&self.wal), *wal_opened) {
            (Ok(id), None) => {
                *wal_opened = Some(id);
                None
            }
            (Ok(id), Some(opened)) if id == opened => None,
            (Ok(_), Some(_)) => Some("was replaced by another file".to_string()),
            // Never seen: SQLite has not created it yet.
            (Err(e), None) if e.kind() == std::io::ErrorKind::NotFound => None,
            (Err(e), _) if e.kind() == std::io::ErrorKind::NotFound => Some("was deleted".to_string()),
            (Err(e), _) => Some(format!("cannot be inspected ({e})")),
        };
        drop(wal_opened);
        match wal {
            None => Ok(()),
            Some(what) => Err(self.lose(format!("the SQLite write-ahead log {} {what}", self.wal.display()))),
        }
    }

    /// Can this process still read and write the database? Its open descriptors would go on
    /// working after a `chmod`, but a restart would not, and an operator who took the rights
    /// away meant the broker to stop. Asked without opening the file: closing any descriptor of
    /// it would drop the locks SQLite holds on it.
    pub(super) fn verify_access(&self) -> Result<(), StoreError> {
        match accessible(&self.database) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.lose(format!(
                "the SQLite database {} can no longer be read and written by this process ({e})",
                self.database.display()
            ))),
        }
    }

    /// Marks the files lost for `reason` (the first reason of an outage is kept: it is the cause,
    /// what follows are its effects) and returns the error that refusals carry.
    pub(super) fn lose(&self, reason: String) -> StoreError {
        let mut lost = self.lost.lock().unwrap_or_else(|p| p.into_inner());
        let message = lost.get_or_insert_with(|| {
            let message = format!(
                "{reason}; reads and writes are refused until the store's own files are back and take a write \
                 (a different file at the path is never adopted: restarting the broker opens it)"
            );
            StoreError::Unavailable(message.clone()).log("the SQLite store is lost: new requests are refused");
            message
        });
        self.available.store(false, Ordering::Release);
        StoreError::Unavailable(message.clone())
    }

    /// The files are the opened ones again and took a write.
    pub(super) fn restore(&self) {
        let mut lost = self.lost.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(message) = lost.take() {
            tracing::info!(was = %message, "the SQLite store is usable again");
        }
        self.available.store(true, Ordering::Release);
    }
}

#[cfg(unix)]
fn c_path(path: &Path) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path holds a NUL byte"))
}

#[cfg(unix)]
fn accessible(path: &Path) -> std::io::Result<()> {
    let path = c_path(path)?;
    // With the effective ids, as opening the file would be checked.
    // SAFETY: `path` is a valid NUL-terminated string that outlives the call, which only reads it.
    let answer = unsafe { libc::faccessat(libc::AT_FDCWD, path.as_ptr(), libc::R_OK | libc::W_OK, libc::AT_EACCESS) };
    if answer == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(unix))]
fn accessible(path: &Path) -> std::io::Result<()> {
    let meta = std::fs::metadata(path)?;
    if meta.permissions().readonly() {
        return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, "read-only"));
    }
    Ok(())
}

/// Does `e` say that the files can no longer be trusted with a commit? I/O errors, a full disk,
/// a file that cannot be opened or has become read-only or unreadable. Busy, constraint and
/// other statement errors concern one write, not the files.
pub(super) fn io_failure(e: &rusqlite::Error) -> bool {
    use rusqlite::ErrorCode::*;
    matches!(
        e.sqlite_error_code(),
        Some(SystemIoFailure | DiskFull | CannotOpen | ReadOnly | DatabaseCorrupt | NotADatabase)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqlite_files(dir: &Path) -> (PathBuf, DatabaseFiles) {
        let path = dir.join("idem.db");
        std::fs::write(&path, b"").unwrap();
        let files = DatabaseFiles::opened(&path).unwrap();
        (path, files)
    }

    #[test]
    fn a_deleted_or_replaced_database_is_lost_and_only_its_own_file_brings_it_back() {
        let dir = tempfile::TempDir::new().unwrap();
        let (path, files) = sqlite_files(dir.path());
        assert!(files.verify().is_ok() && files.check().is_ok());

        let aside = dir.path().join("aside.db");
        std::fs::rename(&path, &aside).unwrap();
        let e = files.verify().unwrap_err().to_string();
        assert!(e.contains("was deleted"), "{e}");
        assert!(files.check().is_err(), "refused until restored");

        // A fresh file at the path is someone else's.
        std::fs::write(&path, b"").unwrap();
        assert!(files.verify().is_err());
        std::fs::remove_file(&path).unwrap();

        std::fs::rename(&aside, &path).unwrap();
        assert!(files.verify().is_ok(), "its own file again");
        assert!(files.check().is_err(), "verified, but restored only after a write commits");
        files.restore();
        assert!(files.check().is_ok());
    }

    #[test]
    fn a_replaced_write_ahead_log_is_lost_too() {
        let dir = tempfile::TempDir::new().unwrap();
        let (path, files) = sqlite_files(dir.path());
        let wal = dir.path().join("idem.db-wal");
        std::fs::write(&wal, b"").unwrap();
        // Held open, as SQLite holds it: its inode cannot be reused by the file made next.
        let _held = std::fs::File::open(&wal).unwrap();
        assert!(files.verify().is_ok(), "first seen");
        std::fs::remove_file(&wal).unwrap();
        std::fs::write(&wal, b"").unwrap();
        let e = files.verify().unwrap_err().to_string();
        assert!(e.contains("write-ahead log") && e.contains("replaced"), "{e}");
        assert!(path.exists());
    }

    #[test]
    #[cfg(unix)]
    fn a_file_is_named_by_the_device_and_inode_a_full_stat_gives() {
        // Where the inode-only call is refused, the full one answers: the two must agree, or a
        // store would take its own file for a replaced one.
        let dir = tempfile::TempDir::new().unwrap();
        let (one, other) = (dir.path().join("one"), dir.path().join("other"));
        std::fs::write(&one, b"").unwrap();
        std::fs::write(&other, b"").unwrap();
        assert_eq!(FileId::of(&one).unwrap(), FileId::of_metadata(&one).unwrap());
        assert_ne!(FileId::of(&one).unwrap(), FileId::of(&other).unwrap());
        let missing = FileId::of(&dir.path().join("missing")).unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
    }

    #[test]
    fn the_first_reason_of_an_outage_is_the_one_kept() {
        let dir = tempfile::TempDir::new().unwrap();
        let (_, files) = sqlite_files(dir.path());
        files.lose("the disk is full".into());
        files.lose("a checkpoint failed".into());
        assert!(files.check().unwrap_err().to_string().contains("the disk is full"));
    }
}
