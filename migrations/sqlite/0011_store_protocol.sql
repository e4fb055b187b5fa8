-- Store protocol 2 (docs/operations.md#upgrading): what the guards on `records` mean changes, so
-- a node that does not speak it must not write at all.
--
-- * Every write that marks an attempt as about to be sent also sets `in_flight_until`: the time
--   after which no attempt marked so far can still reach the upstream. Nothing frees a record
--   whose attempt was marked (a probe's 404, an operator's `not_executed` or retry) before it.
-- * A take-over is guarded by the attempt in flight it was decided on, as well as the lease.
ALTER TABLE records ADD COLUMN in_flight_until INTEGER;

-- The store's protocol, one row. Every node reads it at start and refuses to run against one it
-- does not speak.
CREATE TABLE idem_store (protocol INTEGER NOT NULL);
INSERT INTO idem_store (protocol) VALUES (2);

-- Each node's writing connection declares the protocol it speaks through the SQL function
-- idem_store_protocol(). A node of an older version has no such function: its writes fail with
-- "no such function: idem_store_protocol"; a node of another protocol is refused by name. (So
-- does the connection migrations run on, which declares nothing: a later migration that writes
-- to `records` must drop these triggers first and make them again after.)
CREATE TRIGGER records_protocol_insert BEFORE INSERT ON records
    WHEN idem_store_protocol() IS NOT 2
BEGIN
    SELECT RAISE(ABORT, 'idem: this node does not speak store protocol 2: it may not write; stop it and run a version that speaks protocol 2 (idem migrate --status tells which)');
END;

CREATE TRIGGER records_protocol_update BEFORE UPDATE ON records
    WHEN idem_store_protocol() IS NOT 2
BEGIN
    SELECT RAISE(ABORT, 'idem: this node does not speak store protocol 2: it may not write; stop it and run a version that speaks protocol 2 (idem migrate --status tells which)');
END;
