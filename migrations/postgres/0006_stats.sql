-- Answers the ingress gives from memory, replays and 409s, are counted in memory and added here in
-- batches: one row per second and route, summed by every node that shares the database.
CREATE TABLE answer_counts (
    second_start BIGINT NOT NULL,  -- ms since the epoch, a multiple of 1000
    route        TEXT   NOT NULL,
    replays      BIGINT NOT NULL DEFAULT 0,
    conflicts    BIGINT NOT NULL DEFAULT 0,  -- 409 request-in-progress
    PRIMARY KEY (second_start, route)
);

-- Records that went to the reconciliation queue (whether or not they have left it): the stats
-- rebuild the queue's depth over a window from them. Keyed on created_at, which writes never
-- change, rather than updated_at, which every write does: on PostgreSQL an index on it would
-- keep every update of a record from being a cheap heap-only one.
CREATE INDEX records_went_unknown ON records (created_at) WHERE stop_reason = 'unsafe_replay';
