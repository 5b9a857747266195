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

{{/* The bundled nats chart's client Service (its nats.fullname). */}}
{{- define "cloud-agents.natsServiceName" -}}
{{- if contains "nats" .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-nats" .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The NATS URL: the bundled chart's client Service, else externalNatsUrl. */}}
{{- define "cloud-agents.natsUrl" -}}
{{- if .Values.nats.enabled }}
{{- printf "nats://%s.%s.svc:4222" (include "cloud-agents.natsServiceName" .) .Release.Namespace }}
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
{{- with .ctx.Values.clusterCidrs }}
- name: FLEET_CLUSTER_CIDRS
  value: {{ join "," . | quote }}
{{- end }}
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

{{/* The Secret holding the credentials keyring (given or generated). */}}
{{- define "cloud-agents.credentialsSecretName" -}}
{{- default (printf "%s-credentials-keyring" (include "cloud-agents.fullname" .)) .Values.services.credentialsKeyring.secretName }}
{{- end }}

{{/* Host-services flags shared by front and worker. */}}
{{- define "cloud-agents.servicesArgs" -}}
- --link-signing-key-file=/var/run/cloud-agents/links/link-signing-key
- --credentials-key-file=/var/run/cloud-agents/credentials/credentials.keys
{{- if .Values.services.publicUrl }}
- --public-url={{ .Values.services.publicUrl }}
{{- end }}
{{- if .Values.services.filesPublicUrl }}
- --files-public-url={{ .Values.services.filesPublicUrl }}
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
- name: credentials-keyring
  mountPath: /var/run/cloud-agents/credentials
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
{{- if .Values.services.imageApiKey.secretName }}
- name: image-api-key
  mountPath: /var/run/cloud-agents/image
  readOnly: true
{{- end }}
{{- if .Values.services.oauthClientSecrets.secretName }}
- name: oauth-client-secrets
  mountPath: /var/run/cloud-agents/oauth
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
- name: credentials-keyring
  secret:
    secretName: {{ include "cloud-agents.credentialsSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.services.credentialsKeyring.key }}
        path: credentials.keys
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
{{- if .Values.services.imageApiKey.secretName }}
- name: image-api-key
  secret:
    secretName: {{ .Values.services.imageApiKey.secretName }}
    defaultMode: 0440
    items:
      - key: {{ .Values.services.imageApiKey.key }}
        path: api-key
{{- end }}
{{- if .Values.services.oauthClientSecrets.secretName }}
- name: oauth-client-secrets
  secret:
    secretName: {{ .Values.services.oauthClientSecrets.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* --- NATS authentication and TLS (deploy/helm/README.md "NATS security") --------------------------------- */}}

{{/* True when the fleet connects with credentials (always, unless natsAuth.insecureOpenBus). */}}
{{- define "cloud-agents.natsAuth" -}}
{{- if not .Values.natsAuth.insecureOpenBus }}true{{ end }}
{{- end }}

{{/* Refuses values that would leave the bus open or the bundled servers without the accounts. */}}
{{- define "cloud-agents.natsAuthCheck" -}}
{{- $a := .Values.natsAuth }}
{{- if and $a.insecureOpenBus $a.existingSecret }}
{{- fail "natsAuth: set either natsAuth.existingSecret (credentials) or natsAuth.insecureOpenBus=true (no credentials), not both" }}
{{- end }}
{{- if and (not $a.insecureOpenBus) (not $a.existingSecret) }}
{{- fail "natsAuth.existingSecret is required: the fleet connects to NATS with per-role credentials. Create them once with `fleet nats-auth init --dir ./nats-auth && kubectl create secret generic cloud-agents-nats-auth --from-file=./nats-auth` and set natsAuth.existingSecret=cloud-agents-nats-auth (deploy/helm/README.md \"NATS security\"). Only for a throwaway development cluster: natsAuth.insecureOpenBus=true (an open bus: any client that reaches NATS reads every user's calls)" }}
{{- end }}
{{- if and $a.insecureOpenBus (not $a.execSealSecret) (not .Values.nats.enabled) }}
{{- fail "natsAuth.execSealSecret is required with natsAuth.insecureOpenBus=true: even on an open bus workers run only what a front sealed. Create it with `fleet nats-auth init --dir ./nats-auth && kubectl create secret generic cloud-agents-exec-seal --from-file=./nats-auth/exec.seed --from-file=./nats-auth/exec.pub`" }}
{{- end }}
{{- if and $a.execSealSecret (not $a.insecureOpenBus) }}
{{- fail "natsAuth.execSealSecret is only for natsAuth.insecureOpenBus=true: with natsAuth.existingSecret the exec seal keys (exec.seed, exec.pub) come from that Secret" }}
{{- end }}
{{- if .Values.nats.enabled }}
{{- if $a.insecureOpenBus }}
{{- fail "natsAuth.insecureOpenBus=true cannot be combined with nats.enabled=true: the bundled NATS servers run in operator mode and load server-auth.conf from natsAuth.existingSecret" }}
{{- end }}
{{- $volume := false }}
{{- range (dig "podTemplate" "patch" list .Values.nats) }}
{{- if and (kindIs "map" .) (kindIs "map" .value) (kindIs "map" .value.secret) }}
{{- if eq (toString .value.secret.secretName) $a.existingSecret }}
{{- $volume = true }}
{{- end }}
{{- end }}
{{- end }}
{{- if not $volume }}
{{- fail (printf "nats.enabled: the bundled NATS servers must mount server-auth.conf from natsAuth.existingSecret (%s): set the nats-auth volume of nats.podTemplate.patch to secretName: %s (values.yaml)" $a.existingSecret $a.existingSecret) }}
{{- end }}
{{- $include := false }}
{{- range $k, $v := (dig "config" "merge" dict .Values.nats) }}
{{- if and (hasSuffix "$include" $k) (kindIs "string" $v) (hasSuffix "server-auth.conf" $v) }}
{{- $include = true }}
{{- end }}
{{- end }}
{{- if not $include }}
{{- fail "nats.enabled: nats.config.merge must include server-auth.conf (zzz$include: ../nats-auth/server-auth.conf, values.yaml): without it the bundled servers accept anyone" }}
{{- end }}
{{- end }}
{{- $t := .Values.natsTls }}
{{- if and $t.secretName (not $t.ca) }}
{{- fail "natsTls.ca is required with natsTls.secretName: the key of the CA certificate that signed the NATS servers' certificate" }}
{{- end }}
{{- if and $t.secretName (ne (empty $t.cert) (empty $t.key)) }}
{{- fail "natsTls.cert and natsTls.key go together: both (mutual TLS) or neither (server TLS only)" }}
{{- end }}
{{- end }}

{{/* NATS credential and TLS flags of one component: (dict "ctx" $ "component" "front"|"worker"). */}}
{{- define "cloud-agents.natsArgs" -}}
{{- if include "cloud-agents.natsAuth" .ctx }}
{{- if eq .component "front" }}
- --nats-creds=/var/run/cloud-agents/nats-auth/front.creds
- --nats-auth-dir=/var/run/cloud-agents/nats-auth
{{- else }}
- --nats-creds=/var/run/cloud-agents/nats/worker.creds
{{- end }}
{{- else if eq .component "front" }}
- --exec-signing-key=/var/run/cloud-agents/exec-seal/exec.seed
{{- else }}
- --exec-verify-key=/var/run/cloud-agents/exec-seal/exec.pub
{{- end }}
{{- with .ctx.Values.natsTls }}
{{- if .secretName }}
- --nats-tls-ca=/var/run/cloud-agents/nats-tls/ca.crt
{{- if .cert }}
- --nats-tls-cert=/var/run/cloud-agents/nats-tls/tls.crt
- --nats-tls-key=/var/run/cloud-agents/nats-tls/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* NATS volume mounts of one component: (dict "ctx" $ "component" …). */}}
{{- define "cloud-agents.natsMounts" -}}
{{- if include "cloud-agents.natsAuth" .ctx }}
{{- if eq .component "front" }}
- name: nats-auth
  mountPath: /var/run/cloud-agents/nats-auth
  readOnly: true
{{- else }}
- name: nats-creds
  mountPath: /var/run/cloud-agents/nats
  readOnly: true
{{- end }}
{{- else }}
- name: exec-seal
  mountPath: /var/run/cloud-agents/exec-seal
  readOnly: true
{{- end }}
{{- if .ctx.Values.natsTls.secretName }}
- name: nats-tls
  mountPath: /var/run/cloud-agents/nats-tls
  readOnly: true
{{- end }}
{{- end }}

{{/* NATS volumes of one component: (dict "ctx" $ "component" …). Fronts get the issuer material (seeds.json,
     jwts.json, sys.creds: --nats-auth-dir), front.creds and the exec seal seed (exec.seed); workers get
     worker.creds and the seal's public key (exec.pub), nothing else. On an open bus, only the seal keys, from
     natsAuth.execSealSecret. Files are group-readable on fronts (fsGroup 65532, non-root) and root-only on
     workers, whose plugins run as other uids. */}}
{{- define "cloud-agents.natsVolumes" -}}
{{- $secret := .ctx.Values.natsAuth.existingSecret }}
{{- if include "cloud-agents.natsAuth" .ctx }}
{{- if eq .component "front" }}
- name: nats-auth
  secret:
    secretName: {{ $secret }}
    defaultMode: 0440
    items:
      - key: seeds.json
        path: seeds.json
      - key: jwts.json
        path: jwts.json
      - key: sys.creds
        path: sys.creds
      - key: front.creds
        path: front.creds
      - key: exec.seed
        path: exec.seed
{{- else }}
- name: nats-creds
  secret:
    secretName: {{ $secret }}
    defaultMode: 0400
    items:
      - key: worker.creds
        path: worker.creds
      - key: exec.pub
        path: exec.pub
{{- end }}
{{- else }}
- name: exec-seal
  secret:
    secretName: {{ .ctx.Values.natsAuth.execSealSecret }}
    defaultMode: {{ ternary "0440" "0400" (eq .component "front") }}
    items:
      {{- if eq .component "front" }}
      - key: exec.seed
        path: exec.seed
      {{- else }}
      - key: exec.pub
        path: exec.pub
      {{- end }}
{{- end }}
{{- with .ctx.Values.natsTls }}
{{- if .secretName }}
- name: nats-tls
  secret:
    secretName: {{ .secretName }}
    defaultMode: {{ ternary "0440" "0400" (eq $.component "front") }}
    items:
      - key: {{ .ca }}
        path: ca.crt
      {{- if .cert }}
      - key: {{ .cert }}
        path: tls.crt
      - key: {{ .key }}
        path: tls.key
      {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Selector labels of the bundled nats chart's server pods (its nats.selectorLabels). */}}
{{- define "cloud-agents.natsServerSelectorLabels" -}}
app.kubernetes.io/name: {{ default "nats" .Values.nats.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: nats
{{- end }}

{{/* The port of a URL: (dict "url" "nats://h:4222" "default" 4222). The first URL of a comma-separated list. */}}
{{- define "cloud-agents.urlPort" -}}
{{- $hostport := regexReplaceAll "^[a-zA-Z]+://([^/,@]*@)?([^/,]*).*$" .url "${2}" }}
{{- $port := regexFind "[0-9]+$" (regexFind ":[0-9]+$" $hostport) }}
{{- default (toString .default) $port }}
{{- end }}
