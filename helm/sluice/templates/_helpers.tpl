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
{{- $scheme := ternary "https" "http" (.root.Values.tls.enabled | default false) }}
{{- printf "%s://%s.%s.svc:%d" $scheme (include "sluice.componentFullname" .) .root.Release.Namespace (int $values.port) }}
{{- end }}

{{/*
TLS: the Secret with tls.crt, tls.key and ca.crt (an existing one, or the
one the chart's cert-manager Certificate writes), where it is mounted, and
the name clients check in the services' certificates.
*/}}
{{- define "sluice.tlsSecretName" -}}
{{- if .Values.tls.existingSecret }}
{{- .Values.tls.existingSecret }}
{{- else }}
{{- include "sluice.suffixedName" (dict "root" . "suffix" "tls") }}
{{- end }}
{{- end }}

{{- define "sluice.tlsDir" -}}
/var/run/secrets/sluice/tls
{{- end }}

{{- define "sluice.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s.%s.svc" (include "sluice.fullname" .) .Release.Namespace) }}
{{- end }}

{{/*
Auth: the internal token (an existing Secret, or <fullname>-internal-token
created by the chart) and the JWKS document, each mounted as one file.
*/}}
{{- define "sluice.internalTokenSecretName" -}}
{{- if .Values.auth.internalToken.existingSecret }}
{{- .Values.auth.internalToken.existingSecret }}
{{- else }}
{{- include "sluice.suffixedName" (dict "root" . "suffix" "internal-token") }}
{{- end }}
{{- end }}

{{- define "sluice.internalTokenFile" -}}
/var/run/secrets/sluice/internal-token/token
{{- end }}

{{- define "sluice.jwksFile" -}}
/var/run/secrets/sluice/jwks/jwks.json
{{- end }}

{{- define "sluice.otlpCaFile" -}}
/var/run/secrets/sluice/otlp-ca/ca.crt
{{- end }}

{{/*
The three probes of a service container. Native gRPC probes in plaintext;
with TLS, whose handshake the kubelet's gRPC probe cannot make, exec probes
running `sluice health` against the local port, checking tls.serverName
with the mounted CA (and presenting the pod's own certificate when the
services require client certificates). Takes (dict "root" $ "port" N).
*/}}
{{- define "sluice.probes" -}}
{{- $root := .root }}
{{- $probes := $root.Values.probes }}
{{- $liveness := $probes.liveness.grpcService }}
{{- if $root.Values.tls.enabled }}
{{- $command := list "/usr/local/bin/sluice" "health" "--endpoint" (printf "https://127.0.0.1:%d" (int .port)) "--tls-ca-file" (printf "%s/ca.crt" (include "sluice.tlsDir" $root)) "--tls-server-name" (include "sluice.tlsServerName" $root) }}
{{- if $root.Values.tls.mutual }}
{{- $command = concat $command (list "--tls-cert-file" (printf "%s/tls.crt" (include "sluice.tlsDir" $root)) "--tls-key-file" (printf "%s/tls.key" (include "sluice.tlsDir" $root))) }}
{{- end }}
{{- $livenessCommand := $command }}
{{- if $liveness }}
{{- $livenessCommand = concat $command (list "--service" $liveness) }}
{{- end }}
readinessProbe:
  exec:
    command:
      {{- toYaml $command | nindent 6 }}
  periodSeconds: {{ $probes.readiness.periodSeconds }}
  timeoutSeconds: {{ $probes.readiness.timeoutSeconds }}
  failureThreshold: {{ $probes.readiness.failureThreshold }}
livenessProbe:
  exec:
    command:
      {{- toYaml $livenessCommand | nindent 6 }}
  periodSeconds: {{ $probes.liveness.periodSeconds }}
  timeoutSeconds: {{ $probes.liveness.timeoutSeconds }}
  failureThreshold: {{ $probes.liveness.failureThreshold }}
startupProbe:
  exec:
    command:
      {{- toYaml $livenessCommand | nindent 6 }}
  periodSeconds: {{ $probes.startup.periodSeconds }}
  timeoutSeconds: {{ $probes.startup.timeoutSeconds | default $probes.liveness.timeoutSeconds }}
  failureThreshold: {{ $probes.startup.failureThreshold }}
{{- else }}
{{- include "sluice.grpcProbes" . }}
{{- end }}
{{- end }}

{{/*
Native gRPC probes on a plaintext port: the services without TLS, and the
console (which serves plain HTTP, with grpc.health.v1 on the same port).
Takes (dict "root" $ "port" N).
*/}}
{{- define "sluice.grpcProbes" -}}
{{- $probes := .root.Values.probes }}
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ $probes.readiness.periodSeconds }}
  timeoutSeconds: {{ $probes.readiness.timeoutSeconds }}
  failureThreshold: {{ $probes.readiness.failureThreshold }}
livenessProbe:
  grpc:
    port: {{ .port }}
    {{- with $probes.liveness.grpcService }}
    service: {{ . | quote }}
    {{- end }}
  periodSeconds: {{ $probes.liveness.periodSeconds }}
  timeoutSeconds: {{ $probes.liveness.timeoutSeconds }}
  failureThreshold: {{ $probes.liveness.failureThreshold }}
startupProbe:
  grpc:
    port: {{ .port }}
    {{- with $probes.liveness.grpcService }}
    service: {{ . | quote }}
    {{- end }}
  periodSeconds: {{ $probes.startup.periodSeconds }}
  failureThreshold: {{ $probes.startup.failureThreshold }}
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
The Secrets a serving process (service or console) mounts, read-only, as
whole volumes (no subPath), so rotated certificates and keys reach the
running pods: the TLS certificate, the internal token, the JWKS document,
the OTLP collector's CA.
The files are readable by the pod's fsGroup only. Takes the root context.
*/}}
{{- define "sluice.secretVolumes" -}}
{{- if .Values.tls.enabled }}
{{ include "sluice.tlsVolume" . }}
{{- end }}
{{- if .Values.auth.enabled }}
- name: internal-token
  secret:
    secretName: {{ include "sluice.internalTokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.auth.internalToken.key }}
        path: token
{{- end }}
{{- if and .Values.auth.enabled .Values.auth.jwks.existingSecret }}
- name: jwks
  secret:
    secretName: {{ .Values.auth.jwks.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.auth.jwks.key }}
        path: jwks.json
{{- end }}
{{- if .Values.telemetry.otlpCa.existingSecret }}
- name: otlp-ca
  secret:
    secretName: {{ .Values.telemetry.otlpCa.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.telemetry.otlpCa.key }}
        path: ca.crt
{{- end }}
{{- end }}

{{/*
The TLS Secret as a volume. Naming the three keys makes a Secret that lacks
one (an ACME issuer writes no ca.crt) fail the pod's start with an event
that says which.
*/}}
{{- define "sluice.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ include "sluice.tlsSecretName" . }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}

{{- define "sluice.secretVolumeMounts" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "sluice.tlsDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.auth.enabled }}
- name: internal-token
  mountPath: {{ include "sluice.internalTokenFile" . | dir }}
  readOnly: true
{{- end }}
{{- if and .Values.auth.enabled .Values.auth.jwks.existingSecret }}
- name: jwks
  mountPath: {{ include "sluice.jwksFile" . | dir }}
  readOnly: true
{{- end }}
{{- if .Values.telemetry.otlpCa.existingSecret }}
- name: otlp-ca
  mountPath: {{ include "sluice.otlpCaFile" . | dir }}
  readOnly: true
{{- end }}
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
{{- include "sluice.validateSecurity" . }}
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
{{- if and .Values.networkPolicy.enabled .Values.console.enabled .Values.console.ingress.enabled (not .Values.networkPolicy.consoleFrom) }}
{{- fail "console.ingress.enabled with networkPolicy.enabled needs networkPolicy.consoleFrom: the console's NetworkPolicy admits only those peers, so list your Ingress controller's pods (e.g. - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: ingress-nginx}})." }}
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
{{- /* null: the setting is left to Sluice's default. */}}
{{- if not (kindIs "invalid" (index $durations $key)) }}
{{- if le (include "sluice.durationMs" (index $durations $key) | float64) 0.0 }}
{{- fail (printf "%s must be greater than 0." $key) }}
{{- end }}
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


{{/*
Fails rendering when TLS or authentication is on (the defaults) without what
they need, saying what to provide. Checked before anything else.
*/}}
{{- define "sluice.validateSecurity" -}}
{{- $tls := .Values.tls }}
{{- if $tls.enabled }}
{{- if and $tls.existingSecret $tls.certManager.enabled }}
{{- fail "tls.existingSecret and tls.certManager.enabled are both set: choose one source for the certificate (an existing Secret, or a Secret the chart's cert-manager Certificate writes)." }}
{{- end }}
{{- if not (or $tls.existingSecret $tls.certManager.enabled) }}
{{- fail (printf "tls.enabled is true (the default) but no certificate is configured. Either set tls.existingSecret to a Secret holding tls.crt, tls.key and ca.crt (type kubernetes.io/tls, as cert-manager writes it) whose certificate names %s (tls.serverName), or set tls.certManager.enabled=true and tls.certManager.issuerRef.name=<a cert-manager CA Issuer or ClusterIssuer> to have the chart request one. To serve plaintext gRPC instead (only inside a network that already encrypts and authenticates pod traffic, e.g. a service mesh, or a throwaway cluster), set tls.enabled=false." (include "sluice.tlsServerName" .)) }}
{{- end }}
{{- if and $tls.certManager.enabled (not $tls.certManager.issuerRef.name) }}
{{- fail "tls.certManager.enabled needs tls.certManager.issuerRef.name: the cert-manager Issuer (or, with issuerRef.kind=ClusterIssuer, ClusterIssuer) that signs the services' certificate. It must write ca.crt (a CA, Vault or self-signed issuer)." }}
{{- end }}
{{- else if $tls.mutual }}
{{- fail "tls.mutual needs tls.enabled: client certificates are part of the TLS handshake." }}
{{- end }}
{{- if and (hasPrefix "https://" .Values.telemetry.otlpEndpoint) (not .Values.telemetry.otlpCa.existingSecret) }}
{{- fail (printf "telemetry.otlpEndpoint (%s) is https:// but telemetry.otlpCa.existingSecret is empty: set it to a Secret holding the CA (PEM, key telemetry.otlpCa.key, default ca.crt) that signed the collector's certificate, or use an http:// collector inside the cluster." .Values.telemetry.otlpEndpoint) }}
{{- end }}
{{- $auth := .Values.auth }}
{{- if $auth.enabled }}
{{- if and $auth.jwks.existingSecret (not (and $auth.issuer $auth.audience)) }}
{{- fail (printf "auth.jwks.existingSecret (%s) is set without auth.issuer and auth.audience: set both to the `iss` your identity provider writes into tokens and the `aud` it issues them for (e.g. --set auth.issuer=https://login.example.com/ --set auth.audience=sluice)." $auth.jwks.existingSecret) }}
{{- end }}
{{- if and $auth.clientCertificates (not (and $tls.enabled $tls.mutual)) }}
{{- fail "auth.clientCertificates needs tls.enabled=true and tls.mutual=true: without mutual TLS the services ask no client for a certificate, so these mappings would never match." }}
{{- end }}
{{- if not (or $auth.jwks.existingSecret $auth.clientCertificates) }}
{{- fail "auth.enabled is true (the default) but nothing can authenticate producers, workers and operators. Set auth.jwks.existingSecret to a Secret holding the JWKS document of your identity provider (key auth.jwks.key, default jwks.json) together with auth.issuer and auth.audience, and/or list auth.clientCertificates ({name, tenants, roles}, with tls.mutual=true). The internal token the services share is created by the chart (or taken from auth.internalToken.existingSecret). To run without authentication (a throwaway cluster only: anyone who reaches a gRPC port may act on every tenant), set auth.enabled=false." }}
{{- end }}
{{- end }}
{{- end }}
