//! What can go wrong with a store, from either backend.

use std::error::Error;
use std::sync::Arc;

/// A driver's error, kept as the source of a [`StoreError`]. Shared, because one failed commit
/// answers every write of its batch with the same error.
pub(super) type Cause = Arc<dyn Error + Send + Sync>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or refused the operation; nothing was changed.
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    /// As `Unavailable`, reported by the database driver, whose error is kept as the source.
    #[error("the store is unavailable: {what}")]
    Failed {
        what: String,
        #[source]
        cause: Cause,
    },
    /// The transition table refuses what a write would do to the record as it stands: another
    /// write got there first.
    #[error("the record changed meanwhile: {0}")]
    Refused(#[from] crate::record::Refused),
    /// A stored row could not be read back; a bug or a hand-edited database.
    #[error("a stored record is unreadable: {0}")]
    Corrupt(String),
    /// As `Corrupt`, found by the driver or the JSON decoder, whose error is kept as the source.
    #[error("a stored record is unreadable: {what}")]
    Unreadable {
        what: String,
        #[source]
        cause: Cause,
    },
}

impl StoreError {
    /// Whether the store could not be reached (and may be, later), rather than refusing what
    /// was asked of it.
    pub fn is_outage(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Failed { .. })
    }

    /// `Failed`, its text the cause's own.
    pub(crate) fn failed(cause: impl Error + Send + Sync + 'static) -> StoreError {
        StoreError::Failed { what: cause.to_string(), cause: Arc::new(cause) }
    }

    /// `Unreadable`, its text the cause's own.
    pub(crate) fn unreadable(cause: impl Error + Send + Sync + 'static) -> StoreError {
        StoreError::Unreadable { what: cause.to_string(), cause: Arc::new(cause) }
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) | sqlx::Error::ColumnNotFound(_) => {
                StoreError::unreadable(e)
            }
            other => StoreError::failed(other),
        }
    }
}

impl From<serde_json::Error> for StoreError {
    fn from(e: serde_json::Error) -> Self {
        StoreError::unreadable(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_error_reads_as_before_and_is_kept_as_the_source() {
        let e = StoreError::from(sqlx::Error::PoolTimedOut);
        assert_eq!(e.to_string(), format!("the store is unavailable: {}", sqlx::Error::PoolTimedOut));
        assert!(e.source().is_some_and(|s| s.to_string() == sqlx::Error::PoolTimedOut.to_string()));
        let e = StoreError::from(serde_json::from_str::<u32>("x").unwrap_err());
        assert!(e.to_string().starts_with("a stored record is unreadable: "), "{e}");
        assert!(e.source().is_some());
    }
}
