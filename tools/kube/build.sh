#!/usr/bin/env bash
# Build the real control plane (kube-apiserver, kube-controller-manager, kube-scheduler, etcd) and a
# kubectl of the same release for the kube test tier from Kubernetes' Go modules (go.mod here).
# Binaries go to tools/kube/bin (ignored); Go's module and build caches are reused when present,
# so a warm rebuild takes seconds. Usage: bash tools/kube/build.sh
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v go >/dev/null 2>&1; then
  msg="no Go toolchain on PATH: the kube test tier needs Go >= 1.26 to build the control plane"
  if [ "${MOE_EPLB_REQUIRE_KUBE:-}" = 1 ]; then echo "error: $msg" >&2; exit 1; fi
  echo "warning: $msg; the kube tier will be skipped" >&2; exit 0
fi
KUBE_VERSION=$(awk '$1=="k8s.io/kubernetes"{print $2; exit}' go.mod)
minor=$(echo "$KUBE_VERSION" | cut -d. -f2)
stamp="bin/.built-$KUBE_VERSION-$(sha256sum go.mod go.sum | sha256sum | cut -c1-12)"
if [ -f "$stamp" ]; then echo "control plane $KUBE_VERSION already built in $(pwd)/bin"; exit 0; fi
mkdir -p bin
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags="$ldflags -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags="$ldflags -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
start=$(date +%s)
# one `go build` for all four: packages shared by the binaries are compiled once
go build -trimpath -ldflags "$ldflags" -o bin/ \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl
go build -trimpath -ldflags "-s -w" -o bin/etcd go.etcd.io/etcd/server/v3
rm -f bin/.built-*
touch "$stamp"
echo "control plane $KUBE_VERSION built in $(( $(date +%s) - start )) s: $(ls bin | tr '\n' ' ')"
