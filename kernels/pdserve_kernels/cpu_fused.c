/* Fused elementwise kernels for CPUs: what the model does between its matmuls, one pass each instead
 * of the 5-10 torch ops (each a dispatch of 10-60 us on a decode step's [64, 576] rows) it took.
 *
 *   add_rms_norm: residual' = x + residual (rounded to the dtype), out = weight * norm(residual')
 *   silu_mul:     out = silu(gate) * up, gate and up the two halves of each row of gate_up
 *   rotary:       Hugging Face's rotary (non-interleaved halves) of the query and key heads of qkv
 *   write_kv:     the step's new keys and values into their slots of the paged cache (one call for
 *                 what took torch two index_copy_ and their dispatch); write_kv_fp8 rounds fp32 or
 *                 bf16 rows to an fp8 cache on the way (torch's clamp and cast took four more ops)
 *   causal_softmax_bf16: softmax of a chunk of prefill scores, in place, each row over the keys its
 *                 query sees (the rest set to 0): the mask and the softmax in one pass, and no exp
 *                 of a masked score
 *
 * Each rounds to the dtype where the torch ops it replaces round (bf16 results of bf16 ops, fp32
 * arithmetic inside), so the model computes the same numbers up to the order of a sum. Compiled at
 * first use with `-march=native` (kernels/pdserve_kernels/cpu_build.py): AVX-512 code where the CPU has it, plain C
 * that the compiler vectorizes as it can elsewhere.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"
static inline float f32_round(float x) { return x; }
static inline float bf16_round(float x) { return bf16_to_float(float_to_bf16(x)); }

/* Which instruction sets this build uses: 2 = AVX-512 with bf16 dot products, 1 = AVX-512, 0 = plain C.
 * Tests check that a build for an AVX2-only CPU takes the plain path. */
int fused_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 2;
#elif defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)

static inline void store16_bf16(uint16_t *x, __m512 v) {  /* round to nearest even; NaN stays NaN */
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)x, (__m256i)_mm512_cvtneps_pbh(v));  /* one instruction where the CPU has it */
#else
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)x, _mm512_cvtepi32_epi16(rounded));
#endif
}

static inline void store16_f32(float *x, __m512 v) { _mm512_storeu_ps(x, v); }
static inline __m512 round16_f32(__m512 v) { return v; }
static inline __m512 round16_bf16(__m512 v) {  /* to the nearest bf16, kept in fp32 lanes */
#if defined(__AVX512BF16__)
    const __m256i rounded16 = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded16), 16));
#else
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                                       _mm512_set1_epi32((int)0xFFFF0000u));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(rounded), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
#endif
}

/* silu(x) = x / (1 + e^-x): e^-x with its argument clamped to +-88 (no overflow; sigmoid is 0 or 1 in
 * fp32 past it), the division as a reciprocal estimate refined by one Newton step (2^-28 relative
 * error: fp32's own), several times cheaper than a vector division. */
static inline __m512 silu16(__m512 x) {
    const __m512 argument = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x),
                                                        _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_nonpositive(argument));
    __m512 inverse = _mm512_rcp14_ps(denominator);
    inverse = _mm512_mul_ps(inverse, _mm512_fnmadd_ps(denominator, inverse, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(x, inverse);
}
#define VEC 16
#else
#define VEC 0
#endif

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

#define PARALLEL_WORK 65536  /* elements below which one thread does it all: a fork costs more */

#if defined(__AVX512F__)
#define VECTOR_LOOP(d, n) for (; d + 16 <= (n); d += 16)
#define IF_VECTOR(...) __VA_ARGS__
#else
#define IF_VECTOR(...)
#endif

#define DEFINE_FUSED(SUFFIX, T, LOAD, STORE, ROUND)                                                        \
void add_rms_norm_##SUFFIX(const T *x, const T *residual, const T *weight, T *out, T *residual_out,        \
                           int64_t rows, int64_t size, float eps, int num_threads) {                       \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * size >= PARALLEL_WORK)")                  \
    for (int64_t r = 0; r < rows; r++) {                                                                   \
        const T *xr = x + r * size;                                                                        \
        float sum[size];                                                                                   \
        float squares = 0.0f;                                                                              \
        int64_t d = 0;                                                                                     \
        IF_VECTOR(__m512 acc = _mm512_setzero_ps();                                                        \
            VECTOR_LOOP(d, size) {                                                                         \
                __m512 v = load16_##SUFFIX(xr + d);                                                        \
                if (residual) {                                                                            \
                    v = round16_##SUFFIX(_mm512_add_ps(v, load16_##SUFFIX(residual + r * size + d)));      \
                    store16_##SUFFIX(residual_out + r * size + d, v);                                      \
                }                                                                                          \
                _mm512_storeu_ps(sum + d, v);                                                              \
                acc = _mm512_fmadd_ps(v, v, acc);                                                          \
            }                                                                                              \
            squares = _mm512_reduce_add_ps(acc);)                                                          \
        for (; d < size; d++) {                                                                            \
            float v = LOAD(xr[d]);                                                                         \
            if (residual) {                                                                                \
                v = ROUND(v + LOAD(residual[r * size + d]));                                               \
                residual_out[r * size + d] = STORE(v);                                                     \
            }                                                                                              \
            sum[d] = v;                                                                                    \
            squares += v * v;                                                                              \
        }                                                                                                  \
        const float inverse = 1.0f / sqrtf(squares / (float)size + eps);                                   \
        T *o = out + r * size;                                                                             \
        d = 0;                                                                                             \
        IF_VECTOR(const __m512 scale = _mm512_set1_ps(inverse);                                           \
            VECTOR_LOOP(d, size) {                                                                         \
                __m512 normed = round16_##SUFFIX(_mm512_mul_ps(_mm512_loadu_ps(sum + d), scale));          \
                store16_##SUFFIX(o + d, _mm512_mul_ps(load16_##SUFFIX(weight + d), normed));               \
            })                                                                                             \
        for (; d < size; d++) o[d] = STORE(LOAD(weight[d]) * ROUND(sum[d] * inverse));                    \
    }                                                                                                      \
}                                                                                                          \
                                                                                                           \
void silu_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t size, int num_threads) {           \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * size >= PARALLEL_WORK)")                  \
    for (int64_t r = 0; r < rows; r++) {                                                                   \
        const T *gate = gate_up + r * 2 * size, *up = gate + size;                                         \
        T *o = out + r * size;                                                                             \
        int64_t d = 0;                                                                                     \
        IF_VECTOR(VECTOR_LOOP(d, size) {                                                                   \
            __m512 activated = round16_##SUFFIX(silu16(load16_##SUFFIX(gate + d)));                        \
            store16_##SUFFIX(o + d, _mm512_mul_ps(activated, load16_##SUFFIX(up + d)));                    \
        })                                                                                                 \
        for (; d < size; d++) o[d] = STORE(ROUND(silu(LOAD(gate[d]))) * LOAD(up[d]));                      \
    }                                                                                                      \
}                                                                                                          \
                                                                                                           \
/* qkv rows [rows][row_stride]: the first `heads` heads of `dim` are rotated into out [rows][heads][dim]; \
 * cos and sin are [rows][dim / 2] fp32. */                                                               \
void rotary_##SUFFIX(const T *qkv, int64_t row_stride, const float *cos, const float *sin, T *out,        \
                     int64_t rows, int64_t heads, int64_t dim, int num_threads) {                          \
    const int64_t half = dim / 2;                                                                          \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * heads * dim >= PARALLEL_WORK)")           \
    for (int64_t r = 0; r < rows; r++) {                                                                   \
        const float *c = cos + r * half, *s = sin + r * half;                                              \
        for (int64_t h = 0; h < heads; h++) {                                                              \
            const T *x = qkv + r * row_stride + h * dim;                                                   \
            T *o = out + (r * heads + h) * dim;                                                            \
            int64_t d = 0;                                                                                 \
            IF_VECTOR(VECTOR_LOOP(d, half) {                                                               \
                const __m512 first = load16_##SUFFIX(x + d), second = load16_##SUFFIX(x + half + d);       \
                const __m512 cd = _mm512_loadu_ps(c + d), sd = _mm512_loadu_ps(s + d);                     \
                store16_##SUFFIX(o + d, _mm512_sub_ps(_mm512_mul_ps(first, cd), _mm512_mul_ps(second, sd))); \
                store16_##SUFFIX(o + half + d, _mm512_add_ps(_mm512_mul_ps(second, cd), _mm512_mul_ps(first, sd))); \
            })                                                                                             \
            for (; d < half; d++) {                                                                        \
                const float first = LOAD(x[d]), second = LOAD(x[half + d]);                                \
                o[d] = STORE(first * c[d] - second * s[d]);                                                \
                o[half + d] = STORE(second * c[d] + first * s[d]);                                         \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_FUSED(f32, float, f32_load, f32_store, f32_round)
DEFINE_FUSED(bf16, uint16_t, bf16_to_float, float_to_bf16, bf16_round)

/* scores [rows][cols] bf16, in place: row i is the softmax of its first `visible + i / repeat` entries
 * (fp32 inside, rounded to bf16 as torch's bf16 softmax is), the rest set to 0. `repeat` rows share a
 * query position: the query heads of one KV head, side by side. */
#define STACK_ROW 8192  /* longer rows of scores get their fp32 copy from the heap, not the thread's stack */
int causal_softmax_bf16(uint16_t *scores, int64_t rows, int64_t cols, int64_t visible, int64_t repeat,
                        int num_threads) {
    int failed = 0;
    _Pragma("omp parallel for num_threads(num_threads) if(rows * cols >= PARALLEL_WORK)")
    for (int64_t i = 0; i < rows; i++) {
        uint16_t *x = scores + i * cols;
        int64_t n = visible + i / repeat;
        n = n < cols ? n : cols;
        float stack_row[STACK_ROW];
        float *row = n <= STACK_ROW ? stack_row : malloc(sizeof(float) * n);
        if (row == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
            continue;
        }
        float top = -INFINITY, total = 0.0f;
        int64_t d = 0;
        IF_VECTOR(__m512 peak = _mm512_set1_ps(-INFINITY);
            VECTOR_LOOP(d, n) { __m512 v = load16_bf16(x + d); _mm512_storeu_ps(row + d, v); peak = _mm512_max_ps(peak, v); }
            top = _mm512_reduce_max_ps(peak);)
        for (; d < n; d++) { row[d] = bf16_to_float(x[d]); top = row[d] > top ? row[d] : top; }
        d = 0;
        IF_VECTOR(const __m512 shift = _mm512_set1_ps(top);
            __m512 acc = _mm512_setzero_ps();
            VECTOR_LOOP(d, n) {
                const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + d), shift));
                _mm512_storeu_ps(row + d, e);
                acc = _mm512_add_ps(acc, e);
            }
            total = _mm512_reduce_add_ps(acc);)
        for (; d < n; d++) { row[d] = expf(row[d] - top); total += row[d]; }
        const float inverse = 1.0f / total;
        d = 0;
        IF_VECTOR(const __m512 factor = _mm512_set1_ps(inverse);
            VECTOR_LOOP(d, n) store16_bf16(x + d, _mm512_mul_ps(_mm512_loadu_ps(row + d), factor));)
        for (; d < n; d++) x[d] = float_to_bf16(row[d] * inverse);
        for (d = n; d < cols; d++) x[d] = 0;
        if (row != stack_row) free(row);
    }
    return failed;
}

/* The first index of each row's maximum, as torch.argmax gives it on the same values in fp32 (bf16
 * widens to fp32 exactly, so the answer is the same): ties go to the first, -0 equals +0, and a row
 * holding a NaN gives its first NaN. Rows are `stride` apart. The search runs on 16-bit keys that
 * order as the floats do (the magnitude bits flipped for negative values), 32 at a time with AVX-512. */
static inline int16_t bf16_key(uint16_t x) {
    if (x == 0x8000) x = 0;  /* -0 == +0 */
    return (int16_t)(x ^ ((x >> 15) * 0x7FFF));
}

void argmax_rows_bf16(const uint16_t *logits, int64_t rows, int64_t cols, int64_t stride, int64_t *out,
                      int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if(rows * cols >= 16 * PARALLEL_WORK)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = logits + r * stride;
        int64_t best = 0;
        int has_nan = 0;
        int16_t top = bf16_key(x[0]);
        for (int64_t i = 0; i < cols; i++) {  /* a NaN anywhere decides the row */
            if ((x[i] & 0x7FFF) > 0x7F80) { best = i; has_nan = 1; break; }
        }
        if (!has_nan) {
            int64_t i = 0;
#if defined(__AVX512BW__)
            __m512i peak = _mm512_set1_epi16(top);
            const __m512i zero = _mm512_setzero_si512(), negative_zero = _mm512_set1_epi16((short)0x8000);
            const __m512i flip = _mm512_set1_epi16(0x7FFF);
            for (; i + 32 <= cols; i += 32) {
                __m512i v = _mm512_loadu_si512(x + i);
                v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(v, negative_zero), zero);
                __m512i keys = _mm512_xor_si512(v, _mm512_and_si512(_mm512_srai_epi16(v, 15), flip));
                peak = _mm512_max_epi16(peak, keys);
            }
            /* the largest key of the vector part: fold the 32 lanes */
            int16_t lanes[32];
            _mm512_storeu_si512(lanes, peak);
            for (int j = 0; j < 32; j++) top = lanes[j] > top ? lanes[j] : top;
#endif
            for (; i < cols; i++) { int16_t k = bf16_key(x[i]); top = k > top ? k : top; }
            best = -1;
            i = 0;
#if defined(__AVX512BW__)
            const __m512i wanted = _mm512_set1_epi16(top);
            for (; i + 32 <= cols && best < 0; i += 32) {  /* the first lane holding the largest key */
                __m512i v = _mm512_loadu_si512(x + i);
                v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(v, negative_zero), zero);
                __m512i keys = _mm512_xor_si512(v, _mm512_and_si512(_mm512_srai_epi16(v, 15), flip));
                const __mmask32 hits = _mm512_cmpeq_epi16_mask(keys, wanted);
                if (hits) best = i + __builtin_ctz(hits);
            }
#endif
            for (; i < cols && best < 0; i++) if (bf16_key(x[i]) == top) best = i;
        }
        out[r] = best;
    }
}

/* Row t of `key` (`key_stride` bytes apart) to slot slots[t] of the cache's key half, row t of `value`
 * to the same slot of its value half (`num_slots` rows on); rows of `row_bytes`. Nothing is written
 * and 1 returned if a slot lies outside [0, num_slots): the cache would be written out of bounds. */
int write_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *cache,
             const int64_t *slots, int64_t tokens, int64_t row_bytes, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    char *values = cache + num_slots * row_bytes;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(cache + slots[t] * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(values + slots[t] * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}

/* fp32 to fp8 as torch writes an fp8 cache (`reference.to_cache_dtype`): saturated at the format's
 * largest finite value, then rounded to nearest even; NaN stays NaN (0x7F with the sign). One format is
 * `mbits` mantissa bits and exponent bias `bias` (e4m3fn: 3 and 7, largest 448; e5m2: 2 and 15, largest
 * 57344). Normal results: the exponent rebiased and the mantissa rounded by adding just under half a
 * unit, plus the kept bit's parity (ties to even). Subnormal results: adding a power of two whose unit
 * in the last place is the fp8 subnormal step makes the FPU round, and the sum's low bits are the code. */
typedef struct { int mbits; uint32_t largest, smallest_normal, rebias, denorm; } fp8_format;

static fp8_format fp8_format_of(int e5m2) {
    const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    const fp8_format format = {
        mbits,
        e5m2 ? 0x47600000u : 0x43E00000u,                       /* 57344, 448 */
        (uint32_t)(127 + 1 - bias) << 23,                         /* 2^-14, 2^-6 */
        ((uint32_t)(bias - 127) << 23) + ((1u << (22 - mbits)) - 1),
        (uint32_t)(127 - bias + (23 - mbits) + 1) << 23,
    };
    return format;
}

static inline uint8_t float_to_fp8(float x, fp8_format f) {
    union { float f; uint32_t u; } v = {x}, t;
    const uint32_t sign = v.u & 0x80000000u;
    uint32_t a = v.u ^ sign;
    if (a > 0x7F800000u) return (uint8_t)(0x7F | sign >> 24);
    if (a > f.largest) a = f.largest;
    uint32_t code;
    if (a < f.smallest_normal) {
        v.u = a;
        t.u = f.denorm;
        t.f = v.f + t.f;
        code = t.u - f.denorm;
    } else {
        code = (a + f.rebias + ((a >> (23 - f.mbits)) & 1)) >> (23 - f.mbits);
    }
    return (uint8_t)(code | sign >> 24);
}

#if defined(__AVX512F__)
static inline __m128i fp8_16(__m512 x, fp8_format f) {  /* float_to_fp8 on 16 lanes */
    const __m512i bits = _mm512_castps_si512(x), sign = _mm512_and_si512(bits, _mm512_set1_epi32((int)0x80000000u));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i a = _mm512_min_epu32(_mm512_xor_si512(bits, sign), _mm512_set1_epi32((int)f.largest));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 23 - f.mbits), _mm512_set1_epi32(1));
    __m512i code = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((int)f.rebias)), odd),
                                     23 - f.mbits);
    const __m512i denorm = _mm512_set1_epi32((int)f.denorm);
    const __m512 shifted = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm));
    const __mmask16 subnormal = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((int)f.smallest_normal));
    code = _mm512_mask_mov_epi32(code, subnormal, _mm512_sub_epi32(_mm512_castps_si512(shifted), denorm));
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7F));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(code, _mm512_srli_epi32(sign, 24)));
}
#endif

static void row_to_fp8(uint8_t *out, const char *row, int source_bf16, int64_t n, fp8_format f) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 x = source_bf16 ? load16_bf16((const uint16_t *)row + i) : load16_f32((const float *)row + i);
        _mm_storeu_si128((__m128i *)(out + i), fp8_16(x, f));
    }
#endif
    for (; i < n; i++)
        out[i] = float_to_fp8(source_bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i], f);
}

/* write_kv for an fp8 cache: each of the `tokens` rows of `row` fp32 (or bf16) values rounded to fp8
 * (e5m2 or e4m3fn) straight into its slot, with no tensor of rounded rows made first. */
int write_kv_fp8(const char *key, int64_t key_stride, const char *value, int64_t value_stride, int source_bf16,
                 int e5m2, uint8_t *cache, const int64_t *slots, int64_t tokens, int64_t row, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    const fp8_format f = fp8_format_of(e5m2);
    uint8_t *values = cache + num_slots * row;
    for (int64_t t = 0; t < tokens; t++) {
        row_to_fp8(cache + slots[t] * row, key + t * key_stride, source_bf16, row, f);
        row_to_fp8(values + slots[t] * row, value + t * value_stride, source_bf16, row, f);
    }
    return 0;
}
