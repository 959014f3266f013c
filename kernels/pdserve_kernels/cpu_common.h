/* What the CPU kernels (kernels/pdserve_kernels/cpu_*.c) share: bf16 <-> fp32 as torch converts, fp8 (e5m2, e4m3) -> fp32, the fp32
 * load/store pair their dtype-generic macros use, a vectorized e^x and 16-lane loads widened to fp32. Included by path ("cpu_common.h"), next to them;
 * kernels/pdserve_kernels/cpu_build.py keys its cache on this header too. */
#ifndef PDSERVE_CPU_COMMON_H
#define PDSERVE_CPU_COMMON_H

#include <stdint.h>

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t float_to_bf16(float x) {  /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = x;
    if (x != x) return 0x7FC0;
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
}

/* fp8 e5m2 is fp16's top byte (1 sign, 5 exponent, 2 mantissa bits): exact in fp32. By hand here, not
 * F16C, so that any build has it. */
static inline float e5m2_to_float(uint8_t x) {
    const uint32_t sign = (uint32_t)(x & 0x80) << 24, exponent = (x >> 2) & 0x1F, mantissa = x & 3;
    union { uint32_t u; float f; } v;
    if (exponent == 0) {  /* zero or subnormal: mantissa / 4 * 2^-14 */
        v.f = (float)mantissa * 0x1p-16f;
        v.u |= sign;
    } else if (exponent == 31) {  /* inf or NaN */
        v.u = sign | 0x7F800000u | (mantissa << 21);
    } else {
        v.u = sign | ((exponent + 112) << 23) | (mantissa << 21);
    }
    return v.f;
}

/* fp8 e4m3 ("fn": no infinities; 0x7F and 0xFF are NaN): 1 sign, 4 exponent (bias 7), 3 mantissa bits. */
static inline float e4m3_to_float(uint8_t x) {
    const uint32_t sign = (uint32_t)(x & 0x80) << 24, exponent = (x >> 3) & 0xF, mantissa = x & 7;
    union { uint32_t u; float f; } v;
    if (exponent == 0) {  /* zero or subnormal: mantissa / 8 * 2^-6 */
        v.f = (float)mantissa * 0x1p-9f;
        v.u |= sign;
    } else if (exponent == 15 && mantissa == 7) {
        v.u = sign | 0x7FC00000u;
    } else {
        v.u = sign | ((exponent + 120) << 23) | (mantissa << 20);
    }
    return v.f;
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#if defined(__AVX512F__)
#include <immintrin.h>

/* e^x for x <= 0: 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r by its Taylor polynomial
 * to r^7 (relative error under 2e-7; right up to x = 88); `scalef` applies 2^n and underflows to 0 as it should. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  /* e^-104 is 0 in fp32: keeps n finite */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 elements widened to fp32 (bf16 -> fp32 is exact: the bits moved up). */
static inline __m512 load16_bf16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

static inline __m512 load16_f32(const float *x) { return _mm512_loadu_ps(x); }

/* 16 fp8 e5m2 widened to fp32: each byte moved up into an fp16, which the CPU converts exactly. */
static inline __m512 load16_e5m2(const uint8_t *x) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)x)), 8));
}

/* 16 fp8 e4m3 widened to fp32: exponent and mantissa moved into an fp16's (its sign bit from the sign
 * extension, the exponent's top bit cleared), which is the value times 2^-8 for normals and subnormals
 * alike (the two biases differ by 8); times 256 after. NaN (0x7F) is not kept: the cache holds none. */
static inline __m512 load16_e4m3(const uint8_t *x) {
    const __m256i halves = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x)), 7),
                                            _mm256_set1_epi16((short)0xBF80));
    return _mm512_mul_ps(_mm512_cvtph_ps(halves), _mm512_set1_ps(256.0f));
}
#endif

#endif
