-- rate-window's tables. Every row belongs to one partition of the rate command
-- topic (sluice_partition of the rate key); an owner loads and writes only its
-- partitions' rows, fenced by `owners.epoch`.

-- One row per window: an inline limit (tenant, name, unique_key) with the
-- limit and length of the latest job that used it, or a stored resource.
CREATE TABLE windows (
    window_key   text    PRIMARY KEY,
    partition    integer NOT NULL,
    tenant       text    NOT NULL,
    name         text,
    unique_key   text,
    resource_key text,
    rate_limit   bigint  NOT NULL,
    window_ms    bigint  NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX windows_by_partition ON windows (partition);

-- Granted units per millisecond: what a restart restores, so a restart never
-- resets a window. Rows older than the window are pruned.
CREATE TABLE window_grants (
    window_key text   NOT NULL,
    at_ms      bigint NOT NULL,
    units      bigint NOT NULL,
    PRIMARY KEY (window_key, at_ms)
);

-- Rate tickets: waiting in a window's queue, or granted recently (kept for
-- a retention period so a duplicate acquire re-sends its grant instead of
-- taking units twice).
CREATE TABLE tickets (
    job_id              text     NOT NULL,
    attempt             integer  NOT NULL,
    step                integer  NOT NULL,
    partition           integer  NOT NULL,
    window_key          text     NOT NULL,
    granted             boolean  NOT NULL,
    priority            smallint NOT NULL,
    enqueued_at_us      bigint   NOT NULL,
    cost                bigint   NOT NULL,
    waiting_since_ms    bigint   NOT NULL,
    position_at_enqueue integer  NOT NULL,
    granted_at_ms       bigint,
    unthrottled         boolean  NOT NULL DEFAULT false,
    traceparent         text     NOT NULL DEFAULT '',
    tracestate          text     NOT NULL DEFAULT '',
    PRIMARY KEY (job_id, attempt, step)
);
CREATE INDEX tickets_by_partition ON tickets (partition);
CREATE INDEX tickets_granted ON tickets (partition, granted_at_ms) WHERE granted;

-- Stored rate-limit resources, referenced by jobs as `rate_limit_key`.
CREATE TABLE resources (
    tenant         text    NOT NULL,
    resource_key   text    NOT NULL,
    partition      integer NOT NULL,
    max_count      bigint  NOT NULL,
    window_seconds bigint  NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, resource_key)
);
CREATE INDEX resources_by_partition ON resources (partition);
