-- admission's tables. Admission owns no partitions: any instance serves any
-- job with conditional updates of its row (on status and attempt).

CREATE TABLE jobs (
    job_id              text     PRIMARY KEY,
    tenant              text     NOT NULL,
    task_group          text     NOT NULL,
    priority            smallint NOT NULL,
    -- sluice.v1.JobStatus
    status              smallint NOT NULL,
    -- Identity of the current attempt: tickets, claims, heartbeats and
    -- completions carry it. A hand-back starts a new attempt without using one up.
    attempt             integer  NOT NULL,
    attempts_used       integer  NOT NULL,
    max_attempts        integer  NOT NULL,
    -- Index into the acquisition chain of the step being acquired.
    step                integer  NOT NULL,
    chain_len           integer  NOT NULL,
    -- The acquisition chain, frozen at enqueue (encoded StoredChain).
    chain               bytea    NOT NULL,
    -- The request without its payload (encoded sluice.v1.JobRequest).
    spec                bytea    NOT NULL,
    payload             bytea    NOT NULL,
    -- sluice_partition(job_id) over the grant topic: which admission instance
    -- sweeps the job (the one assigned that grant partition).
    job_partition       integer  NOT NULL,
    lease_ms            bigint   NOT NULL,
    run_timeout_ms      bigint,
    enqueued_at_us      bigint   NOT NULL,
    run_at_ms           bigint,
    -- When the sweeper must look at the job next: run_at / backoff end
    -- (scheduled), re-send time (waiting), claim timeout (admitted), lease or
    -- run-time end (running). NULL once finished.
    due_at_ms           bigint,
    step_started_at_ms  bigint,
    admitted_at_ms      bigint,
    claimed_by          text,
    claimed_at_ms       bigint,
    lease_expires_at_ms bigint,
    finished_at_ms      bigint,
    cancel_reason       text,
    last_error          text     NOT NULL DEFAULT '',
    -- Encoded History: the recorded outcome of each ended attempt.
    history             bytea,
    idempotency_key     text,
    traceparent         text     NOT NULL DEFAULT '',
    tracestate          text     NOT NULL DEFAULT '',
    created_at          timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX jobs_due ON jobs (job_partition, due_at_ms) WHERE due_at_ms IS NOT NULL;

-- One row per (tenant, key) inside its window; an expired row may be taken over.
CREATE TABLE idempotency_keys (
    tenant          text   NOT NULL,
    idempotency_key text   NOT NULL,
    job_id          text   NOT NULL,
    expires_at_ms   bigint NOT NULL,
    PRIMARY KEY (tenant, idempotency_key)
);
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at_ms);
