#!/usr/bin/env bash
# scripts/jetson/install_service.sh
#
# Owns: installing and starting the edgellm-serve systemd unit on a Jetson (run as root).
set -euo pipefail

usage() {
    cat <<'EOF_USAGE'
Usage: sudo scripts/jetson/install_service.sh BUNDLE [--user USER] [--args "EDGELLM_SERVE_ARGS"]

Installs /etc/systemd/system/edgellm-serve.service and /etc/default/edgellm-serve, then
enables and starts the service.
  BUNDLE       bundle directory (or model) that edgellm-serve serves
  --user USER  account the server runs as (default: the user who ran sudo)
  --args ARGS  extra edgellm-serve arguments, e.g. '--speculative-config {"method":"dspark"}'
Check it afterwards with scripts/jetson/check_health.sh.
EOF_USAGE
}

BUNDLE=""
SERVICE_USER=${SUDO_USER:-$(id -un)}
ARGS=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --user) SERVICE_USER=${2:?--user needs a name}; shift 2 ;;
        --args) ARGS=${2?--args needs a value}; shift 2 ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *) BUNDLE=$1; shift ;;
    esac
done
if [[ -z "$BUNDLE" ]]; then
    usage >&2
    exit 2
fi
if [[ $EUID -ne 0 ]]; then
    echo "install_service: run as root (sudo)" >&2
    exit 1
fi
if [[ ! -e "$BUNDLE" ]]; then
    echo "install_service: $BUNDLE does not exist" >&2
    exit 1
fi
if ! id "$SERVICE_USER" >/dev/null 2>&1; then
    echo "install_service: no user $SERVICE_USER (give --user)" >&2
    exit 1
fi
# edgellm-serve may live in the user's ~/.local/bin (pip --user): look there too
SERVE=$(command -v edgellm-serve || sudo -u "$SERVICE_USER" -i sh -c 'command -v edgellm-serve' || true)
if [[ -z "$SERVE" ]]; then
    echo "install_service: edgellm-serve not found on PATH (pip install edgebuild)" >&2
    exit 1
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BUNDLE=$(cd "$(dirname "$BUNDLE")" && pwd)/$(basename "$BUNDLE")
sed -e "s|@EDGELLM_SERVE@|$SERVE|g" -e "s|@EDGELLM_USER@|$SERVICE_USER|g" \
    "$HERE/edgellm-serve.service" >/etc/systemd/system/edgellm-serve.service
{
    echo "# written by scripts/jetson/install_service.sh"
    printf 'EDGELLM_MODEL=%q\n' "$BUNDLE"
    printf 'EDGELLM_ARGS=%q\n' "$ARGS"
} >/etc/default/edgellm-serve

systemctl daemon-reload
systemctl enable --now edgellm-serve.service
systemctl --no-pager --lines=5 status edgellm-serve.service || true
echo "installed: journalctl -u edgellm-serve -f to follow the log"
