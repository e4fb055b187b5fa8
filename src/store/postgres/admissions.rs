//! New keys, admitted together. Each admission alone costs PostgreSQL a statement to parse,
//! execute, commit and answer; under load the new keys waiting at the same moment go in as one
//! `INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING`, one statement and one commit for all
//! of them. Whatever that insert did not take — a key that has a record already, the same key
//! twice in one batch, a batch that failed — goes the one-row way ([`admit`]), which
//! decides takeovers and reads the record that refused it.

use std::sync::LazyLock;

use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::lanes::{Lanes, Reply, LANES, MAX_BATCH};
use super::rows::{record_id, COLUMNS};
use crate::domain::Phase;
use crate::store::{decode, span_ms, Admission, Admit, Fresh, LeaseClock, NewRecord, Overwrite, StoreError};

struct Pending {
    admit: Admit,
    reply: Reply<Admission>,
}

pub(super) struct Admissions {
    lanes: Lanes<Pending>,
}

impl Admissions {
    pub(super) fn start(pool: PgPool, clock: LeaseClock) -> Admissions {
        Admissions { lanes: Lanes::start(LANES, MAX_BATCH, move |batch| admit_all(pool.clone(), clock, batch)) }
    }

    pub(super) async fn admit(&self, admit: Admit) -> Result<Admission, StoreError> {
        self.lanes.ask(|reply| Pending { admit, reply }).await
    }
}

async fn admit_all(pool: PgPool, clock: LeaseClock, mut batch: Vec<Pending>) {
    // Alone, it goes the one-row way at once: the same statement count as without batching,
    // and a key that exists is not tried twice.
    if batch.len() == 1 {
        let pending = batch.remove(0);
        let _ = pending.reply.send(admit(&pool, clock, pending.admit).await);
        return;
    }
    let inserted = insert_fresh(&pool, clock, &mut batch).await;
    for pending in batch {
        match &inserted {
            Ok(ids) if ids.contains(&pending.admit.new.id.0) => {
                let _ = pending.reply.send(Ok(Admission::Created(pending.admit.new.inserted())));
            }
            // Not inserted, or the batch failed: the one-row way decides, with its own error if
            // it has one. It runs beside the lane so that the next batch need not wait for it.
            _ => {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let _ = pending.reply.send(admit(&pool, clock, pending.admit).await);
                });
            }
        }
    }
}

/// The fresh inserts of one statement, queued or claimed as each asks (as the one-row admission
/// inserts them); keys that have a record already are left alone. The ids it inserted.
async fn insert_fresh(pool: &PgPool, clock: LeaseClock, batch: &mut [Pending]) -> Result<Vec<Uuid>, StoreError> {
    // In one order in every batch, so that two batches inserting the same keys at once wait for
    // each other instead of deadlocking.
    batch
        .sort_unstable_by(|a, b| (&a.admit.new.tenant, &a.admit.new.key).cmp(&(&b.admit.new.tenant, &b.admit.new.key)));
    let news: Vec<&NewRecord> = batch.iter().map(|p| &p.admit.new).collect();
    let fresh: Vec<Fresh> = news.iter().map(|n| n.fresh()).collect();
    let headers = news.iter().map(|n| serde_json::to_string(&n.request.headers)).collect::<Result<Vec<_>, _>>()?;
    let ids: Vec<String> = sqlx::query_scalar(INSERT_FRESH)
        .bind(news.iter().map(|n| n.id).collect::<Vec<_>>())
        .bind(news.iter().map(|n| &n.tenant).collect::<Vec<_>>())
        .bind(news.iter().map(|n| &n.key).collect::<Vec<_>>())
        .bind(news.iter().map(|n| &n.route).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.method.as_str()).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.path.as_str()).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.query.as_str()).collect::<Vec<_>>())
        .bind(news.iter().map(|n| &n.fingerprint.as_bytes()[..]).collect::<Vec<_>>())
        .bind(headers)
        .bind(news.iter().map(|n| &n.request.body[..]).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.deadline_at).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.now).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.claim.as_ref().map(|c| &c.owner)).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.claim.as_ref().map(|c| span_ms(c.lease))).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.policy_version.as_ref()).collect::<Vec<_>>())
        .bind(fresh.iter().map(|f| f.state).collect::<Vec<_>>())
        .bind(fresh.iter().map(|f| f.queued).collect::<Vec<_>>())
        .bind(fresh.iter().map(|f| f.in_flight.map(|(number, _)| i64::from(number))).collect::<Vec<_>>())
        .bind(fresh.iter().map(|f| f.in_flight.map(|(_, at)| at)).collect::<Vec<_>>())
        .bind(fresh.iter().map(|f| f.claim.0).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.claim.as_ref().map(|c| span_ms(c.reach))).collect::<Vec<_>>())
        .bind(news.iter().map(|n| n.claim.as_ref().and_then(|c| clock.bind_now(c.marked_at))).collect::<Vec<_>>())
        .fetch_all(pool)
        .await?;
    ids.iter().map(|id| record_id(id)).collect()
}

const INSERT_FRESH: &str = "
INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint, request_headers,
                     request_body, state, queued, deadline_at, created_at, updated_at,
                     lease_owner, lease_expires_at, in_flight_number, in_flight_started_at,
                     policy_version, claim_token, in_flight_until)
SELECT id::uuid, tenant, key, route, method, path, query, fingerprint, headers::jsonb, body,
       state, queued, deadline_at, now, now, owner, COALESCE(marked_at, idem_now()) + lease_ms,
       in_flight_number, in_flight_started_at, policy_version, claim_token,
       COALESCE(marked_at, idem_now()) + reach_ms
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
            $8::bytea[], $9::text[], $10::bytea[], $11::int8[], $12::int8[], $13::text[], $14::int8[],
            $15::text[], $16::text[], $17::bool[], $18::int8[], $19::int8[], $20::int8[], $21::int8[],
            $22::int8[])
     AS fresh (id, tenant, key, route, method, path, query, fingerprint, headers, body,
               deadline_at, now, owner, lease_ms, policy_version, state, queued,
               in_flight_number, in_flight_started_at, claim_token, reach_ms, marked_at)
ON CONFLICT (tenant, key) DO NOTHING
RETURNING id::text";

/// How many times `admit` retries when the row it conflicted with changed before it could read
/// it. Each retry needs another request to change that very row in between; more than a few in a
/// row means something is wrong.
const ADMIT_TRIES: usize = 8;

/// Insert, or take over a key whose record is expired (`done` past retention) or free with the
/// same fingerprint, as [`Overwrite`] says (`$13`, `$26`–`$29`). `ON CONFLICT` locks the existing row before it evaluates the `WHERE`, so of
/// any number of concurrent admits one inserts or updates and the others see its result.
static ADMIT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint,
                              request_headers, request_body, state, queued, deadline_at,
                              created_at, updated_at, lease_owner, lease_expires_at,
                              in_flight_number, in_flight_started_at, policy_version, claim_token,
                              in_flight_until)
         VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10,
                 $19, $20, $11, $12, $12, $15::text, COALESCE($25::bigint, idem_now()) + $16::bigint,
                 $21::bigint, $22::bigint, $18::text, $23, COALESCE($25::bigint, idem_now()) + $24::bigint)
         ON CONFLICT (tenant, key) DO UPDATE SET
            id = CASE WHEN records.state = 'done' THEN excluded.id ELSE records.id END,
            attempts = CASE WHEN records.state = 'done' THEN '[]'::jsonb ELSE records.attempts END,
            history = CASE WHEN records.state = 'done' THEN '[]'::jsonb
                           ELSE records.history || $13::jsonb END,
            created_at = CASE WHEN records.state = 'done' THEN excluded.created_at
                              ELSE records.created_at END,
            takeovers = CASE WHEN records.state = 'done' THEN 0 ELSE records.takeovers END,
            policy_version = CASE WHEN records.state = 'done' THEN excluded.policy_version
                                  ELSE COALESCE(records.policy_version, excluded.policy_version) END,
            in_flight_until = CASE WHEN records.state = 'done' THEN NULL ELSE records.in_flight_until END,
            stream = NULL,
            route = excluded.route, method = excluded.method, path = excluded.path,
            query = excluded.query, fingerprint = excluded.fingerprint,
            request_headers = excluded.request_headers, request_body = excluded.request_body,
            state = CASE WHEN records.state = 'done' THEN $26 ELSE $28 END,
            queued = CASE WHEN records.state = 'done' THEN $27 ELSE $29 END,
            deadline_at = excluded.deadline_at,
            lease_owner = NULL, lease_expires_at = NULL, in_flight_number = NULL,
            in_flight_started_at = NULL, stop_reason = NULL, response_status = NULL,
            response_headers = NULL, response_body = NULL, done_at = NULL,
            cancel_requested = FALSE, probe_count = 0, next_probe_at = NULL, not_before = NULL,
            tombstone_until = NULL, updated_at = excluded.updated_at
         WHERE (records.state = 'done' AND records.done_at < COALESCE($14::bigint, idem_now() - $30::bigint)
                AND NOT ($31::bigint IS NOT NULL
                         AND records.done_at >= COALESCE($17::bigint, idem_now() - $31::bigint)
                         AND records.fingerprint = excluded.fingerprint))
            OR (records.state = 'not_started' AND NOT records.queued
                AND records.fingerprint = excluded.fingerprint)
         RETURNING {COLUMNS}"
    )
});

/// The record that refused an admit, and whether it has since become admissible (then the
/// admit is tried again rather than answered with a record that no longer refuses it).
static EXISTING: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {COLUMNS},
                COALESCE((state = 'done' AND done_at < COALESCE($3::bigint, idem_now() - $6::bigint)
                          AND NOT ($7::bigint IS NOT NULL
                                   AND done_at >= COALESCE($5::bigint, idem_now() - $7::bigint)
                                   AND fingerprint = $4))
                         OR (state = 'not_started' AND NOT queued AND fingerprint = $4),
                         FALSE) AS admissible
         FROM records WHERE tenant = $1 AND key = $2"
    )
});

pub(super) async fn admit(pool: &PgPool, clock: LeaseClock, admit: Admit) -> Result<Admission, StoreError> {
    let Admit { new, retention_cutoff } = admit;
    // A done record's age is judged in the store's clock, as its completion was stamped: the
    // cutoffs go as spans back from the server's time, or as the node's times where the store
    // keeps time in the node's clock.
    let (cutoff, retention) = (clock.bind_now(retention_cutoff), span_ms(new.now - retention_cutoff));
    let tombstone = new.tombstone_cutoff.map(|at| span_ms(new.now - at));
    let tombstone_cutoff = new.tombstone_cutoff.and_then(|at| clock.bind_now(at));
    let fresh = new.fresh();
    let Overwrite { replaced, requeued, entry } = Overwrite::at(new.now)?;
    let entry = serde_json::to_string(&[entry])?;
    let request_headers = serde_json::to_string(&new.request.headers)?;
    for _ in 0..ADMIT_TRIES {
        let row = sqlx::query(&ADMIT)
            .bind(new.id)
            .bind(&new.tenant)
            .bind(&new.key)
            .bind(&new.route)
            .bind(new.method.as_str())
            .bind(&new.path)
            .bind(&new.query)
            .bind(&new.fingerprint.as_bytes()[..])
            .bind(&request_headers)
            .bind(&new.request.body[..])
            .bind(new.deadline_at)
            .bind(new.now)
            .bind(&entry)
            .bind(cutoff)
            .bind(new.claim.as_ref().map(|c| &c.owner))
            .bind(new.claim.as_ref().map(|c| span_ms(c.lease)))
            .bind(tombstone_cutoff)
            .bind(new.policy_version.as_ref())
            .bind(fresh.state)
            .bind(fresh.queued)
            .bind(fresh.in_flight.map(|(number, _)| i64::from(number)))
            .bind(fresh.in_flight.map(|(_, at)| at))
            .bind(fresh.claim.0)
            .bind(new.claim.as_ref().map(|c| span_ms(c.reach)))
            .bind(new.claim.as_ref().and_then(|c| clock.bind_now(c.marked_at)))
            .bind(replaced.state())
            .bind(replaced == Phase::Queued)
            .bind(requeued.state())
            .bind(requeued == Phase::Queued)
            .bind(retention)
            .bind(tombstone)
            .fetch_optional(pool)
            .await?;
        if let Some(row) = row {
            // The row as this statement left it. Read back later, another worker of any node
            // might already have claimed a requeued record, which would pass for our own claim.
            let record = decode(&row)?;
            return Ok(if record.id == new.id { Admission::Created(record) } else { Admission::Requeued(record) });
        }
        // The key's record refused this request. Read it; it may have changed (or been swept)
        // since, in which case the insert decides again.
        let row = sqlx::query(&EXISTING)
            .bind(&new.tenant)
            .bind(&new.key)
            .bind(cutoff)
            .bind(&new.fingerprint.as_bytes()[..])
            .bind(tombstone_cutoff)
            .bind(retention)
            .bind(tombstone)
            .fetch_optional(pool)
            .await?;
        if let Some(row) = row {
            if !row.try_get::<bool, _>("admissible")? {
                return Ok(Admission::Existing(decode(&row)?));
            }
        }
    }
    Err(StoreError::Unavailable(format!("the record for key `{}` kept changing while it was admitted", new.key)))
}
