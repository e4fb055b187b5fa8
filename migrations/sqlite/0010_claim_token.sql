-- A fencing token per claim: each claim of a record (a claimed admission, a single or bulk claim)
-- adds one, and every write made under a claim is guarded by the token that claim was given, not
-- by the holder's name. A worker whose claim was taken over and given again (to another node or
-- to its own) is refused, whatever its name. Kept when the lease ends, so a late outcome and a
-- probe can still name the claim they answer for (docs/guarantees.md).
ALTER TABLE records ADD COLUMN claim_token INTEGER NOT NULL DEFAULT 0;
