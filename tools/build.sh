#!/usr/bin/env bash
# Build the Go tools of the kube test tier that share one set of k8s.io/* versions (v0.37.2) from ONE
# Go module (go.mod here), in one `go build`, so each Kubernetes package is compiled once for all of
# them: the Helm CLI (helm.sh/helm/v4) into helm/bin/helm and the Prometheus Operator
# (github.com/prometheus-operator/prometheus-operator, cmd/operator) into
# prometheus-operator/bin/prometheus-operator, with that release's published CRDs in
# prometheus-operator/bin/crds/. Then the Prometheus server the operator configures, from its own
# module (prometheus/go.mod: it needs k8s.io v0.35.3 and automemlimit v0.7, which the Prometheus
# Operator's v0.37.2/v1.0 cannot give) into prometheus/bin/prometheus. Binaries are ignored; a stamp of go.mod/go.sum skips the build when
# nothing changed. Usage: bash tools/build.sh        (`make kube` runs it)
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v go >/dev/null 2>&1; then
  msg="no Go toolchain on PATH: the Helm CLI and Prometheus Operator tests need Go >= 1.26"
  if [ "${MOE_EPLB_REQUIRE_KUBE:-}" = 1 ]; then echo "error: $msg" >&2; exit 1; fi
  echo "warning: $msg; those tests will be skipped" >&2; exit 0
fi
version() { awk -v m="$1" '$1==m{print $2; exit}' go.mod; }
HELM=helm.sh/helm/v4 PO=github.com/prometheus-operator/prometheus-operator
HELM_VERSION=$(version $HELM) PO_VERSION=$(version $PO)
stamp=".built-$HELM_VERSION-$PO_VERSION-$(sha256sum go.mod go.sum | sha256sum | cut -c1-12)"
if [ -f "helm/bin/$stamp" ] && [ -f "prometheus-operator/bin/$stamp" ]; then
  echo "helm $HELM_VERSION and prometheus-operator $PO_VERSION already built"; bash prometheus/build.sh; exit 0
fi
start=$(date +%s)
# the operator's client module is not on the module proxy: generate it (prometheus-operator/gen-client.sh)
bash prometheus-operator/gen-client.sh
mkdir -p .bin helm/bin prometheus-operator/bin
ldflags="-s -w -X $HELM/internal/version.version=$HELM_VERSION -X github.com/prometheus/common/version.Version=${PO_VERSION#v}"
# one `go build` for both: the k8s.io/* packages they share are compiled once
go build -trimpath -ldflags "$ldflags" -o .bin/ $HELM/cmd/helm $PO/cmd/operator
mv -f .bin/helm helm/bin/helm
mv -f .bin/operator prometheus-operator/bin/prometheus-operator
rmdir .bin
# the release's published CRDs (Prometheus, PodMonitor, PrometheusRule, ...), unchanged
src=$(go list -m -f '{{.Dir}}' $PO)
mkdir -p prometheus-operator/bin/crds
install -m 0644 "$src"/example/prometheus-operator-crd/monitoring.coreos.com_*.yaml prometheus-operator/bin/crds/
rm -f helm/bin/.built-* prometheus-operator/bin/.built-*
touch "helm/bin/$stamp" "prometheus-operator/bin/$stamp"
echo "helm $HELM_VERSION and prometheus-operator $PO_VERSION built in $(( $(date +%s) - start )) s"
bash prometheus/build.sh
