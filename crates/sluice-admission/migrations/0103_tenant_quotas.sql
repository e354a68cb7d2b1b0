-- Per-tenant quotas set at run time (SetTenantQuota): a NULL field falls back
-- to the configured default (admission.default_max_waiting,
-- admission.default_max_enqueues_per_second).
CREATE TABLE tenant_quotas (
    tenant                   text             PRIMARY KEY,
    max_waiting              bigint           CHECK (max_waiting >= 0),
    max_enqueues_per_second  double precision CHECK (max_enqueues_per_second >= 0),
    updated_at               timestamptz      NOT NULL DEFAULT now()
);
