#!/usr/bin/env bash
# scripts/gpu_check.sh
#
# Owns: the prepared check to run on a machine with an NVIDIA GPU (a lent H200, a Jetson).
#   1. builds the plugin parts for the local GPU's SM (CMake; plain nvcc + g++ if CMake is
#      missing): host build, CUDA kernels, the edgebuild_cuda_check driver, and the TensorRT
#      plugin library when TensorRT headers exist;
#   2. runs edgebuild_cuda_check: the CUDA kernels against the host build (itself checked
#      against the Python reference op by tests/test_plugin_host.py) on every phase, dtype and
#      both attention kernels, then kernel timings (PASS/FAIL/TIME lines);
#   3. if the Python `tensorrt` module imports: engine-build placeholders that call the
#      edgebuild CLI when it offers them, SKIP lines with the reason otherwise;
#   4. the TensorRT runtime backend (scripts/gpu_check_engines.py, ~8 min): engines built for
#      this GPU vs the torch backend on the SmolLM2 pair (greedy output, DSpark acceptance,
#      CUDA graphs on/off), decode tokens/s with and without DSpark; NVFP4 on SM >= 100.
# Everything is logged to ${OUT:-/tmp}/gpu_check.log. Finishes well within 10 minutes on one
# H200 (each step has its own timeout). Exit 0 iff nothing FAILed.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/gpu_check.sh [--recipe RECIPE] [--no-timing] [--build-dir DIR]

Builds the edgebuild plugins for this GPU and checks the CUDA kernels against the host build.
  --recipe RECIPE   also try `edgebuild build RECIPE -o BUNDLE` when TensorRT is importable
  --no-timing       skip the kernel timing section of edgebuild_cuda_check
  --build-dir DIR   build directory (default: build/gpu_check)
Log: ${OUT:-/tmp}/gpu_check.log
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD="$ROOT/build/gpu_check"
RECIPE=""
TIMING_ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --recipe) RECIPE=${2:?--recipe needs a path}; shift 2 ;;
        --no-timing) TIMING_ARGS=(--no-timing); shift ;;
        --build-dir) BUILD=${2:?--build-dir needs a directory}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

LOG_DIR=${OUT:-/tmp}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/gpu_check.log"
exec > >(tee "$LOG") 2>&1

FAILURES=0
fail() { echo "FAIL $*"; FAILURES=$((FAILURES + 1)); }
skip() { echo "SKIP $*"; }
section() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

find_nvcc() {
    local candidate
    for candidate in "${NVCC:-}" "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc; do
        if [[ -n "$candidate" && -x "$candidate" ]]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

section "machine"
if ! command -v nvidia-smi >/dev/null 2>&1; then
    fail "nvidia-smi not found: this script needs an NVIDIA GPU"
    exit 1
fi
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
SM=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')
NVCC=$(find_nvcc) || { fail "nvcc not found (PATH, /usr/local/cuda/bin)"; exit 1; }
export NVCC
echo "sm_$SM, $("$NVCC" --version | tail -n 1), $(nproc) cores"

build_with_cmake() {
    timeout 420 cmake -S "$ROOT/plugins" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$SM" &&
        timeout 420 cmake --build "$BUILD" -j "$(nproc)"
}

# Same objects as the CMake targets, for machines without CMake (no TensorRT plugin then).
build_with_nvcc() {
    local inc="$ROOT/plugins/include" gen="arch=compute_$SM,code=sm_$SM"
    mkdir -p "$BUILD"
    g++ -std=c++17 -O2 -fPIC -ffp-contract=off -I"$inc" \
        -c "$ROOT/plugins/src/attention_host.cpp" -o "$BUILD/attention_host.o" &&
        timeout 420 "$NVCC" -std=c++17 -O3 -I"$inc" -gencode "$gen" \
            -c "$ROOT/plugins/src/attention_kernels.cu" -o "$BUILD/attention_kernels.o" &&
        timeout 420 "$NVCC" -std=c++17 -O3 -I"$inc" -gencode "$gen" \
            -c "$ROOT/plugins/tests/cuda_check.cu" -o "$BUILD/cuda_check.o" &&
        "$NVCC" -gencode "$gen" "$BUILD/cuda_check.o" "$BUILD/attention_kernels.o" \
            "$BUILD/attention_host.o" -o "$BUILD/edgebuild_cuda_check"
}

section "build plugins for sm_$SM"
start=$SECONDS
if command -v cmake >/dev/null 2>&1; then
    build_with_cmake || fail "cmake build for sm_$SM"
else
    echo "cmake not found: building the check with nvcc + g++ directly"
    build_with_nvcc || fail "nvcc build for sm_$SM"
fi
echo "build took $((SECONDS - start)) s"
if [[ -f "$BUILD/libedgebuild_plugins.so" ]]; then
    echo "PASS TensorRT plugin library built: $BUILD/libedgebuild_plugins.so"
else
    skip "TensorRT plugin library: no TensorRT headers (NvInfer.h) on this machine"
fi

section "CUDA kernels vs host build"
if [[ -x "$BUILD/edgebuild_cuda_check" ]]; then
    start=$SECONDS
    if timeout 300 "$BUILD/edgebuild_cuda_check" "${TIMING_ARGS[@]}"; then
        echo "PASS edgebuild_cuda_check ($((SECONDS - start)) s)"
    else
        fail "edgebuild_cuda_check (exit $?, $((SECONDS - start)) s): see FAIL lines above"
    fi
else
    fail "edgebuild_cuda_check was not built"
fi

section "TensorRT engine builds"
if python3 -c "import tensorrt" >/dev/null 2>&1; then
    echo "tensorrt $(python3 -c 'import tensorrt; print(tensorrt.__version__)')"
    if ! command -v edgebuild >/dev/null 2>&1; then
        skip "engine build: the edgebuild CLI is not installed (pip install -e .)"
    elif ! edgebuild build --help >/dev/null 2>&1; then
        skip "engine build: this edgebuild has no 'build' command yet"
    elif [[ -z "$RECIPE" ]]; then
        skip "engine build: no --recipe given"
    elif [[ ! -f "$BUILD/libedgebuild_plugins.so" ]]; then
        skip "engine build: the TensorRT plugin library was not built (no NvInfer.h)"
    else
        bundle=$(mktemp -d)
        if timeout 300 edgebuild build "$RECIPE" -o "$bundle/bundle"; then
            echo "PASS edgebuild build $RECIPE"
        else
            fail "edgebuild build $RECIPE"
        fi
    fi
else
    skip "TensorRT engine builds: python module tensorrt is not importable"
fi

section "TensorRT runtime backend: engines vs torch"
if ! python3 -c "import tensorrt" >/dev/null 2>&1; then
    skip "TensorRT backend: python module tensorrt is not importable"
elif [[ ! -f "$BUILD/libedgebuild_plugins.so" ]]; then
    skip "TensorRT backend: the TensorRT plugin library was not built (no NvInfer.h)"
else
    start=$SECONDS
    if PYTHONUNBUFFERED=1 timeout 540 python3 "$ROOT/scripts/gpu_check_engines.py" \
        --plugin-library "$BUILD/libedgebuild_plugins.so" --work-dir "$BUILD/engines"; then
        echo "PASS gpu_check_engines ($((SECONDS - start)) s)"
    else
        fail "gpu_check_engines (exit $?, $((SECONDS - start)) s): see FAIL lines above"
    fi
fi

section "summary"
if [[ $FAILURES -eq 0 ]]; then
    echo "gpu_check: ALL PASS (log: $LOG)"
else
    echo "gpu_check: $FAILURES FAILED (log: $LOG)"
fi
[[ $FAILURES -eq 0 ]]
