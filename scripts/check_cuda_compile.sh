#!/usr/bin/env bash
# scripts/check_cuda_compile.sh
#
# Owns: the "do the CUDA kernels still compile for every Jetson/test target" check.
# Compiles every .cu file under plugins/ into an object (no link, no TensorRT, no GPU needed)
# once per target architecture and fails if any (file, arch) pair fails:
#   sm_87  Jetson Orin
#   sm_90  H200 test machines
#   sm_110 Jetson Thor (CUDA 13 calls Thor sm_110; CUDA 12.8/12.9 called it sm_101)
# -O1 for the host compiler and NVVM (-Xcicc -O1) keeps it quick: it checks that the code
# compiles down to SASS for each target (ptxas included), not how fast it runs. Run by
# tests/test_plugin_host.py::test_nvcc_compiles_every_kernel_for_all_targets.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/check_cuda_compile.sh [--archs "87 90 110"] [--jobs N] [--keep DIR]

Compiles every plugins/**/*.cu with nvcc into objects for each target architecture.
  --archs LIST  space-separated SM numbers (default: "87 90 110"; env CUDA_ARCHS)
  --jobs N      parallel nvcc processes (default: nproc; env JOBS)
  --keep DIR    write the objects and logs to DIR instead of a temporary directory
Environment: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc).
Exit status: 0 if every (file, arch) compiled, 1 if any failed, 2 on usage errors.
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ARCHS=${CUDA_ARCHS:-"87 90 110"}
JOBS=${JOBS:-$(nproc)}
KEEP=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --archs) ARCHS=${2:?--archs needs a value}; shift 2 ;;
        --jobs) JOBS=${2:?--jobs needs a value}; shift 2 ;;
        --keep) KEEP=${2:?--keep needs a directory}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

NVCC=${NVCC:-$(command -v nvcc || true)}
if [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]]; then
    NVCC=/usr/local/cuda/bin/nvcc
fi
if [[ -z "$NVCC" ]]; then
    echo "check_cuda_compile: nvcc not found (set NVCC or put it on PATH)" >&2
    exit 1
fi
export NVCC ROOT

if [[ -n "$KEEP" ]]; then
    WORK=$KEEP
    mkdir -p "$WORK"
else
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
fi
export WORK

mapfile -t FILES < <(cd "$ROOT" && find plugins -name '*.cu' -not -path '*/build/*' | sort)
if [[ ${#FILES[@]} -eq 0 ]]; then
    echo "check_cuda_compile: no .cu files under plugins/" >&2
    exit 1
fi

echo "nvcc: $("$NVCC" --version | tail -n 1)"
echo "archs: $ARCHS; files: ${FILES[*]}"

# One (file, arch) compile; writes WORK/<name>.sm<arch>.{o,log,status}.
compile_one() {
    local file=$1 arch=$2
    local stem
    stem="$WORK/$(echo "$file" | tr '/' '_').sm$arch"
    local start=$SECONDS
    if "$NVCC" -std=c++17 -O1 -Xcicc -O1 -I"$ROOT/plugins/include" \
        -gencode "arch=compute_$arch,code=sm_$arch" \
        -c "$ROOT/$file" -o "$stem.o" >"$stem.log" 2>&1; then
        echo "PASS sm_$arch $file ($((SECONDS - start)) s)" >"$stem.status"
    else
        echo "FAIL sm_$arch $file ($((SECONDS - start)) s)" >"$stem.status"
    fi
}
export -f compile_one

JOBLIST="$WORK/jobs.txt"
: >"$JOBLIST"
for file in "${FILES[@]}"; do
    for arch in $ARCHS; do
        printf '%s\n%s\n' "$file" "$arch" >>"$JOBLIST"
    done
done
# $1/$2 expand in the child bash that xargs starts, not here.
# shellcheck disable=SC2016
xargs -n 2 -P "$JOBS" bash -c 'compile_one "$1" "$2"' _ <"$JOBLIST"

failed=0
for file in "${FILES[@]}"; do
    for arch in $ARCHS; do
        stem="$WORK/$(echo "$file" | tr '/' '_').sm$arch"
        status=$(cat "$stem.status" 2>/dev/null || echo "FAIL sm_$arch $file (no result)")
        echo "$status"
        if [[ $status == FAIL* ]]; then
            failed=1
            sed 's/^/    /' "$stem.log" 2>/dev/null | head -n 40
        fi
    done
done

if [[ $failed -ne 0 ]]; then
    echo "check_cuda_compile: FAILED"
    exit 1
fi
echo "check_cuda_compile: all ${#FILES[@]} file(s) compiled for sm ${ARCHS// /, sm }"
