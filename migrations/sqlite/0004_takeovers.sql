-- How many times the record's expired lease was taken over: a record whose worker keeps dying on
-- it (one that crashes the process, say) stops being continued past `worker.max_takeovers`.
ALTER TABLE records ADD COLUMN takeovers INTEGER NOT NULL DEFAULT 0;
