#!/usr/bin/env bash
# The published CRDs the kube tier installs beside the project's own, taken from their projects' Go
# modules through the Go module proxy (pinned here; reused from Go's module cache when present) and
# copied unchanged into tools/kube/crds (ignored). Usage: bash tools/kube/crds.sh
set -euo pipefail
cd "$(dirname "$0")"
# module@version  path-in-module  (one CRD a line)
CRDS=(
  "github.com/prometheus-operator/prometheus-operator@v0.94.0 example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml"
  "github.com/prometheus-operator/prometheus-operator@v0.94.0 example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"
  "github.com/prometheus-operator/prometheus-operator@v0.94.0 example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml"
  "sigs.k8s.io/lws@v0.8.0 config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"
  # KEDA: every kind its operator watches (tools/keda runs it; the ScaledObject is the one the operator renders)
  "github.com/kedacore/keda/v2@v2.18.0 config/crd/bases/keda.sh_scaledobjects.yaml"
  "github.com/kedacore/keda/v2@v2.18.0 config/crd/bases/keda.sh_scaledjobs.yaml"
  "github.com/kedacore/keda/v2@v2.18.0 config/crd/bases/keda.sh_triggerauthentications.yaml"
  "github.com/kedacore/keda/v2@v2.18.0 config/crd/bases/keda.sh_clustertriggerauthentications.yaml"
  "github.com/kedacore/keda/v2@v2.18.0 config/crd/bases/eventing.keda.sh_cloudeventsources.yaml"
  "github.com/kedacore/keda/v2@v2.18.0 config/crd/bases/eventing.keda.sh_clustercloudeventsources.yaml"
)
mkdir -p crds
for line in "${CRDS[@]}"; do
  read -r mod path <<<"$line"
  dest="crds/$(basename "$path")"
  [ -s "$dest" ] && continue
  dir=$(go mod download -json "$mod" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or sys.exit(d.get("Error")))')
  install -m 0644 "$dir/$path" "$dest"
  echo "$dest <- $mod"
done
