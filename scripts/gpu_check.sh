#!/usr/bin/env bash
# scripts/gpu_check.sh
#
# Owns: the prepared check to run on a machine with an NVIDIA GPU (sized for a lent H200,
# sm_90: it finishes within --budget seconds, default 480 = 8 minutes, every step with its own
# timeout cut to what is left of the budget):
#   1. builds the plugin parts for the local GPU's SM with CMake (plain nvcc + g++ without
#      CMake): host build, CUDA kernels, edgebuild_cuda_check, and the TensorRT plugin library
#      when TensorRT headers exist (a TensorRT install, or shared/third_party/tensorrt/10.13
#      above the repository);
#   2. edgebuild_cuda_check: the CUDA kernels against the host build (itself checked against
#      the Python reference op by tests/test_plugin_host.py) on every phase, head config,
#      storage path (fp32/fp16/bf16/fp8 KV) and both attention kernels: PASS/FAIL lines;
#   3. kernel timings on model-sized shapes (TIME lines) and the decode-attention bandwidth
#      microbenchmark (BANDWIDTH lines: GB/s and % of the HBM roofline, > 1 GB KV pools);
#   4. only with --engines and an importable `tensorrt`: the TensorRT engine build and runtime
#      backend checks (scripts/gpu_check_engines.py, ~8 min on its own: not in the budget);
#   5. only with --refit and an importable `tensorrt` or `tensorrt_rtx`: the draft engine
#      built without the target's head / embedding (weight-stripped, refittable), refitted
#      from the bundle's base/draft.onnx and compared with the fully embedded engine
#      (scripts/gpu_check_refit.py, issue 27; a few minutes: not in the budget). The dry run
#      runs its --plan (the steps, and the builder API they need).
# --dry-run runs everything except the device parts on the CPU: argument handling, the tool
# and header lookup, the step plan and its budget, and steps 2-3 on the real kernel sources
# built with g++ on the CUDA CPU emulation (plugins/tests/cuda_emulation.h; quick correctness
# set, tiny bandwidth shapes, no timing). tests/test_gpu_check.py runs it.
# Everything is logged to ${OUT:-/tmp}/gpu_check.log. Exit 0 iff nothing FAILed.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/gpu_check.sh [--dry-run] [--budget SECONDS] [--no-timing] [--peak-gbps GBPS]
                            [--engines [--recipe RECIPE]] [--refit] [--build-dir DIR]

Builds the edgebuild plugins for this GPU, checks the CUDA kernels against the host build,
times them and measures decode-attention bandwidth against the HBM roofline.
  --dry-run         no GPU needed: everything but the device parts, on the CPU emulation
  --budget SECONDS  wall-clock budget of steps 1-3 (default 480)
  --no-timing       skip the kernel timings and the bandwidth benchmark
  --peak-gbps GBPS  HBM roofline to report against (default: from the device's memory clock
                    and bus width; an H200 is ~4800)
  --engines         also run the TensorRT engine checks (needs `tensorrt`; ~8 more minutes)
  --recipe RECIPE   with --engines: also try `edgebuild build RECIPE`
  --refit           also check a weight-stripped draft engine refitted from the shared
                    head / embedding (needs tensorrt or tensorrt_rtx; a few more minutes)
  --build-dir DIR   build directory (default: build/gpu_check, build/gpu_check_dry)
Log: ${OUT:-/tmp}/gpu_check.log
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=""
RECIPE=""
DRY=0
ENGINES=0
REFIT=0
PYTHON=${PYTHON:-python3}
TIMING=1
BUDGET=480
PEAK_ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift 2 ;;
        --no-timing) TIMING=0; shift ;;
        --peak-gbps) PEAK_ARGS=(--peak-gbps "${2:?--peak-gbps needs a number}"); shift 2 ;;
        --engines) ENGINES=1; shift ;;
        --refit) REFIT=1; shift ;;
        --recipe) RECIPE=${2:?--recipe needs a path}; shift 2 ;;
        --build-dir) BUILD=${2:?--build-dir needs a directory}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]] || ((BUDGET < 60)); then
    echo "--budget must be a whole number of seconds >= 60" >&2
    exit 2
fi
if [[ -z "$BUILD" ]]; then
    BUILD="$ROOT/build/gpu_check$([[ $DRY -eq 1 ]] && echo _dry)"
fi

LOG_DIR=${OUT:-/tmp}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/gpu_check.log"
exec > >(tee "$LOG") 2>&1

FAILURES=0
fail() { echo "FAIL $*"; FAILURES=$((FAILURES + 1)); }
skip() { echo "SKIP $*"; }
section() { echo; echo "=== $* ($(date -u +%H:%M:%S), $((SECONDS - T0)) s of $BUDGET s used)"; }
T0=$SECONDS

# Step caps (seconds); each step gets min(cap, what is left of the budget).
CAP_BUILD=200
CAP_CORRECTNESS=150
CAP_TIMING=100
left() {
    local cap=$1 rest=$((BUDGET - (SECONDS - T0)))
    ((rest < 1)) && rest=1
    echo $((cap < rest ? cap : rest))
}

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

find_tensorrt_root() {  # a TensorRT install or the third-party headers (10.13 = JetPack 7)
    local dir=$ROOT
    if [[ -n "${TENSORRT_ROOT:-}" ]]; then
        echo "$TENSORRT_ROOT"
        return 0
    fi
    while [[ "$dir" != "/" ]]; do
        dir=$(dirname "$dir")
        if [[ -f "$dir/shared/third_party/tensorrt/10.13/include/NvInferRuntime.h" ]]; then
            echo "$dir/shared/third_party/tensorrt/10.13"
            return 0
        fi
    done
    return 1
}

section "plan"
echo "steps (cap s): build $CAP_BUILD, kernels vs host build $CAP_CORRECTNESS," \
    "timings + bandwidth $CAP_TIMING; budget $BUDGET s$([[ $DRY -eq 1 ]] && echo ', DRY RUN')"
if ((CAP_BUILD + CAP_CORRECTNESS + CAP_TIMING > BUDGET)); then
    echo "note: the caps add up to more than the budget; later steps get what is left"
fi

section "machine"
if [[ $DRY -eq 1 ]]; then
    echo "DRY no GPU queried; assuming sm_90 (H200)"
    SM=90
else
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        fail "nvidia-smi not found: this script needs an NVIDIA GPU (use --dry-run without one)"
        exit 1
    fi
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
    SM=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')
fi
NVCC=$(find_nvcc) || NVCC=""
TRT_ROOT=$(find_tensorrt_root) || TRT_ROOT=""
echo "sm_$SM; nvcc: ${NVCC:-not found}; TensorRT headers: ${TRT_ROOT:-not found}; $(getconf _NPROCESSORS_ONLN) cores"
if [[ $DRY -eq 0 && -z "$NVCC" ]]; then
    fail "nvcc not found (PATH, /usr/local/cuda/bin)"
    exit 1
fi

build_with_cmake() {
    local trt=()
    [[ -n "$TRT_ROOT" ]] && trt=(-DTENSORRT_ROOT="$TRT_ROOT")
    timeout "$(left $CAP_BUILD)" cmake -S "$ROOT/plugins" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$SM" "${trt[@]}" &&
        timeout "$(left $CAP_BUILD)" cmake --build "$BUILD" -j "$(getconf _NPROCESSORS_ONLN)"
}

# Same objects as the CMake targets, for machines without CMake (no TensorRT plugin then).
build_with_nvcc() {
    local inc="$ROOT/plugins/include" gen="arch=compute_$SM,code=sm_$SM" t
    t=$(left $CAP_BUILD)
    mkdir -p "$BUILD"
    g++ -std=c++17 -O2 -fPIC -ffp-contract=off -I"$inc" \
        -c "$ROOT/plugins/src/attention_host.cpp" -o "$BUILD/attention_host.o" &&
        timeout "$t" "$NVCC" -std=c++17 -O3 -I"$inc" -gencode "$gen" \
            -c "$ROOT/plugins/src/attention_kernels.cu" -o "$BUILD/attention_kernels.o" &&
        timeout "$t" "$NVCC" -std=c++17 -O3 -I"$inc" -gencode "$gen" \
            -c "$ROOT/plugins/tests/cuda_check.cu" -o "$BUILD/cuda_check.o" &&
        "$NVCC" -gencode "$gen" "$BUILD/cuda_check.o" "$BUILD/attention_kernels.o" \
            "$BUILD/attention_host.o" -o "$BUILD/edgebuild_cuda_check"
}

# The kernels and the check driver with g++ on the CUDA CPU emulation (what --dry-run runs).
build_emulated() {
    local inc="$ROOT/plugins/include" t
    local emu=(-std=c++20 -O1 -U_FORTIFY_SOURCE -ffp-contract=off -DEB_KERNEL_EMULATION
        -I"$inc" -include "$ROOT/plugins/tests/cuda_emulation.h")
    t=$(left $CAP_BUILD)
    mkdir -p "$BUILD"
    timeout "$t" g++ "${emu[@]}" -x c++ -c "$ROOT/plugins/src/attention_kernels.cu" \
        -o "$BUILD/attention_kernels.o" &
    local kernels=$!
    timeout "$t" g++ "${emu[@]}" -x c++ -c "$ROOT/plugins/tests/cuda_check.cu" \
        -o "$BUILD/cuda_check.o" &&
        g++ -std=c++17 -O2 -ffp-contract=off -I"$inc" \
            -c "$ROOT/plugins/src/attention_host.cpp" -o "$BUILD/attention_host.o" &&
        wait "$kernels" &&
        g++ "$BUILD/cuda_check.o" "$BUILD/attention_kernels.o" "$BUILD/attention_host.o" \
            -o "$BUILD/edgebuild_cuda_check"
}

section "build plugins for sm_$SM"
start=$SECONDS
if [[ $DRY -eq 1 ]]; then
    echo "DRY building the kernels and edgebuild_cuda_check with g++ on the CUDA CPU emulation"
    build_emulated || fail "emulated build"
elif command -v cmake >/dev/null 2>&1; then
    build_with_cmake || fail "cmake build for sm_$SM"
else
    echo "cmake not found: building the check with nvcc + g++ directly"
    build_with_nvcc || fail "nvcc build for sm_$SM"
fi
echo "build took $((SECONDS - start)) s"
if [[ $DRY -eq 1 ]]; then
    echo "DRY TensorRT plugin library: not built here (scripts/check_plugin_build.sh builds it)"
elif [[ -f "$BUILD/libedgebuild_plugins.so" ]]; then
    echo "PASS TensorRT plugin library built: $BUILD/libedgebuild_plugins.so"
else
    skip "TensorRT plugin library: no TensorRT headers (NvInferRuntime.h) on this machine"
fi

CHECK="$BUILD/edgebuild_cuda_check"
section "CUDA kernels vs host build (every phase, dtype, kernel)"
if [[ -x "$CHECK" ]]; then
    start=$SECONDS
    args=(--no-timing)
    [[ $DRY -eq 1 ]] && args+=(--quick)
    if timeout "$(left $CAP_CORRECTNESS)" "$CHECK" "${args[@]}"; then
        echo "PASS edgebuild_cuda_check ${args[*]} ($((SECONDS - start)) s)"
    else
        fail "edgebuild_cuda_check (exit $?, $((SECONDS - start)) s): see FAIL lines above"
    fi
else
    fail "edgebuild_cuda_check was not built"
fi

section "kernel timings and decode-attention bandwidth"
if [[ $TIMING -eq 0 ]]; then
    skip "timings: --no-timing"
elif [[ ! -x "$CHECK" ]]; then
    fail "timings: edgebuild_cuda_check was not built"
else
    start=$SECONDS
    if [[ $DRY -eq 1 ]]; then
        args=(--no-correctness --no-timing --bandwidth-dry)
    else
        args=(--no-correctness --bandwidth "${PEAK_ARGS[@]}")
    fi
    if timeout "$(left $CAP_TIMING)" "$CHECK" "${args[@]}"; then
        echo "PASS timings and bandwidth ($((SECONDS - start)) s)"
    else
        fail "timings and bandwidth (exit $?, $((SECONDS - start)) s): see FAIL lines above"
    fi
fi
echo "steps 1-3 took $((SECONDS - T0)) s (budget $BUDGET s)"
if ((SECONDS - T0 > BUDGET)); then
    fail "over the budget of $BUDGET s"
fi

section "TensorRT engine checks"
if [[ $ENGINES -eq 0 ]]; then
    skip "TensorRT engine checks: not asked for (--engines)"
elif [[ $DRY -eq 1 ]]; then
    skip "TensorRT engine checks: --dry-run (they need a GPU)"
elif ! python3 -c "import tensorrt" >/dev/null 2>&1; then
    skip "TensorRT engine checks: python module tensorrt is not importable"
elif [[ ! -f "$BUILD/libedgebuild_plugins.so" ]]; then
    skip "TensorRT engine checks: the TensorRT plugin library was not built (no NvInferRuntime.h)"
else
    echo "tensorrt $(python3 -c 'import tensorrt; print(tensorrt.__version__)')"
    if [[ -n "$RECIPE" ]]; then
        bundle=$(mktemp -d)
        if EDGEBUILD_PLUGIN_LIB="$BUILD/libedgebuild_plugins.so" timeout 300 \
            edgebuild build "$RECIPE" -o "$bundle/bundle"; then
            echo "PASS edgebuild build $RECIPE"
        else
            fail "edgebuild build $RECIPE"
        fi
    fi
    start=$SECONDS
    if PYTHONUNBUFFERED=1 timeout 540 python3 "$ROOT/scripts/gpu_check_engines.py" \
        --plugin-library "$BUILD/libedgebuild_plugins.so" --work-dir "$BUILD/engines"; then
        echo "PASS gpu_check_engines ($((SECONDS - start)) s)"
    else
        fail "gpu_check_engines (exit $?, $((SECONDS - start)) s): see FAIL lines above"
    fi
fi

section "weight-stripped draft engine refitted from the shared head / embedding"
start=$SECONDS
if [[ $DRY -eq 1 ]]; then
    if "$PYTHON" "$ROOT/scripts/gpu_check_refit.py" --plan; then
        echo "PASS refit plan ($((SECONDS - start)) s)"
    else
        fail "refit plan: see FAIL lines above"
    fi
elif [[ $REFIT -eq 0 ]]; then
    skip "refit check: not asked for (--refit)"
elif PYTHONUNBUFFERED=1 timeout 400 "$PYTHON" "$ROOT/scripts/gpu_check_refit.py" \
    --work-dir "$BUILD"; then
    echo "PASS gpu_check_refit ($((SECONDS - start)) s)"
else
    fail "gpu_check_refit (exit $?, $((SECONDS - start)) s): see FAIL lines above"
fi

section "summary"
if [[ $FAILURES -eq 0 ]]; then
    echo "gpu_check: ALL PASS$([[ $DRY -eq 1 ]] && echo ' (dry run: no device part ran)') (log: $LOG)"
else
    echo "gpu_check: $FAILURES FAILED (log: $LOG)"
fi
[[ $FAILURES -eq 0 ]]
