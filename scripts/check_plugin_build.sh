#!/usr/bin/env bash
# scripts/check_plugin_build.sh
#
# Owns: "does libedgebuild_plugins.so build against the real TensorRT headers" (CI runs it).
# Builds the TensorRT plugin library with CMake (-DTENSORRT_ROOT=<headers>/<version>) for each
# (TensorRT version, SM) pair of the matrix, in parallel, then checks each library:
#   - no compiler warning from our own sources (the headers' own deprecation warnings allowed);
#   - it exports the plugin-library entry points getCreators and setLoggerFinder;
#   - nothing from libnvinfer is undefined or NEEDED (an IPluginV3 library calls none of it);
#   - its device code is for the pair's SM (cuobjdump --list-elf).
# The default matrix compiles every header version (10.3 JetPack 6 / Orin, 10.13 JetPack 7 /
# Thor, 11.1 newest) and every SM (87 Orin, 110 Thor, 90 H200) once each, the natural pairs.
# Exit 0: all passed, or skipped (printed with the reason) because nvcc, cmake or the headers
# are missing; 1: a build or a check failed; 2: usage.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/check_plugin_build.sh [--headers DIR] [--matrix "10.3:87 10.13:110 11.1:90"]
                                     [--build-root DIR] [--jobs N]
  --headers DIR     folder holding <version>/include (default: the first
                    shared/third_party/tensorrt above the repository; env TENSORRT_HEADERS)
  --matrix LIST     version:sm pairs (env PLUGIN_MATRIX)
  --build-root DIR  build folders go to DIR/trt<version>-sm<sm> (default: build/plugin_matrix)
  --jobs N          parallel compile jobs per build (default: nproc)
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HEADERS=${TENSORRT_HEADERS:-}
MATRIX=${PLUGIN_MATRIX:-"10.3:87 10.13:110 11.1:90"}
BUILD_ROOT="$ROOT/build/plugin_matrix"
JOBS=${JOBS:-$(getconf _NPROCESSORS_ONLN)}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --headers) HEADERS=${2:?--headers needs a directory}; shift 2 ;;
        --matrix) MATRIX=${2:?--matrix needs a list}; shift 2 ;;
        --build-root) BUILD_ROOT=${2:?--build-root needs a directory}; shift 2 ;;
        --jobs) JOBS=${2:?--jobs needs a number}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

if [[ -z "$HEADERS" ]]; then
    dir=$ROOT
    while [[ "$dir" != "/" ]]; do
        dir=$(dirname "$dir")
        if [[ -d "$dir/shared/third_party/tensorrt" ]]; then
            HEADERS="$dir/shared/third_party/tensorrt"
            break
        fi
    done
fi
NVCC=${NVCC:-$(command -v nvcc || true)}
if [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]]; then
    NVCC=/usr/local/cuda/bin/nvcc
fi
if [[ -z "$NVCC" ]]; then
    echo "SKIP plugin build matrix: nvcc not found (PATH, /usr/local/cuda/bin)"
    exit 0
fi
if ! command -v cmake >/dev/null 2>&1; then
    echo "SKIP plugin build matrix: cmake not found"
    exit 0
fi
if [[ -z "$HEADERS" || ! -d "$HEADERS" ]]; then
    echo "SKIP plugin build matrix: TensorRT headers not found" \
        "(${HEADERS:-no shared/third_party/tensorrt above $ROOT}; set TENSORRT_HEADERS or --headers)"
    exit 0
fi
CUOBJDUMP=$(dirname "$NVCC")/cuobjdump
echo "nvcc: $("$NVCC" --version | tail -n 1); headers: $HEADERS; matrix: $MATRIX"

build_one() {
    local version=$1 sm=$2
    local dir="$BUILD_ROOT/trt$version-sm$sm" start=$SECONDS
    mkdir -p "$dir"
    if [[ ! -f "$HEADERS/$version/include/NvInferRuntime.h" ]]; then
        echo "missing $HEADERS/$version/include/NvInferRuntime.h" >"$dir/build.log"
        echo "FAIL" >"$dir/status"
        return 0
    fi
    if cmake -S "$ROOT/plugins" -B "$dir" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$sm" \
        -DTENSORRT_ROOT="$HEADERS/$version" -DTENSORRT_INCLUDE_DIR="$HEADERS/$version/include" \
        >"$dir/build.log" 2>&1 &&
        cmake --build "$dir" --target edgebuild_plugins -j "$JOBS" >>"$dir/build.log" 2>&1; then
        echo "OK $((SECONDS - start))" >"$dir/status"
    else
        echo "FAIL $((SECONDS - start))" >"$dir/status"
    fi
}

pids=()
for pair in $MATRIX; do
    build_one "${pair%%:*}" "${pair##*:}" &
    pids+=($!)
done
for pid in "${pids[@]}"; do
    wait "$pid"
done

failed=0
fail() { echo "FAIL $*"; failed=1; }
archs_seen=""
versions_seen=""
for pair in $MATRIX; do
    version=${pair%%:*} sm=${pair##*:}
    dir="$BUILD_ROOT/trt$version-sm$sm"
    lib="$dir/libedgebuild_plugins.so"
    read -r status seconds <"$dir/status" || status=FAIL
    if [[ $status != OK || ! -f "$lib" ]]; then
        fail "TensorRT $version sm_$sm: build failed (log $dir/build.log)"
        grep -E "error|Error|skipping" "$dir/build.log" | head -n 20 | sed 's/^/    /'
        continue
    fi
    # warnings whose location is one of our files (the TensorRT headers' own are allowed);
    # g++ writes file:line:col: warning, nvcc file(line): warning
    own=$(grep -E "^$ROOT/plugins/([^:]+:[0-9]+:[0-9]+|[^(]+\([0-9]+\)): warning" \
        "$dir/build.log" || true)
    [[ -z "$own" ]] || fail "TensorRT $version sm_$sm: warnings in our sources:"$'\n'"$own"
    for sym in getCreators setLoggerFinder; do
        nm -D --defined-only "$lib" | grep -qE " T $sym$" ||
            fail "TensorRT $version sm_$sm: $sym is not exported"
    done
    undefined=$(nm -D --undefined-only "$lib" | c++filt | grep -iE "nvinfer|nvonnx" || true)
    [[ -z "$undefined" ]] ||
        fail "TensorRT $version sm_$sm: undefined TensorRT symbols:"$'\n'"$undefined"
    if readelf -d "$lib" | grep NEEDED | grep -qi nvinfer; then
        fail "TensorRT $version sm_$sm: links libnvinfer"
    fi
    if [[ -x "$CUOBJDUMP" ]]; then
        "$CUOBJDUMP" --list-elf "$lib" | grep -q "sm_$sm" ||
            fail "TensorRT $version sm_$sm: no sm_$sm device code in the library"
    fi
    exported=$(nm -D --defined-only "$lib" | awk '$2 == "T" {print $3}' | tr '\n' ' ')
    echo "PASS TensorRT $version sm_$sm: $lib ($seconds s; exports: $exported)"
    archs_seen+=" $sm"
    versions_seen+=" $version"
done

if [[ $failed -ne 0 ]]; then
    echo "check_plugin_build: FAILED"
    exit 1
fi
echo "check_plugin_build: built against TensorRT${versions_seen} for sm${archs_seen}"
