//! The process's own limits, as they bear on the connections it can hold: the open-file limit is
//! raised as far as the system allows, and the default connection budget is derived from it.

/// File descriptors kept for everything but client connections and their upstream calls: the
/// store's files and connection pool, the listeners, the runtime's own, log files.
const RESERVED_FILES: u64 = 128;

/// The derived budget never goes past this, however many files are allowed: each open connection
/// holds buffers and a task, and tens of thousands of idle ones would hold real memory.
const MAX_DERIVED_CONNECTIONS: usize = 10_000;

/// Nor below this, on a system with very few files: a broker must take some clients.
const MIN_DERIVED_CONNECTIONS: usize = 16;

/// The open-file limit before and after [`raise_open_file_limit`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpenFiles {
    pub soft_before: u64,
    pub hard: u64,
    /// The soft limit in force now.
    pub soft: u64,
}

/// Raises the soft open-file limit to the hard one: the usual soft limit (1024) is meant for
/// interactive programs, and a proxy holds two descriptors per request in flight.
pub(crate) fn raise_open_file_limit() -> std::io::Result<OpenFiles> {
    let (soft_before, hard) = rlimit::getrlimit(rlimit::Resource::NOFILE)?;
    let soft = rlimit::increase_nofile_limit(hard)?;
    Ok(OpenFiles { soft_before, hard, soft })
}

/// The data listener's connection budget when the config sets none, like HAProxy's `maxconn`:
/// half the open files left once the reserve and the admin listener's budget are set aside,
/// because each client connection may hold one upstream connection as well.
pub(crate) fn derived_max_connections(open_files: u64, admin_connections: usize) -> usize {
    let spare = open_files.saturating_sub(RESERVED_FILES + admin_connections as u64) / 2;
    usize::try_from(spare).unwrap_or(usize::MAX).clamp(MIN_DERIVED_CONNECTIONS, MAX_DERIVED_CONNECTIONS)
}

/// Whether `connections` client connections (and as many upstream ones) fit in `open_files`
/// beside the reserve: when they do not, accepts and upstream calls will fail near the budget.
pub(crate) fn fits(connections: usize, admin_connections: usize, open_files: u64) -> bool {
    (2 * connections as u64).saturating_add(admin_connections as u64 + RESERVED_FILES) <= open_files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_budget_follows_the_open_file_limit() {
        // The common soft limit, when it cannot be raised: (1024 - 128 - 64) / 2.
        assert_eq!(derived_max_connections(1024, 64), 416);
        assert!(fits(416, 64, 1024) && !fits(417, 64, 1024));
        assert_eq!(derived_max_connections(1_048_576, 64), MAX_DERIVED_CONNECTIONS);
        assert_eq!(derived_max_connections(100, 64), MIN_DERIVED_CONNECTIONS);
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let files = raise_open_file_limit().unwrap();
        assert!(files.soft >= files.soft_before && files.soft <= files.hard.max(files.soft_before));
        assert_eq!(rlimit::getrlimit(rlimit::Resource::NOFILE).unwrap().0, files.soft);
    }
}
