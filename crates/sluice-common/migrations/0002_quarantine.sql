-- Input that can never be applied, set aside instead of stopping a partition:
-- an internal message (or one entry of a batched one) that fails every time
-- it is applied (undecodable, invalid, refused by PostgreSQL). Its bytes and
-- the reason are kept here, an error is logged and sluice_quarantined_total
-- counts it; the partition goes on with the next input.
CREATE TABLE quarantine (
    id              bigserial PRIMARY KEY,
    topic           text        NOT NULL,
    partition       integer     NOT NULL,
    input_offset    bigint      NOT NULL,
    -- The entry's bytes (one entry of a batch message, or the whole message).
    entry           bytea       NOT NULL,
    reason          text        NOT NULL,
    quarantined_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX quarantine_by_time ON quarantine (quarantined_at);
