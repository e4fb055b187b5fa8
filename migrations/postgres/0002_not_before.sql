-- When a record waits between attempts, the earliest time its next attempt may start, so that a
-- worker taking it over still honours the wait (and the upstream's Retry-After).
ALTER TABLE records ADD COLUMN not_before BIGINT;
