/* What the CPU kernels (kernels/cpu_*.c) share: bf16 <-> fp32 as torch converts, and the fp32
 * load/store pair their dtype-generic macros use. Included by path ("cpu_common.h"), next to them;
 * kernels/cpu_build.py keys its cache on this header too. */
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

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#endif
