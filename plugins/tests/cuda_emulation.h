// plugins/tests/cuda_emulation.h
//
// Owns: a small CPU stand-in for the CUDA execution model, so that the real kernel source
// (src/attention_kernels.cu) and the real GPU check driver (tests/cuda_check.cu) compile with
// g++ and run on a machine without a GPU. Force-included (g++ -include) ahead of them with
// -DEB_KERNEL_EMULATION; tests/test_plugin_host.py builds and runs the result.
//
// Why: no GPU is available in CI or on the developers' machines. The host build checks the
// math; this checks the kernels themselves: indexing, tiling, masks per tile, shared-memory
// layout and sizes, the barrier/warp-shuffle protocol, the online-softmax merges and the
// launcher's dispatch. Each CUDA thread of a block is a fiber (ucontext) on one OS thread; a
// barrier (__syncthreads, __syncwarp, each half of __shfl_xor_sync) parks the fiber until every
// live thread of the block (or warp) has arrived, so the interleavings are the ones the CUDA
// rules allow, and a barrier that some threads never reach is reported as a deadlock instead
// of hanging. Blocks run one after another, so a function-static array is exactly one block's
// __shared__ memory. Exited threads drop out of the barriers (as on the GPU).
//
// Not emulated: timing, memory coalescing, anything about real hardware numerics beyond
// IEEE fp32 (the device-only intrinsics fall back to the host code paths of numeric.h).
#pragma once

#if !defined(EB_KERNEL_EMULATION)
#error "cuda_emulation.h is for -DEB_KERNEL_EMULATION builds only"
#endif

#include <setjmp.h>
#include <ucontext.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

// ---- language keywords ------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define EB_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(emu::dynamic_smem().data())

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

enum class State { kRunnable, kWarpBarrier, kBlockBarrier, kDone };

// A fiber starts once through makecontext/swapcontext; after that every switch is
// _setjmp/_longjmp, which (unlike swapcontext) costs no signal-mask system call. Build with
// -U_FORTIFY_SOURCE: the fortified longjmp refuses to jump between stacks.
struct Fiber {
    ucontext_t context;
    jmp_buf jump;
    char* stack = nullptr;
    bool started = false;
    State state = State::kRunnable;
};

// The block being run: its fibers, the scheduler's resume point and the warp shuffle slots.
struct Scheduler {
    jmp_buf main;
    ucontext_t main_context;
    std::vector<Fiber> fibers;
    std::vector<std::array<float, 32>> exchange;
    std::function<void()> body;
    unsigned current = 0;
};

inline Scheduler* scheduler = nullptr;
inline dim3 thread_idx;
inline dim3 block_idx;
inline dim3 block_dim;
inline dim3 grid_dim;

inline std::vector<unsigned char>& dynamic_smem() {
    static std::vector<unsigned char> buffer;
    return buffer;
}

// Fiber stacks, allocated once (uninitialised: zeroing megabytes per launch dominated the run).
constexpr size_t kStackBytes = 64 * 1024;
inline char* fiber_stack(unsigned index) {
    static std::vector<std::unique_ptr<char[]>> stacks;
    while (stacks.size() <= index) stacks.emplace_back(new char[kStackBytes]);
    return stacks[index].get();
}

inline void park(State state) {
    Fiber& self = scheduler->fibers[scheduler->current];
    self.state = state;
    if (_setjmp(self.jump) == 0) {
        _longjmp(scheduler->main, 1);
    }
}

inline void fiber_entry() {
    scheduler->body();
    scheduler->fibers[scheduler->current].state = State::kDone;
    _longjmp(scheduler->main, 1);  // never returns into this finished stack
}

inline void resume(Scheduler& s, unsigned t) {
    Fiber& f = s.fibers[t];
    if (_setjmp(s.main) != 0) {
        return;  // the fiber parked or finished
    }
    if (!f.started) {
        f.started = true;
        swapcontext(&s.main_context, &f.context);
    }
    _longjmp(f.jump, 1);
}

// Releases every barrier whose live participants have all arrived; false if nothing can run.
inline bool release_barriers(Scheduler& s) {
    const unsigned n = static_cast<unsigned>(s.fibers.size());
    bool runnable = false, block_ready = true, any_live = false;
    for (unsigned w = 0; w * 32 < n; ++w) {
        bool warp_ready = true, warp_live = false;
        for (unsigned t = w * 32; t < n && t < w * 32 + 32; ++t) {
            const State st = s.fibers[t].state;
            warp_live |= st != State::kDone;
            warp_ready &= st == State::kWarpBarrier || st == State::kDone;
        }
        if (warp_live && warp_ready) {
            for (unsigned t = w * 32; t < n && t < w * 32 + 32; ++t) {
                if (s.fibers[t].state == State::kWarpBarrier) s.fibers[t].state = State::kRunnable;
            }
        }
    }
    for (const Fiber& f : s.fibers) {
        any_live |= f.state != State::kDone;
        block_ready &= f.state == State::kBlockBarrier || f.state == State::kDone;
        runnable |= f.state == State::kRunnable;
    }
    if (any_live && block_ready) {
        for (Fiber& f : s.fibers) {
            if (f.state == State::kBlockBarrier) f.state = State::kRunnable;
        }
        runnable = true;
    }
    return runnable || !any_live;
}

// Runs one block to completion; aborts with a message on a barrier deadlock.
inline void run_block(Scheduler& s) {
    const unsigned n = static_cast<unsigned>(s.fibers.size());
    for (unsigned t = 0; t < n; ++t) {
        Fiber& f = s.fibers[t];
        f.stack = fiber_stack(t);
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack;
        f.context.uc_stack.ss_size = kStackBytes;
        f.context.uc_link = nullptr;
        makecontext(&f.context, fiber_entry, 0);
        f.started = false;
        f.state = State::kRunnable;
    }
    for (;;) {
        for (unsigned t = 0; t < n; ++t) {
            if (s.fibers[t].state != State::kRunnable) continue;
            s.current = t;
            thread_idx = dim3(t % block_dim.x, (t / block_dim.x) % block_dim.y,
                              t / (block_dim.x * block_dim.y));
            resume(s, t);
        }
        bool all_done = true;
        for (const Fiber& f : s.fibers) all_done &= f.state == State::kDone;
        if (all_done) return;
        if (!release_barriers(s)) {
            std::fprintf(stderr, "cuda_emulation: barrier deadlock in block (%u,%u,%u)\n",
                         block_idx.x, block_idx.y, block_idx.z);
            std::abort();
        }
    }
}

inline unsigned linear_thread() { return scheduler->current; }

}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::park(emu::State::kBlockBarrier); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::park(emu::State::kWarpBarrier); }
inline float __shfl_xor_sync(unsigned, float value, int lane_mask, int = 32) {
    emu::Scheduler& s = *emu::scheduler;
    const unsigned warp = emu::linear_thread() / 32, lane = emu::linear_thread() % 32;
    s.exchange[warp][lane] = value;
    emu::park(emu::State::kWarpBarrier);
    const float other = s.exchange[warp][lane ^ static_cast<unsigned>(lane_mask)];
    emu::park(emu::State::kWarpBarrier);  // nobody overwrites the slot before everyone read it
    return other;
}

// ---- runtime API subset (host memory stands in for device memory) ------------------------------
using cudaError_t = int;
using cudaStream_t = void*;
using cudaEvent_t = int*;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
enum cudaMemcpyKind {
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaDeviceProp {
    char name[256];
    int major;
    int minor;
};

inline const char* cudaGetErrorString(cudaError_t) { return "emulated CUDA error"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaMalloc(void** p, size_t n) {
    *p = std::malloc(n == 0 ? 1 : n);
    return *p != nullptr ? cudaSuccess : 2;
}
inline cudaError_t cudaFree(void* p) {
    std::free(p);
    return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
    std::memcpy(dst, src, n);
    return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                                   cudaStream_t = nullptr) {
    return cudaMemcpy(dst, src, n, kind);
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
// The emulated device's compute capability: $EB_EMULATED_SM (e.g. 87 for Orin), default 90.
// Memory clock / bus width are not emulated (cudaErrorInvalidValue: no bandwidth roofline).
enum cudaDeviceAttr {
    cudaDevAttrMemoryClockRate = 36,
    cudaDevAttrGlobalMemoryBusWidth = 37,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76
};
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
    const char* env = std::getenv("EB_EMULATED_SM");
    const int sm = env != nullptr ? std::atoi(env) : 90;
    if (attr == cudaDevAttrComputeCapabilityMajor || attr == cudaDevAttrComputeCapabilityMinor) {
        *value = attr == cudaDevAttrComputeCapabilityMajor ? sm / 10 : sm % 10;
        return cudaSuccess;
    }
    *value = 0;
    return cudaErrorInvalidValue;
}
inline cudaError_t cudaMemset(void* p, int value, size_t n) {
    std::memset(p, value, n);
    return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
    *device = 0;
    return cudaSuccess;
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int) {
    std::strcpy(prop->name, "CPU emulation (plugins/tests/cuda_emulation.h)");
    prop->major = 0;
    prop->minor = 0;
    return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) {
    *e = nullptr;
    return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = nullptr) { return cudaSuccess; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) {
    *ms = 0.0f;
    return cudaSuccess;
}
template <typename F>
cudaError_t cudaFuncSetAttribute(F*, cudaFuncAttribute, int) {
    return cudaSuccess;
}

// The launch: every block in turn, each as blockDim fibers. Replaces `kernel<<<...>>>(args)`
// (attention_kernels.cu routes all launches through launch_kernel).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t, Args... args) {
    const unsigned threads = block.x * block.y * block.z;
    emu::dynamic_smem().assign(smem + 16, 0xcd);  // garbage, like real shared memory
    emu::block_dim = block;
    emu::grid_dim = grid;
    emu::Scheduler s;
    s.fibers.resize(threads);
    s.exchange.resize((threads + 31) / 32);
    s.body = [&] { kernel(args...); };
    emu::Scheduler* const outer = emu::scheduler;
    emu::scheduler = &s;
    for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
            for (unsigned x = 0; x < grid.x; ++x) {
                emu::block_idx = dim3(x, y, z);
                emu::run_block(s);
            }
        }
    }
    emu::scheduler = outer;
    return cudaSuccess;
}
