{{/* Names, labels and the few computed values that several templates share. */}}

{{- define "gpuscaler.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The resource name prefix; 63 characters at most because names end up in DNS labels. */}}
{{- define "gpuscaler.fullname" -}}
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

{{- define "gpuscaler.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selects every agent pod of this release, whatever its architecture: the headless Service and the agents'
NetworkPolicy use it, and KEDA's Service when the gateway is off.
*/}}
{{- define "gpuscaler.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuscaler.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end }}

{{- define "gpuscaler.labels" -}}
helm.sh/chart: {{ include "gpuscaler.chart" . }}
{{ include "gpuscaler.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuscaler
{{- end }}

{{/* The agents' ServiceAccount: the release's own, or agent.serviceAccount.name (or "default") when not created. */}}
{{- define "gpuscaler.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (include "gpuscaler.fullname" .) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* registry/repository:tag, or @digest when one is given; the tag defaults to appVersion, the published tag. */}}
{{- define "gpuscaler.image" -}}
{{- $repository := .Values.image.repository }}
{{- if .Values.image.registry }}
{{- $repository = printf "%s/%s" .Values.image.registry .Values.image.repository }}
{{- end }}
{{- $tag := .Values.image.tag | default .Chart.AppVersion | toString }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" $repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}
{{- end }}

{{/* HOST:PORT as the agent and the gateway parse it; IPv6 hosts get brackets. Takes (list host port). */}}
{{- define "gpuscaler.hostPort" -}}
{{- $host := index . 0 | toString }}
{{- if contains ":" $host }}
{{- printf "[%s]:%v" $host (index . 1) }}
{{- else }}
{{- printf "%s:%v" $host (index . 1) }}
{{- end }}
{{- end }}

{{- define "gpuscaler.scenarioEnabled" -}}
{{- if and (eq .Values.agent.collector "fake") .Values.agent.fake.scenario }}true{{ end }}
{{- end }}

{{/*
One agent probe: native gRPC health on the listen port; with TLS on, GET /healthz on the plaintext metrics port,
or a TCP connect when metrics are off too (the kubelet's gRPC probe speaks plaintext only). Takes a dict: port,
tls, metrics, service, settings.
*/}}
{{- define "gpuscaler.probe" -}}
{{- if and .tls .metrics }}
httpGet:
  path: /healthz
  port: metrics
{{- else if .tls }}
tcpSocket:
  port: grpc
{{- else }}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end }}
{{ toYaml .settings }}
{{- end }}

{{/* The host device paths that agent.nvmlHostMounts mounts, as a JSON list. */}}
{{- define "gpuscaler.deviceFiles" -}}
{{- $devices := .Values.agent.nvmlHostMounts.devices }}
{{- if eq $devices.mode "dev" }}
{{- list "/dev" | toJson }}
{{- else }}
{{- $files := list "/dev/nvidiactl" }}
{{- range $index := until (int $devices.gpuCount) }}
{{- $files = append $files (printf "/dev/nvidia%d" $index) }}
{{- end }}
{{- concat $files $devices.extra | uniq | toJson }}
{{- end }}
{{- end }}

{{/* A volume name (a DNS label) for a host path: /dev/nvidia-uvm -> host-dev-nvidia-uvm. */}}
{{- define "gpuscaler.volumeName" -}}
{{- printf "host-%s" (. | trimPrefix "/" | replace "/" "-" | replace "_" "-" | replace "." "-" | lower) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selects the gateway's pods: KEDA's Service (when the gateway is on), the PodDisruptionBudget, the replicas'
anti-affinity and both NetworkPolicies use it.
*/}}
{{- define "gpuscaler.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ include "gpuscaler.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "gpuscaler.gatewayLabels" -}}
helm.sh/chart: {{ include "gpuscaler.chart" . }}
{{ include "gpuscaler.gatewaySelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuscaler
{{- end }}

{{- define "gpuscaler.gatewayName" -}}
{{- printf "%s-gateway" (include "gpuscaler.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Whether the gateway watches pods through the API, and so needs its token and the RBAC for it. */}}
{{- define "gpuscaler.gatewayWatchesPods" -}}
{{- if and .Values.gateway.enabled (eq .Values.gateway.podDirectory "kubernetes") }}true{{ end }}
{{- end }}

{{/* The GPUSCALER_* variables of a process's connectionLimits (docs/security.md). */}}
{{- define "gpuscaler.connectionLimitsEnv" -}}
- name: GPUSCALER_HANDSHAKE_TIMEOUT
  value: {{ .handshakeTimeout | quote }}
- name: GPUSCALER_IDLE_TIMEOUT
  value: {{ .idleTimeout | quote }}
- name: GPUSCALER_MAX_CONNECTIONS
  value: {{ .maxConnections | quote }}
- name: GPUSCALER_MAX_STREAMS
  value: {{ .maxStreams | quote }}
- name: GPUSCALER_REQUEST_TIMEOUT
  value: {{ .requestTimeout | quote }}
- name: GPUSCALER_MAX_RESETS_PER_SECOND
  value: {{ .maxResetsPerSecond | quote }}
- name: GPUSCALER_MAX_PINGS_PER_SECOND
  value: {{ .maxPingsPerSecond | quote }}
- name: GPUSCALER_WRITE_BUFFER_LIMIT
  value: {{ .writeBufferLimit | int64 | quote }}
- name: GPUSCALER_WRITE_TIMEOUT
  value: {{ .writeTimeout | quote }}
{{- end }}
