//! The SQLite writer's rows and errors, as the store reads them: the writer drives SQLite through
//! rusqlite (see [`super::writer`]), whose rows [`decode`] reads through [`WriterRow`].

use crate::record::Record;
use crate::store::{decode, Columns, StoreError};

/// A rusqlite row, read by column name like any sqlx row.
pub(super) struct WriterRow<'a, 'r>(pub &'a rusqlite::Row<'r>);

impl Columns for WriterRow<'_, '_> {
    fn text(&self, name: &str) -> Result<Option<String>, StoreError> {
        Ok(self.0.get(name)?)
    }
    fn integer(&self, name: &str) -> Result<Option<i64>, StoreError> {
        Ok(self.0.get(name)?)
    }
    fn blob(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.0.get(name)?)
    }
    fn flag(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self.0.get(name)?)
    }
}

/// The record in a row the writer read.
pub(super) fn record(row: &rusqlite::Row<'_>) -> Result<Record, StoreError> {
    decode(&WriterRow(row))
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        use rusqlite::Error::*;
        match e {
            FromSqlConversionFailure(..)
            | InvalidColumnType(..)
            | InvalidColumnName(_)
            | IntegralValueOutOfRange(..) => StoreError::unreadable(e),
            other => StoreError::failed(other),
        }
    }
}
