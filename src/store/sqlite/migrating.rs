//! One node at a time migrates a SQLite file. Nodes started together on a fresh file would
//! otherwise read its protocol while another is halfway through creating the schema, or race it
//! to a migration. The lock is an advisory `flock` on the file's directory: SQLite's own locks
//! are `fcntl` locks on the file, which `flock` neither takes nor releases, and the directory
//! holds no file of the lock's own to leave behind.

use std::fs::File;
use std::path::Path;

use crate::store::StoreError;

/// Held while a node reads the file's protocol and migrates it; released when dropped.
pub(super) struct MigrationLock {
    _directory: File,
}

impl MigrationLock {
    /// Waits (on a thread of its own) until no other process migrates the database at `path`.
    pub(super) async fn take(path: &Path) -> Result<MigrationLock, StoreError> {
        let directory = match path.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(parent) => parent.to_path_buf(),
            None => Path::new(".").to_path_buf(),
        };
        let locked = tokio::task::spawn_blocking(move || lock(&directory))
            .await
            .map_err(|e| StoreError::Unavailable(format!("taking the migration lock: {e}")))?;
        locked.map(|directory| MigrationLock { _directory: directory })
    }
}

#[cfg(unix)]
fn lock(directory: &Path) -> Result<File, StoreError> {
    use std::os::fd::AsRawFd;
    let file = File::open(directory).map_err(|e| {
        StoreError::Unavailable(format!("cannot open {} to migrate the database in it: {e}", directory.display()))
    })?;
    // SAFETY: flock takes a descriptor this function owns, open for as long as the call.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(StoreError::Unavailable(format!("cannot lock {} to migrate: {e}", directory.display())));
    }
    Ok(file)
}

#[cfg(not(unix))]
fn lock(directory: &Path) -> Result<File, StoreError> {
    File::open(directory).map_err(|e| StoreError::Unavailable(format!("cannot open {}: {e}", directory.display())))
}
