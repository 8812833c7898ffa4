// plugins/include/edgebuild/numeric.h
//
// Owns: the host/device portability macro (EB_HD) and the storage number formats of the
// attention plugin (fp32, fp16, bf16, fp8 e4m3): conversions to and from fp32, and the few
// fp32 operations whose rounding must be identical on the host and the GPU.
//
// Why it exists: the same header functions run in the CUDA kernels and in the host build
// (g++, no CUDA toolkit) that is checked against the Python reference op. The host build
// therefore gets bit-exact software conversions; the device build uses the CUDA intrinsics
// where they are exact (fp16/bf16 <-> fp32) and the same software code for fp8, so that the
// bytes written to the KV cache are the same on both sides.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define EB_HD __host__ __device__ __forceinline__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#define EB_HD inline
#endif

// True inside the device pass of nvcc only: device intrinsics are usable there.
#if defined(__CUDA_ARCH__)
#define EB_DEVICE_PASS 1
#else
#define EB_DEVICE_PASS 0
#endif

#if !EB_DEVICE_PASS
#include <math.h>
#include <string.h>
#endif

namespace eb {

// Storage tag types. They hold raw bits so that the same template code runs on the host
// (where no __half exists) and on the device.
struct f16 {
    uint16_t bits;
};
struct bf16 {
    uint16_t bits;
};
struct fp8e4m3 {
    uint8_t bits;
};

EB_HD uint32_t float_bits(float x) {
#if EB_DEVICE_PASS
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
#endif
}

EB_HD float bits_float(uint32_t u) {
#if EB_DEVICE_PASS
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
#endif
}

// ---- fp32 operations with one rounding each ------------------------------------------------
// nvcc contracts a*b+c into an FMA by default; the host build is compiled with
// -ffp-contract=off. Using these in the K/Q preparation (norm, RoPE, fp8 scaling) makes the
// cache contents bit-identical between the host build and the kernels.
EB_HD float mul_rn(float a, float b) {
#if EB_DEVICE_PASS
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
EB_HD float add_rn(float a, float b) {
#if EB_DEVICE_PASS
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
EB_HD float sub_rn(float a, float b) {
#if EB_DEVICE_PASS
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
EB_HD float div_rn(float a, float b) {
#if EB_DEVICE_PASS
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
EB_HD float sqrt_rn(float a) {
#if EB_DEVICE_PASS
    return __fsqrt_rn(a);
#else
    return sqrtf(a);
#endif
}

// ---- software conversions (round to nearest even), usable everywhere -----------------------

// fp32 -> fp16 bits. Overflow gives inf, as torch's .to(float16) does.
EB_HD uint16_t float_to_f16_bits(float f) {
    const uint32_t x = float_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {  // inf or nan (keep nan quiet)
        return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    }
    if (ax >= 0x477ff000u) {  // >= 65520 rounds to inf
        return static_cast<uint16_t>(sign | 0x7c00u);
    }
    if (ax >= 0x38800000u) {  // normal half: rebias the exponent (127 -> 15) and round 13 bits
        const uint32_t r = ax - 0x38000000u;
        return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
    }
    const uint32_t e = ax >> 23;
    if (e < 102) {  // below half of the smallest subnormal (2^-25): rounds to zero
        return static_cast<uint16_t>(sign);
    }
    // subnormal half: value = M * 2^(e-150), half mantissa = value / 2^-24 = M >> (126 - e)
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (h & 1u))) {
        ++h;
    }
    return static_cast<uint16_t>(sign | h);
}

EB_HD float f16_bits_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu;
    const uint32_t m = h & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m * 2^-24 is exact in fp32
        const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
        return bits_float(float_bits(v) | sign);
    }
    if (e == 31) {
        return bits_float(sign | 0x7f800000u | (m << 13));
    }
    return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

EB_HD uint16_t float_to_bf16_bits(float f) {
    const uint32_t x = float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {  // nan stays a quiet nan
        return static_cast<uint16_t>((x >> 16) | 0x40u);
    }
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

EB_HD float bf16_bits_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// fp32 -> fp8 e4m3 ("fn": no inf, max 448, nan = 0x7f). Saturates to +-448 (satfinite, as the
// CUDA __NV_SATFINITE conversion) instead of producing nan like torch's cast: the KV cache
// must never hold a nan that would poison every later softmax.
EB_HD uint8_t float_to_fp8e4m3_bits(float f) {
    const uint32_t x = float_bits(f);
    const uint32_t sign = (x >> 24) & 0x80u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {
        return static_cast<uint8_t>(sign | 0x7fu);
    }
    if (ax >= 0x43e00000u) {  // >= 448 (and inf): saturate
        return static_cast<uint8_t>(sign | 0x7eu);
    }
    if (ax >= 0x3c800000u) {  // normal e4m3 (>= 2^-6): rebias 127 -> 7, round 20 bits
        const uint32_t r = ax - 0x3c000000u;
        uint32_t b = (r + 0x7ffffu + ((r >> 20) & 1u)) >> 20;
        if (b > 0x7eu) {
            b = 0x7eu;  // 448 < x < 464 rounds to 448 already; keep the guard explicit
        }
        return static_cast<uint8_t>(sign | b);
    }
    const uint32_t e = ax >> 23;
    if (e < 117) {  // below 2^-10, half of the smallest subnormal (2^-9)
        return static_cast<uint8_t>(sign);
    }
    // subnormal e4m3: mantissa = value / 2^-9 = M >> (141 - e)
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 141u - e;
    uint32_t b = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (b & 1u))) {
        ++b;
    }
    return static_cast<uint8_t>(sign | b);
}

EB_HD float fp8e4m3_bits_to_float(uint8_t b) {
    const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
    const uint32_t e = (b >> 3) & 0xfu;
    const uint32_t m = b & 0x7u;
    if (e == 15 && m == 7) {
        return bits_float(sign | 0x7fc00000u);
    }
    if (e == 0) {  // m * 2^-9, exact
        const float v = static_cast<float>(m) * 0.001953125f;
        return bits_float(float_bits(v) | sign);
    }
    return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

// ---- Storage<T>: load/store one element as fp32 ---------------------------------------------
// `round(x)` is store-then-load: the value x takes when it is kept in T. The reference op
// rounds to qkv's dtype after the norm and after RoPE (HF order), and to the cache dtype before
// attention; the kernels call round() at the same points.
template <typename T>
struct Storage;

template <>
struct Storage<float> {
    static constexpr int kBytes = 4;
    static EB_HD float load(const float* p) { return *p; }
    static EB_HD void store(float* p, float x) { *p = x; }
    static EB_HD float round(float x) { return x; }
};

template <>
struct Storage<f16> {
    static constexpr int kBytes = 2;
    static EB_HD float load(const f16* p) {
#if EB_DEVICE_PASS
        return __half2float(__ushort_as_half(p->bits));
#else
        return f16_bits_to_float(p->bits);
#endif
    }
    static EB_HD void store(f16* p, float x) {
#if EB_DEVICE_PASS
        p->bits = __half_as_ushort(__float2half_rn(x));
#else
        p->bits = float_to_f16_bits(x);
#endif
    }
    static EB_HD float round(float x) {
        f16 t;
        store(&t, x);
        return load(&t);
    }
};

template <>
struct Storage<bf16> {
    static constexpr int kBytes = 2;
    static EB_HD float load(const bf16* p) { return bf16_bits_to_float(p->bits); }
    static EB_HD void store(bf16* p, float x) {
#if EB_DEVICE_PASS
        p->bits = __bfloat16_as_ushort(__float2bfloat16_rn(x));
#else
        p->bits = float_to_bf16_bits(x);
#endif
    }
    static EB_HD float round(float x) {
        bf16 t;
        store(&t, x);
        return load(&t);
    }
};

template <>
struct Storage<fp8e4m3> {
    static constexpr int kBytes = 1;
    static EB_HD float load(const fp8e4m3* p) { return fp8e4m3_bits_to_float(p->bits); }
    static EB_HD void store(fp8e4m3* p, float x) { p->bits = float_to_fp8e4m3_bits(x); }
    static EB_HD float round(float x) { return fp8e4m3_bits_to_float(float_to_fp8e4m3_bits(x)); }
};

}  // namespace eb
