-- Store protocol 3 (docs/operations.md#upgrading): what the guards on `records` mean changes
-- again, so a node of protocol 2 must not write at all.
--
-- * An outcome brings its record's bound (`in_flight_until`) down to its own time only when it
--   proves its request finished upstream: an answer of the upstream's own, or a request never
--   sent. An ambiguous one (a gateway's 504, a timeout, a cut connection) keeps the whole bound:
--   the request may still take effect within it.
-- * A probe's "not executed" is judged against the bound as of when the probe was sent, not as
--   of when it is written.
-- * A record keeps the policy it was admitted under: one whose policy a reload removed is not
--   replay-safe, whatever its route says now.
UPDATE idem_store SET protocol = 3;

DROP TRIGGER records_protocol_insert;
DROP TRIGGER records_protocol_update;

CREATE TRIGGER records_protocol_insert BEFORE INSERT ON records
    WHEN idem_store_protocol() IS NOT 3
BEGIN
    SELECT RAISE(ABORT, 'idem: this node does not speak store protocol 3: it may not write; stop it and run a version that speaks protocol 3 (idem migrate --status tells which)');
END;

CREATE TRIGGER records_protocol_update BEFORE UPDATE ON records
    WHEN idem_store_protocol() IS NOT 3
BEGIN
    SELECT RAISE(ABORT, 'idem: this node does not speak store protocol 3: it may not write; stop it and run a version that speaks protocol 3 (idem migrate --status tells which)');
END;
