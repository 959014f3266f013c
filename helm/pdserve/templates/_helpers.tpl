{{/*
Names. The RayCluster is named after the release; KubeRay names its head Service
"<cluster>-head-svc" and shortens names over 50 characters, so the cluster name stays within 41.
*/}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 41 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 41 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 41 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries; `component` says which part of the release it is. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" .root }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Selects every pod of the release (Ray head and workers, gateway, Redis). */}}
{{- define "pdserve.releaseSelector" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.rayClusterName" -}}
{{- include "pdserve.fullname" . }}
{{- end }}

{{/* The address of Ray's GCS on the head, which the gateway joins. */}}
{{- define "pdserve.rayAddress" -}}
{{- printf "%s-head-svc:%d" (include "pdserve.rayClusterName" .) (int .Values.ray.head.gcsPort) }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString (default .Chart.AppVersion .Values.image.tag)) }}
{{- end }}

{{/* The API key's Secret: an existing one, or the one the chart creates. */}}
{{- define "pdserve.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "pdserve.fullname" .)) .Values.apiKey.existingSecret }}
{{- end }}

{{/* Ray's token: an existing Secret, or the one the chart creates. */}}
{{- define "pdserve.rayAuthSecretName" -}}
{{- default (printf "%s-ray-auth" (include "pdserve.fullname" .)) .Values.ray.auth.existingSecret }}
{{- end }}

{{/*
Ray's authentication, in the environment of every Ray container: the head, the worker groups, the
gateway (whose `ray start` joins the cluster and whose driver calls it) and the autoscaler. Ray 2.x
reads RAY_AUTH_MODE and RAY_AUTH_TOKEN: with a token, a process without it can neither join nor call
the GCS, the raylets or the dashboard. The dashboard's health endpoints (/api/gcs_healthz,
/api/local_raylet_healthz, /api/healthz) need no token, so KubeRay's probes keep working.
(Recent KubeRay releases' `authOptions` would do this too; the environment works with every KubeRay
the chart supports.) Disabled: only the NetworkPolicy fences Ray.
*/}}
{{- define "pdserve.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.rayAuthSecretName" . }}
      key: {{ .Values.ray.auth.secretKey }}
{{- else }}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- end }}

{{/* Whether the chart runs Redis of its own (no external URL). */}}
{{- define "pdserve.ownRedis" -}}
{{- if and .Values.redis.enabled (not .Values.redis.externalUrl) }}true{{ end }}
{{- end }}

{{/* Whether the chart's own Redis requires a password. */}}
{{- define "pdserve.redisAuth" -}}
{{- if and (include "pdserve.ownRedis" .) .Values.redis.auth.enabled }}true{{ end }}
{{- end }}

{{/* The Redis password's Secret: an existing one, or the one the chart creates. */}}
{{- define "pdserve.redisSecretName" -}}
{{- default (printf "%s-redis-auth" (include "pdserve.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{/*
Redis for state shared by routers and workers: the chart's own, an external URL (credentials, if
any, in it), or none. The chart's own with a password: `$(REDIS_PASSWORD)`, which Kubernetes fills
in from an env entry defined before the one holding this URL.
*/}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.externalUrl }}
{{- .Values.redis.externalUrl }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s%s-redis:%d/0" (ternary ":$(REDIS_PASSWORD)@" "" (eq (include "pdserve.redisAuth" .) "true")) (include "pdserve.fullname" .) (int .Values.redis.port) }}
{{- end }}
{{- end }}

{{/* The env entry REDIS_PASSWORD, from the chart's Redis Secret. */}}
{{- define "pdserve.redisPasswordEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: {{ .Values.redis.auth.secretKey }}
{{- end }}

{{/*
A Secret's value that upgrades keep: the one given in values, else the one already in the cluster
(`lookup`; empty under `helm template`), else a random one of `length` letters and digits.
*/}}
{{- define "pdserve.keptSecretValue" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- $value := .value }}
{{- if and (not $value) $existing }}
{{- $value = get $existing.data .key | b64dec }}
{{- end }}
{{- default (randAlphaNum (int .length)) $value }}
{{- end }}

{{/* Ray custom resources that pin pdserve's pools to their worker groups. */}}
{{- define "pdserve.prefillResource" -}}prefill_node{{- end }}
{{- define "pdserve.decodeResource" -}}decode_node{{- end }}

{{/* pdserve workers in a pool: each pod of a group runs `workersPerPod` of them. */}}
{{- define "pdserve.prefillWorkers" -}}
{{- mul (int .Values.ray.prefill.replicas) (int .Values.ray.prefill.workersPerPod) }}
{{- end }}

{{/*
Whether Ray's autoscaler runs: asked for, or needed by pdserve's live controller (its new workers
wait for pods the autoscaler brings up).
*/}}
{{- define "pdserve.autoscaling" -}}
{{- if or .Values.ray.enableInTreeAutoscaling .Values.cluster.scaling.enabled }}true{{ else }}false{{ end }}
{{- end }}

{{/*
A pool's bound for the live controller: the workers its groups hold at `key` (minReplicas or
maxReplicas, else replicas) pods each, summed; at least 1.
*/}}
{{- define "pdserve.poolBound" -}}
{{- $total := 0 }}
{{- range .groups }}
{{- $pods := ternary (get . $.key) .replicas (hasKey . $.key) }}
{{- $total = add $total (mul (int $pods) (int .workersPerPod)) }}
{{- end }}
{{- max 1 $total }}
{{- end }}

{{- define "pdserve.decodeWorkers" -}}
{{- $total := 0 }}
{{- range .Values.ray.decodeGroups }}
{{- $total = add $total (mul (int .replicas) (int .workersPerPod)) }}
{{- end }}
{{- $total }}
{{- end }}

{{/*
Environment every pdserve container shares (all of them run Ray): Ray's authentication, the model
cache, a writable home under /tmp.
*/}}
{{- define "pdserve.commonEnv" -}}
{{ include "pdserve.rayAuthEnv" . | trim }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: UCX_WARN_UNUSED_ENV_VARS
  value: "n"
- name: PDSERVE_CACHE_DIR
  value: {{ .Values.model.cacheDir | quote }}
- name: HOME
  value: /tmp/home
{{- end }}

{{/* Volumes every pdserve pod mounts: /tmp (Ray's session files), the model cache, extras. */}}
{{- define "pdserve.commonVolumes" -}}
- name: tmp
  emptyDir: {}
- name: model-cache
  {{- toYaml .Values.model.cacheVolume | nindent 2 }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdserve.commonVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: model-cache
  mountPath: {{ .Values.model.cacheDir }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
One Ray worker group: `group` is its values, `resource` the custom resource its pods offer.
*/}}
{{- define "pdserve.workerGroup" -}}
{{- $root := .root }}
{{- $group := .group }}
{{- $min := ternary $group.minReplicas $group.replicas (hasKey $group "minReplicas") }}
{{- $max := ternary $group.maxReplicas $group.replicas (hasKey $group "maxReplicas") -}}
- groupName: {{ $group.groupName }}
  replicas: {{ int $group.replicas }}
  minReplicas: {{ int $min }}
  maxReplicas: {{ int $max }}
  {{- if and $group.idleTimeoutSeconds (eq (include "pdserve.autoscaling" $root) "true") }}
  {{- if ne (toString $root.Values.ray.autoscalerOptions.version) "v2" }}
  {{- fail (printf "worker group %s: idleTimeoutSeconds needs the v2 autoscaler (ray.autoscalerOptions.version: v2)" $group.groupName) }}
  {{- end }}
  idleTimeoutSeconds: {{ int $group.idleTimeoutSeconds }}
  {{- end }}
  rayStartParams:
    {{- /* A JSON object inside a quoted string: KubeRay passes it to `ray start --resources` as is. */}}
    resources: {{ printf "\"{\\\"%s\\\": %d}\"" .resource (int $group.workersPerPod) | squote }}
    {{- range $key, $value := $group.rayStartParams }}
    {{ $key }}: {{ $value | toString | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" (dict "root" $root "component" "ray-worker") | nindent 8 }}
        pdserve.io/pool: {{ .pool }}
        {{- with $group.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $group.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "pdserve.rayPodSpec" (dict "root" $root "group" $group "containerName" "ray-worker") | trim | nindent 6 }}
{{- end }}

{{/* The pod spec of a Ray pod (head or worker); KubeRay fills in the `ray start` command. */}}
{{- define "pdserve.rayPodSpec" -}}
{{- $root := .root }}
{{- $group := .group -}}
{{- if and .head (eq (include "pdserve.autoscaling" $root) "true") }}
{{- /* The autoscaler beside the head scales the RayCluster through the API: KubeRay gives the head an
account of its own with the rights it needs, and the head mounts its token. */}}
{{- else }}
serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
automountServiceAccountToken: false
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: {{ .containerName }}
    image: {{ include "pdserve.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    {{- with .ports }}
    ports:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    env:
      {{- include "pdserve.commonEnv" $root | nindent 6 }}
      {{- with $root.Values.ray.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
      {{- with $group.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    resources:
      {{- toYaml $group.resources | nindent 6 }}
    securityContext:
      {{- toYaml (default $root.Values.containerSecurityContext $group.securityContext) | nindent 6 }}
    volumeMounts:
      {{- include "pdserve.commonVolumeMounts" $root | nindent 6 }}
      - name: shm
        mountPath: /dev/shm
volumes:
  {{- include "pdserve.commonVolumes" $root | nindent 2 }}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $group.shmSize }}
{{- end }}

{{/* The model name clients send: as cluster/engine/llm_engine.py served_model_name. */}}
{{- define "pdserve.servedModelName" -}}
{{- if eq .Values.model.name "default" }}SmolLM2-135M-Instruct
{{- else }}{{ base .Values.model.name | trimSuffix ".gguf" }}
{{- end }}
{{- end }}

{{/*
Where the gateway, routers and workers send their traces (cluster.yaml's tracing.endpoint): the
release's collector when tracing.collector.enabled, else tracing.endpoint ("" : no tracing).
*/}}
{{- define "pdserve.tracesEndpoint" -}}
{{- if and .Values.tracing.collector.enabled .Values.tracing.endpoint }}
{{- fail "tracing.endpoint and tracing.collector.enabled exclude each other: with the chart's collector the endpoint is the collector; point the collector's exporters at your backend instead" }}
{{- end }}
{{- if .Values.tracing.collector.enabled -}}
http://{{ include "pdserve.fullname" . }}-otel-collector.{{ .Release.Namespace }}.svc:{{ int .Values.tracing.collector.port }}
{{- else -}}
{{ .Values.tracing.endpoint }}
{{- end }}
{{- end }}
