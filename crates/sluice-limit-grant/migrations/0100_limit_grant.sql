-- limit-grant's tables. Every row belongs to one partition of the limit
-- command topic (sluice_partition(tenant, key)); an owner loads and writes
-- only its partitions' rows, fenced by `owners.epoch`.

-- A ticket is one step of one attempt of one job on one key: either held
-- (counted against the key's max) or waiting in the key's queue.
CREATE TABLE tickets (
    job_id              text     NOT NULL,
    attempt             integer  NOT NULL,
    step                integer  NOT NULL,
    partition           integer  NOT NULL,
    tenant              text     NOT NULL,
    key                 text     NOT NULL,
    held                boolean  NOT NULL,
    priority            smallint NOT NULL,
    enqueued_at_us      bigint   NOT NULL,
    -- The job's own max (plain keys) or its floating default_max.
    job_max             integer  NOT NULL,
    floating            boolean  NOT NULL,
    waiting_since_ms    bigint   NOT NULL,
    position_at_enqueue integer  NOT NULL,
    granted_at_ms       bigint,
    traceparent         text     NOT NULL DEFAULT '',
    tracestate          text     NOT NULL DEFAULT '',
    PRIMARY KEY (job_id, attempt, step)
);
CREATE INDEX tickets_by_partition ON tickets (partition);
-- No index on (tenant, key): every write pays for an index, and only ListKeys
-- (an admin call over live tickets) would read it.

-- Per-key state that outlives tickets: runtime overrides and floating limits.
CREATE TABLE keys (
    tenant                       text    NOT NULL,
    key                          text    NOT NULL,
    partition                    integer NOT NULL,
    -- NULL: no override. 0 pauses the key.
    override_max                 integer,
    -- Floating limits: current max and the config of the job that created it.
    floating_max                 integer,
    floating_default_max         integer,
    floating_refresh_interval_ms bigint,
    floating_metadata            jsonb,
    -- When the last refresh-due event was sent and the last value applied.
    floating_last_due_ms         bigint,
    floating_last_set_ms         bigint,
    floating_last_task_id        text,
    updated_at                   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, key)
);
CREATE INDEX keys_by_partition ON keys (partition);
