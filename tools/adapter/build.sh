#!/usr/bin/env bash
# Build prometheus-adapter (the custom.metrics.k8s.io API server the HPA reads vLLM's metrics
# through) from its Go module, sigs.k8s.io/prometheus-adapter v0.12.0 (go.mod here, with the
# dependency versions its own go.mod requires). The binary goes to tools/adapter/bin/adapter
# (ignored); a stamp of go.mod/go.sum skips the build when nothing changed.
# Usage: bash tools/adapter/build.sh
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v go >/dev/null 2>&1; then
  msg="no Go toolchain on PATH: the HPA-through-prometheus-adapter test needs Go to build the adapter"
  if [ "${MOE_EPLB_REQUIRE_KUBE:-}" = 1 ]; then echo "error: $msg" >&2; exit 1; fi
  echo "warning: $msg; that test will be skipped" >&2; exit 0
fi
VERSION=$(awk '$1=="sigs.k8s.io/prometheus-adapter"{print $2; exit}' go.mod)
stamp="bin/.built-$VERSION-$(sha256sum go.mod go.sum | sha256sum | cut -c1-12)"
if [ -f "$stamp" ]; then echo "prometheus-adapter $VERSION already built in $(pwd)/bin"; exit 0; fi
mkdir -p bin
start=$(date +%s)
go build -trimpath -ldflags "-s -w" -o bin/adapter sigs.k8s.io/prometheus-adapter/cmd/adapter
rm -f bin/.built-*
touch "$stamp"
echo "prometheus-adapter $VERSION built in $(( $(date +%s) - start )) s: $(pwd)/bin/adapter"
