//! Where a name (a tenant, a key, a route, a policy version, a lease's owner), a state, a
//! switch's scope and action, a record's id or a claim's token crosses into a database: bound as the text both schemas store, by
//! sqlx and by the SQLite writer's rusqlite, so that no query spells `.as_str()`. On PostgreSQL the text is written from the
//! name itself; sqlx's SQLite driver, which only reads here, takes its own copy.

use std::borrow::Cow;

use rusqlite::types::{ToSql, ToSqlOutput};
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgHasArrayType, PgTypeInfo, Postgres};
use sqlx::sqlite::{Sqlite, SqliteArgumentValue, SqliteTypeInfo};
use sqlx::{Encode, Type};

use crate::domain::key::IdempotencyKey;
use crate::domain::switch::{Scope, SwitchAction};
use crate::domain::{ClaimToken, Owner, PolicyVersion, RecordId, RouteName, State, Tenant};

macro_rules! bound_as_text {
    ($($name:ty),* $(,)?) => {$(
        impl Type<Postgres> for $name {
            fn type_info() -> PgTypeInfo {
                <&str as Type<Postgres>>::type_info()
            }

            fn compatible(ty: &PgTypeInfo) -> bool {
                <&str as Type<Postgres>>::compatible(ty)
            }
        }

        impl Encode<'_, Postgres> for $name {
            fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
                <&str as Encode<Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl PgHasArrayType for $name {
            fn array_type_info() -> PgTypeInfo {
                <&str as PgHasArrayType>::array_type_info()
            }
        }

        impl Type<Sqlite> for $name {
            fn type_info() -> SqliteTypeInfo {
                <&str as Type<Sqlite>>::type_info()
            }
        }

        impl<'q> Encode<'q, Sqlite> for $name {
            fn encode_by_ref(&self, buf: &mut Vec<SqliteArgumentValue<'q>>) -> Result<IsNull, BoxDynError> {
                buf.push(SqliteArgumentValue::Text(Cow::Owned(self.as_str().to_owned())));
                Ok(IsNull::No)
            }
        }

        impl ToSql for $name {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                Ok(ToSqlOutput::from(self.as_str()))
            }
        }
    )*};
}

bound_as_text!(Tenant, IdempotencyKey, RouteName, PolicyVersion, Owner, State, Scope, SwitchAction);

/// A value bound as the `$repr` both schemas store it as, made from it by `$value` (and, for
/// sqlx's SQLite driver, which only reads here, the argument `$sqlite`).
macro_rules! bound_as {
    ($name:ty as $repr:ty, |$it:ident| $value:expr, sqlite: $sqlite:expr) => {
        impl Type<Postgres> for $name {
            fn type_info() -> PgTypeInfo {
                <$repr as Type<Postgres>>::type_info()
            }

            fn compatible(ty: &PgTypeInfo) -> bool {
                <$repr as Type<Postgres>>::compatible(ty)
            }
        }

        impl Encode<'_, Postgres> for $name {
            fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
                let $it = self;
                <$repr as Encode<Postgres>>::encode($value, buf)
            }
        }

        impl PgHasArrayType for $name {
            fn array_type_info() -> PgTypeInfo {
                <$repr as PgHasArrayType>::array_type_info()
            }
        }

        impl Type<Sqlite> for $name {
            fn type_info() -> SqliteTypeInfo {
                <$repr as Type<Sqlite>>::type_info()
            }
        }

        impl<'q> Encode<'q, Sqlite> for $name {
            fn encode_by_ref(&self, buf: &mut Vec<SqliteArgumentValue<'q>>) -> Result<IsNull, BoxDynError> {
                let $it = self;
                buf.push($sqlite);
                Ok(IsNull::No)
            }
        }

        impl ToSql for $name {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                let $it = self;
                Ok(ToSqlOutput::from($value))
            }
        }
    };
}

// A record's id as the text of its UUID, as both schemas' statements take it (a PostgreSQL
// statement casts it where its column is `uuid`); a claim's token as the integer both store.
bound_as!(RecordId as String, |id| id.0.to_string(), sqlite: SqliteArgumentValue::Text(Cow::Owned(id.0.to_string())));
bound_as!(ClaimToken as i64, |token| token.0, sqlite: SqliteArgumentValue::Int64(token.0));
