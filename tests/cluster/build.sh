#!/usr/bin/env bash
# Builds the node's container runtime and cluster DNS from their Go modules into a cache, once:
# containerd, its `ctr` client and `containerd-shim-runc-v2`, and CoreDNS. Later runs reuse them.
# Prints the folder on its last line:
#
#   ${INFERPLANE_NODE_DIR:-~/.cache/inferplane/node}/<key>/{containerd,ctr,containerd-shim-runc-v2,coredns}
#
# No site serves these binaries to our machines, and Debian's containerd (1.6) predates the CRI
# settings the kubelet 1.34 needs. The first build takes about 4 minutes on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
containerd_version=v2.2.9
coredns_version=v1.14.7
cache=${INFERPLANE_NODE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/inferplane/node}
key=$(cat "$0" | sha256sum | cut -c1-16)
dest=$cache/$key
binaries=(containerd ctr containerd-shim-runc-v2 coredns)

if [ -f "$dest/.done" ]; then
  echo "node: reusing containerd $containerd_version and CoreDNS $coredns_version" >&2
  echo "$dest"
  exit 0
fi
command -v go >/dev/null 2>&1 || { echo "node: 'go' is not installed; the cluster tests need it" >&2; exit 1; }
echo "node: building containerd $containerd_version and CoreDNS $coredns_version (about 4 minutes the first time)" >&2
start=$(date +%s)
mkdir -p "$cache"
work=$(mktemp -d "$cache/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
# Static, without cgo: the btrfs snapshotter (cgo) is left out; overlayfs and native remain.
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false GOBIN=$work
tags="no_btrfs osusergo netgo urfave_cli_no_docs"
go install -tags "$tags" -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/containerd@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/ctr@$containerd_version"
go install -tags "$tags no_grpc" -ldflags "-s -w" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$containerd_version"
go install -ldflags "-s -w" "github.com/coredns/coredns@$coredns_version"
for b in "${binaries[@]}"; do [ -x "$work/$b" ] || { echo "node: $b was not built" >&2; exit 1; }; done
"$work/containerd" --version >&2
"$work/coredns" -version >&2
touch "$work/.done"
rm -rf "$dest"
mv "$work" "$dest"
trap - EXIT
echo "node: built in $(( $(date +%s) - start )) s into $dest" >&2
echo "$dest"
