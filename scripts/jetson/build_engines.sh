#!/usr/bin/env bash
# scripts/jetson/build_engines.sh
#
# Owns: building a bundle's TensorRT engines on the Jetson itself (engines are specific to
# the device's GPU and TensorRT version, so they are built where they run). A thin wrapper
# over `edgebuild build` that checks the prerequisites first and says what is missing.
set -euo pipefail

usage() {
    cat <<'EOF_USAGE'
Usage: scripts/jetson/build_engines.sh RECIPE_OR_BUNDLE [-o BUNDLE] [-- EDGEBUILD_BUILD_ARGS...]

  RECIPE_OR_BUNDLE  a recipe (recipes/*.yaml) or an exported bundle directory
  -o BUNDLE         output bundle (required for a recipe; default for a bundle: build in place)
  -- ARGS           passed to `edgebuild build` unchanged (see `edgebuild build --help`)
Runs: edgebuild build RECIPE_OR_BUNDLE [-o BUNDLE] ARGS
EOF_USAGE
}

SRC=""
OUT_BUNDLE=""
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        -o | --output) OUT_BUNDLE=${2:?-o needs a bundle directory}; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *)
            if [[ -n "$SRC" ]]; then
                echo "only one RECIPE_OR_BUNDLE expected, got '$SRC' and '$1'" >&2
                exit 2
            fi
            SRC=$1; shift ;;
    esac
done
if [[ -z "$SRC" ]]; then
    usage >&2
    exit 2
fi
if [[ ! -e "$SRC" ]]; then
    echo "build_engines: $SRC does not exist" >&2
    exit 1
fi
if [[ -f "$SRC" && -z "$OUT_BUNDLE" ]]; then
    echo "build_engines: $SRC is a recipe: give the output bundle with -o BUNDLE" >&2
    exit 2
fi
if ! command -v edgebuild >/dev/null 2>&1; then
    echo "build_engines: the edgebuild CLI is not on PATH (pip install edgebuild, or use docker/Dockerfile.thor)" >&2
    exit 1
fi
if ! python3 -c "import tensorrt" >/dev/null 2>&1; then
    echo "build_engines: python3 cannot import tensorrt (JetPack's python3-libnvinfer, or the Thor image)" >&2
    exit 1
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader || true
fi

cmd=(edgebuild build "$SRC")
if [[ -n "$OUT_BUNDLE" ]]; then
    cmd+=(-o "$OUT_BUNDLE")
fi
cmd+=("${EXTRA[@]}")
echo "+ ${cmd[*]}"
"${cmd[@]}"
