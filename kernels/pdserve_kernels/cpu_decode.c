/* Paged decode attention for CPUs: one query token per sequence against its cached context, read
 * straight from the paged KV cache (no gather into a dense tensor), in fp32 arithmetic.
 *
 * Layout (kernels/pdserve_kernels/reference.py): cache[0 = key | 1 = value][block][offset][kv_head][head_dim].
 * One task per sequence: every head's score for every cached token (one pass over the keys, each
 * token's row of all KV heads read whole), a softmax, then the weighted sum of the values (one
 * pass). Every key and value is read once per step and layer, and only the sequence's own `seq_len`
 * tokens. A sequence of length 0 (a padding row) gives zeros.
 *
 * With AVX-512 and a head size of 64 or 128 (`tiled`, the default), both passes go 16 tokens at a
 * time: 16 independent dot products per head (no FMA chain waits on the one before) summed into one
 * vector of 16 scores by a shuffle tree (~3 instructions a token instead of a horizontal sum each),
 * the output of a group of query heads kept in registers over the 16 tokens' values, and the next 16
 * tokens' rows prefetched (blocks lie anywhere in the pool: the hardware prefetcher stops at each)
 * and each tile's lines touched in address order first (see touch_rows).
 * Elsewhere (AVX2, other head sizes, or `tiled` 0) one token at a time.
 *
 * The cache is in the model's dtype (fp32, bf16) or in fp8 (`kv_cache_dtype`: e5m2 or e4m3, a byte per
 * element, no scale) under an fp32 or bf16 query: each fp8 key and value widened to fp32 exactly as it
 * is read (16 at a time through the CPU's fp16 -> fp32 conversion), half of bf16's bytes read.
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

/* fp8 keys (a cache of `kv_cache_dtype` fp8_e5m2 or fp8_e4m3): widened to fp32 and multiplied by the
 * scaled fp32 query, whatever the query's own dtype. */
#if defined(__AVX512F__)
#define FP8_DOT_LOOP(FMT)                                                                                   \
    __m512 sum = _mm512_setzero_ps();                                                                      \
    for (; d + 16 <= dim; d += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16_##FMT(k + d), sum); \
    total = _mm512_reduce_add_ps(sum);
#else
#define FP8_DOT_LOOP(FMT)
#endif
#define DEFINE_FP8_DOT(FMT)                                                                                 \
static inline float dot_##FMT(const float *q, const void *raw, const uint8_t *k, int64_t dim, float scale) { \
    (void)raw; (void)scale;  /* q is already scaled */                                                    \
    float total = 0.0f;                                                                                   \
    int64_t d = 0;                                                                                        \
    FP8_DOT_LOOP(FMT)                                                                                     \
    for (; d < dim; d++) total += q[d] * FMT##_to_float(k[d]);                                            \
    return total;                                                                                         \
}
DEFINE_FP8_DOT(e5m2)
DEFINE_FP8_DOT(e4m3)

typedef struct {
    int64_t batch, heads, kv_heads, head_dim, block_size;
    int64_t num_blocks;     /* blocks in one of the cache's two halves */
    int64_t table_stride;   /* elements between two rows of the block table */
    float scale;
    int num_threads;
    int tiled;              /* 1: 16 tokens at a time where the build and head size allow; 0: one at a time */
    int64_t query_stride;   /* elements between two rows of the query (each row's heads contiguous) */
    int64_t table_width;    /* blocks in a row of the block table: no length may pass width * block_size */
    int64_t window;         /* a sliding window: the query sees its context's last `window` tokens; 0: all */
    float softcap;          /* scores become softcap * tanh(score / softcap) before the softmax; 0: no cap */
} DecodeShape;

/* A sliding window's first visible token of a context of seq_len (transformers' sliding mask: the
 * query at seq_len - 1 and the window - 1 tokens before it); 0 without a window. */
static inline int64_t window_start(int64_t seq_len, const DecodeShape *s) {
    return s->window > 0 && seq_len > s->window ? seq_len - s->window : 0;
}

/* One head's scores before its softmax: soft-capped where the layer caps them, and the first `masked`
 * (the tokens of the context's first visible block that lie before the window) hidden. */
static inline void adjust_scores(float *x, int64_t n, int64_t masked, float softcap) {
    if (softcap > 0.0f)
        for (int64_t i = 0; i < n; i++) x[i] = softcap * tanhf(x[i] / softcap);
    for (int64_t i = 0; i < masked && i < n; i++) x[i] = -INFINITY;
}

/* x[0:n] becomes softmax(x) in place (n >= 1, some x finite). */
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

#define TILE_KEYS 16  /* rows of keys widened from fp8 at once: a tile's (the scratch holds them) */

#if defined(__AVX512F__)
#define TILE TILE_KEYS

/* Lane i of the result: the sum of v[i]'s 16 lanes. Each level adds pairs after a shuffle that lines
 * up their halves: 16 vectors -> 8 (4-lane groups) -> 4 -> 2 -> 1, 45 instructions for 16 sums. */
static inline __m512 sum16(const __m512 v[TILE]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The cache rows (all KV heads) of tokens t0 .. t0 + n - 1 of a sequence; the tile's unused rows
 * repeat the last one, so a short tile computes on memory it may read and stores only n lanes. */
static inline void tile_rows(const char *base, const int64_t *table, int64_t t0, int64_t n, int64_t bs,
                             int64_t block_bytes, int64_t row_bytes, const char *rows[TILE]) {
    for (int64_t j = 0; j < TILE; j++) {
        const int64_t t = t0 + (j < n ? j : n - 1);
        rows[j] = base + table[t / bs] * block_bytes + (t % bs) * row_bytes;
    }
}

/* The next tile's rows asked for ahead of their use. */
static inline void prefetch_rows(const char *const rows[TILE], int64_t n, int64_t row_bytes) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(rows[j] + b, _MM_HINT_T0);
}

/* One load of every cache line of the tile's rows, in address order, before the tile's loops read
 * them one KV head at a time (a stride through the rows). The hardware's stream prefetcher follows
 * loads in address order, not the strided ones: without this pass the tiled loops are slower than one
 * token at a time on a cache read from memory in order, with it faster, prefetching or not
 * (docs/performance.md). */
static volatile char tile_sink;
static inline void touch_rows(const char *const rows[TILE], int64_t n, int64_t row_bytes) {
    char x = 0;  /* one byte a line (a char may alias anything); kept alive through the volatile sink */
    for (int64_t j = 0; j < n; j++)
        for (int64_t b = 0; b < row_bytes; b += 64) x ^= rows[j][b];
    tile_sink = x;
}

/* Step to the tile at t0 of the keys or values at `base`: its rows (found a tile earlier, in `next`)
 * into `rows` and touched in order; the tile after it found into `next` and prefetched. Its length. */
static inline int64_t advance_tile(const char *base, const int64_t *table, int64_t t0, int64_t seq_len, int64_t bs,
                                   int64_t block_bytes, int64_t row_bytes, const char *rows[TILE],
                                   const char *next[TILE]) {
    const int64_t n = seq_len - t0 < TILE ? seq_len - t0 : TILE;
    memcpy(rows, next, sizeof(rows[0]) * TILE);
    if (t0 + TILE < seq_len) {
        const int64_t later = seq_len - t0 - TILE < TILE ? seq_len - t0 - TILE : TILE;
        tile_rows(base, table, t0 + TILE, later, bs, block_bytes, row_bytes, next);
        prefetch_rows(next, later, row_bytes);
    }
    touch_rows(rows, n, row_bytes);
    return n;
}

#if defined(__AVX512BF16__)
/* 32 bf16 as the dot-product instruction's operand. A cast of `_mm512_loadu_si512` made gcc 12 send
 * every key through the stack inside the tile loop (a store and a reload each); memcpy does not. */
static inline __m512bh load32_bf16(const uint16_t *x) {
    __m512bh v;
    memcpy(&v, x, sizeof v);
    return v;
}
#endif

/* Scores of one query head against a tile's keys (the head's KV head at byte `at` of each row). */
static inline __attribute__((always_inline)) __m512 scores16_f32(const float *q, const char *const rows[TILE],
                                                                 int64_t at, const int64_t dim) {
    __m512 sums[TILE];
    for (int j = 0; j < TILE; j++) sums[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + d);
        for (int j = 0; j < TILE; j++)
            sums[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps((const float *)(rows[j] + at) + d), sums[j]);
    }
    return sum16(sums);
}

/* bf16 keys: `vdpbf16ps` with the unscaled bf16 query where the CPU has it (see dot_bf16), else the
 * key widened and multiplied by the scaled fp32 query. Either way the result is scaled. */
static inline __attribute__((always_inline)) __m512 scores16_bf16(const float *q, const uint16_t *raw,
                                                                  const char *const rows[TILE], int64_t at,
                                                                  const int64_t dim, float scale) {
    __m512 sums[TILE];
    for (int j = 0; j < TILE; j++) sums[j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    (void)q;
    for (int64_t d = 0; d < dim; d += 32) {
        const __m512bh qd = load32_bf16(raw + d);
        for (int j = 0; j < TILE; j++)
            sums[j] = _mm512_dpbf16_ps(sums[j], qd, load32_bf16((const uint16_t *)(rows[j] + at) + d));
    }
    return _mm512_mul_ps(sum16(sums), _mm512_set1_ps(scale));
#else
    (void)raw; (void)scale;
    for (int64_t d = 0; d < dim; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + d);
        for (int j = 0; j < TILE; j++)
            sums[j] = _mm512_fmadd_ps(qd, load16_bf16((const uint16_t *)(rows[j] + at) + d), sums[j]);
    }
    return sum16(sums);
#endif
}

/* fp8 keys: widened to fp32 (one conversion per 16), times the scaled fp32 query. */
#define DEFINE_FP8_SCORES16(FMT)                                                                            \
static inline __attribute__((always_inline)) __m512 scores16_##FMT(const float *q, const char *const rows[TILE], \
                                                                   int64_t at, const int64_t dim) {       \
    __m512 sums[TILE];                                                                                    \
    for (int j = 0; j < TILE; j++) sums[j] = _mm512_setzero_ps();                                         \
    for (int64_t d = 0; d < dim; d += 16) {                                                               \
        const __m512 qd = _mm512_loadu_ps(q + d);                                                         \
        for (int j = 0; j < TILE; j++)                                                                    \
            sums[j] = _mm512_fmadd_ps(qd, load16_##FMT((const uint8_t *)(rows[j] + at) + d), sums[j]);    \
    }                                                                                                     \
    return sum16(sums);                                                                                   \
}
DEFINE_FP8_SCORES16(e5m2)
DEFINE_FP8_SCORES16(e4m3)

#define SCORES16_f32(q, raw, rows, at, dim, scale) scores16_f32(q, rows, at, dim)
#define SCORES16_e5m2(q, raw, rows, at, dim, scale) scores16_e5m2(q, rows, at, dim)
#define SCORES16_e4m3(q, raw, rows, at, dim, scale) scores16_e4m3(q, rows, at, dim)
#define SCORES16_bf16(q, raw, rows, at, dim, scale) scores16_bf16(q, raw, rows, at, dim, scale)

/* acc[h] += sum over the tile's n tokens of p[h][t] * value[t], for NH query heads sharing one KV
 * head (at byte `at` of each row): their outputs stay in registers over the tile, each value widened once. */
#define DEFINE_VALUES16(SUFFIX, T)                                                                           \
static inline __attribute__((always_inline)) void values16_##SUFFIX(                                       \
        float *acc, const float *p, int64_t p_stride, const char *const rows[TILE], int64_t at, int64_t n,  \
        const int64_t nh, const int64_t dim) {                                                              \
    __m512 sums[4][8];                                                                                      \
    for (int64_t h = 0; h < nh; h++)                                                                        \
        for (int64_t c = 0; c < dim / 16; c++) sums[h][c] = _mm512_loadu_ps(acc + h * dim + c * 16);         \
    for (int64_t j = 0; j < n; j++) {                                                                       \
        const T *v = (const T *)(rows[j] + at);                                                             \
        __m512 wide[8];                                                                                     \
        for (int64_t c = 0; c < dim / 16; c++) wide[c] = load16_##SUFFIX(v + c * 16);                       \
        for (int64_t h = 0; h < nh; h++) {                                                                  \
            const __m512 ph = _mm512_set1_ps(p[h * p_stride + j]);                                          \
            for (int64_t c = 0; c < dim / 16; c++) sums[h][c] = _mm512_fmadd_ps(ph, wide[c], sums[h][c]);   \
        }                                                                                                   \
    }                                                                                                       \
    for (int64_t h = 0; h < nh; h++)                                                                        \
        for (int64_t c = 0; c < dim / 16; c++) _mm512_storeu_ps(acc + h * dim + c * 16, sums[h][c]);         \
}
DEFINE_VALUES16(f32, float)
DEFINE_VALUES16(bf16, uint16_t)
DEFINE_VALUES16(e5m2, uint8_t)
DEFINE_VALUES16(e4m3, uint8_t)

/* values16 with the head count a constant (the compiler keeps `sums` in registers only then): up to
 * 4 heads of 64 or 2 of 128 at once, 16-21 of the 32 vector registers. */
#define VALUES16(SUFFIX, acc, p, p_stride, rows, at, n, nh, dim)                                            \
    switch (nh) {                                                                                           \
    case 1: values16_##SUFFIX(acc, p, p_stride, rows, at, n, 1, dim); break;                                \
    case 2: values16_##SUFFIX(acc, p, p_stride, rows, at, n, 2, dim); break;                                \
    case 3: values16_##SUFFIX(acc, p, p_stride, rows, at, n, 3, dim); break;                                \
    default: values16_##SUFFIX(acc, p, p_stride, rows, at, n, 4, dim); break;                               \
    }

/* A tile's key rows as the scores read them: the cache's own rows (`keep_rows`), or fp8 rows widened
 * once into `tile` (fp32 or bf16, both exact for fp8), not once per query head of a KV head's group.
 * Widening in the scores' inner loop, once per query head, costs what reading half the bytes saves;
 * widened once to bf16, the scores keep bf16's `vdpbf16ps`. */
static inline const char *const *keep_rows(const char *const rows[TILE], int64_t n, int64_t row_elems, char *tile,
                                           const char *out[TILE]) {
    (void)n; (void)row_elems; (void)tile; (void)out;
    return rows;
}

static inline void store16_f32(char *x, __m512 v) { _mm512_storeu_ps((float *)x, v); }
static inline void store16_bf16_exact(char *x, __m512 v) {  /* v holds bf16 values: the top halves */
    _mm256_storeu_si256((__m256i *)x, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

#define DEFINE_WIDEN_ROWS(FMT, WSUFFIX, WT)                                                                 \
static inline const char *const *widen_##FMT##_##WSUFFIX(const char *const rows[TILE], int64_t n,           \
                                                         int64_t row_elems, char *tile, const char *out[TILE]) { \
    const int64_t bytes = row_elems * (int64_t)sizeof(WT);                                                \
    for (int64_t j = 0; j < n; j++)                                                                       \
        for (int64_t e = 0; e < row_elems; e += 16)                                                       \
            store16_##WSUFFIX(tile + j * bytes + e * (int64_t)sizeof(WT), load16_##FMT((const uint8_t *)rows[j] + e)); \
    for (int64_t j = 0; j < TILE; j++) out[j] = tile + (j < n ? j : n - 1) * bytes;                       \
    return out;                                                                                           \
}
DEFINE_WIDEN_ROWS(e5m2, f32, float)
DEFINE_WIDEN_ROWS(e5m2, bf16_exact, uint16_t)
DEFINE_WIDEN_ROWS(e4m3, f32, float)
DEFINE_WIDEN_ROWS(e4m3, bf16_exact, uint16_t)

/* One sequence, 16 tokens at a time (dim 64 or 128): the same three passes as NAME##_sequence. The
 * query and output are QT, the cache CT (an fp8 one under a bf16 or fp32 model: `kv_cache_dtype`); the
 * scores read keys of KT through KEYS (the cache's rows, or fp8 ones widened to KT: KSUFFIX's), the
 * values pass widens CT itself (VSUFFIX). */
#define DEFINE_TILED(NAME, QT, CT, KT, KSUFFIX, VSUFFIX, KEYS, LOAD, STORE)                                 \
static inline __attribute__((always_inline)) void NAME##_tiled(                                          \
        const QT *query, const CT *keys, const CT *values, const int64_t *table, int64_t seq_len, QT *out,  \
        const DecodeShape *s, float *scratch, const int64_t dim, int64_t masked) {                          \
    const int64_t heads = s->heads, group = heads / s->kv_heads, bs = s->block_size;                      \
    const int64_t row_bytes = s->kv_heads * dim * (int64_t)sizeof(CT), block_bytes = bs * row_bytes;     \
    const int64_t most = dim == 64 ? 4 : 2;  /* query heads whose outputs fit in registers at once */      \
    float *q = scratch, *acc = q + heads * dim, *scores = acc + heads * dim;                              \
    char *key_tile = (char *)(scores + heads * seq_len);  /* TILE rows of widened keys, if any */         \
    for (int64_t i = 0; i < heads * dim; i++) { q[i] = LOAD(query[i]) * s->scale; acc[i] = 0.0f; }         \
    const char *rows[TILE], *next[TILE], *widened[TILE];                                                  \
    tile_rows((const char *)keys, table, 0, seq_len < TILE ? seq_len : TILE, bs, block_bytes, row_bytes, next); \
    for (int64_t t0 = 0; t0 < seq_len; t0 += TILE) {                                                      \
        const int64_t n = advance_tile((const char *)keys, table, t0, seq_len, bs, block_bytes, row_bytes, rows, next); \
        const __mmask16 lanes = (__mmask16)((1u << n) - 1);                                               \
        const char *const *key_rows = KEYS(rows, n, s->kv_heads * dim, key_tile, widened);                \
        for (int64_t h = 0; h < heads; h++) {                                                             \
            const int64_t at = h / group * dim * (int64_t)sizeof(KT);                                     \
            _mm512_mask_storeu_ps(scores + h * seq_len + t0, lanes,                                      \
                                  SCORES16_##KSUFFIX(q + h * dim, query + h * dim, key_rows, at, dim, s->scale)); \
        }                                                                                                 \
    }                                                                                                     \
    tile_rows((const char *)values, table, 0, seq_len < TILE ? seq_len : TILE, bs, block_bytes, row_bytes, next); \
    prefetch_rows(next, seq_len < TILE ? seq_len : TILE, row_bytes);  /* read while the softmax runs */   \
    for (int64_t h = 0; h < heads; h++) {                                                                 \
        adjust_scores(scores + h * seq_len, seq_len, masked, s->softcap);                                 \
        softmax(scores + h * seq_len, seq_len);                                                           \
    }                                                                                                     \
    for (int64_t t0 = 0; t0 < seq_len; t0 += TILE) {                                                      \
        const int64_t n = advance_tile((const char *)values, table, t0, seq_len, bs, block_bytes, row_bytes, rows, next); \
        for (int64_t g = 0; g < s->kv_heads; g++) {                                                       \
            const int64_t at = g * dim * (int64_t)sizeof(CT), end = (g + 1) * group;                      \
            for (int64_t h = g * group; h < end; h += most) {                                             \
                const int64_t nh = end - h < most ? end - h : most;                                       \
                VALUES16(VSUFFIX, acc + h * dim, scores + h * seq_len + t0, seq_len, rows, at, n, nh, dim) \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    for (int64_t i = 0; i < heads * dim; i++) out[i] = STORE(acc[i]);                                     \
}
DEFINE_TILED(paged_decode_f32, float, float, float, f32, f32, keep_rows, f32_load, f32_store)
DEFINE_TILED(paged_decode_bf16, uint16_t, uint16_t, uint16_t, bf16, bf16, keep_rows, bf16_to_float, float_to_bf16)
DEFINE_TILED(paged_decode_f32_e5m2, float, uint8_t, float, f32, e5m2, widen_e5m2_f32, f32_load, f32_store)
DEFINE_TILED(paged_decode_bf16_e5m2, uint16_t, uint8_t, uint16_t, bf16, e5m2, widen_e5m2_bf16_exact, bf16_to_float,
             float_to_bf16)
DEFINE_TILED(paged_decode_f32_e4m3, float, uint8_t, float, f32, e4m3, widen_e4m3_f32, f32_load, f32_store)
DEFINE_TILED(paged_decode_bf16_e4m3, uint16_t, uint8_t, uint16_t, bf16, e4m3, widen_e4m3_bf16_exact, bf16_to_float,
             float_to_bf16)
#endif

#if defined(__AVX512F__)
#define TILED(s) ((s)->tiled)
#else  /* no tiled code in this build: the calls below are never made */
#define TILED(s) 0
#define paged_decode_f32_tiled paged_decode_f32_sequence
#define paged_decode_bf16_tiled paged_decode_bf16_sequence
#define paged_decode_f32_e5m2_tiled paged_decode_f32_e5m2_sequence
#define paged_decode_bf16_e5m2_tiled paged_decode_bf16_e5m2_sequence
#define paged_decode_f32_e4m3_tiled paged_decode_f32_e4m3_sequence
#define paged_decode_bf16_e4m3_tiled paged_decode_bf16_e4m3_sequence
#endif

/* Query and output QT (LOAD and STORE convert them), cache CT (KV_LOAD widens it). */
#define DEFINE_DECODE(NAME, QT, CT, LOAD, STORE, KV_LOAD, DOT)                                              \
static inline __attribute__((always_inline)) void NAME##_sequence(                                       \
        const QT *query, const CT *keys, const CT *values, const int64_t *table, int64_t seq_len, QT *out,  \
        const DecodeShape *s, float *scratch, const int64_t dim, int64_t masked) {                          \
    const int64_t heads = s->heads, group = heads / s->kv_heads, bs = s->block_size;                      \
    const int64_t token_stride = s->kv_heads * dim, block_stride = bs * token_stride;                     \
    float *q = scratch, *acc = q + heads * dim, *scores = acc + heads * dim;                              \
    int64_t kv_of_head[heads];  /* offset of each query head's KV head in a token's row */               \
    for (int64_t h = 0; h < heads; h++) kv_of_head[h] = h / group * dim;                                  \
    for (int64_t i = 0; i < heads * dim; i++) { q[i] = LOAD(query[i]) * s->scale; acc[i] = 0.0f; }         \
    for (int64_t t = 0; t < seq_len; t++) {  /* one token's keys, every KV head: one contiguous row */     \
        const CT *row = keys + table[t / bs] * block_stride + (t % bs) * token_stride;                    \
        for (int64_t h = 0; h < heads; h++) {                                                             \
            const float *qh = q + h * dim;                                                                \
            const CT *k = row + kv_of_head[h];                                                            \
            scores[h * seq_len + t] = DOT(qh, query + h * dim, k, dim, s->scale);                         \
        }                                                                                                 \
    }                                                                                                     \
    for (int64_t h = 0; h < heads && seq_len > 0; h++) {                                                  \
        adjust_scores(scores + h * seq_len, seq_len, masked, s->softcap);                                 \
        softmax(scores + h * seq_len, seq_len);                                                           \
    }                                                                                                     \
    for (int64_t t = 0; t < seq_len; t++) {  /* each KV head's value widened once for its query group */ \
        const CT *row = values + table[t / bs] * block_stride + (t % bs) * token_stride;                  \
        for (int64_t g = 0; g < s->kv_heads; g++) {                                                       \
            float v[dim];                                                                                 \
            _Pragma("omp simd")                                                                           \
            for (int64_t d = 0; d < dim; d++) v[d] = KV_LOAD(row[g * dim + d]);                           \
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
int NAME(const QT *query, const CT *cache, const int64_t *block_tables, const int32_t *seq_lens, QT *out, \
         const DecodeShape *s) {                                                                          \
    const int64_t row = s->heads * s->head_dim;                                                           \
    const CT *keys = cache, *values = cache + s->num_blocks * s->block_size * s->kv_heads * s->head_dim;  \
    int64_t longest = 0;                                                                              \
    for (int64_t b = 0; b < s->batch; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;       \
    for (int64_t b = 0; b < s->batch; b++)  /* checked here, not per layer in Python: nothing read past a table */ \
        if (seq_lens[b] < 0 || seq_lens[b] > s->table_width * s->block_size) return 2;                    \
    /* the query, the outputs, the scores, and a tile of keys widened from fp8 (fp32 at most) */         \
    const int64_t scratch_floats = s->heads * (2 * s->head_dim + longest) + TILE_KEYS * s->kv_heads * s->head_dim; \
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
            const QT *q = query + b * s->query_stride;                                                    \
            /* Under a window, the blocks wholly before it are skipped (the table starts later, the    \
             * length shrinks) and the rest of the tokens before it masked. */                          \
            const int64_t first = window_start(seq_lens[b], s), skip = first / s->block_size;           \
            const int64_t *table = block_tables + b * s->table_stride + skip;                             \
            const int64_t len = seq_lens[b] - skip * s->block_size, masked = first - skip * s->block_size; \
            /* The common head sizes as constants: the compiler unrolls the dot products. */               \
            if (s->head_dim == 64 && TILED(s))                                                            \
                NAME##_tiled(q, keys, values, table, len, out + b * row, s, scratch, 64, masked);         \
            else if (s->head_dim == 128 && TILED(s))                                                      \
                NAME##_tiled(q, keys, values, table, len, out + b * row, s, scratch, 128, masked);        \
            else if (s->head_dim == 64)                                                                   \
                NAME##_sequence(q, keys, values, table, len, out + b * row, s, scratch, 64, masked);      \
            else if (s->head_dim == 128)                                                                  \
                NAME##_sequence(q, keys, values, table, len, out + b * row, s, scratch, 128, masked);     \
            else                                                                                          \
                NAME##_sequence(q, keys, values, table, len, out + b * row, s, scratch, s->head_dim, masked); \
        }                                                                                                 \
        free(scratch);                                                                                    \
    }                                                                                                     \
    return failed;                                                                                        \
}

DEFINE_DECODE(paged_decode_f32, float, float, f32_load, f32_store, f32_load, dot_f32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, uint16_t, bf16_to_float, float_to_bf16, bf16_to_float, dot_bf16)
DEFINE_DECODE(paged_decode_f32_e5m2, float, uint8_t, f32_load, f32_store, e5m2_to_float, dot_e5m2)
DEFINE_DECODE(paged_decode_bf16_e5m2, uint16_t, uint8_t, bf16_to_float, float_to_bf16, e5m2_to_float, dot_e5m2)
DEFINE_DECODE(paged_decode_f32_e4m3, float, uint8_t, f32_load, f32_store, e4m3_to_float, dot_e4m3)
DEFINE_DECODE(paged_decode_bf16_e4m3, uint16_t, uint8_t, bf16_to_float, float_to_bf16, e4m3_to_float, dot_e4m3)
