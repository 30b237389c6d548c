#!/usr/bin/env bash
# Build the real LeaderWorkerSet controller (sigs.k8s.io/lws, main package sigs.k8s.io/lws/cmd) for
# the kube test tier from its Go module (go.mod here, pinned to the release the published CRDs in
# tools/kube/crds come from). The binary goes to tools/lws/bin/lws-controller (ignored); a stamp of
# go.mod/go.sum skips the build when nothing changed. Usage: bash tools/lws/build.sh
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v go >/dev/null 2>&1; then
  msg="no Go toolchain on PATH: the real LeaderWorkerSet controller needs Go >= 1.25"
  if [ "${MOE_EPLB_REQUIRE_KUBE:-}" = 1 ]; then echo "error: $msg" >&2; exit 1; fi
  echo "warning: $msg; LeaderWorkerSets will use the emulated controller" >&2; exit 0
fi
LWS_VERSION=$(awk '$1=="sigs.k8s.io/lws"{print $2; exit}' go.mod)
stamp="bin/.built-$LWS_VERSION-$(sha256sum go.mod go.sum | sha256sum | cut -c1-12)"
if [ -f "$stamp" ]; then echo "lws-controller $LWS_VERSION already built in $(pwd)/bin"; exit 0; fi
mkdir -p bin
start=$(date +%s)
go build -trimpath -ldflags "-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION" \
  -o bin/lws-controller sigs.k8s.io/lws/cmd
# its published webhook configurations (rewritten to a loopback URL when registered: sim/lwscontroller.py)
src=$(go list -m -f '{{.Dir}}' sigs.k8s.io/lws)
install -m 0644 "$src/config/webhook/manifests.yaml" bin/webhook-manifests.yaml
rm -f bin/.built-*
touch "$stamp"
echo "lws-controller $LWS_VERSION built in $(( $(date +%s) - start )) s"
