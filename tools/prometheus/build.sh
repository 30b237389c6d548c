#!/usr/bin/env bash
# Build the Prometheus server the Prometheus Operator configures in the kube tier, and promtool:
# github.com/prometheus/prometheus at the version the operator requires (go.mod here: v0.314.0, i.e.
# Prometheus 3.14.0), main packages cmd/prometheus and cmd/promtool, with Prometheus' own build tags for the kubernetes
# service discovery only (remove_all_sd,enable_kubernetes_sd: the other plugins' cloud SDKs are not
# compiled). The Debian package's prometheus 2.42 cannot run the operator's configuration: Debian
# builds it without kubernetes_sd_configs. The pair is also the tests' Prometheus where the Debian
# package is absent (`make prometheus`, moe_eplb_harness.floor.prometheus). Binaries: bin/prometheus,
# bin/promtool (ignored); a stamp of go.mod/go.sum skips the build when nothing changed. Run by
# ../build.sh (`make kube`) and by `make prometheus`.
set -euo pipefail
cd "$(dirname "$0")"
command -v go >/dev/null 2>&1 || {
  echo "error: no Go toolchain on PATH: Prometheus and promtool are built from their Go module (Go >= 1.26), or apt-get install prometheus" >&2
  exit 1; }
PROM=github.com/prometheus/prometheus
VERSION=$(awk -v m="$PROM" '$1==m{print $2; exit}' go.mod)
minor=${VERSION#v0.}; minor=${minor%%.*}           # the library's v0.314.0 is Prometheus 3.14.0
RELEASE="${minor:0:1}.${minor:1}.${VERSION##*.}"
stamp="bin/.built-$VERSION-$(sha256sum go.mod go.sum | sha256sum | cut -c1-12)"
if [ -f "$stamp" ] && [ -x bin/prometheus ] && [ -x bin/promtool ]; then
  echo "prometheus and promtool $RELEASE already built in $(pwd)/bin"; exit 0
fi
mkdir -p bin
start=$(date +%s)
for cmd in prometheus promtool; do
  go build -tags remove_all_sd,enable_kubernetes_sd -trimpath \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=$RELEASE" -o bin/$cmd $PROM/cmd/$cmd
done
rm -f bin/.built-*
touch "$stamp"
echo "prometheus and promtool $RELEASE built in $(( $(date +%s) - start )) s: $(pwd)/bin/{prometheus,promtool}"
