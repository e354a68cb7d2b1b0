{{/*
A TOML float: Go prints 1.0 as "1", which TOML reads as an integer.
*/}}
{{- define "sluice.tomlFloat" -}}
{{- $text := printf "%v" (float64 .) }}
{{- if or (contains "." $text) (contains "e" $text) }}
{{- $text }}
{{- else }}
{{- printf "%s.0" $text }}
{{- end }}
{{- end }}

{{/*
The Sluice configuration file (TOML), layered by the binaries over their
built-in defaults and under SLUICE__SECTION__KEY environment variables.
Strings are written with toJson: a JSON string is a valid TOML basic string.

It holds no credential: the PostgreSQL URL and the Kafka SASL credentials
reach the containers only as environment variables from Secrets
(sluice.secretEnv); the TLS key, the internal token and the JWKS document
are files mounted from Secrets (sluice.secretVolumes), named here by path.
*/}}
{{- define "sluice.configToml" -}}
# Rendered by the Sluice Helm chart from values. Credentials are not in this
# file: SLUICE__POSTGRES__URL and SLUICE__KAFKA__SASL_USERNAME/_PASSWORD come
# from Secrets through the environment; the TLS key, the internal token and
# the JWKS document are files mounted from Secrets.

[postgres]
schema_prefix = {{ .Values.postgres.schemaPrefix | toJson }}
max_connections = {{ .Values.postgres.maxConnections | int64 }}
acquire_timeout = {{ .Values.postgres.acquireTimeout | toJson }}
{{- if .Values.migrations.enabled }}
# The migration hook Job runs `<service> migrate`; replicas never race it.
run_migrations = false
{{- else }}
# No migration hook Job: each service migrates at startup under the lock.
run_migrations = true
{{- end }}

[kafka]
brokers = {{ .Values.kafka.brokers | toJson }}
topic_prefix = {{ .Values.kafka.topicPrefix | toJson }}
{{- if .Values.topicsJob.enabled }}
# The topic hook Job runs `sluice topics ensure`.
create_topics = false
{{- else }}
# No topic hook Job: the services create missing topics at startup.
create_topics = true
{{- end }}
replication_factor = {{ .Values.kafka.replicationFactor | int64 }}
fetch_wait_max_ms = {{ .Values.kafka.fetchWaitMaxMs | int64 }}
linger_ms = {{ .Values.kafka.lingerMs | int64 }}
session_timeout_ms = {{ .Values.kafka.sessionTimeoutMs | int64 }}
max_message_bytes = {{ .Values.kafka.maxMessageBytes | int64 }}

[kafka.properties]
{{- $properties := deepCopy (.Values.kafka.properties | default dict) }}
{{- if .Values.kafka.securityProtocol }}
{{- $_ := set $properties "security.protocol" .Values.kafka.securityProtocol }}
{{- end }}
{{- if .Values.kafka.sasl.existingSecret }}
{{- $_ := set $properties "sasl.mechanisms" .Values.kafka.sasl.mechanism }}
{{- end }}
{{- range $key := keys $properties | sortAlpha }}
{{ $key | toJson }} = {{ index $properties $key | toString | toJson }}
{{- end }}

[kafka.partitions]
{{- with .Values.kafka.partitions }}
requested = {{ .requested | int64 }}
admitted = {{ .admitted | int64 }}
limit_commands = {{ .limitCommands | int64 }}
rate_commands = {{ .rateCommands | int64 }}
jobs = {{ .jobs | int64 }}
refresh_due = {{ .refreshDue | int64 }}
refresh_tasks = {{ .refreshTasks | int64 }}
deadletter = {{ .deadletter | int64 }}
{{- end }}

[topics]
{{- with .Values.topics }}
requested = {{ .requested | toJson }}
admitted_prefix = {{ .admittedPrefix | toJson }}
refresh_tasks = {{ .refreshTasks | toJson }}
deadletter = {{ .deadletter | toJson }}
limit_commands = {{ .limitCommands | toJson }}
rate_commands = {{ .rateCommands | toJson }}
jobs = {{ .jobs | toJson }}
refresh_due = {{ .refreshDue | toJson }}
{{- end }}

[telemetry]
{{- with .Values.telemetry }}
log_format = {{ .logFormat | toJson }}
log_level = {{ .logLevel | toJson }}
otlp_endpoint = {{ .otlpEndpoint | toJson }}
{{- if .otlpCa.existingSecret }}
otlp_ca_file = {{ include "sluice.otlpCaFile" $ | toJson }}
{{- end }}
sampling_ratio = {{ include "sluice.tomlFloat" .samplingRatio }}
key_metrics_top_n = {{ .keyMetrics.topN | int64 }}
key_metrics_patterns = {{ .keyMetrics.patterns | default list | toJson }}
{{- end }}
{{- if .Values.metrics.enabled }}
# The Prometheus scrape endpoint (GET /metrics) on the pods' metrics port.
metrics_listen = {{ printf "0.0.0.0:%d" (int .Values.metrics.port) | toJson }}
{{- else }}
# metrics.enabled is false: no scrape endpoint.
metrics_listen = ""
{{- end }}

# Partition owners (admission too: it owns the job partitions) advertise
# {{ ternary "https" "http" .Values.tls.enabled }}://$POD_IP:<port> (advertised_endpoint empty, listener on 0.0.0.0,
# POD_IP from the downward API).
[admission]
{{- with .Values.admission }}
listen = {{ printf "0.0.0.0:%d" (int .port) | toJson }}
advertised_endpoint = ""
consumer_group = {{ .config.consumerGroup | toJson }}
{{- end }}
# Any instance: a non-owner forwards to the key's owner.
limit_grant_endpoint = {{ include "sluice.componentEndpoint" (dict "root" . "component" "limit-grant") | toJson }}
rate_window_endpoint = {{ include "sluice.componentEndpoint" (dict "root" . "component" "rate-window") | toJson }}
{{- with .Values.admission.config }}
default_priority = {{ .defaultPriority | int64 }}
max_payload_bytes = {{ .maxPayloadBytes | int64 }}
max_limits_per_job = {{ .maxLimitsPerJob | int64 }}
max_key_bytes = {{ .maxKeyBytes | int64 }}
max_floating_metadata_bytes = {{ .maxFloatingMetadataBytes | int64 }}
default_idempotency_window = {{ .defaultIdempotencyWindow | toJson }}
{{- /* Unset: Sluice derives them from the session timeout. */}}
{{- if not (kindIs "invalid" .resendWaitingAfter) }}
resend_waiting_after = {{ .resendWaitingAfter | toJson }}
{{- end }}
{{- if not (kindIs "invalid" .claimTimeout) }}
claim_timeout = {{ .claimTimeout | toJson }}
{{- end }}
sweep_interval = {{ .sweepInterval | toJson }}
stand_behind_interval = {{ .standBehindInterval | toJson }}
max_batch = {{ .maxBatch | int64 }}
{{- end }}

[limit_grant]
{{- with .Values.limitGrant }}
listen = {{ printf "0.0.0.0:%d" (int .port) | toJson }}
advertised_endpoint = ""
consumer_group = {{ .config.consumerGroup | toJson }}
ticket_grace = {{ .config.ticketGrace | toJson }}
max_batch = {{ .config.maxBatch | int64 }}
{{- end }}

[rate_window]
{{- with .Values.rateWindow }}
listen = {{ printf "0.0.0.0:%d" (int .port) | toJson }}
advertised_endpoint = ""
consumer_group = {{ .config.consumerGroup | toJson }}
granted_retention = {{ .config.grantedRetention | toJson }}
max_batch = {{ .config.maxBatch | int64 }}
{{- end }}

[refresh_dispatcher]
{{- with .Values.refreshDispatcher }}
listen = {{ printf "0.0.0.0:%d" (int .port) | toJson }}
advertised_endpoint = ""
consumer_group = {{ .config.consumerGroup | toJson }}
max_batch = {{ .config.maxBatch | int64 }}
task_timeout = {{ .config.taskTimeout | toJson }}
initial_backoff = {{ .config.initialBackoff | toJson }}
max_backoff = {{ .config.maxBackoff | toJson }}
{{- end }}
{{- if .Values.console.enabled }}

# The web console reads the services through their Services.
[console]
{{- with .Values.console }}
listen = {{ printf "0.0.0.0:%d" (int .port) | toJson }}
tenants = {{ .config.tenants | default list | toJson }}
trace_url_template = {{ .config.traceUrlTemplate | toJson }}
refresh_interval = {{ .config.refreshInterval | toJson }}
chart_window = {{ .config.chartWindow | toJson }}
watch_kafka = {{ .config.watchKafka }}
consumer_group = {{ .config.consumerGroup | toJson }}
dead_letters_kept = {{ .config.deadLettersKept | int64 }}
{{- end }}
admission_endpoint = {{ include "sluice.componentEndpoint" (dict "root" . "component" "admission") | toJson }}
limit_grant_endpoint = {{ include "sluice.componentEndpoint" (dict "root" . "component" "limit-grant") | toJson }}
rate_window_endpoint = {{ include "sluice.componentEndpoint" (dict "root" . "component" "rate-window") | toJson }}
refresh_dispatcher_endpoint = {{ include "sluice.componentEndpoint" (dict "root" . "component" "refresh-dispatcher") | toJson }}
{{- end }}

[tls]
{{- if .Values.tls.enabled }}
{{- $dir := include "sluice.tlsDir" . }}
# Every gRPC server speaks only TLS; endpoints are https://. The files come
# from Secret {{ include "sluice.tlsSecretName" . | toJson }}{{ if .Values.tls.certManager.enabled }} (written by cert-manager){{ end }}.
cert_file = {{ printf "%s/tls.crt" $dir | toJson }}
key_file = {{ printf "%s/tls.key" $dir | toJson }}
{{- if .Values.tls.mutual }}
# Mutual TLS: clients need a certificate signed by ca.crt.
client_ca_file = {{ printf "%s/ca.crt" $dir | toJson }}
{{- else }}
client_ca_file = ""
{{- end }}
ca_file = {{ printf "%s/ca.crt" $dir | toJson }}
server_name = {{ include "sluice.tlsServerName" . | toJson }}
{{- else }}
# tls.enabled is false: plaintext gRPC.
cert_file = ""
key_file = ""
client_ca_file = ""
ca_file = ""
server_name = ""
{{- end }}
reload_interval = {{ .Values.tls.reloadInterval | toJson }}

[auth]
{{- with .Values.auth }}
enabled = {{ .enabled }}
{{- if .enabled }}
internal_token_file = {{ include "sluice.internalTokenFile" $ | toJson }}
{{- else }}
# auth.enabled is false: every caller may act on every tenant.
internal_token_file = ""
{{- end }}
{{- if and .enabled .jwks.existingSecret }}
jwks_file = {{ include "sluice.jwksFile" $ | toJson }}
{{- else }}
jwks_file = ""
{{- end }}
issuer = {{ .issuer | toJson }}
audience = {{ .audience | toJson }}
tenants_claim = {{ .tenantsClaim | toJson }}
roles_claim = {{ .rolesClaim | toJson }}
leeway = {{ .leeway | toJson }}
reload_interval = {{ .reloadInterval | toJson }}
{{- if not .clientCertificates }}
client_certificates = []
{{- end }}
{{- range .clientCertificates }}

[[auth.client_certificates]]
name = {{ .name | toJson }}
tenants = {{ .tenants | default list | toJson }}
roles = {{ .roles | default list | toJson }}
{{- end }}
{{- end }}

[process]
grpc_reflection = {{ .Values.grpcReflection }}
{{- range $name := keys .Values.taskGroups | sortAlpha }}
{{- $group := index $.Values.taskGroups $name }}

[task_groups.{{ $name | toJson }}]
lease = {{ $group.lease | toJson }}
{{- if $group.runTimeout }}
run_timeout = {{ $group.runTimeout | toJson }}
{{- end }}
{{- if $group.caps }}
caps = [
{{- range $index, $cap := $group.caps }}
{{- if $index }},{{ end }}
  { key = {{ $cap.key | toJson }}, max = {{ $cap.max | int64 }}, scope = {{ $cap.scope | default "tenant" | toJson }} }
{{- end }}
]
{{- else }}
caps = []
{{- end }}
{{- end }}
{{- end }}
