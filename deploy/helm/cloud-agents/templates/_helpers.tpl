{{/* Names. */}}
{{- define "cloud-agents.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cloud-agents.fullname" -}}
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

{{- define "cloud-agents.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "cloud-agents.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cloud-agents
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "front"). */}}
{{- define "cloud-agents.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cloud-agents.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "cloud-agents.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cloud-agents.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "cloud-agents.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The NATS URL: the bundled chart's client Service, else externalNatsUrl. */}}
{{- define "cloud-agents.natsUrl" -}}
{{- if .Values.nats.enabled }}
{{- $nats := "nats" }}
{{- if contains $nats .Release.Name }}
{{- printf "nats://%s.%s.svc:4222" (.Release.Name | trunc 63 | trimSuffix "-") .Release.Namespace }}
{{- else }}
{{- printf "nats://%s-nats.%s.svc:4222" .Release.Name .Release.Namespace }}
{{- end }}
{{- else }}
{{- required "externalNatsUrl is required when nats.enabled is false" .Values.externalNatsUrl }}
{{- end }}
{{- end }}

{{- define "cloud-agents.generatedSecretName" -}}
{{- printf "%s-jwt" (include "cloud-agents.fullname" .) }}
{{- end }}

{{/* True when the chart generates the HS256 secret. */}}
{{- define "cloud-agents.generateSecret" -}}
{{- if and .Values.auth.generateHs256Secret (not .Values.auth.hs256Secrets) (not .Values.auth.ed25519PublicKeys) }}true{{ end }}
{{- end }}

{{- define "cloud-agents.generatedOperatorSecretName" -}}
{{- printf "%s-operator-jwt" (include "cloud-agents.fullname" .) }}
{{- end }}

{{/* True when the chart generates the operator HS256 secret. */}}
{{- define "cloud-agents.generateOperatorSecret" -}}
{{- if and .Values.auth.generateOperatorHs256Secret (not .Values.auth.operatorHs256Secrets) (not .Values.auth.operatorEd25519PublicKeys) }}true{{ end }}
{{- end }}

{{/* Environment shared by every component: (dict "ctx" $ "component" "front"). */}}
{{- define "cloud-agents.commonEnv" -}}
- name: FLEET_NATS_URL
  value: {{ include "cloud-agents.natsUrl" .ctx | quote }}
- name: FLEET_LOG
  value: {{ .ctx.Values.logLevel | quote }}
- name: FLEET_JETSTREAM_REPLICAS
  value: {{ .ctx.Values.jetstream.replicas | quote }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- with .ctx.Values.otlp.endpoint }}
- name: FLEET_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "cloud-agents-%s" $.component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,service.namespace=cloud-agents%s" $.ctx.Release.Namespace (ternary (printf ",%s" $.ctx.Values.otlp.resourceAttributes) "" (ne $.ctx.Values.otlp.resourceAttributes "")) | quote }}
{{- end }}
{{- end }}

{{/* Security context of a container that needs nothing: non-root, read-only root, no capabilities. */}}
{{- define "cloud-agents.restrictedSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The Secret holding the link-signing key (given or generated). */}}
{{- define "cloud-agents.linkSecretName" -}}
{{- default (printf "%s-links" (include "cloud-agents.fullname" .)) .Values.services.linkSigningKey.secretName }}
{{- end }}

{{/* Host-services flags shared by front and worker. */}}
{{- define "cloud-agents.servicesArgs" -}}
- --link-signing-key-file=/var/run/cloud-agents/links/link-signing-key
{{- if .Values.services.publicUrl }}
- --public-url={{ .Values.services.publicUrl }}
{{- end }}
{{- if .Values.services.config }}
- --services-config=/var/run/cloud-agents/services/services.toml
{{- end }}
{{- end }}

{{/* Host-services volume mounts shared by front and worker. */}}
{{- define "cloud-agents.servicesMounts" -}}
- name: link-key
  mountPath: /var/run/cloud-agents/links
  readOnly: true
{{- if .Values.services.config }}
- name: services-config
  mountPath: /var/run/cloud-agents/services
  readOnly: true
{{- end }}
{{- if .Values.services.llmApiKey.secretName }}
- name: llm-api-key
  mountPath: /var/run/cloud-agents/llm
  readOnly: true
{{- end }}
{{- end }}

{{/* Host-services volumes shared by front and worker. */}}
{{- define "cloud-agents.servicesVolumes" -}}
- name: link-key
  secret:
    secretName: {{ include "cloud-agents.linkSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.services.linkSigningKey.key }}
        path: link-signing-key
{{- if .Values.services.config }}
- name: services-config
  configMap:
    name: {{ include "cloud-agents.fullname" . }}-services
{{- end }}
{{- if .Values.services.llmApiKey.secretName }}
- name: llm-api-key
  secret:
    secretName: {{ .Values.services.llmApiKey.secretName }}
    defaultMode: 0440
    items:
      - key: {{ .Values.services.llmApiKey.key }}
        path: api-key
{{- end }}
{{- end }}
