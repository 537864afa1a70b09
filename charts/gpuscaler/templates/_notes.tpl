{{/*
The part of NOTES.txt that reads the cluster, so that it can be rendered with any nodes, namespace and RuntimeClass
(the chart tests do, through a parent chart; NOTES.txt passes helm's lookups). Takes a dict: root, nodes (a List, or
{} when helm did not read the cluster), namespace and runtimeClass (objects, or {}).
*/}}
{{- define "gpuscaler.clusterNotes" -}}
{{- $root := .root }}
{{- $agent := $root.Values.agent }}
{{- $nodes := .nodes }}
{{- $namespace := .namespace }}
{{- $runtimeClass := .runtimeClass }}
{{- if hasKey $nodes "items" }}
{{- $report := include "gpuscaler.nodeReport" (list $root $nodes.items) | fromJson }}
{{- if not $report.matching }}

WARNING: NO NODE MATCHES. None of the cluster's {{ len $nodes.items }} node(s) has any of agent.gpuNodeLabels
{{- with $agent.nodeSelector }} together with agent.nodeSelector {{ toJson . }}{{ end }}, so the DaemonSet starts no
agent, and the gateway has no GPU to answer for. Label the GPU nodes (kubectl label node NODE
nvidia.com/gpu.present=true), or set agent.gpuNodeLabels to a label they have: docs/troubleshooting.md,
"The DaemonSet runs no agent".
{{- else }}
Nodes that match now ({{ len $report.matching }} of {{ len $nodes.items }}): {{ join ", " (slice $report.matching 0 (min 10 (len $report.matching))) }}
{{- if gt (len $report.matching) 10 }}, ...{{ end }}
{{- end }}
{{- if $report.blocked }}

WARNING: TAINTS KEEP THE AGENT OFF {{ len $report.blocked }} MATCHING NODE(S): {{ join ", " (slice $report.blocked 0 (min 10 (len $report.blocked))) }}
{{- if gt (len $report.blocked) 10 }}, ...{{ end }}. Add a toleration for each to agent.tolerations.
{{- end }}
{{- end }}
{{- $privileged := include "gpuscaler.agentPrivilegedReasons" $root }}
{{- if $privileged }}
{{- $enforce := "" }}
{{- with $namespace.metadata }}{{ with .labels }}{{ $enforce = get . "pod-security.kubernetes.io/enforce" }}{{ end }}{{ end }}
{{- if has $enforce (list "baseline" "restricted") }}

WARNING: THE AGENTS' PODS WILL BE REFUSED. Namespace {{ $root.Release.Namespace }} enforces Pod Security "{{ $enforce }}",
and the agents need "privileged", for: {{ $privileged }}. Label it:
  kubectl label namespace {{ $root.Release.Namespace }} pod-security.kubernetes.io/enforce=privileged --overwrite
or set agent.podResources.enabled=false for agents that "restricted" admits (no per-workload queries):
docs/install.md#pod-security.
{{- else }}

Pod Security: the agents need the "privileged" level in namespace {{ $root.Release.Namespace }} (the gateway passes
"restricted"), for: {{ $privileged }}.
Where the cluster enforces a stricter level by default, label the namespace:
  kubectl label namespace {{ $root.Release.Namespace }} pod-security.kubernetes.io/enforce=privileged
{{- end }}
{{- end }}
{{- if and $agent.podResources.enabled (not (include "gpuscaler.agentRunsAsRoot" $root)) }}

WARNING: agent.podResources is on but the agent does not run as uid 0. The kubelet's pod-resources socket is
srwxr-xr-x root in a 0750 root folder, so the agent cannot connect, and every workload, pod, podSelector and
scaleTargetPods query gets UNAVAILABLE ("Permission denied"). Leave runAsUser unset (the chart then runs the
agent as uid 0 without capabilities), or turn agent.podResources off: docs/install.md#the-agents-privileges.
{{- end }}
{{- if and $agent.runtimeClassName (hasKey $nodes "items") (not $runtimeClass) }}

WARNING: RuntimeClass "{{ $agent.runtimeClassName }}" does not exist, so no agent pod can be created (the DaemonSet's
events say FailedCreate). Install the NVIDIA container toolkit or GPU operator, which create it, or see "Getting NVML
into the container" in the chart's README (agent.runtimeClassName, agent.nvmlHostMounts).
{{- end }}
{{- end }}
