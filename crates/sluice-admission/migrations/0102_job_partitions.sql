-- Admission owns job partitions (docs/hot-path.md): a partition's active jobs
-- live in its owner's memory. The job row is written once, at enqueue, and
-- never updated; what changes is journaled per committed batch, and a job
-- that ends gets an outcome row.

-- Due times live in memory now.
DROP INDEX IF EXISTS jobs_due;

-- How a job ended: written once, when it ends.
CREATE TABLE job_outcomes (
    job_id          text     PRIMARY KEY,
    status          smallint NOT NULL,
    attempt         integer  NOT NULL,
    attempts_used   integer  NOT NULL,
    step            integer  NOT NULL,
    admitted_at_ms  bigint,
    claimed_by      text,
    finished_at_ms  bigint   NOT NULL,
    cancel_reason   text,
    last_error      text     NOT NULL DEFAULT '',
    -- Encoded History: the recorded outcome of each ended attempt.
    history         bytea
);

-- One row per committed batch of a job partition: the changes of its jobs
-- (encoded JournalBatch). Rows up to the partition's snapshot are deleted
-- when the snapshot is written.
CREATE TABLE job_journal (
    partition  integer NOT NULL,
    seq        bigint  NOT NULL,
    epoch      bigint  NOT NULL,
    entry      bytea   NOT NULL,
    PRIMARY KEY (partition, seq)
);

-- Every active job of a partition as of batch `seq` (encoded Snapshot).
CREATE TABLE job_snapshots (
    partition  integer PRIMARY KEY,
    seq        bigint  NOT NULL,
    epoch      bigint  NOT NULL,
    state      bytea   NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now()
);
