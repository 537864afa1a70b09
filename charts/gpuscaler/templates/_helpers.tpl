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

{{/*
"true" when the gateway sends the EPP a bearer token (gateway.epp.metricsToken.enabled); fails the render when that
is on without the pod watch or without a namespace to trust.
*/}}
{{- define "gpuscaler.eppMetricsToken" -}}
{{- $token := .Values.gateway.epp.metricsToken }}
{{- if and .Values.gateway.enabled $token.enabled }}
{{- if ne .Values.gateway.podDirectory "kubernetes" }}
{{- fail "gateway.epp.metricsToken.enabled needs gateway.podDirectory \"kubernetes\": the token goes only to pods the Kubernetes API says an InferencePool's endpointPickerRef names" }}
{{- end }}
{{- if not $token.namespaces }}
{{- fail "gateway.epp.metricsToken.enabled needs gateway.epp.metricsToken.namespaces: the namespaces whose InferencePools are trusted to name the pods that receive the token (anyone who can create an InferencePool, a Service and a pod elsewhere could otherwise aim it at their own pod; docs/engines.md)" }}
{{- end }}
{{- print "true" }}
{{- end }}
{{- end }}

{{/* The ServiceAccount whose token the EPP receives: it may only "get" /metrics. */}}
{{- define "gpuscaler.eppMetricsName" -}}
{{- printf "%s-epp-metrics" (include "gpuscaler.gatewayName" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The GPUSCALER_* variables of a process's connectionLimits (docs/security.md). */}}
{{- define "gpuscaler.connectionLimitsEnv" -}}
- name: GPUSCALER_HANDSHAKE_TIMEOUT
  value: {{ .handshakeTimeout | quote }}
- name: GPUSCALER_IDLE_TIMEOUT
  value: {{ .idleTimeout | quote }}
- name: GPUSCALER_MAX_CONNECTIONS
  value: {{ .maxConnections | quote }}
- name: GPUSCALER_MAX_CONNECTIONS_PER_PEER
  value: {{ .maxConnectionsPerPeer | quote }}
- name: GPUSCALER_MAX_PENDING_CONNECTIONS
  value: {{ .maxPendingConnections | quote }}
- name: GPUSCALER_FIRST_REQUEST_TIMEOUT
  value: {{ .firstRequestTimeout | quote }}
- name: GPUSCALER_MAX_STREAMS
  value: {{ .maxStreams | quote }}
- name: GPUSCALER_REQUEST_TIMEOUT
  value: {{ .requestTimeout | quote }}
- name: GPUSCALER_MAX_RESETS_PER_SECOND
  value: {{ .maxResetsPerSecond | quote }}
- name: GPUSCALER_MAX_PINGS_PER_SECOND
  value: {{ .maxPingsPerSecond | quote }}
- name: GPUSCALER_MAX_DEADLINE_RESETS_PER_SECOND
  value: {{ .maxDeadlineResetsPerSecond | quote }}
- name: GPUSCALER_TURN_CALLS
  value: {{ .turnCalls | quote }}
- name: GPUSCALER_TURN_BYTES
  value: {{ .turnBytes | int64 | quote }}
- name: GPUSCALER_WRITE_BUFFER_LIMIT
  value: {{ .writeBufferLimit | int64 | quote }}
- name: GPUSCALER_WRITE_TIMEOUT
  value: {{ .writeTimeout | quote }}
{{- end }}

{{/*
The agents' pod securityContext, as JSON: agent.podSecurityContext with runAsUser and runAsGroup derived from
agent.podResources.enabled where it leaves them out (0 with it: the kubelet's socket is srwxr-xr-x root in a 0750
root folder; the image's 65532 without), and runAsNonRoot derived from the user the container ends up with. A pod
with runAsNonRoot true and uid 0 never starts (the kubelet refuses it), so that combination fails the render.
docs/install.md#the-agents-privileges says why.
*/}}
{{- define "gpuscaler.agentPodSecurityContext" -}}
{{- $agent := .Values.agent }}
{{- $pod := deepCopy ($agent.podSecurityContext | default dict) }}
{{- $container := $agent.securityContext | default dict }}
{{- $id := ternary 0 65532 $agent.podResources.enabled }}
{{- if hasKey $container "runAsUser" }}
{{- $id = $container.runAsUser }}
{{- end }}
{{- if not (hasKey $pod "runAsUser") }}
{{- $_ := set $pod "runAsUser" $id }}
{{- end }}
{{- if not (hasKey $pod "runAsGroup") }}
{{- $_ := set $pod "runAsGroup" $id }}
{{- end }}
{{- $user := $pod.runAsUser }}
{{- $where := printf "derived from agent.podResources.enabled=%v" $agent.podResources.enabled }}
{{- if hasKey $container "runAsUser" }}
{{- $user = $container.runAsUser }}
{{- $where = "agent.securityContext.runAsUser" }}
{{- else if hasKey ($agent.podSecurityContext | default dict) "runAsUser" }}
{{- $where = "agent.podSecurityContext.runAsUser" }}
{{- end }}
{{- $root := eq (int64 $user) (int64 0) }}
{{- range $section, $context := dict "agent.podSecurityContext" $pod "agent.securityContext" $container }}
{{- if and $root (hasKey $context "runAsNonRoot") $context.runAsNonRoot }}
{{- fail (printf "%s.runAsNonRoot is true but the agent runs as uid 0 (%s): the kubelet refuses to start such a pod. Leave runAsNonRoot out (the chart derives it from the user), or run as a non-root user with agent.podResources.enabled=false (docs/install.md#the-agents-privileges)" $section $where) }}
{{- end }}
{{- end }}
{{- if not (hasKey $pod "runAsNonRoot") }}
{{- $_ := set $pod "runAsNonRoot" (not $root) }}
{{- end }}
{{- toJson $pod }}
{{- end }}

{{/* Whether the agent container ends up as uid 0: "true" or "". */}}
{{- define "gpuscaler.agentRunsAsRoot" -}}
{{- $pod := include "gpuscaler.agentPodSecurityContext" . | fromJson }}
{{- $user := $pod.runAsUser }}
{{- if hasKey (.Values.agent.securityContext | default dict) "runAsUser" }}
{{- $user = .Values.agent.securityContext.runAsUser }}
{{- end }}
{{- if eq (int64 $user) (int64 0) }}true{{ end }}
{{- end }}

{{/*
The agents' affinity, as JSON ("" for none): agent.affinity, plus a required node affinity with one term per entry of
agent.gpuNodeLabels (Kubernetes ORs the terms), unless agent.affinity has a required node affinity of its own.
*/}}
{{- define "gpuscaler.agentAffinity" -}}
{{- $affinity := deepCopy (.Values.agent.affinity | default dict) }}
{{- $terms := list }}
{{- range .Values.agent.gpuNodeLabels }}
{{- $terms = append $terms (dict "matchExpressions" (list .)) }}
{{- end }}
{{- $nodeAffinity := $affinity.nodeAffinity | default dict }}
{{- if and $terms (not (hasKey $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution")) }}
{{- $_ := set $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" $terms) }}
{{- $_ := set $affinity "nodeAffinity" $nodeAffinity }}
{{- end }}
{{- if $affinity }}{{ toJson $affinity }}{{ end }}
{{- end }}

{{/* Whether one NodeSelectorRequirement (key, operator, values) holds for a map of labels: "true" or "". */}}
{{- define "gpuscaler.requirementHolds" -}}
{{- $labels := index . 0 }}
{{- $requirement := index . 1 }}
{{- $present := hasKey $labels $requirement.key }}
{{- $value := toString (get $labels $requirement.key) }}
{{- $values := $requirement.values | default list }}
{{- $op := $requirement.operator }}
{{- if eq $op "In" }}{{ if and $present (has $value $values) }}true{{ end }}
{{- else if eq $op "NotIn" }}{{ if not (and $present (has $value $values)) }}true{{ end }}
{{- else if eq $op "Exists" }}{{ if $present }}true{{ end }}
{{- else if eq $op "DoesNotExist" }}{{ if not $present }}true{{ end }}
{{- else if and $present (regexMatch "^-?[0-9]+$" $value) (eq $op "Gt") }}{{ if gt (int64 $value) (int64 (first $values)) }}true{{ end }}
{{- else if and $present (regexMatch "^-?[0-9]+$" $value) (eq $op "Lt") }}{{ if lt (int64 $value) (int64 (first $values)) }}true{{ end }}
{{- end }}
{{- end }}

{{/*
What the agent DaemonSet(s) would do on the cluster's nodes, as JSON {"matching": [names], "blocked": ["name (taint)"]}:
a node matches the required node affinity and the node selector (with each architecture's when agent.nvmlHostMounts
renders one DaemonSet per architecture); it is blocked when a NoSchedule or NoExecute taint on it is not tolerated
(the DaemonSet controller's own tolerations included). Takes (list root nodes).
*/}}
{{- define "gpuscaler.nodeReport" -}}
{{- $root := index . 0 }}
{{- $agent := $root.Values.agent }}
{{- $affinity := include "gpuscaler.agentAffinity" $root | default "{}" | fromJson }}
{{- $terms := list }}
{{- with $affinity.nodeAffinity }}{{ with .requiredDuringSchedulingIgnoredDuringExecution }}
{{- $terms = .nodeSelectorTerms | default list }}
{{- end }}{{ end }}
{{- $arches := list }}
{{- if $agent.nvmlHostMounts.enabled }}
{{- range $arch, $path := $agent.nvmlHostMounts.libraryHostPaths }}{{ if $path }}{{ $arches = append $arches $arch }}{{ end }}{{ end }}
{{- end }}
{{- /* The DaemonSet controller adds these tolerations itself (network-unavailable only for host network pods). */}}
{{- $automatic := list "node.kubernetes.io/not-ready:NoExecute" "node.kubernetes.io/unreachable:NoExecute" "node.kubernetes.io/disk-pressure:NoSchedule" "node.kubernetes.io/memory-pressure:NoSchedule" "node.kubernetes.io/pid-pressure:NoSchedule" "node.kubernetes.io/unschedulable:NoSchedule" }}
{{- $matching := list }}
{{- $blocked := list }}
{{- range $node := index . 1 }}
{{- $labels := $node.metadata.labels | default dict }}
{{- $ok := true }}
{{- range $key, $value := $agent.nodeSelector }}
{{- if ne (toString (get $labels $key)) (toString $value) }}{{ $ok = false }}{{ end }}
{{- end }}
{{- if and $arches (not (has (toString (get $labels "kubernetes.io/arch")) $arches)) }}{{ $ok = false }}{{ end }}
{{- if $terms }}
{{- $anyTerm := false }}
{{- range $term := $terms }}
{{- $all := true }}
{{- range $term.matchExpressions }}
{{- if not (include "gpuscaler.requirementHolds" (list $labels .)) }}{{ $all = false }}{{ end }}
{{- end }}
{{- range $term.matchFields }}
{{- if not (include "gpuscaler.requirementHolds" (list (dict "metadata.name" $node.metadata.name) .)) }}{{ $all = false }}{{ end }}
{{- end }}
{{- if $all }}{{ $anyTerm = true }}{{ end }}
{{- end }}
{{- if not $anyTerm }}{{ $ok = false }}{{ end }}
{{- end }}
{{- if $ok }}
{{- $matching = append $matching $node.metadata.name }}
{{- range $taint := (($node.spec | default dict).taints | default list) }}
{{- if and (has $taint.effect (list "NoSchedule" "NoExecute")) (not (has (printf "%s:%s" $taint.key $taint.effect) $automatic)) }}
{{- $tolerated := false }}
{{- range $toleration := $agent.tolerations }}
{{- $keyMatches := or (and (not $toleration.key) (eq ($toleration.operator | default "Equal") "Exists")) (eq ($toleration.key | default "") $taint.key) }}
{{- $valueMatches := or (eq ($toleration.operator | default "Equal") "Exists") (eq (toString ($toleration.value | default "")) (toString ($taint.value | default ""))) }}
{{- $effectMatches := or (not $toleration.effect) (eq $toleration.effect $taint.effect) }}
{{- if and $keyMatches $valueMatches $effectMatches }}{{ $tolerated = true }}{{ end }}
{{- end }}
{{- if not $tolerated }}
{{- $blocked = append $blocked (printf "%s (%s%s:%s)" $node.metadata.name $taint.key (ternary (printf "=%v" $taint.value) "" (not (empty $taint.value))) $taint.effect) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson (dict "matching" $matching "blocked" $blocked) }}
{{- end }}

{{/* Why the agents' pods need Pod Security "privileged", as one phrase; "" when "restricted" admits them. */}}
{{- define "gpuscaler.agentPrivilegedReasons" -}}
{{- $agent := .Values.agent }}
{{- $reasons := list }}
{{- if $agent.podResources.enabled }}{{ $reasons = append $reasons (printf "a hostPath of %s (agent.podResources)" $agent.podResources.hostPath) }}{{ end }}
{{- if $agent.nvmlHostMounts.enabled }}{{ $reasons = append $reasons "privileged: true and host mounts of the driver (agent.nvmlHostMounts)" }}{{ end }}
{{- if $agent.processes.enabled }}{{ $reasons = append $reasons "hostPID (agent.processes)" }}{{ end }}
{{- join ", " $reasons }}
{{- end }}

{{/*
The port of KEDA's Service: the port of the component it fronts, the gateway's or, without one, the agents'.
*/}}
{{- define "gpuscaler.scalerPort" -}}
{{- if .Values.gateway.enabled }}{{ .Values.gateway.listen.port }}{{ else }}{{ .Values.agent.listen.port }}{{ end -}}
{{- end }}
