/* Paged decode attention for CPUs: one query token per sequence against its cached context, read
 * straight from the paged KV cache (no gather into a dense tensor), in fp32 arithmetic.
 *
 * Layout (kernels/reference.py): cache[0 = key | 1 = value][block][offset][kv_head][head_dim].
 * One task per sequence: every head's score for every cached token (one pass over the keys, each
 * token's row of all KV heads read whole), a softmax, then the weighted sum of the values (one
 * pass). Every key and value is read once per step and layer, and only the sequence's own `seq_len`
 * tokens. A sequence of length 0 (a padding row) gives zeros.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

/* Dot products of an fp32 query head with one key. A plain loop's sum is reduced lane by lane in
 * order (the compiler may not reassociate it), which cost more than the products; AVX-512 sums 16
 * partial sums as a tree instead. */
static inline float dot_f32(const float *q, const float *raw, const float *k, int64_t dim, float scale) {
    (void)raw; (void)scale;  /* q is already scaled */
    float total = 0.0f;
    int64_t d = 0;
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    for (; d + 16 <= dim; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), sum);
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; d < dim; d++) total += q[d] * k[d];
    return total;
}

/* With AVX512-BF16, `vdpbf16ps` multiplies the unscaled bf16 query and the key pairwise (each product
 * exact in fp32) and sums in fp32: no conversion of the key, half the instructions; the scale comes
 * after. Without it, the key is widened to fp32 and multiplied by the scaled fp32 query. */
static inline float dot_bf16(const float *q, const uint16_t *raw, const uint16_t *k, int64_t dim, float scale) {
    float total = 0.0f;
    int64_t d = 0;
#if defined(__AVX512BF16__)
    __m512 pairs = _mm512_setzero_ps();
    for (; d + 32 <= dim; d += 32)
        pairs = _mm512_dpbf16_ps(pairs, (__m512bh)_mm512_loadu_si512(raw + d), (__m512bh)_mm512_loadu_si512(k + d));
    total = _mm512_reduce_add_ps(pairs);
    for (; d < dim; d++) total += bf16_to_float(raw[d]) * bf16_to_float(k[d]);
    return total * scale;
#elif defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    for (; d + 16 <= dim; d += 16) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(k + d)));
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), sum);
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; d < dim; d++) total += q[d] * bf16_to_float(k[d]);
    return total;
}

typedef struct {
    int64_t batch, heads, kv_heads, head_dim, block_size;
    int64_t num_blocks;     /* blocks in one of the cache's two halves */
    int64_t table_stride;   /* elements between two rows of the block table */
    float scale;
    int num_threads;
} DecodeShape;

/* x[0:n] becomes softmax(x) in place (n >= 1). */
static inline void softmax(float *x, int64_t n) {
    float top = x[0], total = 0.0f;
    int64_t t = 0;
    for (int64_t i = 1; i < n; i++) top = x[i] > top ? x[i] : top;
#if defined(__AVX512F__)
    const __m512 shift = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) {
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + t), shift));
        _mm512_storeu_ps(x + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; t < n; t++) { x[t] = expf(x[t] - top); total += x[t]; }
    const float inverse = 1.0f / total;
    for (int64_t i = 0; i < n; i++) x[i] *= inverse;
}

#define DEFINE_DECODE(NAME, T, LOAD, STORE, DOT)                                                            \
static inline __attribute__((always_inline)) void NAME##_sequence(                                       \
        const T *query, const T *keys, const T *values, const int64_t *table, int64_t seq_len, T *out,      \
        const DecodeShape *s, float *scratch, const int64_t dim) {                                          \
    const int64_t heads = s->heads, group = heads / s->kv_heads, bs = s->block_size;                      \
    const int64_t token_stride = s->kv_heads * dim, block_stride = bs * token_stride;                     \
    float *q = scratch, *acc = q + heads * dim, *scores = acc + heads * dim;                              \
    int64_t kv_of_head[heads];  /* offset of each query head's KV head in a token's row */               \
    for (int64_t h = 0; h < heads; h++) kv_of_head[h] = h / group * dim;                                  \
    for (int64_t i = 0; i < heads * dim; i++) { q[i] = LOAD(query[i]) * s->scale; acc[i] = 0.0f; }         \
    for (int64_t t = 0; t < seq_len; t++) {  /* one token's keys, every KV head: one contiguous row */     \
        const T *row = keys + table[t / bs] * block_stride + (t % bs) * token_stride;                     \
        for (int64_t h = 0; h < heads; h++) {                                                             \
            const float *qh = q + h * dim;                                                                \
            const T *k = row + kv_of_head[h];                                                             \
            scores[h * seq_len + t] = DOT(qh, query + h * dim, k, dim, s->scale);                         \
        }                                                                                                 \
    }                                                                                                     \
    for (int64_t h = 0; h < heads && seq_len > 0; h++) softmax(scores + h * seq_len, seq_len);          \
    for (int64_t t = 0; t < seq_len; t++) {  /* each KV head's value widened once for its query group */ \
        const T *row = values + table[t / bs] * block_stride + (t % bs) * token_stride;                   \
        for (int64_t g = 0; g < s->kv_heads; g++) {                                                       \
            float v[dim];                                                                                 \
            _Pragma("omp simd")                                                                           \
            for (int64_t d = 0; d < dim; d++) v[d] = LOAD(row[g * dim + d]);                              \
            for (int64_t h = g * group; h < (g + 1) * group; h++) {                                       \
                const float p = scores[h * seq_len + t];                                                  \
                float *ah = acc + h * dim;                                                                \
                _Pragma("omp simd")                                                                       \
                for (int64_t d = 0; d < dim; d++) ah[d] += p * v[d];                                      \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    for (int64_t i = 0; i < heads * dim; i++) out[i] = STORE(acc[i]);                                     \
}                                                                                                         \
                                                                                                          \
int NAME(const T *query, const T *cache, const int64_t *block_tables, const int32_t *seq_lens, T *out,    \
         const DecodeShape *s) {                                                                          \
    const int64_t row = s->heads * s->head_dim;                                                           \
    const T *keys = cache, *values = cache + s->num_blocks * s->block_size * s->kv_heads * s->head_dim;   \
    int64_t longest = 0;                                                                                  \
    for (int64_t b = 0; b < s->batch; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;       \
    const int64_t scratch_floats = s->heads * (2 * s->head_dim + longest);                                \
    int failed = 0;                                                                                       \
    _Pragma("omp parallel num_threads(s->num_threads)")                                                   \
    {                                                                                                     \
        float *scratch = malloc(sizeof(float) * scratch_floats);                                          \
        _Pragma("omp for schedule(dynamic)")                                                              \
        for (int64_t b = 0; b < s->batch; b++) {                                                          \
            if (scratch == NULL) {                                                                        \
                _Pragma("omp atomic write")                                                               \
                failed = 1;                                                                               \
                continue;                                                                                 \
            }                                                                                             \
            const T *q = query + b * row;                                                                 \
            const int64_t *table = block_tables + b * s->table_stride;                                    \
            /* The common head sizes as constants: the compiler unrolls the dot products. */               \
            if (s->head_dim == 64)                                                                        \
                NAME##_sequence(q, keys, values, table, seq_lens[b], out + b * row, s, scratch, 64);      \
            else if (s->head_dim == 128)                                                                  \
                NAME##_sequence(q, keys, values, table, seq_lens[b], out + b * row, s, scratch, 128);     \
            else                                                                                          \
                NAME##_sequence(q, keys, values, table, seq_lens[b], out + b * row, s, scratch, s->head_dim); \
        }                                                                                                 \
        free(scratch);                                                                                    \
    }                                                                                                     \
    return failed;                                                                                        \
}

DEFINE_DECODE(paged_decode_f32, float, f32_load, f32_store, dot_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_float, float_to_bf16, dot_bf16)
