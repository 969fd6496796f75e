{{/* Names and labels, as `helm create` makes them. */}}
{{- define "fleetgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's resources: the release name, with the chart's unless it has it. */}}
{{- define "fleetgate.fullname" -}}
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

{{- define "fleetgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fleetgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "fleetgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "fleetgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "fleetgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "fleetgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is needed when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The config (values.config) parsed, as JSON: `include "fleetgate.config" . | fromJson`.
A config that is not TOML fails the render with the parser's message.
*/}}
{{- define "fleetgate.config" -}}
{{- $config := fromToml .Values.config }}
{{- if hasKey $config "Error" }}
{{- fail (printf "config is not valid TOML: %s" $config.Error) }}
{{- end }}
{{- toJson $config }}
{{- end }}

{{/*
The port of one of the config's listeners: (list $config "listen"). Pods are reached
on their own address, so a listener on the loopback fails the render.
*/}}
{{- define "fleetgate.listenPort" -}}
{{- $key := index . 1 }}
{{- $address := index (index . 0) $key }}
{{- if not (kindIs "string" $address) }}
{{- fail (printf "config must set %s, e.g. %s = \"0.0.0.0:PORT\"" $key $key) }}
{{- end }}
{{- if or (hasPrefix "127." $address) (hasPrefix "localhost:" $address) (hasPrefix "[::1]:" $address) }}
{{- fail (printf "config: %s = %q is the pod's loopback; use 0.0.0.0:PORT" $key $address) }}
{{- end }}
{{- $address | splitList ":" | last | atoi }}
{{- end }}
