-- refresh-dispatcher's tables. Every row belongs to one partition of the
-- refresh-due topic (sluice_partition of tenant+key); an owner loads and
-- writes only its partitions' rows, fenced by `owners.epoch`.

-- One row per floating key that has had a refresh due: the schedule, the task
-- in flight (saved before it is published, so a new owner re-sends it with the
-- same id), the retry counter and backoff, and the newest value sent to
-- limit-grant (re-sent by a new owner; limit-grant applies a task's value once).
CREATE TABLE schedules (
    tenant                 text     NOT NULL,
    key                    text     NOT NULL,
    partition              integer  NOT NULL,
    current_max            bigint   NOT NULL,
    current_max_at_ms      bigint   NOT NULL,
    default_max            bigint   NOT NULL,
    refresh_interval_ms    bigint   NOT NULL,
    metadata               jsonb    NOT NULL DEFAULT '{}',
    last_due_at_ms         bigint   NOT NULL,
    in_flight_task_id      text,
    in_flight_attempt      integer,
    in_flight_issued_at_ms bigint,
    in_flight_deadline_ms  bigint,
    retry_count            integer  NOT NULL DEFAULT 0,
    retry_at_ms            bigint,
    last_refresh_at_ms     bigint,
    last_refresh_value     bigint,
    last_refresh_outcome   smallint,
    last_refresh_error     text,
    last_error             text     NOT NULL DEFAULT '',
    applied_task_id        text,
    applied_max            bigint,
    traceparent            text     NOT NULL DEFAULT '',
    tracestate             text     NOT NULL DEFAULT '',
    updated_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, key)
);
CREATE INDEX schedules_by_partition ON schedules (partition);
