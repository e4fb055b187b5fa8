-- One row per (tenant, key): the request as received, where it stands, its attempts and its answer.
CREATE TABLE records (
    id                   TEXT    PRIMARY KEY NOT NULL,
    tenant               TEXT    NOT NULL,
    key                  TEXT    NOT NULL,
    route                TEXT    NOT NULL,
    method               TEXT    NOT NULL,
    path                 TEXT    NOT NULL,
    query                TEXT    NOT NULL,
    fingerprint          BLOB    NOT NULL,
    request_headers      TEXT    NOT NULL,  -- JSON [[name, value], ...]
    request_body         BLOB    NOT NULL,
    state                TEXT    NOT NULL CHECK (state IN ('not_started', 'in_progress', 'done', 'unknown')),
    queued               INTEGER NOT NULL,  -- for not_started: is work waiting for a worker?
    deadline_at          INTEGER NOT NULL,  -- ms since the epoch, as are all times here
    lease_owner          TEXT,
    lease_expires_at     INTEGER,
    in_flight_number     INTEGER,           -- the attempt that may have been sent, outcome unrecorded
    in_flight_started_at INTEGER,
    attempts             TEXT    NOT NULL DEFAULT '[]',
    stop_reason          TEXT,
    response_status      INTEGER,
    response_headers     TEXT,
    response_body        BLOB,
    history              TEXT    NOT NULL DEFAULT '[]',
    cancel_requested     INTEGER NOT NULL DEFAULT 0,
    probe_count          INTEGER NOT NULL DEFAULT 0,
    next_probe_at        INTEGER,
    created_at           INTEGER NOT NULL,
    updated_at           INTEGER NOT NULL,
    done_at              INTEGER,
    UNIQUE (tenant, key)
);

-- The retention sweep.
CREATE INDEX records_done ON records (done_at) WHERE state = 'done';
-- Work to pick up: queued records, and leases to take over.
CREATE INDEX records_queued ON records (created_at) WHERE state = 'not_started' AND queued = 1;
CREATE INDEX records_leases ON records (lease_expires_at) WHERE state = 'in_progress';
-- The reconciliation queue: unknown records, oldest first, and their next probe.
CREATE INDEX records_unknown ON records (next_probe_at, created_at) WHERE state = 'unknown';
-- Operator listings, newest first, by state.
CREATE INDEX records_listing ON records (created_at, id);
CREATE INDEX records_listing_by_state ON records (state, created_at, id);
