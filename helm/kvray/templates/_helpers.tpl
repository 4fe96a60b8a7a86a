{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "kvray.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The RayService name. KubeRay derives longer names from it (<name>-serve-svc,
<name>-head-svc, <name>-raycluster-xxxxx-head-...), so it is kept to 40 characters.
*/}}
{{- define "kvray.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvray.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvray.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvray.labels" -}}
helm.sh/chart: {{ include "kvray.chart" . }}
{{ include "kvray.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* KubeRay's stable Service in front of the Serve HTTP proxies (OpenAI API + /metrics). */}}
{{- define "kvray.serveServiceName" -}}
{{- printf "%s-serve-svc" (include "kvray.fullname" .) }}
{{- end }}

{{- define "kvray.metricsServiceName" -}}
{{- printf "%s-metrics" (include "kvray.fullname" .) }}
{{- end }}

{{- define "kvray.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "kvray.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else }}
{{- printf "%s-api-key" (include "kvray.fullname" .) }}
{{- end }}
{{- end }}

{{/* The name clients send as "model" (mirrors kvray.deploy.serve_config._model_name). */}}
{{/* With an API key, kvray's /metrics needs it too: the scrape sends it from the Secret. */}}
{{- define "kvray.metricsAuth" -}}
{{- if .Values.apiKey.enabled }}
authorization:
  type: Bearer
  credentials:
    name: {{ include "kvray.apiKeySecretName" . }}
    key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- end }}

{{- define "kvray.servedModelName" -}}
{{- if .Values.model.servedModelName }}
{{- .Values.model.servedModelName }}
{{- else if .Values.model.path }}
{{- base (trimSuffix "/" .Values.model.path) }}
{{- else }}
{{- "SmolLM2-135M-Instruct" }}
{{- end }}
{{- end }}

{{/*
Fail early, at `helm install` / `helm lint` time, on values that the schema cannot relate to
each other and that would otherwise leave placement groups pending forever.
*/}}
{{- define "kvray.validate" -}}
{{- $e := .Values.engine }}
{{- $w := .Values.worker }}
{{- if or (lt (int $w.replicas) (int $w.minReplicas)) (gt (int $w.replicas) (int $w.maxReplicas)) }}
{{- fail (printf "worker.replicas (%d) must lie within [worker.minReplicas, worker.maxReplicas] = [%d, %d]" (int $w.replicas) (int $w.minReplicas) (int $w.maxReplicas)) }}
{{- end }}
{{- if gt (int $w.gpusPerPod) 0 }}
{{- $needed := mul (int $e.replicas) (int $e.tpSize) }}
{{- $pods := ternary (int $w.maxReplicas) (int $w.replicas) .Values.autoscaling.enabled }}
{{- $capacity := mul $pods (int $w.gpusPerPod) }}
{{- if gt $needed $capacity }}
{{- fail (printf "engine.replicas x engine.tpSize = %d GPUs, but the worker group offers %d pods x %d GPUs = %d; raise worker.replicas%s or worker.gpusPerPod" $needed $pods (int $w.gpusPerPod) $capacity (ternary "/maxReplicas" "" .Values.autoscaling.enabled)) }}
{{- end }}
{{- if and (eq $e.placementStrategy "STRICT_PACK") (gt (int $e.tpSize) (int $w.gpusPerPod)) }}
{{- fail (printf "engine.placementStrategy STRICT_PACK puts one engine's %d TP workers on one pod, but worker.gpusPerPod is %d; raise gpusPerPod or use PACK/SPREAD (NCCL across pods)" (int $e.tpSize) (int $w.gpusPerPod)) }}
{{- end }}
{{- if eq $e.placementStrategy "STRICT_PACK" }}
{{- /* whole engines per pod: GPUs left over on a pod serve no engine */}}
{{- $placeable := mul $pods (div (int $w.gpusPerPod) (int $e.tpSize)) }}
{{- if gt (int $e.replicas) $placeable }}
{{- fail (printf "engine.placementStrategy STRICT_PACK keeps each engine on one pod: %d pods x %d GPUs hold %d whole engines of TP %d, not engine.replicas = %d; raise worker.replicas%s or worker.gpusPerPod, or use PACK/SPREAD" $pods (int $w.gpusPerPod) $placeable (int $e.tpSize) (int $e.replicas) (ternary "/maxReplicas" "" .Values.autoscaling.enabled)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.apiKey.enabled (not .Values.apiKey.existingSecret) (not .Values.apiKey.value) }}
{{- fail "apiKey.enabled needs apiKey.existingSecret (a Secret you created) or apiKey.value" }}
{{- end }}
{{- if and .Values.apiKey.existingSecret .Values.apiKey.value }}
{{- fail "give apiKey.existingSecret or apiKey.value, not both" }}
{{- end }}
{{- if and .Values.model.download.enabled (not .Values.model.download.command) }}
{{- fail "model.download.enabled needs model.download.command" }}
{{- end }}
{{- if and .Values.model.download.enabled (not .Values.model.volume) }}
{{- fail "model.download.enabled needs model.volume (where the checkpoint is written)" }}
{{- end }}
{{- end }}

{{/* The engines' device: engine.device, with "auto" decided by the worker group's GPUs. */}}
{{- define "kvray.device" -}}
{{- if ne .Values.engine.device "auto" }}
{{- .Values.engine.device }}
{{- else if gt (int .Values.worker.gpusPerPod) 0 }}
{{- "cuda" }}
{{- else }}
{{- "cpu" }}
{{- end }}
{{- end }}

{{/* The `args` of the kvray application: kvray.deploy.serve_config.ServeArgs. */}}
{{- define "kvray.serveArgs" -}}
{{- $e := .Values.engine }}
{{- $args := dict
      "app_name" .Values.serve.appName
      "served_model_name" (include "kvray.servedModelName" .)
      "served_model_aliases" .Values.model.servedModelAliases
      "tp_size" (int $e.tpSize)
      "replicas" (int $e.replicas)
      "page_size" (int $e.pageSize)
      "cache_policy" $e.cachePolicy
      "max_running_reqs" (int $e.maxRunningReqs)
      "max_prefill_tokens" (int $e.maxPrefillTokens)
      "itl_target_ms" $e.itlTargetMs
      "speculative_tokens" (int $e.speculativeTokens)
      "prompt_lookup_max" (int $e.promptLookupMax)
      "prompt_lookup_min" (int $e.promptLookupMin)
      "dtype" $e.dtype
      "attention_backend" $e.attentionBackend
      "placement_strategy" $e.placementStrategy
      "compiled" $e.compiledGraph
      "overlap_schedule" $e.overlapSchedule
      "worker_cpus" $e.workerCpus
      "worker_threads" $e.workerThreads
      "bind_threads" $e.bindThreads
      "small_batch_kernel" $e.smallBatchKernel
      "step_channel" $e.stepChannel
      "router" .Values.serve.router
      "router_load_margin" (int .Values.serve.routerLoadMargin)
      "share_kv" .Values.serve.shareKv
      "share_kv_min_tokens" (int .Values.serve.shareKvMinTokens)
      "request_channel" .Values.serve.requestChannel
      "seed" (int $e.seed)
      "device" (include "kvray.device" .)
      "special_tokens_in_messages" .Values.serve.specialTokensInMessages
      "public_paths" .Values.serve.publicPaths
      "health_timeout_s" .Values.serve.healthTimeoutS
      "generation_config" .Values.serve.generationConfig
      "allowed_origins" .Values.serve.allowedOrigins }}
{{- if .Values.model.path }}
{{- $_ := set $args "model" .Values.model.path }}
{{- end }}
{{- if not (kindIs "invalid" $e.numPages) }}
{{- $_ := set $args "num_pages" (int $e.numPages) }}
{{- end }}
{{- if not (kindIs "invalid" $e.kvCacheMemoryGb) }}
{{- $_ := set $args "kv_cache_memory_gb" $e.kvCacheMemoryGb }}
{{- end }}
{{- if not (kindIs "invalid" $e.maxSeqLen) }}
{{- $_ := set $args "max_seq_len" (int $e.maxSeqLen) }}
{{- end }}
{{- if .Values.serve.chatTemplate }}
{{- $_ := set $args "chat_template" .Values.serve.chatTemplate }}
{{- end }}
{{- if not (kindIs "invalid" .Values.serve.maxTokensDefault) }}
{{- $_ := set $args "max_tokens_default" (int .Values.serve.maxTokensDefault) }}
{{- end }}
{{- if not (kindIs "invalid" .Values.serve.maxTokensCap) }}
{{- $_ := set $args "max_tokens_cap" (int .Values.serve.maxTokensCap) }}
{{- end }}
{{- if .Values.apiKey.enabled }}
{{- $_ := set $args "api_key_env" "KVRAY_API_KEY" }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/* serveConfigV2: one Serve application built by kvray.deploy.serve_config:app_builder. */}}
{{- define "kvray.serveConfig" -}}
{{- $app := dict
      "name" .Values.serve.appName
      "route_prefix" .Values.serve.routePrefix
      "import_path" "kvray.deploy.serve_config:app_builder"
      "args" (include "kvray.serveArgs" . | fromYaml) }}
{{- $config := dict
      "http_options" (dict "host" "0.0.0.0" "port" (int .Values.serve.port))
      "applications" (list $app) }}
{{- toYaml (merge $config .Values.serve.extraConfig) }}
{{- end }}

{{/* Environment shared by the head and the workers. */}}
{{- define "kvray.env" -}}
{{- if .Values.apiKey.enabled }}
- name: KVRAY_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kvray.apiKeySecretName" . }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
- name: TOKENIZERS_PARALLELISM
  value: "false"
{{- end }}

{{- define "kvray.envFrom" -}}
{{- if .Values.model.credentialsSecret }}
envFrom:
  - secretRef:
      name: {{ .Values.model.credentialsSecret }}
{{- end }}
{{- end }}

{{/* Volumes for a pod; pass (dict "root" $ "shm" <size or "">). */}}
{{- define "kvray.volumes" -}}
{{- $v := .root.Values }}
{{- if or $v.model.volume .shm }}
volumes:
{{- if $v.model.volume }}
  - name: model
{{ toYaml $v.model.volume | indent 4 }}
{{- end }}
{{- if .shm }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .shm }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvray.volumeMounts" -}}
{{- $v := .root.Values }}
{{- if or $v.model.volume .shm }}
volumeMounts:
{{- if $v.model.volume }}
  - name: model
    mountPath: {{ $v.model.mountPath }}
    readOnly: {{ not $v.model.download.enabled }}
{{- end }}
{{- if .shm }}
  - name: dshm
    mountPath: /dev/shm
{{- end }}
{{- end }}
{{- end }}

{{/* The model download init container, when enabled. */}}
{{- define "kvray.initContainers" -}}
{{- $v := .Values }}
{{- if $v.model.download.enabled }}
initContainers:
  - name: model-download
    image: {{ default (include "kvray.image" .) $v.model.download.image }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command:
{{ toYaml $v.model.download.command | indent 6 }}
{{- with (include "kvray.envFrom" . | trim) }}{{ . | nindent 4 }}{{- end }}
    volumeMounts:
      - name: model
        mountPath: {{ $v.model.mountPath }}
{{- with $v.model.download.resources }}
    resources:
{{ toYaml . | indent 6 }}
{{- end }}
{{- end }}
{{- end }}

{{/* The worker container's resources with the GPU count set in limits (and requests). */}}
{{- define "kvray.workerResources" -}}
{{- $w := .Values.worker }}
{{- $res := deepCopy (default (dict) $w.resources) }}
{{- if gt (int $w.gpusPerPod) 0 }}
{{- $limits := default (dict) $res.limits }}
{{- $_ := set $limits $w.gpuResourceName (int $w.gpusPerPod) }}
{{- $_ := set $res "limits" $limits }}
{{- if $res.requests }}
{{- $_ := set $res.requests $w.gpuResourceName (int $w.gpusPerPod) }}
{{- end }}
{{- end }}
{{- toYaml $res }}
{{- end }}
