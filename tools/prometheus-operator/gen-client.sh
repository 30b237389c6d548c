#!/usr/bin/env bash
# Generates the Prometheus Operator's client module (pkg/client: apply configurations, clientset,
# listers, informers) into tools/prometheus-operator/client from the API types its release serves
# (github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring, the version in ../go.mod),
# with k8s.io/code-generator's four generators and the arguments of upstream's `make k8s-client-gen`.
# Why: the Go module proxy does not serve .../pkg/client at v0.94.0 (403), and the operator's main
# package imports it. Nothing generated is committed (client/go.mod is). Run by ../build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."            # tools/ (the module that requires the generators)
out=prometheus-operator/client
gen=prometheus-operator/gen-bin
PO=github.com/prometheus-operator/prometheus-operator
VERSION=$(awk -v m="$PO/pkg/apis/monitoring" '$1==m{print $2; exit}' go.mod)
stamp="$out/.generated-$VERSION-$(sha256sum go.mod go.sum | sha256sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0
mkdir -p "$gen"
go build -trimpath -o "$gen/" k8s.io/code-generator/cmd/client-gen k8s.io/code-generator/cmd/lister-gen \
  k8s.io/code-generator/cmd/informer-gen k8s.io/code-generator/cmd/applyconfiguration-gen
header=$(go mod download -json "$PO@$VERSION" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or sys.exit(d.get("Error")))')/.header
rm -rf "$out"/{versioned,informers,listers,applyconfiguration} "$out"/.generated-*
apis=("$PO/pkg/apis/monitoring/v1" "$PO/pkg/apis/monitoring/v1alpha1" "$PO/pkg/apis/monitoring/v1beta1")
args=(--go-header-file "$header" --v=0 --logtostderr)
"$gen/applyconfiguration-gen" "${args[@]}" --output-pkg "$PO/pkg/client/applyconfiguration" \
  --output-dir "$out/applyconfiguration" "${apis[@]}"
"$gen/client-gen" "${args[@]}" --apply-configuration-package "$PO/pkg/client/applyconfiguration" \
  --input-base "$PO/pkg/apis" --clientset-name versioned --output-pkg "$PO/pkg/client" --output-dir "$out" \
  --input monitoring/v1 --input monitoring/v1beta1 --input monitoring/v1alpha1
"$gen/lister-gen" "${args[@]}" --output-pkg "$PO/pkg/client/listers" --output-dir "$out/listers" "${apis[@]}"
"$gen/informer-gen" "${args[@]}" --versioned-clientset-package "$PO/pkg/client/versioned" \
  --listers-package "$PO/pkg/client/listers" --output-pkg "$PO/pkg/client/informers" \
  --output-dir "$out/informers" "${apis[@]}"
touch "$stamp"
echo "generated $PO/pkg/client $VERSION in $(pwd)/$out"
