-- Store protocol 3 (docs/operations.md#upgrading): what the guards on `records` mean changes
-- again, so a node of protocol 2 must not write at all.
--
-- * An outcome brings its record's bound (`in_flight_until`) down to its own time only when it
--   proves its request finished upstream (`ends`): an answer of the upstream's own, or a request
--   never sent. An ambiguous one (a gateway's 504, a timeout, a cut connection) keeps the whole
--   bound: the request may still take effect within it.
-- * A probe's "not executed" is judged against the bound as of when the probe was sent, in this
--   server's clock, not as of when it is written.
-- * A done record's completion (`done_at`) is stamped in this server's clock, where its retention
--   is judged: a node whose clock runs ahead no longer ends a record's retention early.
-- * A record keeps the policy it was admitted under: one whose policy a reload removed is not
--   replay-safe, whatever its route says now.

UPDATE idem_store SET protocol = 3;

CREATE OR REPLACE FUNCTION idem_refuse_other_protocol() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'idem: this node speaks store protocol %, but the store speaks protocol 3: it may not write; stop it and run a version that speaks protocol 3 (idem migrate --status tells which)',
        coalesce(current_setting('idem.protocol', true), '1 or older')
        USING ERRCODE = 'IM001';
END
$$;

DROP TRIGGER records_protocol ON records;
CREATE TRIGGER records_protocol
    BEFORE INSERT OR UPDATE ON records
    FOR EACH ROW
    WHEN (current_setting('idem.protocol', true) IS DISTINCT FROM '3')
    EXECUTE FUNCTION idem_refuse_other_protocol();

-- idem_end_attempts (0013), bringing the bound down only for an outcome that ends its attempt
-- (`ends`), and stamping the store's time (`clocks`: the node's when the store keeps leases in
-- it, else NULL for this server's own) on what it settles and on the bound it brings down.
CREATE FUNCTION idem_end_attempts(
    ids uuid[], tokens bigint[], new_attempts jsonb[], ends boolean[], states text[], stops text[],
    statuses integer[], headers jsonb[], bodies bytea[], nows bigint[], clocks bigint[],
    queueds boolean[], not_befores bigint[], streams jsonb[]
) RETURNS TABLE (ended uuid, cancel_requested boolean)
LANGUAGE plpgsql AS $$
DECLARE
    flag boolean;
    store_now bigint;
BEGIN
    FOR i IN 1 .. coalesce(array_length(ids, 1), 0) LOOP
        store_now := COALESCE(clocks[i], idem_now());
        UPDATE records AS r SET
            attempts = r.attempts || COALESCE(new_attempts[i], '[]'::jsonb),
            in_flight_number = NULL, in_flight_started_at = NULL,
            in_flight_until = CASE WHEN ends[i] AND r.takeovers = 0 AND r.in_flight_until > store_now
                                   THEN store_now ELSE r.in_flight_until END,
            state = states[i], queued = queueds[i],
            not_before = CASE WHEN queueds[i] THEN r.not_before ELSE not_befores[i] END,
            lease_owner = CASE WHEN states[i] = 'in_progress' THEN r.lease_owner END,
            lease_expires_at = CASE WHEN states[i] = 'in_progress' THEN r.lease_expires_at END,
            stop_reason = stops[i], response_status = statuses[i], response_headers = headers[i],
            response_body = bodies[i], done_at = CASE WHEN states[i] = 'done' THEN store_now END,
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

-- Protocol 2's form: its nodes can no longer write.
DROP FUNCTION idem_end_attempts(uuid[], bigint[], jsonb[], text[], text[], integer[], jsonb[], bytea[], bigint[], boolean[], bigint[], jsonb[]);
