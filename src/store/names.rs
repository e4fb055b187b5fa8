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

/// A record's id is bound as the text of its UUID, as both schemas' statements take it (a
/// PostgreSQL statement casts it where its column is `uuid`).
impl Type<Postgres> for RecordId {
    fn type_info() -> PgTypeInfo {
        <String as Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <String as Type<Postgres>>::compatible(ty)
    }
}

impl Encode<'_, Postgres> for RecordId {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        <String as Encode<Postgres>>::encode(self.0.to_string(), buf)
    }
}

impl PgHasArrayType for RecordId {
    fn array_type_info() -> PgTypeInfo {
        <String as PgHasArrayType>::array_type_info()
    }
}

impl Type<Sqlite> for RecordId {
    fn type_info() -> SqliteTypeInfo {
        <String as Type<Sqlite>>::type_info()
    }
}

impl<'q> Encode<'q, Sqlite> for RecordId {
    fn encode_by_ref(&self, buf: &mut Vec<SqliteArgumentValue<'q>>) -> Result<IsNull, BoxDynError> {
        buf.push(SqliteArgumentValue::Text(Cow::Owned(self.0.to_string())));
        Ok(IsNull::No)
    }
}

impl ToSql for RecordId {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::from(self.0.to_string()))
    }
}

/// A claim's token is bound as the integer both schemas store.
impl Type<Postgres> for ClaimToken {
    fn type_info() -> PgTypeInfo {
        <i64 as Type<Postgres>>::type_info()
    }
}

impl Encode<'_, Postgres> for ClaimToken {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        <i64 as Encode<Postgres>>::encode(self.0, buf)
    }
}

impl PgHasArrayType for ClaimToken {
    fn array_type_info() -> PgTypeInfo {
        <i64 as PgHasArrayType>::array_type_info()
    }
}

impl Type<Sqlite> for ClaimToken {
    fn type_info() -> SqliteTypeInfo {
        <i64 as Type<Sqlite>>::type_info()
    }
}

impl<'q> Encode<'q, Sqlite> for ClaimToken {
    fn encode_by_ref(&self, buf: &mut Vec<SqliteArgumentValue<'q>>) -> Result<IsNull, BoxDynError> {
        buf.push(SqliteArgumentValue::Int64(self.0));
        Ok(IsNull::No)
    }
}

impl ToSql for ClaimToken {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::from(self.0))
    }
}
