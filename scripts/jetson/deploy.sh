#!/usr/bin/env bash
# scripts/jetson/deploy.sh
#
# Owns: copying a bundle (or a recipe's inputs) from this machine to a Jetson over SSH.
# rsync when both ends have it (resumable, only changed files), scp -r otherwise.
set -euo pipefail

usage() {
    cat <<'EOF_USAGE'
Usage: scripts/jetson/deploy.sh BUNDLE_DIR USER@HOST [REMOTE_DIR]

Copies BUNDLE_DIR to HOST:REMOTE_DIR/<bundle name> (default REMOTE_DIR: ~/edgebuild/bundles).
  BUNDLE_DIR  a bundle directory (manifest.json, base/, draft/, visual/) or any directory
  USER@HOST   SSH destination of the Jetson
Environment: SSH_OPTS  extra ssh options, e.g. "-p 2222 -i ~/.ssh/jetson"
Afterwards, on the device: scripts/jetson/build_engines.sh REMOTE_DIR/<bundle name>
EOF_USAGE
}

if [[ $# -ge 1 && ( $1 == -h || $1 == --help ) ]]; then
    usage
    exit 0
fi
if [[ $# -lt 2 || $# -gt 3 ]]; then
    usage >&2
    exit 2
fi

SRC=${1%/}
DEST=$2
REMOTE_DIR=${3:-edgebuild/bundles}
SSH_OPTS=${SSH_OPTS:-}

if [[ ! -d "$SRC" ]]; then
    echo "deploy: $SRC is not a directory" >&2
    exit 1
fi
if [[ ! -f "$SRC/manifest.json" ]]; then
    echo "deploy: warning: $SRC has no manifest.json (not a bundle); copying it anyway" >&2
fi

read -r -a ssh_args <<<"$SSH_OPTS"
name=$(basename "$SRC")
# REMOTE_DIR is meant to expand here, quoted for the remote shell
# shellcheck disable=SC2029
ssh "${ssh_args[@]}" "$DEST" "mkdir -p $(printf %q "$REMOTE_DIR")"

if command -v rsync >/dev/null 2>&1 && ssh "${ssh_args[@]}" "$DEST" "command -v rsync" >/dev/null; then
    rsync -a --partial --info=progress2 -e "ssh $SSH_OPTS" "$SRC/" "$DEST:$REMOTE_DIR/$name/"
else
    echo "deploy: rsync missing on one side, using scp" >&2
    scp -r "${ssh_args[@]}" "$SRC" "$DEST:$REMOTE_DIR/"
fi
echo "deployed $SRC -> $DEST:$REMOTE_DIR/$name"
