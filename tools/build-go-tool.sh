#!/usr/bin/env bash
# Build one Go *tools module* of the kube test tier (tools/lws: the LeaderWorkerSet controller,
# tools/adapter: prometheus-adapter) from its own go.mod, as its build.conf says. The binary goes to
# <tool dir>/bin (ignored); a stamp of go.mod/go.sum skips the build when nothing changed.
# Usage: bash tools/build-go-tool.sh tools/lws      (`make kube` runs it for each tool)
#
# <tool dir>/build.conf is sourced (bash) and sets:
#   NAME          what the messages call it                     (e.g. lws-controller)
#   MODULE        the Go module its version is read from in go.mod (e.g. sigs.k8s.io/lws)
#   PACKAGE       the main package to build                       (e.g. sigs.k8s.io/lws/cmd)
#   BINARY        the file name under bin/                        (e.g. lws-controller)
#   VERSION_VAR   optional: a string variable stamped with the module's version by -ldflags -X
#   WITHOUT_GO    what needs Go, and WITHOUT_GO_EFFECT what happens without it (the warning)
#   after_build   optional function run in the tool dir after `go build` (e.g. copy a manifest to bin/)
set -euo pipefail
if [ $# -ne 1 ] || [ ! -f "$1/build.conf" ] || [ ! -f "$1/go.mod" ]; then
  echo "usage: bash tools/build-go-tool.sh <tool dir with go.mod and build.conf>, e.g. tools/lws" >&2; exit 2
fi
cd "$1"
NAME="" MODULE="" PACKAGE="" BINARY="" VERSION_VAR="" WITHOUT_GO="" WITHOUT_GO_EFFECT=""
# shellcheck source=/dev/null
source ./build.conf
for var in NAME MODULE PACKAGE BINARY WITHOUT_GO WITHOUT_GO_EFFECT; do
  if [ -z "${!var}" ]; then echo "error: $1/build.conf sets no $var" >&2; exit 2; fi
done
if ! command -v go >/dev/null 2>&1; then
  msg="no Go toolchain on PATH: $WITHOUT_GO"
  if [ "${MOE_EPLB_REQUIRE_KUBE:-}" = 1 ]; then echo "error: $msg" >&2; exit 1; fi
  echo "warning: $msg; $WITHOUT_GO_EFFECT" >&2; exit 0
fi
VERSION=$(awk -v m="$MODULE" '$1==m{print $2; exit}' go.mod)
if [ -z "$VERSION" ]; then echo "error: $1/go.mod requires no $MODULE" >&2; exit 2; fi
stamp="bin/.built-$VERSION-$(sha256sum go.mod go.sum | sha256sum | cut -c1-12)"
if [ -f "$stamp" ]; then echo "$NAME $VERSION already built in $(pwd)/bin"; exit 0; fi
mkdir -p bin
start=$(date +%s)
ldflags="-s -w"
if [ -n "$VERSION_VAR" ]; then ldflags="$ldflags -X $VERSION_VAR=$VERSION"; fi
go build -trimpath -ldflags "$ldflags" -o "bin/$BINARY" "$PACKAGE"
if declare -F after_build >/dev/null; then after_build; fi
rm -f bin/.built-*
touch "$stamp"
echo "$NAME $VERSION built in $(( $(date +%s) - start )) s: $(pwd)/bin/$BINARY"
