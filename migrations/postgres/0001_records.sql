-- One row per (tenant, key): the request as received, where it stands, its attempts and its answer.
-- Times are milliseconds since the epoch, as in the SQLite store, so one Record type reads both.
CREATE TABLE records (
    id                   UUID    PRIMARY KEY,
    tenant               TEXT    NOT NULL,
    key                  TEXT    NOT NULL,
    route                TEXT    NOT NULL,
    method               TEXT    NOT NULL,
    path                 TEXT    NOT NULL,
    query                TEXT    NOT NULL,
    fingerprint          BYTEA   NOT NULL,
    request_headers      JSONB   NOT NULL,  -- [[name, value], ...]
    request_body         BYTEA   NOT NULL,
    state                TEXT    NOT NULL CHECK (state IN ('not_started', 'in_progress', 'done', 'unknown')),
    queued               BOOLEAN NOT NULL,  -- for not_started: is work waiting for a worker?
    deadline_at          BIGINT  NOT NULL,
    lease_owner          TEXT,
    lease_expires_at     BIGINT,
    in_flight_number     BIGINT,            -- the attempt that may have been sent, outcome unrecorded
    in_flight_started_at BIGINT,
    attempts             JSONB   NOT NULL DEFAULT '[]',
    stop_reason          TEXT,
    response_status      INTEGER,
    response_headers     JSONB,
    response_body        BYTEA,
    history              JSONB   NOT NULL DEFAULT '[]',
    cancel_requested     BOOLEAN NOT NULL DEFAULT FALSE,
    probe_count          INTEGER NOT NULL DEFAULT 0,
    next_probe_at        BIGINT,
    created_at           BIGINT  NOT NULL,
    updated_at           BIGINT  NOT NULL,
    done_at              BIGINT,
    UNIQUE (tenant, key)
);

-- The retention sweep.
CREATE INDEX records_done ON records (done_at) WHERE state = 'done';
-- Work to pick up: queued records, and leases to take over.
CREATE INDEX records_queued ON records (created_at) WHERE state = 'not_started' AND queued;
CREATE INDEX records_leases ON records (lease_expires_at) WHERE state = 'in_progress';
-- The reconciliation queue: unknown records, oldest first, and their next probe.
CREATE INDEX records_unknown ON records (next_probe_at, created_at) WHERE state = 'unknown';
-- Operator listings, oldest first, by state.
CREATE INDEX records_listing ON records (created_at, id);
CREATE INDEX records_listing_by_state ON records (state, created_at, id);

-- Every process sharing the database hears of records that stop being pending (in_progress or
-- queued), so requests waiting on them can answer, and of records queued, so an idle worker can
-- claim them. Lease renewals and attempt bookkeeping never change `state` or `queued`, so the
-- triggers below do not even fire for them; the WHEN clauses keep the function off the rest.
CREATE FUNCTION records_announce() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'not_started' AND NEW.queued THEN
        PERFORM pg_notify('idem_records', 'queued:' || NEW.id::text);
    ELSIF TG_OP = 'UPDATE' AND NEW.state <> 'in_progress' THEN
        PERFORM pg_notify('idem_records', 'settled:' || NEW.id::text);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER records_announce_insert
    AFTER INSERT ON records
    FOR EACH ROW
    WHEN (NEW.state = 'not_started' AND NEW.queued)
    EXECUTE FUNCTION records_announce();

-- Fires when a record becomes queued (from anything but queued), or stops being pending.
CREATE TRIGGER records_announce_update
    AFTER UPDATE OF state, queued ON records
    FOR EACH ROW
    WHEN ((NEW.state = 'not_started' AND NEW.queued AND NOT (OLD.state = 'not_started' AND OLD.queued))
       OR ((OLD.state = 'in_progress' OR (OLD.state = 'not_started' AND OLD.queued))
           AND NOT (NEW.state = 'in_progress' OR (NEW.state = 'not_started' AND NEW.queued))))
    EXECUTE FUNCTION records_announce();
