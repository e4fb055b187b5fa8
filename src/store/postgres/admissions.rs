//! New keys, admitted together. Each admission alone costs PostgreSQL a statement to parse,
//! execute, commit and answer; under load the new keys waiting at the same moment go in as one
//! `INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING`, one statement and one commit for all
//! of them. Whatever that insert did not take — a key that has a record already, the same key
//! twice in one batch, a batch that failed — goes the one-row way ([`super::admit`]), which
//! decides takeovers and reads the record that refused it.

use sqlx::PgPool;
use uuid::Uuid;

use super::lanes::{Lanes, Reply};
use crate::record::Millis;
use crate::store::{Admission, NewRecord, StoreError};

/// The most admissions in one statement.
const MAX_BATCH: usize = 128;
/// Statements in flight at once.
const LANES: usize = 4;

struct Pending {
    new: NewRecord,
    cutoff: Millis,
    reply: Reply<Admission>,
}

pub(super) struct Admissions {
    lanes: Lanes<Pending>,
}

impl Admissions {
    pub(super) fn start(pool: PgPool) -> Admissions {
        Admissions { lanes: Lanes::start(LANES, MAX_BATCH, move |batch| admit_all(pool.clone(), batch)) }
    }

    pub(super) async fn admit(&self, new: NewRecord, cutoff: Millis) -> Result<Admission, StoreError> {
        self.lanes.ask(|reply| Pending { new, cutoff, reply }).await
    }
}

async fn admit_all(pool: PgPool, mut batch: Vec<Pending>) {
    // Alone, it goes the one-row way at once: the same statement count as without batching,
    // and a key that exists is not tried twice.
    if batch.len() == 1 {
        let pending = batch.remove(0);
        let _ = pending.reply.send(super::admit(&pool, pending.new, pending.cutoff).await);
        return;
    }
    let inserted = insert_fresh(&pool, &mut batch).await;
    for pending in batch {
        match &inserted {
            Ok(ids) if ids.contains(&pending.new.id) => {
                let _ = pending.reply.send(Ok(Admission::Created(pending.new.inserted())));
            }
            // Not inserted, or the batch failed: the one-row way decides, with its own error if
            // it has one. It runs beside the lane so that the next batch need not wait for it.
            _ => {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let _ = pending.reply.send(super::admit(&pool, pending.new, pending.cutoff).await);
                });
            }
        }
    }
}

/// The fresh inserts of one statement, queued or claimed as each asks (as the one-row admission
/// inserts them); keys that have a record already are left alone. The ids it inserted.
async fn insert_fresh(pool: &PgPool, batch: &mut [Pending]) -> Result<Vec<Uuid>, StoreError> {
    // In one order in every batch, so that two batches inserting the same keys at once wait for
    // each other instead of deadlocking.
    batch.sort_unstable_by(|a, b| (&a.new.tenant, &a.new.key).cmp(&(&b.new.tenant, &b.new.key)));
    let news: Vec<&NewRecord> = batch.iter().map(|p| &p.new).collect();
    let headers = news.iter().map(|n| serde_json::to_string(&n.request.headers)).collect::<Result<Vec<_>, _>>()?;
    let ids: Vec<String> = sqlx::query_scalar(INSERT_FRESH)
        .bind(news.iter().map(|n| n.id.to_string()).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.tenant.as_str()).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.key.as_str()).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.route.as_str()).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.method.as_str()).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.path.as_str()).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.query.as_str()).collect::<Vec<_>>())
        .bind(news.iter().map(|n| &n.fingerprint.as_bytes()[..]).collect::<Vec<_>>())
        .bind(headers)
        .bind(news.iter().map(|n| &n.request.body[..]).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.deadline_at).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.now).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.claim.as_ref().map(|c| c.owner.as_str())).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.claim.as_ref().map(|c| c.lease_until)).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.claim.as_ref().map(|c| c.policy_version.as_str())).collect::<Vec<_>>())
        .fetch_all(pool)
        .await?;
    ids.iter().map(|id| super::record_id(id)).collect()
}

const INSERT_FRESH: &str = "
INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint, request_headers,
                     request_body, state, queued, deadline_at, created_at, updated_at,
                     lease_owner, lease_expires_at, in_flight_number, in_flight_started_at,
                     policy_version)
SELECT id::uuid, tenant, key, route, method, path, query, fingerprint, headers::jsonb, body,
       CASE WHEN owner IS NULL THEN 'not_started' ELSE 'in_progress' END, owner IS NULL,
       deadline_at, now, now, owner, lease_until,
       CASE WHEN owner IS NULL THEN NULL ELSE 1 END, CASE WHEN owner IS NULL THEN NULL ELSE now END,
       policy_version
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
            $8::bytea[], $9::text[], $10::bytea[], $11::int8[], $12::int8[], $13::text[], $14::int8[],
            $15::text[])
     AS fresh (id, tenant, key, route, method, path, query, fingerprint, headers, body,
               deadline_at, now, owner, lease_until, policy_version)
ON CONFLICT (tenant, key) DO NOTHING
RETURNING id::text";
