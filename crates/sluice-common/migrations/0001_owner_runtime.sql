-- The owner runtime's tables, created in each partition-owning service's schema.

-- One row per partition of the service's input topic: the fencing epoch (bumped
-- by every takeover; every batch commit re-checks it under this row's lock),
-- the owner directory entry, and the last input offset whose effects are saved.
CREATE TABLE owners (
    partition       integer PRIMARY KEY,
    epoch           bigint  NOT NULL,
    owner_id        text    NOT NULL,
    endpoint        text    NOT NULL,
    applied_offset  bigint  NOT NULL DEFAULT -1,
    owned_since     timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
