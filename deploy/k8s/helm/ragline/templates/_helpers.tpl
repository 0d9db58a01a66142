{{- define "ragline.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "ragline.labels" -}}
app.kubernetes.io/part-of: ragline
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "ragline.selector" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/name: {{ .name }}
{{- end -}}

{{- /* The bundled etcd by its headless Service's one name, which resolves to every
member (gRPC's DNS resolver; a list of names would not be one target). */ -}}
{{- define "ragline.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "%s-etcd:2379" (include "ragline.fullname" .) -}}
{{- else -}}
{{- required "etcd.endpoints is required when etcd.enabled is false" .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{- define "ragline.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ragline.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /* "true" when RAGLINE_TLS_MODE is tls or mtls. */ -}}
{{- define "ragline.tlsOn" -}}
{{- ne (toString .Values.config.RAGLINE_TLS_MODE) "off" -}}
{{- end -}}

{{- /* Whether the bundled Redis has its exporter: asked for, and a way to log in (no
password asked, or the exporter's own user's). */ -}}
{{- define "ragline.redisExporter" -}}
{{- if and .Values.redis.enabled .Values.redis.exporter.enabled (or (not .Values.redis.password) .Values.redis.exporter.password) -}}
true
{{- end -}}
{{- end -}}

{{- /* Whether Prometheus can read the bundled Qdrant's /metrics: no key asked, or the
read-only one to send. */ -}}
{{- define "ragline.qdrantScraped" -}}
{{- if and .Values.qdrant.enabled (or (not .Values.qdrant.apiKey) .Values.qdrant.metricsApiKey) -}}
true
{{- end -}}
{{- end -}}

{{- /* The Secret ragline pods mount at /etc/ragline/tls (tls.crt, tls.key, ca.crt): the
operator's, else the one cert-manager or the chart writes (certificate.yaml). */ -}}
{{- define "ragline.tlsSecretName" -}}
{{- if .Values.tls.secretName -}}
{{- .Values.tls.secretName -}}
{{- else -}}
{{- include "ragline.fullname" . }}-tls
{{- end -}}
{{- end -}}

{{- /* Every name a client may dial a ragline service, a store or Triton by, one per line:
the names the one certificate holds (cert-manager's or the chart's). */ -}}
{{- define "ragline.tlsDnsNames" -}}
{{- $fullname := include "ragline.fullname" . -}}
{{- $namespace := .Release.Namespace -}}
{{- $hosts := list -}}
{{- range $name, $svc := .Values.services -}}
{{- if $svc.enabled -}}
{{- $hosts = concat $hosts (list (printf "%s-%s" $fullname $name) (printf "%s-%s-pods" $fullname $name)) -}}
{{- end -}}
{{- end -}}
{{- range $store := list "redis" "qdrant" "triton" -}}
{{- if (index $.Values $store).enabled -}}
{{- $hosts = append $hosts (printf "%s-%s" $fullname $store) -}}
{{- end -}}
{{- end -}}
{{- $names := list -}}
{{- range $host := $hosts -}}
{{- range $suffix := list "" (printf ".%s" $namespace) (printf ".%s.svc" $namespace) (printf ".%s.svc.cluster.local" $namespace) -}}
{{- $names = append $names (printf "%s%s" $host $suffix) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.etcd.enabled .Values.etcd.secure -}}
{{- $etcd := printf "%s-etcd" $fullname -}}
{{- range $suffix := list "" (printf ".%s" $namespace) (printf ".%s.svc" $namespace) (printf ".%s.svc.cluster.local" $namespace) -}}
{{- $names = concat $names (list (printf "%s%s" $etcd $suffix) (printf "*.%s%s" $etcd $suffix)) -}}
{{- end -}}
{{- end -}}
{{- join "\n" $names -}}
{{- end -}}

{{- /* The enabled gRPC services, space-separated: each holds a key of its own for the
credential it presents to the others (service-keys.yaml). */ -}}
{{- define "ragline.keyedServices" -}}
{{- $names := list -}}
{{- range $name, $svc := .Values.services -}}
{{- if and $svc.enabled (ne $name "gateway") -}}
{{- $names = append $names $name -}}
{{- end -}}
{{- end -}}
{{- join " " $names -}}
{{- end -}}

{{- /* A credential kept across upgrades: the value the Secret `name` holds under `key`
(written by an earlier install), else a new random one. */ -}}
{{- define "ragline.kept" -}}
{{- $root := index . 0 -}}
{{- $found := lookup "v1" "Secret" $root.Release.Namespace (index . 1) -}}
{{- $data := (and $found $found.data) | default dict -}}
{{- if index $data (index . 2) -}}
{{- index $data (index . 2) | b64dec -}}
{{- else -}}
{{- randAlphaNum 40 -}}
{{- end -}}
{{- end -}}

{{- /* Secure by default, once per render: every template that reads a store's
credentials or the TLS mode includes this first, and the values it fills are the same
for all of them. Unless `insecure`, an open install is refused with what to set, and each
bundled store's password or key left empty is made at the first install and read back
from its Secret at every upgrade (the pods keep their credentials). */ -}}
{{- define "ragline.secure" -}}
{{- $full := include "ragline.fullname" . -}}
{{- if not .Values.insecure -}}
{{- if eq (toString .Values.config.RAGLINE_TLS_MODE) "off" }}{{ fail "config.RAGLINE_TLS_MODE is off: every call would cross the cluster in plaintext. Use mtls (the default) or tls, or set insecure: true for a sealed test cluster" }}{{ end -}}
{{- if ne (toString .Values.config.RAGLINE_AUTH_MODE) "jwt" }}{{ fail "config.RAGLINE_AUTH_MODE is not jwt: any pod could claim any tenant. Use jwt (the default), or set insecure: true for a sealed test cluster" }}{{ end -}}
{{- if and .Values.etcd.enabled (not .Values.etcd.secure) }}{{ fail "etcd.secure is false: any pod that reaches etcd could rewrite the budget ledger. Keep it true (the default), or set insecure: true for a sealed test cluster" }}{{ end -}}
{{- if .Values.redis.enabled -}}
{{- if not .Values.redis.password -}}
{{- $_ := set .Values.redis "password" (include "ragline.kept" (list . (printf "%s-redis-client" $full) "RAGLINE_REDIS_PASSWORD")) -}}
{{- end -}}
{{- if and .Values.redis.exporter.enabled (not .Values.redis.exporter.password) -}}
{{- $_ := set .Values.redis.exporter "password" (include "ragline.kept" (list . (printf "%s-redis-exporter" $full) "REDIS_PASSWORD")) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.etcd.enabled .Values.etcd.secure -}}
{{- if not .Values.etcd.rootPassword -}}
{{- $_ := set .Values.etcd "rootPassword" (include "ragline.kept" (list . (printf "%s-etcd-root" $full) "RAGLINE_ETCD_ROOT_PASSWORD")) -}}
{{- end -}}
{{- if not (or .Values.etcd.clientPassword .Values.etcd.clientExistingSecret) -}}
{{- $_ := set .Values.etcd "clientPassword" (include "ragline.kept" (list . (printf "%s-budget-etcd" $full) "RAGLINE_BUDGET_ETCD_PASSWORD")) -}}
{{- end -}}
{{- end -}}
{{- if .Values.qdrant.enabled -}}
{{- if not .Values.qdrant.apiKey -}}
{{- $_ := set .Values.qdrant "apiKey" (include "ragline.kept" (list . (printf "%s-qdrant-key" $full) "RAGLINE_RETRIEVAL_QDRANT_API_KEY")) -}}
{{- end -}}
{{- if not .Values.qdrant.metricsApiKey -}}
{{- $_ := set .Values.qdrant "metricsApiKey" (include "ragline.kept" (list . (printf "%s-qdrant-metrics-key" $full) "apiKey")) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* The ragline image: repository:tag, pinned to image.digest when one is set. */ -}}
{{- define "ragline.image" -}}
{{- .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- with .Values.image.digest }}@{{ . }}{{ end }}
{{- end -}}

{{- /* etcd.secure's requirements, failing with what to set. */ -}}
{{- define "ragline.etcdSecure" -}}
{{- if and .Values.etcd.enabled .Values.etcd.secure -}}
{{- if ne (include "ragline.tlsOn" .) "true" }}{{ fail "etcd.secure needs RAGLINE_TLS_MODE on (its certificates come from tls:)" }}{{ end -}}
{{- if not .Values.etcd.rootPassword }}{{ fail "etcd.secure needs etcd.rootPassword (the setup Job's root user)" }}{{ end -}}
{{- if not (or .Values.etcd.clientPassword .Values.etcd.clientExistingSecret) }}{{ fail "etcd.secure needs etcd.clientPassword (the budget service's etcd user)" }}{{ end -}}
{{- if not (tpl (toString .Values.config.RAGLINE_BUDGET_ETCD_USERNAME) .) }}{{ fail "etcd.secure needs config.RAGLINE_BUDGET_ETCD_USERNAME (the budget service's etcd user)" }}{{ end -}}
true
{{- end -}}
{{- end -}}
