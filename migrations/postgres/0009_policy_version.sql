-- The version of the policy (a digest of the route's effective retry policy) that the record's
-- latest attempt was sent under. Written with the attempt's "may have been sent" mark, before
-- it is sent, so that an attempt whose worker died before storing its outcome is still known by
-- its policy; every stored attempt also carries its own in the `attempts` JSON.
ALTER TABLE records ADD COLUMN policy_version TEXT;
