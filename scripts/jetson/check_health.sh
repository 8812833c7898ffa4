#!/usr/bin/env bash
# scripts/jetson/check_health.sh
#
# Owns: the smoke check of a running edgellm-serve: GET /health and GET /v1/models, optionally
# waiting for the server to come up (engine loading can take a while).
set -euo pipefail

usage() {
    cat <<'EOF_USAGE'
Usage: scripts/jetson/check_health.sh [BASE_URL] [--wait SECONDS]

  BASE_URL        server address (default: http://127.0.0.1:8000)
  --wait SECONDS  retry /health until it answers or SECONDS pass (default: 0, one try)
Exit status 0 when /health and /v1/models both answer 2xx.
EOF_USAGE
}

URL="http://127.0.0.1:8000"
WAIT=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --wait) WAIT=${2:?--wait needs seconds}; shift 2 ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *) URL=${1%/}; shift ;;
    esac
done
if ! command -v curl >/dev/null 2>&1; then
    echo "check_health: curl is not installed" >&2
    exit 1
fi

deadline=$((SECONDS + WAIT))
until body=$(curl -fsS --max-time 5 "$URL/health" 2>&1); do
    if ((SECONDS >= deadline)); then
        echo "FAIL $URL/health: $body"
        exit 1
    fi
    sleep 2
done
echo "OK   $URL/health: $body"

if ! models=$(curl -fsS --max-time 5 "$URL/v1/models" 2>&1); then
    echo "FAIL $URL/v1/models: $models"
    exit 1
fi
echo "OK   $URL/v1/models: $models"
