-- Tickets journaled (docs/hot-path.md, step 4): a ticket is no longer a row
-- inserted, updated and deleted. Each committed batch of a partition adds one
-- journal row holding its ticket changes (an encoded TicketBatch), and a
-- snapshot of the partition's live tickets (an encoded TicketSnapshot)
-- replaces the journal rows up to it when the journal has outgrown it.
-- Loading a partition is its snapshot plus its journal in order. Both are
-- written only by the partition's owner, fenced by `owners.epoch`.
--
-- The `tickets` table stays for tickets an earlier version saved: a
-- partition without a snapshot starts from its rows, and its first snapshot
-- deletes them.

CREATE TABLE ticket_journal (
    partition integer NOT NULL,
    seq       bigint  NOT NULL,
    epoch     bigint  NOT NULL,
    entry     bytea   NOT NULL,
    PRIMARY KEY (partition, seq)
);

CREATE TABLE ticket_snapshots (
    partition integer PRIMARY KEY,
    seq       bigint  NOT NULL,
    epoch     bigint  NOT NULL,
    state     bytea   NOT NULL
);
