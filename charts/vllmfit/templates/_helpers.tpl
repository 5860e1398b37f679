{{/* Chart name. */}}
{{- define "vllmfit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource-name prefix ("fullname"); every name below is built from it. */}}
{{- define "vllmfit.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "vllmfit.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Names shared with the operator's command line (docs/install.md, "Operator flags"). */}}
{{- define "vllmfit.operatorName" -}}{{ include "vllmfit.fullname" . }}-operator{{- end -}}
{{- define "vllmfit.agentName" -}}{{ include "vllmfit.fullname" . }}-agent{{- end -}}
{{- define "vllmfit.reservationName" -}}{{ include "vllmfit.fullname" . }}-reservation{{- end -}}
{{- define "vllmfit.reservationPriorityClass" -}}
{{- .Values.placement.reservation.priorityClassName | default (printf "%s-reservation" (include "vllmfit.fullname" .)) -}}
{{- end -}}
{{- define "vllmfit.reservationImage" -}}
{{- $repo := .Values.placement.reservation.image.repository | default .Values.image.repository -}}
{{- $tag := .Values.placement.reservation.image.tag | default .Values.image.tag | default .Chart.AppVersion -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}
{{- define "vllmfit.webhookService" -}}{{ include "vllmfit.fullname" . }}-webhook{{- end -}}
{{- define "vllmfit.certSecret" -}}{{ include "vllmfit.fullname" . }}-webhook-cert{{- end -}}
{{- define "vllmfit.metricsService" -}}{{ include "vllmfit.fullname" . }}-metrics{{- end -}}
{{- define "vllmfit.validatingWebhook" -}}vllmfit-validate{{- end -}}
{{- define "vllmfit.mutatingWebhook" -}}vllmfit-default{{- end -}}
{{- define "vllmfit.certDir" -}}/etc/vllmfit/certs{{- end -}}
{{/* Where the API server's client CA is mounted (webhook.clientAuth), as ca.crt. */}}
{{- define "vllmfit.clientCaDir" -}}/etc/vllmfit/client-ca{{- end -}}

{{/* Labels of every object (without the component). */}}
{{- define "vllmfit.labels" -}}
app.kubernetes.io/name: {{ include "vllmfit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{ include "vllmfit.versionLabels" . }}
{{- end -}}

{{/* The labels that are not selector labels (pod templates add them to the selector labels). */}}
{{- define "vllmfit.versionLabels" -}}
helm.sh/chart: {{ include "vllmfit.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: vllmfit
{{- end -}}

{{- define "vllmfit.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "vllmfit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "vllmfit.agentSelectorLabels" -}}
app.kubernetes.io/name: {{ include "vllmfit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "vllmfit.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "vllmfit.agentImage" -}}
{{- $repo := default .Values.image.repository .Values.agent.image.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.agent.image.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* The pod and container security contexts every vllmfit pod uses (tests/chart checks them). */}}
{{- define "vllmfit.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "vllmfit.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end -}}
