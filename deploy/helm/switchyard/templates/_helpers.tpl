{{/* Chart name. */}}
{{- define "switchyard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: <release>-<chart>, or the release name when it contains the chart name. */}}
{{- define "switchyard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "switchyard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "switchyard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "switchyard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "switchyard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "switchyard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "switchyard.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespace pod discovery watches ("" = all namespaces). */}}
{{- define "switchyard.watchNamespace" -}}
{{- if not .Values.discovery.kubernetes.allNamespaces -}}
{{- default .Release.Namespace .Values.discovery.kubernetes.namespace -}}
{{- end -}}
{{- end -}}

{{/* Configuration checks that would otherwise fail at router startup. */}}
{{- define "switchyard.validate" -}}
{{- $pd := eq .Values.router.mode "pd" -}}
{{- if not (or $pd (eq .Values.router.mode "regular")) -}}
{{- fail (printf "router.mode must be regular or pd, not %q" .Values.router.mode) -}}
{{- end -}}
{{- if and .Values.discovery.zmq.enabled (not $pd) -}}
{{- fail "discovery.zmq needs router.mode=pd" -}}
{{- end -}}
{{- if and .Values.discovery.zmq.enabled (gt (int .Values.replicaCount) 1) -}}
{{- fail "discovery.zmq allows replicaCount 1: every vLLM instance registers with a single router address (use discovery.kubernetes for several replicas; see docs/KUBERNETES.md)" -}}
{{- end -}}
{{- if and (eq .Values.router.kvConnector "moriio") (not .Values.discovery.zmq.enabled) -}}
{{- fail "router.kvConnector=moriio needs discovery.zmq.enabled (MoRI-IO addresses come from ZMQ registration)" -}}
{{- end -}}
{{- if not (or .Values.discovery.zmq.enabled .Values.discovery.kubernetes.enabled .Values.router.workerUrls .Values.router.prefill .Values.router.decode) -}}
{{- fail "no workers: set router.workerUrls (regular), router.prefill/router.decode (pd), or enable discovery.kubernetes or discovery.zmq" -}}
{{- end -}}
{{- end -}}
