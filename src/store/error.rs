//! What can go wrong with a store, from either backend.

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or refused the operation; nothing was changed.
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    /// A stored row could not be read back; a bug or a hand-edited database.
    #[error("a stored record is unreadable: {0}")]
    Corrupt(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) | sqlx::Error::ColumnNotFound(_) => {
                StoreError::Corrupt(e.to_string())
            }
            other => StoreError::Unavailable(other.to_string()),
        }
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        use rusqlite::Error::*;
        match e {
            FromSqlConversionFailure(..)
            | InvalidColumnType(..)
            | InvalidColumnName(_)
            | IntegralValueOutOfRange(..) => StoreError::Corrupt(e.to_string()),
            other => StoreError::Unavailable(other.to_string()),
        }
    }
}

impl From<serde_json::Error> for StoreError {
    fn from(e: serde_json::Error) -> Self {
        StoreError::Corrupt(e.to_string())
    }
}
