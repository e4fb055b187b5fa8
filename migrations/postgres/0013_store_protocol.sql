-- Store protocol 2 (docs/operations.md#upgrading): what the guards on `records` mean changes, so
-- a node that does not speak it must not write at all.
--
-- * Leases are set and compared in this server's clock (idem_now), never in a node's: a node
--   whose clock runs ahead can no longer take over a live lease.
-- * Every write that marks an attempt as about to be sent also sets `in_flight_until`: the time,
--   in this server's clock, after which no attempt marked so far can still reach the upstream.
--   Nothing frees a record whose attempt was marked (a probe's 404, an operator's
--   `not_executed` or retry) before it.
-- * A take-over is guarded by the attempt in flight it was decided on, as well as the lease.

CREATE FUNCTION idem_now() RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT (extract(epoch FROM statement_timestamp()) * 1000)::bigint
$$;

ALTER TABLE records ADD COLUMN in_flight_until bigint;

-- The store's protocol, one row. Every node reads it at start and refuses to run against one it
-- does not speak; each node's connections declare the protocol they speak (`idem.protocol`).
CREATE TABLE idem_store (protocol integer NOT NULL);
INSERT INTO idem_store (protocol) VALUES (2);

-- A write to `records` from a connection that does not declare protocol 2 (a node of an older
-- version still running, whose guards mean something else) is refused, loudly, rather than
-- left unguarded.
CREATE FUNCTION idem_refuse_other_protocol() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'idem: this node speaks store protocol %, but the store speaks protocol 2: it may not write; stop it and run a version that speaks protocol 2 (idem migrate --status tells which)',
        coalesce(current_setting('idem.protocol', true), '1 or older')
        USING ERRCODE = 'IM001';
END
$$;

CREATE TRIGGER records_protocol
    BEFORE INSERT OR UPDATE ON records
    FOR EACH ROW
    WHEN (current_setting('idem.protocol', true) IS DISTINCT FROM '2')
    EXECUTE FUNCTION idem_refuse_other_protocol();

-- idem_end_attempts (0012), ending the life of each outcome's attempt: its node saw it end, so
-- the record's bound need not run on past the outcome's time — unless the record was ever taken
-- over, when an attempt of an earlier claim may still be on its way and the bound covers it. (Any
-- time not later than the bound will do for an attempt that has ended: the node's serves.)
CREATE OR REPLACE FUNCTION idem_end_attempts(
    ids uuid[], tokens bigint[], new_attempts jsonb[], states text[], stops text[], statuses integer[],
    headers jsonb[], bodies bytea[], nows bigint[], queueds boolean[], not_befores bigint[],
    streams jsonb[]
) RETURNS TABLE (ended uuid, cancel_requested boolean)
LANGUAGE plpgsql AS $$
DECLARE
    flag boolean;
BEGIN
    FOR i IN 1 .. coalesce(array_length(ids, 1), 0) LOOP
        UPDATE records AS r SET
            attempts = r.attempts || COALESCE(new_attempts[i], '[]'::jsonb),
            in_flight_number = NULL, in_flight_started_at = NULL,
            in_flight_until = CASE WHEN new_attempts[i] IS NOT NULL AND r.takeovers = 0
                                        AND r.in_flight_until > nows[i]
                                   THEN nows[i] ELSE r.in_flight_until END,
            state = states[i], queued = queueds[i],
            not_before = CASE WHEN queueds[i] THEN r.not_before ELSE not_befores[i] END,
            lease_owner = CASE WHEN states[i] = 'in_progress' THEN r.lease_owner END,
            lease_expires_at = CASE WHEN states[i] = 'in_progress' THEN r.lease_expires_at END,
            stop_reason = stops[i], response_status = statuses[i], response_headers = headers[i],
            response_body = bodies[i], done_at = CASE WHEN states[i] = 'done' THEN nows[i] END,
            stream = COALESCE(streams[i], r.stream),
            updated_at = nows[i]
        WHERE r.id = ids[i] AND r.state IS NOT DISTINCT FROM 'in_progress' AND r.claim_token = tokens[i]
        RETURNING r.cancel_requested INTO flag;
        IF FOUND THEN
            ended := ids[i];
            cancel_requested := flag;
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;

-- Kept by 0004, 0011 and 0012 for nodes of earlier versions, which can no longer write.
DROP FUNCTION IF EXISTS idem_end_attempts(uuid[], text[], jsonb[], text[], text[], integer[], jsonb[], bytea[], bigint[], boolean[], bigint[]);
DROP FUNCTION IF EXISTS idem_end_attempts(uuid[], text[], jsonb[], text[], text[], integer[], jsonb[], bytea[], bigint[], boolean[], bigint[], jsonb[]);
