{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "moe-eplb.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<chart>, or the release name when it contains the chart name or
     the chart name starts with it (release "moe-eplb" -> "moe-eplb"). */}}
{{- define "moe-eplb.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if or (contains $name .Release.Name) (hasPrefix .Release.Name $name) }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "moe-eplb.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "moe-eplb.labels" -}}
helm.sh/chart: {{ include "moe-eplb.chart" . }}
{{ include "moe-eplb.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: moe-eplb
{{- end }}

{{/* Labels that select the operator pods (immutable in the Deployment). */}}
{{- define "moe-eplb.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moe-eplb.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "moe-eplb.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "moe-eplb.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image reference: repository@digest, or repository:tag (tag defaults to appVersion). */}}
{{- define "moe-eplb.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The metrics Service name; the operator-down alert matches it as the scrape job. */}}
{{- define "moe-eplb.metricsServiceName" -}}
{{- printf "%s-metrics" (include "moe-eplb.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* True (non-empty) in namespaced mode. */}}
{{- define "moe-eplb.namespaced" -}}
{{- if .Values.operator.watchNamespaces }}true{{ end }}
{{- end }}

{{/* operator.podMonitorLabels as MOE_EPLB_POD_MONITOR_LABELS: key=value pairs sorted by key
     (range over a map is in key order), joined by ",". */}}
{{- define "moe-eplb.podMonitorLabels" -}}
{{- $pairs := list }}
{{- range $k, $v := .Values.operator.podMonitorLabels }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/* Whether a Prometheus Operator object is rendered, from its auto|true|false value:
     "true" (non-empty) for true, or for auto when the cluster serves monitoring.coreos.com/v1
     (helm install/upgrade ask the API server; helm template only knows --api-versions).
     Call: include "moe-eplb.monitoringOn" (list <value> $) */}}
{{- define "moe-eplb.monitoringOn" -}}
{{- $value := index . 0 }}
{{- $root := index . 1 }}
{{- if eq (toString $value) "auto" }}
{{- if $root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- else if $value }}true{{ end }}
{{- end }}

{{- define "moe-eplb.serviceMonitorOn" -}}
{{- include "moe-eplb.monitoringOn" (list .Values.metrics.serviceMonitor.enabled .) }}
{{- end }}

{{- define "moe-eplb.prometheusRuleOn" -}}
{{- include "moe-eplb.monitoringOn" (list .Values.prometheusRule.enabled .) }}
{{- end }}

{{/* runbook_url of an alert: prometheusRule.runbookUrl + "#" + the alert name in lower case (the
     anchor of its section in docs/runbook.md). Call: include "moe-eplb.runbookUrl" (list $ "Alert") */}}
{{- define "moe-eplb.runbookUrl" -}}
{{- printf "%s#%s" (index . 0).Values.prometheusRule.runbookUrl (lower (index . 1)) }}
{{- end }}
