{{/*
Named helpers. Names are truncated so every derived name stays a valid DNS label (63 chars),
StatefulSet names leave room for the controller-revision-hash label (52 chars).
*/}}

{{- define "elastic-trainer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "elastic-trainer.fullname" -}}
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

{{- define "elastic-trainer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every resource (never on pod templates of the Job: see podLabels). */}}
{{- define "elastic-trainer.labels" -}}
helm.sh/chart: {{ include "elastic-trainer.chart" . }}
app.kubernetes.io/name: {{ include "elastic-trainer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "worker"). */}}
{{- define "elastic-trainer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "elastic-trainer.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "elastic-trainer.componentLabels" -}}
{{ include "elastic-trainer.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* ---------------------------------------------------------------- names */}}
{{- define "elastic-trainer.workers.name" -}}
{{- printf "%s-workers" (include "elastic-trainer.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/* Headless Service of the workers; also the pods' DNS subdomain. */}}
{{- define "elastic-trainer.workers.serviceName" -}}
{{- include "elastic-trainer.workers.name" . }}
{{- end }}

{{- define "elastic-trainer.workers.serviceAccountName" -}}
{{- if .Values.workers.serviceAccount.create }}
{{- default (include "elastic-trainer.workers.name" .) .Values.workers.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.workers.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "elastic-trainer.checkpoints.claimName" -}}
{{- if .Values.checkpoints.existingClaim }}
{{- .Values.checkpoints.existingClaim }}
{{- else }}
{{- printf "%s-checkpoints" (include "elastic-trainer.fullname" . | trunc 51 | trimSuffix "-") }}
{{- end }}
{{- end }}

{{- define "elastic-trainer.etcd.name" -}}
{{- printf "%s-etcd" (include "elastic-trainer.fullname" . | trunc 47 | trimSuffix "-") }}
{{- end }}

{{- define "elastic-trainer.etcd.headlessName" -}}
{{- printf "%s-etcd-headless" (include "elastic-trainer.fullname" . | trunc 47 | trimSuffix "-") }}
{{- end }}

{{/* ---------------------------------------------------------------- image */}}
{{- define "elastic-trainer.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* ---------------------------------------------------------------- run */}}
{{/*
The run id names the rendezvous in etcd. Default: "<namespace>-<release>-<Job uid>", where the
kubelet expands $(JOB_UID) from the pod's batch.kubernetes.io/controller-uid label. It is
unique per release and stable while the Job lives (scaling keeps it), and a recreated Job (after
a failure, or to change the image) gets a fresh rendezvous: torchrun closes a run's rendezvous
for good when a launcher finishes or gives up, so reusing the id would end the new Job at once.
Checkpoints do not depend on it (see checkpointDir), so the new Job resumes.
*/}}
{{- define "elastic-trainer.runId" -}}
{{- default (printf "%s-%s-$(JOB_UID)" .Release.Namespace .Release.Name) .Values.workers.runId }}
{{- end }}

{{/* Checkpoints of this release: stable across Job recreation and run ids. */}}
{{- define "elastic-trainer.checkpointDir" -}}
{{- $sub := default (printf "%s-%s" .Release.Namespace .Release.Name) .Values.checkpoints.subPath }}
{{- printf "%s/%s" (.Values.checkpoints.mountPath | trimSuffix "/") $sub }}
{{- end }}

{{/* Comma-separated client endpoints, "host:port,...". */}}
{{- define "elastic-trainer.rdzvEndpoint" -}}
{{- if eq .Values.etcd.mode "external" }}
{{- join "," .Values.etcd.external.endpoints }}
{{- else }}
{{- $name := include "elastic-trainer.etcd.name" . }}
{{- $svc := include "elastic-trainer.etcd.headlessName" . }}
{{- $members := list }}
{{- range $i := until (int .Values.etcd.bundled.replicas) }}
{{- $members = append $members (printf "%s-%d.%s.%s.svc.%s:2379" $name $i $svc $.Release.Namespace $.Values.clusterDomain) }}
{{- end }}
{{- join "," $members }}
{{- end }}
{{- end }}

{{- define "elastic-trainer.etcdTlsDir" -}}/etc/elastic-trainer/etcd-tls{{- end }}
{{- define "elastic-trainer.etcdAuthDir" -}}/etc/elastic-trainer/etcd-auth{{- end }}
{{/* Where the bundled etcd members read their server certificate (etcd pods only). */}}
{{- define "elastic-trainer.etcd.serverTlsDir" -}}/etc/etcd/tls{{- end }}

{{/* "true" when the bundled etcd serves mutual TLS (empty otherwise). */}}
{{- define "elastic-trainer.etcd.bundledTls" -}}
{{- if and (eq .Values.etcd.mode "bundled") .Values.etcd.bundled.tls.enabled }}true{{- end }}
{{- end }}

{{/*
Secrets of the bundled etcd's TLS: the server one (CA, member certificate and key; mounted in
etcd pods only) and the client one (CA, the workers' client certificate and key; mounted in
worker pods only). With certManager they are the Secrets its Certificates write.
*/}}
{{- define "elastic-trainer.etcd.serverSecretName" -}}
{{- if .Values.etcd.bundled.tls.certManager.enabled }}
{{- printf "%s-server-tls" (include "elastic-trainer.etcd.name" .) }}
{{- else }}
{{- .Values.etcd.bundled.tls.existingSecret }}
{{- end }}
{{- end }}

{{- define "elastic-trainer.etcd.clientSecretName" -}}
{{- if .Values.etcd.bundled.tls.certManager.enabled }}
{{- printf "%s-client-tls" (include "elastic-trainer.etcd.name" .) }}
{{- else }}
{{- .Values.etcd.bundled.tls.clientSecret }}
{{- end }}
{{- end }}

{{/*
The worker-side TLS files, as a dict: secret (name), dir, caKey, certKey, keyKey; empty when
the workers reach etcd without TLS or without a client certificate. One source for the
volume, the mounts, --rdzv-conf and the wait-for-etcd arguments.
*/}}
{{- define "elastic-trainer.etcdClientTls" -}}
{{- $dir := include "elastic-trainer.etcdTlsDir" . }}
{{- if include "elastic-trainer.etcd.bundledTls" . }}
{{- $t := .Values.etcd.bundled.tls }}
{{- toYaml (dict "secret" (include "elastic-trainer.etcd.clientSecretName" .) "dir" $dir "caKey" $t.caKey "certKey" $t.certKey "keyKey" $t.keyKey) }}
{{- else if and (eq .Values.etcd.mode "external") .Values.etcd.external.tls.enabled }}
{{- $t := .Values.etcd.external.tls }}
{{- if $t.clientAuth }}
{{- toYaml (dict "secret" $t.existingSecret "dir" $dir "caKey" $t.caKey "certKey" $t.certKey "keyKey" $t.keyKey) }}
{{- else }}
{{- toYaml (dict "secret" $t.existingSecret "dir" $dir "caKey" $t.caKey "certKey" "" "keyKey" "") }}
{{- end }}
{{- end }}
{{- end }}

{{/* The --rdzv-conf value: TLS and credentials (files) first, then workers.rdzvConf, sorted. */}}
{{- define "elastic-trainer.rdzvConf" -}}
{{- $pairs := list }}
{{- with include "elastic-trainer.etcdClientTls" . | fromYaml }}
{{- $pairs = append $pairs "protocol=https" }}
{{- $pairs = append $pairs (printf "ca_cert=%s/%s" .dir .caKey) }}
{{- if .certKey }}
{{- $pairs = append $pairs (printf "ssl_cert=%s/%s" .dir .certKey) }}
{{- $pairs = append $pairs (printf "ssl_cert_key=%s/%s" .dir .keyKey) }}
{{- end }}
{{- end }}
{{- if eq .Values.etcd.mode "external" }}
{{- $ext := .Values.etcd.external }}
{{- if $ext.auth.enabled }}
{{- /* $(ETCD_USERNAME) is expanded by the kubelet from the env var set from the Secret. */}}
{{- $pairs = append $pairs "user=$(ETCD_USERNAME)" }}
{{- $pairs = append $pairs (printf "password_file=%s/%s" (include "elastic-trainer.etcdAuthDir" .) $ext.auth.passwordKey) }}
{{- end }}
{{- end }}
{{- range $key := keys .Values.workers.rdzvConf | sortAlpha }}
{{- $pairs = append $pairs (printf "%s=%s" $key (include "elastic-trainer.scalar" (get $.Values.workers.rdzvConf $key))) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/*
A scalar as text. YAML numbers arrive as float64, which Go would print as 4.194304e+06: print
integral floats as integers.
*/}}
{{- define "elastic-trainer.scalar" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}
{{- int64 . }}
{{- else }}
{{- . }}
{{- end }}
{{- end }}

{{/*
The bundled example, training.module's default. training.exampleArgs go to it and to nothing
else, and a training.script replaces it without training.module having to be cleared.
*/}}
{{- define "elastic-trainer.exampleModule" -}}elastic_trainer.examples.synthetic_cnn{{- end }}

{{/*
Arguments of the container: the image's entrypoint is `dumb-init -- elastic-trainer`. What the
ranks run: training.script, else `-m training.module` (plus training.exampleArgs for the
example); then training.args, then the checkpoint flag.
*/}}
{{- define "elastic-trainer.launcherArgs" -}}
- run
- --nnodes={{ int .Values.workers.minNodes }}:{{ int .Values.workers.maxNodes }}
- --nproc-per-node={{ int .Values.workers.nprocPerNode }}
- --rdzv-endpoint={{ include "elastic-trainer.rdzvEndpoint" . }}
- --run-id={{ include "elastic-trainer.runId" . }}
{{- with include "elastic-trainer.rdzvConf" . }}
- --rdzv-conf={{ . }}
{{- end }}
- --max-restarts={{ int .Values.workers.maxRestarts }}
- --metrics-port={{ int .Values.workers.metricsPort }}
- --metrics-addr=0.0.0.0
{{- $training := .Values.training }}
{{- if $training.script }}
- {{ $training.script | quote }}
{{- else }}
- -m
- {{ $training.module | quote }}
{{- if eq $training.module (include "elastic-trainer.exampleModule" .) }}
{{- range $training.exampleArgs }}
- {{ include "elastic-trainer.scalar" . | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- range $training.args }}
- {{ include "elastic-trainer.scalar" . | quote }}
{{- end }}
{{- with .Values.training.checkpointDirFlag }}
- {{ printf "%s=%s" . (include "elastic-trainer.checkpointDir" $) | quote }}
{{- end }}
{{- end }}

{{/*
Init container program: wait until one of the bundled etcd members answers /health on its
client port (it needs a leader), bounded by workers.waitForEtcd.timeoutSeconds. Standard
library only; argv: endpoints ("host:port,..."), timeout in seconds, and with TLS the CA,
client certificate and key files (https, the same mutual TLS the launcher will use).
*/}}
{{- define "elastic-trainer.waitForEtcdScript" -}}
import json, ssl, sys, time, urllib.request
endpoints, timeout = sys.argv[1].split(","), float(sys.argv[2])
scheme, context = "http", None
if len(sys.argv) > 3:
    scheme, context = "https", ssl.create_default_context(cafile=sys.argv[3])
    context.load_cert_chain(sys.argv[4], sys.argv[5])
deadline, last = time.monotonic() + timeout, "no answer yet"
while True:
    for endpoint in endpoints:
        try:
            url = f"{scheme}://{endpoint}/health"
            with urllib.request.urlopen(url, timeout=3, context=context) as response:
                if json.load(response).get("health") == "true":
                    print(f"etcd is ready ({endpoint})")
                    sys.exit(0)
                last = f"{endpoint}: unhealthy"
        except Exception as exc:
            last = f"{endpoint}: {exc}"
    if time.monotonic() > deadline:
        print(f"etcd not ready after {timeout:g} s: {last}", file=sys.stderr)
        sys.exit(1)
    time.sleep(2)
{{- end }}

{{/* ---------------------------------------------------------------- validation */}}
{{/*
Cross-field rules JSON Schema cannot express. Called from every always-rendered template so
`helm install/upgrade/template/lint` fail with one clear message listing every problem.
*/}}
{{- define "elastic-trainer.validateValues" -}}
{{- $errors := list }}
{{- $w := .Values.workers }}
{{- $min := int $w.minNodes }}
{{- $max := int $w.maxNodes }}
{{- $replicas := int $w.replicas }}
{{- if lt $min 1 }}
{{- $errors = append $errors (printf "workers.minNodes (%d) must be >= 1" $min) }}
{{- end }}
{{- if gt $min $max }}
{{- $errors = append $errors (printf "workers.minNodes (%d) must be <= workers.maxNodes (%d)" $min $max) }}
{{- end }}
{{- if or (lt $replicas $min) (gt $replicas $max) }}
{{- $errors = append $errors (printf "workers.replicas (%d) must be between workers.minNodes (%d) and workers.maxNodes (%d)" $replicas $min $max) }}
{{- end }}
{{- if le (int $w.terminationGracePeriodSeconds) (int $w.sigtermGraceSeconds) }}
{{- $errors = append $errors (printf "workers.terminationGracePeriodSeconds (%d) must be greater than workers.sigtermGraceSeconds (%d): the pod would be killed before its checkpoint is written" (int $w.terminationGracePeriodSeconds) (int $w.sigtermGraceSeconds)) }}
{{- end }}
{{- $heartbeat := get .Values.nccl.env "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" }}
{{- if and (hasKey .Values.nccl.env "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC") (lt (int (include "elastic-trainer.scalar" $heartbeat)) (int $w.processGroupTimeoutSeconds)) }}
{{- $errors = append $errors (printf "nccl.env.TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (%s) must be >= workers.processGroupTimeoutSeconds (%d): the heartbeat monitor would kill ranks before a slow collective times out" (include "elastic-trainer.scalar" $heartbeat) (int $w.processGroupTimeoutSeconds)) }}
{{- end }}
{{- if eq (toString .Values.image.tag) "latest" }}
{{- $errors = append $errors "image.tag must not be \"latest\": pin a version so every node runs the same code" }}
{{- end }}
{{- $training := .Values.training }}
{{- if and $training.script $training.module (ne $training.module (include "elastic-trainer.exampleModule" .)) }}
{{- $errors = append $errors (printf "set only one of training.module (%s) and training.script (%s); a script alone replaces the bundled example" $training.module $training.script) }}
{{- else if not (or .Values.training.module .Values.training.script) }}
{{- $errors = append $errors "set training.module or training.script" }}
{{- end }}
{{- if eq .Values.etcd.mode "external" }}
{{- $ext := .Values.etcd.external }}
{{- if not $ext.endpoints }}
{{- $errors = append $errors "etcd.mode is external but etcd.external.endpoints is empty" }}
{{- end }}
{{- if and $ext.tls.enabled (not $ext.tls.existingSecret) }}
{{- $errors = append $errors "etcd.external.tls.enabled needs etcd.external.tls.existingSecret (a Secret with the CA, client certificate and key)" }}
{{- end }}
{{- if and $ext.auth.enabled (not $ext.auth.existingSecret) }}
{{- $errors = append $errors "etcd.external.auth.enabled needs etcd.external.auth.existingSecret (a Secret with the user name and password)" }}
{{- end }}
{{- end }}
{{- if eq .Values.etcd.mode "bundled" }}
{{- $tls := .Values.etcd.bundled.tls }}
{{- if $tls.enabled }}
{{- if $tls.certManager.enabled }}
{{- if or $tls.existingSecret $tls.clientSecret }}
{{- $errors = append $errors "etcd.bundled.tls.certManager.enabled creates the Secrets itself: leave etcd.bundled.tls.existingSecret and clientSecret empty" }}
{{- end }}
{{- if not $tls.certManager.issuerRef.name }}
{{- $errors = append $errors "etcd.bundled.tls.certManager.enabled needs etcd.bundled.tls.certManager.issuerRef.name (a cert-manager CA Issuer or ClusterIssuer)" }}
{{- end }}
{{- else }}
{{- if not $tls.existingSecret }}
{{- $errors = append $errors "etcd.bundled.tls.enabled needs etcd.bundled.tls.existingSecret (a Secret with the CA and the etcd server certificate and key) or etcd.bundled.tls.certManager.enabled" }}
{{- end }}
{{- if not $tls.clientSecret }}
{{- $errors = append $errors "etcd.bundled.tls.enabled needs etcd.bundled.tls.clientSecret (a Secret with the CA and the workers' client certificate and key) or etcd.bundled.tls.certManager.enabled" }}
{{- else if eq $tls.clientSecret $tls.existingSecret }}
{{- $errors = append $errors "etcd.bundled.tls.clientSecret must differ from etcd.bundled.tls.existingSecret: the etcd server key must never be mounted in worker pods" }}
{{- end }}
{{- end }}
{{- else if $tls.certManager.enabled }}
{{- $errors = append $errors "etcd.bundled.tls.certManager.enabled needs etcd.bundled.tls.enabled" }}
{{- end }}
{{- end }}
{{- $reserved := list "protocol" "ca_cert" "ssl_cert" "ssl_cert_key" "user" "password" "password_file" }}
{{- range $key := keys $w.rdzvConf | sortAlpha }}
{{- if has $key $reserved }}
{{- $errors = append $errors (printf "workers.rdzvConf.%s is set by the chart from etcd.external or etcd.bundled.tls; remove it" $key) }}
{{- end }}
{{- end }}
{{- if and .Values.metrics.podMonitor.enabled .Values.metrics.serviceMonitor.enabled }}
{{- $errors = append $errors "enable at most one of metrics.podMonitor and metrics.serviceMonitor (both would scrape every worker twice)" }}
{{- end }}
{{- if and .Values.metrics.dashboard.enabled (not (.Files.Get "dashboards/elastic-trainer.json")) }}
{{- $errors = append $errors "metrics.dashboard.enabled but the chart has no dashboards/elastic-trainer.json" }}
{{- end }}
{{- if $errors }}
{{- fail (printf "\n\nelastic-trainer: invalid values:\n  - %s\n" (join "\n  - " $errors)) }}
{{- end }}
{{- end }}
