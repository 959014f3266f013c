/* A copy whose stores bypass the caches (non-temporal), for KV written into another process's landing
 * segment (cluster/transfer/stream_copy.py says why). Built at first use by kernels/pdserve_kernels/cpu_build.py. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* Copies n bytes from src to dst (not overlapping); every store is visible to other cores on return. */
void stream_copy(char *dst, const char *src, size_t n) {
#if defined(__x86_64__)
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;  /* up to the first 64-byte line: plain stores */
    if (head > n) head = n;
    memcpy(dst, src, head);
    size_t i = head;
#if defined(__AVX2__)
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
#else
    for (; i + 64 <= n; i += 64) {
        for (size_t k = 0; k < 64; k += 16)
            _mm_stream_si128((__m128i *)(dst + i + k), _mm_loadu_si128((const __m128i *)(src + i + k)));
    }
#endif
    _mm_sfence();  /* non-temporal stores are weakly ordered: all out before the caller says "written" */
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}
