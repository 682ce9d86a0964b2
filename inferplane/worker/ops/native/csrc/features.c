/* What this build has: its kernels (ip_features) and its instruction set (ip_isa).
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone. */
#include "common.h"
#include "kernels.h"
#include "kv_cache.h"

/* Which of the kernels (kernels.h) this build has (the others return -1). */
int ip_features(void) {
    return (IP_INT8 ? IP_FEATURE_INT8_LINEAR | IP_FEATURE_BLOCK_LINEAR : 0) | (IP_VECTOR ? IP_FEATURE_F32_LINEAR : 0)
           | (IP_HALF_KV ? IP_FEATURE_HALF_KV : 0);
}

/* The instruction set this build's vector code uses: what the library was compiled for, so the
 * Python side can check it loaded what it asked for, and stats can say which kernels ran. */
const char *ip_isa(void) {
#if IP_AVX512 && IP_INT8
    return "avx512-vnni";
#elif IP_AVX512
    return "avx512";
#elif IP_AVX2_VNNI && !defined(__AVXVNNI__)
    return "avx2-vnni-emulated";
#elif IP_AVX2_VNNI
    return "avx2-vnni";
#elif IP_AVX2
    return "avx2";
#else
    return "generic";
#endif
}
