-- idem_end_attempts (0004) with one more argument: how each attempt's answer streamed, when it
-- did (SPEC §11), stored by the same update as the outcome rather than by a write of its own
-- before it. NULL keeps the record's `stream` as it is. The eleven-argument form stays, for nodes
-- of the previous version still running against this database.
CREATE FUNCTION idem_end_attempts(
    ids uuid[], owners text[], new_attempts jsonb[], states text[], stops text[], statuses integer[],
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
            state = states[i], queued = queueds[i],
            not_before = CASE WHEN queueds[i] THEN r.not_before ELSE not_befores[i] END,
            lease_owner = CASE WHEN states[i] = 'in_progress' THEN r.lease_owner END,
            lease_expires_at = CASE WHEN states[i] = 'in_progress' THEN r.lease_expires_at END,
            stop_reason = stops[i], response_status = statuses[i], response_headers = headers[i],
            response_body = bodies[i], done_at = CASE WHEN states[i] = 'done' THEN nows[i] END,
            stream = COALESCE(streams[i], r.stream),
            updated_at = nows[i]
        WHERE r.id = ids[i] AND r.state IS NOT DISTINCT FROM 'in_progress' AND r.lease_owner = owners[i]
        RETURNING r.cancel_requested INTO flag;
        IF FOUND THEN
            ended := ids[i];
            cancel_requested := flag;
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
