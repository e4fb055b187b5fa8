-- A done record past its retention becomes a tombstone: its bodies and headers are dropped, its
-- tenant, key, fingerprint, final status and completion time stay until `tombstone_until`, so
-- that a late retry of the same request is answered 410 instead of being executed again.
ALTER TABLE records ADD COLUMN tombstone_until INTEGER;

-- The retention sweep reads live done records only: tombstones, the oldest done records of all,
-- must not stand in its way.
DROP INDEX records_done;
CREATE INDEX records_done ON records (done_at) WHERE state = 'done' AND tombstone_until IS NULL;
CREATE INDEX records_tombstones ON records (tombstone_until) WHERE tombstone_until IS NOT NULL;
