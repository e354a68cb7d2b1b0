{{/*
Chart name, truncated to 63 characters (DNS label limit).
*/}}
{{- define "sluice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: <release>-<chart>, or the release name alone when
it already contains the chart name.
*/}}
{{- define "sluice.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "sluice.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every resource.
*/}}
{{- define "sluice.labels" -}}
helm.sh/chart: {{ include "sluice.chart" . }}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | replace "+" "_" | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels that select every pod of the release.
*/}}
{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The four services. valuesKey: their block in values.yaml; section: their
section of the configuration file; partitionsKey: the kafka.partitions entry
whose partitions they own.
*/}}
{{- define "sluice.componentTable" -}}
admission:
  valuesKey: admission
  binary: sluice-admission
  section: admission
  partitionsKey: jobs
limit-grant:
  valuesKey: limitGrant
  binary: sluice-limit-grant
  section: limit_grant
  partitionsKey: limitCommands
rate-window:
  valuesKey: rateWindow
  binary: sluice-rate-window
  section: rate_window
  partitionsKey: rateCommands
refresh-dispatcher:
  valuesKey: refreshDispatcher
  binary: sluice-refresh-dispatcher
  section: refresh_dispatcher
  partitionsKey: refreshDue
{{- end }}

{{/*
Name of one component's resources: <fullname>-<component>, kept within 63
characters by shortening the prefix. Takes (dict "root" $ "component" NAME).
*/}}
{{- define "sluice.componentFullname" -}}
{{- include "sluice.suffixedName" (dict "root" .root "suffix" .component) }}
{{- end }}

{{/*
Labels of one component's resources. Takes (dict "root" $ "component" NAME).
*/}}
{{- define "sluice.componentLabels" -}}
{{ include "sluice.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Selector labels of one component's pods. Takes (dict "root" $ "component" NAME).
*/}}
{{- define "sluice.componentSelectorLabels" -}}
{{ include "sluice.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
<fullname>-<suffix> within 63 characters. Takes (dict "root" $ "suffix" S).
*/}}
{{- define "sluice.suffixedName" -}}
{{- $prefix := include "sluice.fullname" .root | trunc (int (sub 62 (len .suffix))) | trimSuffix "-" }}
{{- printf "%s-%s" $prefix .suffix }}
{{- end }}

{{/*
The ConfigMap with the configuration file, and its hook copy.
*/}}
{{- define "sluice.configMapName" -}}
{{- include "sluice.suffixedName" (dict "root" . "suffix" "config") }}
{{- end }}

{{- define "sluice.hooksConfigMapName" -}}
{{- include "sluice.suffixedName" (dict "root" . "suffix" "hooks-config") }}
{{- end }}

{{/*
In-cluster gRPC endpoint of one component's Service.
Takes (dict "root" $ "component" NAME).
*/}}
{{- define "sluice.componentEndpoint" -}}
{{- $table := include "sluice.componentTable" .root | fromYaml }}
{{- $values := index .root.Values (index $table .component).valuesKey }}
{{- printf "http://%s.%s.svc:%d" (include "sluice.componentFullname" .) .root.Release.Namespace (int $values.port) }}
{{- end }}

{{/*
The ServiceAccount the services (and the test pod) run as.
*/}}
{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The ServiceAccount the pre-install hook Jobs run as. Hooks run before the
release's own ServiceAccount exists, so the chart creates a hook-scoped one.
*/}}
{{- define "sluice.hookServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- include "sluice.suffixedName" (dict "root" . "suffix" "hooks") }}
{{- else }}
{{- include "sluice.serviceAccountName" . }}
{{- end }}
{{- end }}

{{/*
The image reference: digest wins over tag; tag defaults to appVersion.
*/}}
{{- define "sluice.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
Name of the Secret holding the PostgreSQL URL.
*/}}
{{- define "sluice.postgresSecretName" -}}
{{- default (printf "%s-postgres" (include "sluice.fullname" .)) .Values.postgres.existingSecret }}
{{- end }}

{{/*
Environment variables carrying credentials. They come only from Secrets
(secretKeyRef); the configuration file never holds them. The PostgreSQL URL
and the Kafka SASL credentials are separate so each hook Job gets only what
it uses.
*/}}
{{- define "sluice.postgresEnv" -}}
- name: SLUICE__POSTGRES__URL
  valueFrom:
    secretKeyRef:
      name: {{ include "sluice.postgresSecretName" . }}
      key: {{ .Values.postgres.urlKey }}
{{- end }}

{{- define "sluice.kafkaEnv" -}}
{{- with .Values.kafka.sasl }}
{{- if .existingSecret }}
- name: SLUICE__KAFKA__SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .usernameKey }}
- name: SLUICE__KAFKA__SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .passwordKey }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sluice.secretEnv" -}}
{{ include "sluice.postgresEnv" . }}
{{- with include "sluice.kafkaEnv" . | trim }}
{{ . }}
{{- end }}
{{- end }}

{{/*
Where the configuration file is mounted, and the arguments that point at it.
*/}}
{{- define "sluice.configPath" -}}
/etc/sluice/sluice.toml
{{- end }}

{{/*
Volumes every Sluice pod mounts: the configuration file and a writable /tmp
(the root filesystem is read-only). Takes (dict "root" $ "configMap" NAME).
*/}}
{{- define "sluice.volumes" -}}
- name: config
  configMap:
    name: {{ .configMap }}
- name: tmp
  emptyDir:
    medium: Memory
    sizeLimit: 64Mi
{{- end }}

{{- define "sluice.volumeMounts" -}}
- name: config
  mountPath: /etc/sluice
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{/*
Milliseconds in a duration string, the way Sluice reads it (humantime:
"500ms", "30s", "1h 30m", "1.5s"; values.schema.json admits only those
units). A float, as a string.
*/}}
{{- define "sluice.durationMs" -}}
{{- $units := dict "nanos" 0.000001 "nsec" 0.000001 "ns" 0.000001 "usec" 0.001 "us" 0.001 "µs" 0.001 "millis" 1.0 "msec" 1.0 "ms" 1.0 "seconds" 1000.0 "second" 1000.0 "secs" 1000.0 "sec" 1000.0 "s" 1000.0 "minutes" 60000.0 "minute" 60000.0 "mins" 60000.0 "min" 60000.0 "m" 60000.0 "hours" 3600000.0 "hour" 3600000.0 "hrs" 3600000.0 "hr" 3600000.0 "h" 3600000.0 "days" 86400000.0 "day" 86400000.0 "d" 86400000.0 "weeks" 604800000.0 "week" 604800000.0 "wks" 604800000.0 "wk" 604800000.0 "w" 604800000.0 "months" 2630016000.0 "month" 2630016000.0 "M" 2630016000.0 "years" 31557600000.0 "year" 31557600000.0 "yrs" 31557600000.0 "yr" 31557600000.0 "y" 31557600000.0 }}
{{- $total := 0.0 }}
{{- range $part := regexFindAll "[0-9]+(\\.[0-9]+)?\\s*[a-zA-Zµ]+" (toString .) -1 }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $part | float64 }}
{{- $unit := regexFind "[a-zA-Zµ]+$" $part }}
{{- if not (hasKey $units $unit) }}
{{- fail (printf "unknown duration unit %q in %q" $unit (toString $)) }}
{{- end }}
{{- $total = addf $total (mulf $number (index $units $unit)) }}
{{- end }}
{{- $total }}
{{- end }}

{{/*
Fails rendering on values the schema cannot check because they relate two
keys.
*/}}
{{- define "sluice.validate" -}}
{{- $root := . }}
{{- $table := include "sluice.componentTable" . | fromYaml }}
{{- range $component, $spec := $table }}
{{- $values := index $root.Values $spec.valuesKey }}
{{- if $spec.partitionsKey }}
{{- $partitions := int (index $root.Values.kafka.partitions $spec.partitionsKey) }}
{{- if gt (int $values.replicas) $partitions }}
{{- fail (printf "%s.replicas (%d) exceeds kafka.partitions.%s (%d): %s owns partitions of that topic, so an instance beyond the partition count owns nothing and only adds rebalances. Lower the replicas (a partition count never changes after the topic exists)." $spec.valuesKey (int $values.replicas) $spec.partitionsKey $partitions $component) }}
{{- end }}
{{- if and $values.autoscaling.enabled (gt (int $values.autoscaling.maxReplicas) $partitions) }}
{{- fail (printf "%s.autoscaling.maxReplicas (%d) exceeds kafka.partitions.%s (%d): %s cannot use more instances than partitions." $spec.valuesKey (int $values.autoscaling.maxReplicas) $spec.partitionsKey $partitions $component) }}
{{- end }}
{{- end }}
{{- if and $values.autoscaling.enabled (gt (int $values.autoscaling.minReplicas) (int $values.autoscaling.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) exceeds maxReplicas (%d)." $spec.valuesKey (int $values.autoscaling.minReplicas) (int $values.autoscaling.maxReplicas)) }}
{{- end }}
{{- if and $values.autoscaling.enabled (not $values.autoscaling.targetCPUUtilizationPercentage) (not $values.autoscaling.targetMemoryUtilizationPercentage) }}
{{- fail (printf "%s.autoscaling needs targetCPUUtilizationPercentage or targetMemoryUtilizationPercentage." $spec.valuesKey) }}
{{- end }}
{{- if and $root.Values.metrics.enabled (eq (int $values.port) (int $root.Values.metrics.port)) }}
{{- fail (printf "metrics.port (%d) collides with %s.port." (int $root.Values.metrics.port) $spec.valuesKey) }}
{{- end }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.serviceMonitor.enabled needs metrics.enabled: the ServiceMonitor scrapes the metrics port." }}
{{- end }}
{{- if and .Values.kafka.sasl.existingSecret (not (hasPrefix "SASL_" .Values.kafka.securityProtocol)) }}
{{- fail "kafka.sasl.existingSecret is set but kafka.securityProtocol is not SASL_SSL or SASL_PLAINTEXT: the credentials would never be used." }}
{{- end }}
{{- /* The checks SluiceConfig::validate makes at startup that relate or
  bound durations: failing here beats every pod crash-looping. */}}
{{- $admission := .Values.admission.config }}
{{- $durations := dict
  "admission.config.sweepInterval" $admission.sweepInterval
  "admission.config.standBehindInterval" $admission.standBehindInterval
  "admission.config.claimTimeout" $admission.claimTimeout
  "admission.config.resendWaitingAfter" $admission.resendWaitingAfter
  "limitGrant.config.ticketGrace" .Values.limitGrant.config.ticketGrace }}
{{- range $key := keys $durations | sortAlpha }}
{{- if le (include "sluice.durationMs" (index $durations $key) | float64) 0.0 }}
{{- fail (printf "%s must be greater than 0." $key) }}
{{- end }}
{{- end }}
{{- $standBehindMs := include "sluice.durationMs" $admission.standBehindInterval | float64 }}
{{- $ticketGraceMs := include "sluice.durationMs" .Values.limitGrant.config.ticketGrace | float64 }}
{{- if gt (mulf 2 $standBehindMs) $ticketGraceMs }}
{{- fail (printf "admission.config.standBehindInterval (%s) must be at most half of limitGrant.config.ticketGrace (%s): admission restates the tickets it stands behind at that interval, and limit-grant reclaims a ticket nobody restated within its grace." $admission.standBehindInterval .Values.limitGrant.config.ticketGrace) }}
{{- end }}
{{- range $name, $group := .Values.taskGroups }}
{{- if lt (include "sluice.durationMs" $group.lease | float64) 100.0 }}
{{- fail (printf "taskGroups.%s.lease (%s) must be at least 100ms." $name $group.lease) }}
{{- end }}
{{- end }}
{{- range $key, $value := .Values.kafka.properties }}
{{- if regexMatch "(?i)(password|secret|jaas|sasl\\.username|private|token)" $key }}
{{- fail (printf "kafka.properties.%s looks like a credential: the configuration file is a ConfigMap. Put SASL credentials in a Secret and name it in kafka.sasl.existingSecret." $key) }}
{{- end }}
{{- end }}
{{- end }}
