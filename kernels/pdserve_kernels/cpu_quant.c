/* Matmuls over GGUF-quantized weights kept packed (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
 * y[m, n] = sum_k x[m, k] * w[n, k].
 *
 * Each row of w is its blocks of 32 weights, as llama.cpp lays them out:
 *   Q8_0: fp16 scale d, 32 int8 q                      w = d * q
 *   Q4_0: fp16 scale d, 16 bytes of 4-bit q            w = d * (q - 8)
 *   Q4_1: fp16 scale d, fp16 min m, 16 bytes of q      w = d * q + m
 *   Q5_0: fp16 scale d, 4 bytes qh, 16 bytes of q   w = d * (q + 16 * bit - 16)
 *   Q5_1: fp16 scale d, fp16 min m, 4 bytes qh, 16 bytes of q    w = d * (q + 16 * bit) + m
 * where byte j of a 4-bit block holds weight j in its low nibble and weight j + 16 in its high one, and
 * a Q5 weight j's 5th bit is bit j of qh read as a little-endian 32-bit word;
 *   Q4_K: a super-block of 256: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of
 *         4-bit q; sub-block i of 32 is w = d * scale_i * q - dmin * min_i, its q in the low nibbles of
 *         32 bytes (even i) or their high nibbles (odd i), two sub-blocks per 32 bytes;
 *   Q5_K: as Q4_K with 32 bytes qh between the scales and the 4-bit q: weight l of sub-block i has its
 *         5th bit in bit i of qh[l] (176 bytes);
 *   Q6_K: a super-block of 256: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales,
 *         fp16 d (210 bytes); w = d * scale_i * (q - 32), scale_i for each 16 weights. Each half of 128
 *         weights takes 64 bytes of ql and 32 of qh: its run r of 32 is ql's bytes 32 * (r % 2) on, low
 *         nibbles for r < 2, high ones after, with bits 2r and 2r + 1 of qh's bytes on top.
 * A row of w is widened to floats once and dotted with every row of x: the packed weights are read
 * once per call, which is what bounds a decode step (a 4-bit weight is 5 bits of memory, not 16).
 * x and y are fp32; rows of w are split between threads. `quant_widen` widens whole rows for a
 * matmul library (a prefill's many rows). Compiled at first use (cpu_build.py). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q5_0 = 4, Q5_1 = 5, Q6_K = 6, Q5_K = 7 };

static inline float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    union { uint32_t u; float f; } v;
    if (exponent == 0) {  /* zero or subnormal: mantissa * 2^-24 */
        v.f = (float)mantissa * 0x1p-24f;
        v.u |= sign;
    } else if (exponent == 31) {
        v.u = sign | 0x7F800000u | (mantissa << 13);
    } else {
        v.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    return v.f;
}

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t value;
    memcpy(&value, p, sizeof value);
    return value;
}

static int block_bytes(int qtype) {
    switch (qtype) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static int block_weights(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K ? 256 : 32; }

/* Q4_K's 6-bit scale and min of sub-block j, as llama.cpp packs them into 12 bytes. */
static void scale_min_k4(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K, or Q5_K (`qh` not NULL: its 5th bits, bit j of qh[l] for weight l of sub-block j). */
static void widen_q4_k_q5_k(const uint8_t *block, const uint8_t *qh, float *out) {
    const float d = f16_to_float(read_u16(block)), dmin = f16_to_float(read_u16(block + 2));
    const uint8_t *scales = block + 4, *q = block + (qh != NULL ? 48 : 16);
    for (int j = 0; j < 8; j += 2, q += 32, out += 64) {
        int sc0, m0, sc1, m1;
        scale_min_k4(j, scales, &sc0, &m0);
        scale_min_k4(j + 1, scales, &sc1, &m1);
        const float d0 = d * (float)sc0, d1 = d * (float)sc1, min0 = dmin * (float)m0, min1 = dmin * (float)m1;
        for (int l = 0; l < 32; l++) {
            const int high0 = qh != NULL ? ((qh[l] >> j) & 1) << 4 : 0;
            const int high1 = qh != NULL ? ((qh[l] >> (j + 1)) & 1) << 4 : 0;
            out[l] = d0 * (float)((q[l] & 0x0F) | high0) - min0;
            out[l + 32] = d1 * (float)((q[l] >> 4) | high1) - min1;
        }
    }
}

static void widen_q6_k(const uint8_t *block, float *out) {
    const float d = f16_to_float(read_u16(block + 208));
    const int8_t *scales = (const int8_t *)(block + 192);
    const uint8_t *ql = block, *qh = block + 128;
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, scales += 8, out += 128) {
        for (int l = 0; l < 32; l++) {
            const int q[4] = {(ql[l] & 0x0F) | ((qh[l] & 3) << 4), (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                              (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), (ql[l + 32] >> 4) | ((qh[l] >> 6) << 4)};
            for (int r = 0; r < 4; r++) {  /* run r of 32 weights: scales 2r (its first 16) and 2r + 1 */
                out[32 * r + l] = d * (float)scales[2 * r + l / 16] * (float)(q[r] - 32);
            }
        }
    }
}

static void widen_block(const uint8_t *block, int qtype, float *out) {
    if (qtype == Q4_K || qtype == Q5_K) {
        widen_q4_k_q5_k(block, qtype == Q5_K ? block + 16 : NULL, out);
        return;
    }
    if (qtype == Q6_K) {
        widen_q6_k(block, out);
        return;
    }
    const float d = f16_to_float(read_u16(block));
    if (qtype == Q8_0) {
        const int8_t *q = (const int8_t *)(block + 2);
        for (int j = 0; j < 32; j++) out[j] = d * (float)q[j];
        return;
    }
    const int has_min = qtype == Q4_1 || qtype == Q5_1, five_bits = qtype == Q5_0 || qtype == Q5_1;
    const float m = has_min ? f16_to_float(read_u16(block + 2)) : (qtype == Q5_0 ? -16.0f : -8.0f) * d;
    const uint8_t *q = block + (has_min ? 4 : 2);
    uint32_t high = 0;
    if (five_bits) {
        memcpy(&high, q, sizeof high);
        q += 4;
    }
    for (int j = 0; j < 16; j++) {
        const int low_q = (q[j] & 0x0F) | (int)(((high >> j) & 1) << 4);
        const int high_q = (q[j] >> 4) | (int)(((high >> (j + 16)) & 1) << 4);
        out[j] = d * (float)low_q + m;
        out[j + 16] = d * (float)high_q + m;
    }
}

static void widen_row(const uint8_t *row, int64_t blocks, int qtype, int bytes, float *out) {
    const int weights = block_weights(qtype);
    for (int64_t b = 0; b < blocks; b++) widen_block(row + b * bytes, qtype, out + b * weights);
}

/* 0 on success, -1 for an unknown qtype or a width not a multiple of its block. Each thread widens one row of
 * w at a time into its own buffer, then dots it with every row of x: the widening runs once per row
 * of w, the dots over k contiguous floats vectorize. */
int quant_matmul(const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n, int qtype, float *y,
                 int num_threads) {
    const int bytes = block_bytes(qtype), weights = block_weights(qtype);
    if (bytes == 0 || k % weights != 0) return -1;
    const int64_t blocks = k / weights, row_bytes = blocks * bytes;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        float *widened = malloc(sizeof(float) * (size_t)k);
        if (widened == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t col = 0; col < n; col++) {
            if (widened == NULL) continue;
            widen_row(w + col * row_bytes, blocks, qtype, bytes, widened);
            for (int64_t m = 0; m < rows; m++) {
                const float *xs = x + m * k;
                float s = 0.0f;
                _Pragma("omp simd reduction(+:s)")
                for (int64_t j = 0; j < k; j++) s += widened[j] * xs[j];
                y[m * n + col] = s;
            }
        }
        free(widened);
    }
    return failed ? -2 : 0;
}

static inline uint16_t to_bf16(float x) {  /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = x;
    if (x != x) return 0x7FC0;
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
}

/* The packed rows widened: out [n, k] in fp32, or bf16 (rounded as torch rounds) if `bf16`. For the
 * rows a matmul library multiplies faster than the kernel above (a prefill's). */
int quant_widen(const uint8_t *w, int64_t n, int64_t k, int qtype, void *out, int bf16, int num_threads) {
    const int bytes = block_bytes(qtype), weights = block_weights(qtype);
    if (bytes == 0 || k % weights != 0) return -1;
    const int64_t blocks = k / weights, row_bytes = blocks * bytes;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t row = 0; row < n; row++) {
        float widened[256];
        for (int64_t b = 0; b < blocks; b++) {
            widen_block(w + row * row_bytes + b * bytes, qtype, widened);
            if (bf16) {
                uint16_t *to = (uint16_t *)out + row * k + b * weights;
                for (int j = 0; j < weights; j++) to[j] = to_bf16(widened[j]);
            } else {
                memcpy((float *)out + row * k + b * weights, widened, sizeof(float) * (size_t)weights);
            }
        }
    }
    return 0;
}
