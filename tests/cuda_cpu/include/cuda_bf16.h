// tests/cuda_cpu/include/cuda_bf16.h -- the CPU stand-in for CUDA's cuda_bf16.h: __nv_bfloat16 (the upper
// 16 bits of an fp32 value) and the conversions the kernels use, rounding fp32 -> bf16 to nearest, ties
// to even, as the GPU's cvt.rn.bf16.f32 does (NaN -> the canonical 0x7fff).
#pragma once
#include <cstdint>
#include <cstring>

inline unsigned short cpuexec_f32_to_bf16_bits(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float cpuexec_bf16_bits_to_f32(unsigned short h) {
    const unsigned u = (unsigned)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

struct __align__(2) __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(cpuexec_f32_to_bf16_bits(f)) {}
    operator float() const { return cpuexec_bf16_bits_to_f32(__x); }
};
struct __align__(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return cpuexec_bf16_bits_to_f32(h.__x); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return make_float2(__bfloat162float(h.x), __bfloat162float(h.y)); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__nv_bfloat16(a), __nv_bfloat16(b)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return {a, b}; }
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
// per half the larger value (a NaN loses to a number), exact as bf16
inline __nv_bfloat162 __hmax2(__nv_bfloat162 a, __nv_bfloat162 b) {
    return {__nv_bfloat16(fmaxf(__bfloat162float(a.x), __bfloat162float(b.x))),
            __nv_bfloat16(fmaxf(__bfloat162float(a.y), __bfloat162float(b.y)))};
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 h; h.__x = u; return h; }
