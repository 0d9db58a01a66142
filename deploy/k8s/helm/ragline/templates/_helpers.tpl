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

{{- /* The Secret ragline pods mount at /etc/ragline/tls (tls.crt, tls.key, ca.crt). */ -}}
{{- define "ragline.tlsSecretName" -}}
{{- if .Values.tls.secretName -}}
{{- .Values.tls.secretName -}}
{{- else if .Values.tls.certManager.enabled -}}
{{- include "ragline.fullname" . }}-tls
{{- else -}}
{{- fail (printf "RAGLINE_TLS_MODE is %s: set tls.secretName (a kubernetes.io/tls Secret holding ca.crt) or tls.certManager.enabled with its issuerRef" (toString .Values.config.RAGLINE_TLS_MODE)) -}}
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
{{- if not .Values.config.RAGLINE_BUDGET_ETCD_USERNAME }}{{ fail "etcd.secure needs config.RAGLINE_BUDGET_ETCD_USERNAME (the budget service's etcd user)" }}{{ end -}}
true
{{- end -}}
{{- end -}}
