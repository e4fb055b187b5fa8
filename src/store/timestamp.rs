//! Where a [`Timestamp`] crosses into a database and back: bound and read as the 64-bit integer
//! of milliseconds both schemas store, by sqlx (either backend) and by the SQLite writer's
//! rusqlite, so that no query converts by hand.

use rusqlite::types::{FromSql, FromSqlResult, ToSql, ToSqlOutput, ValueRef};
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgHasArrayType, PgTypeInfo};
use sqlx::{Database, Decode, Encode, Type};

use crate::domain::Timestamp;

impl<DB: Database> Type<DB> for Timestamp
where
    i64: Type<DB>,
{
    fn type_info() -> DB::TypeInfo {
        <i64 as Type<DB>>::type_info()
    }

    fn compatible(ty: &DB::TypeInfo) -> bool {
        <i64 as Type<DB>>::compatible(ty)
    }
}

impl<'q, DB: Database> Encode<'q, DB> for Timestamp
where
    i64: Encode<'q, DB>,
{
    fn encode_by_ref(&self, buf: &mut DB::ArgumentBuffer<'q>) -> Result<IsNull, BoxDynError> {
        self.as_millis().encode_by_ref(buf)
    }
}

impl<'r, DB: Database> Decode<'r, DB> for Timestamp
where
    i64: Decode<'r, DB>,
{
    fn decode(value: DB::ValueRef<'r>) -> Result<Timestamp, BoxDynError> {
        Ok(Timestamp::from_millis(i64::decode(value)?))
    }
}

impl PgHasArrayType for Timestamp {
    fn array_type_info() -> PgTypeInfo {
        <i64 as PgHasArrayType>::array_type_info()
    }
}

impl ToSql for Timestamp {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::from(self.as_millis()))
    }
}

impl FromSql for Timestamp {
    fn column_result(value: ValueRef<'_>) -> FromSqlResult<Timestamp> {
        i64::column_result(value).map(Timestamp::from_millis)
    }
}

/// A span as the queries add it to a stored time: whole milliseconds, capped.
pub(crate) fn span_ms(span: std::time::Duration) -> i64 {
    i64::try_from(span.as_millis()).unwrap_or(i64::MAX)
}
