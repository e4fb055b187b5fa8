-- Emergency switches (SPEC §10): one row per switch ever set, kept after it is cleared, replaced
-- or expired, so the table is its own audit trail. A switch is active while it is not cleared
-- and its expiry (if any) is still ahead.
CREATE TABLE switches (
    id             TEXT    PRIMARY KEY,
    scope          TEXT    NOT NULL,  -- a route's name, or 'all'
    action         TEXT    NOT NULL,  -- retries_off | isolate | canary_off
    reason         TEXT    NOT NULL,
    actor          TEXT    NOT NULL,
    set_at         INTEGER NOT NULL,  -- ms since the epoch, as every time here
    expires_at     INTEGER,
    cleared_at     INTEGER,
    cleared_by     TEXT,
    cleared_reason TEXT,
    replaced_by    TEXT               -- the switch that replaced this one, if one did
);

-- Every node reads the uncleared switches twice a second; the history is read newest first.
CREATE INDEX switches_uncleared ON switches (scope, action) WHERE cleared_at IS NULL;
CREATE INDEX switches_history ON switches (set_at);
