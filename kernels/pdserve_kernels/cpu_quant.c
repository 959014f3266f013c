/* Matmuls over GGUF-quantized weights kept packed (Q8_0, Q4_0, Q4_1): y[m, n] = sum_k x[m, k] * w[n, k].
 *
 * Each row of w is its blocks of 32 weights, as llama.cpp lays them out:
 *   Q8_0: fp16 scale d, 32 int8 q                      w = d * q
 *   Q4_0: fp16 scale d, 16 bytes of 4-bit q            w = d * (q - 8)
 *   Q4_1: fp16 scale d, fp16 min m, 16 bytes of q      w = d * q + m
 * where byte j of a 4-bit block holds weight j in its low nibble and weight j + 16 in its high one.
 * A block is widened to 32 floats once and dotted with every row of x: the packed weights are read
 * once per call, which is what bounds a decode step (a 4-bit weight is 5 bits of memory, not 16).
 * x and y are fp32; rows of w are split between threads. Compiled at first use (cpu_build.py). */

#include <stdint.h>
#include <string.h>

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };

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
    return qtype == Q8_0 ? 34 : qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : 0;
}

static void widen_block(const uint8_t *block, int qtype, float *out) {
    const float d = f16_to_float(read_u16(block));
    if (qtype == Q8_0) {
        const int8_t *q = (const int8_t *)(block + 2);
        for (int j = 0; j < 32; j++) out[j] = d * (float)q[j];
        return;
    }
    const float m = qtype == Q4_1 ? f16_to_float(read_u16(block + 2)) : -8.0f * d;
    const uint8_t *q = block + (qtype == Q4_1 ? 4 : 2);
    for (int j = 0; j < 16; j++) {
        out[j] = d * (float)(q[j] & 0x0F) + m;
        out[j + 16] = d * (float)(q[j] >> 4) + m;
    }
}

/* 0 on success, -1 for an unknown qtype or a width not a multiple of 32. */
int quant_matmul(const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n, int qtype, float *y,
                 int num_threads) {
    const int bytes = block_bytes(qtype);
    if (bytes == 0 || k % 32 != 0) return -1;
    const int64_t blocks = k / 32, row_bytes = blocks * bytes;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")
    for (int64_t col = 0; col < n; col++) {
        float widened[32];
        float sums[64];
        for (int64_t m0 = 0; m0 < rows; m0 += 64) {
            const int64_t count = rows - m0 < 64 ? rows - m0 : 64;
            for (int64_t m = 0; m < count; m++) sums[m] = 0.0f;
            const uint8_t *row = w + col * row_bytes;
            for (int64_t b = 0; b < blocks; b++) {
                widen_block(row + b * bytes, qtype, widened);
                for (int64_t m = 0; m < count; m++) {
                    const float *xs = x + (m0 + m) * k + b * 32;
                    float s = 0.0f;
                    _Pragma("omp simd reduction(+:s)")
                    for (int j = 0; j < 32; j++) s += widened[j] * xs[j];
                    sums[m] += s;
                }
            }
            for (int64_t m = 0; m < count; m++) y[(m0 + m) * n + col] = sums[m];
        }
    }
    return 0;
}
