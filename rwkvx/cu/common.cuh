// rwkvx/cu/common.cuh -- the activation element type floatX and its conversions, for every kernel file.
//
// Kernels are written once for floatX (float or __nv_bfloat16, chosen by FLOATX_BF16, which the runtime
// defines from the launch's element type) and compute in fp32: every value is widened on load and
// rounded once on store. For floatX = float every helper is the identity, so the fp32 instantiation
// runs exactly the arithmetic written in the kernel.
#pragma once
#include <cuda_bf16.h>

#ifndef FLOATX_BF16
#error "FLOATX_BF16 is not defined: compile rwkvx kernels through rwkvx.runtime (their declarations)"
#endif
#if FLOATX_BF16
typedef __nv_bfloat16 floatX;
#else
typedef float floatX;
#endif

// Four consecutive elements in fp32: the unit of the vectorised row kernels.
struct f4 { float v[4]; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ floatX from_f32(float x) {
#if FLOATX_BF16
    return __float2bfloat16_rn(x);
#else
    return x;
#endif
}

__device__ __forceinline__ f4 f4_zero() { f4 r; r.v[0] = 0.f; r.v[1] = 0.f; r.v[2] = 0.f; r.v[3] = 0.f; return r; }

// 4 elements at p (aligned to 4 elements: 16 bytes for float, 8 for bf16)
__device__ __forceinline__ f4 load4(const float* p) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    f4 r; r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w; return r;
}
__device__ __forceinline__ void store4(float* p, const f4& r) {
    *reinterpret_cast<float4*>(p) = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
}
__device__ __forceinline__ f4 load4(const __nv_bfloat16* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    f4 r; r.v[0] = a.x; r.v[1] = a.y; r.v[2] = b.x; r.v[3] = b.y; return r;
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const f4& r) {
    const __nv_bfloat162 a = __floats2bfloat162_rn(r.v[0], r.v[1]);
    const __nv_bfloat162 b = __floats2bfloat162_rn(r.v[2], r.v[3]);
    uint2 u;
    u.x = *reinterpret_cast<const unsigned*>(&a);
    u.y = *reinterpret_cast<const unsigned*>(&b);
    *reinterpret_cast<uint2*>(p) = u;
}
// Four elements as loaded (8 bytes of bf16, 16 of float), widened to fp32 only where used: a kernel that
// holds many loads in flight, or a row in registers, keeps them in half the registers in bf16. Generic
// over the element type, because a bf16 kernel also reads buffers that are fp32 in every precision (the
// residual stream, docs/SPEC.md §4): quad_of<float> for those, quadX for its floatX buffers.
template <class T> struct quad_of;
template <> struct quad_of<float> { typedef float4 type; };
template <> struct quad_of<__nv_bfloat16> { typedef uint2 type; };
typedef quad_of<floatX>::type quadX;
__device__ __forceinline__ f4 widen(uint2 u) {        // bf16 -> fp32: the bits shifted up
    f4 r;
    r.v[0] = __uint_as_float(u.x << 16); r.v[1] = __uint_as_float(u.x & 0xffff0000u);
    r.v[2] = __uint_as_float(u.y << 16); r.v[3] = __uint_as_float(u.y & 0xffff0000u);
    return r;
}
__device__ __forceinline__ f4 widen(float4 u) { f4 r; r.v[0] = u.x; r.v[1] = u.y; r.v[2] = u.z; r.v[3] = u.w; return r; }
template <class T>
__device__ __forceinline__ typename quad_of<T>::type load_quad(const T* p) {
    return *reinterpret_cast<const typename quad_of<T>::type*>(p);
}
template <class T>
__device__ __forceinline__ void store_quad(T* p, typename quad_of<T>::type q) {
    *reinterpret_cast<typename quad_of<T>::type*>(p) = q;
}

// 4 consecutive elements with scalar loads (parameter vectors: only element alignment)
__device__ __forceinline__ f4 load4_scalar(const float* p) {
    f4 r; r.v[0] = p[0]; r.v[1] = p[1]; r.v[2] = p[2]; r.v[3] = p[3]; return r;
}

// true when p is aligned for load4/store4 of floatX
__device__ __forceinline__ bool aligned4(const void* p) {
    return ((unsigned long long)p & (4 * sizeof(floatX) - 1)) == 0;
}

// f(i, r, c4) for every 4-element group i (row r, group c4 of the row) of a row-major [R, C] array,
// C % 4 == 0, over a grid-stride loop.
template <class F>
__device__ __forceinline__ void for_each_quad(int R, int C, F f) {
    const int C4 = C >> 2;
    const long long n4 = (long long)R * C4;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / C4);
        f(i, r, (int)(i - (long long)r * C4));
    }
}
