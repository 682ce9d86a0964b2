/* CPU kernels for the worker's decode step, called through ctypes (native/bindings.py).
 *
 * Two jobs that PyTorch's eager CPU ops do poorly at decode sizes:
 *  - ip_int8_linear: y = x @ W.T for int8 W, with each row of x quantized to int8 inside the call.
 *    The weight is stored once, at load time, in one layout every ISA reads front to back (16 output
 *    channels x 4 inputs per 64-byte block, shifted to uint8 by +128), so no call pays for a
 *    reorder; `torch._int_mm` reorders on every call and the row quantization alone took five eager
 *    ops (and on CPUs without VNNI it ran 10x slower than float32).
 *  - ip_paged_decode_attention: one query token per sequence against its KV blocks read where they
 *    lie in the paged cache, so no gather copies the context first.
 *
 * One library, built once per instruction set from this file and the parts it includes below
 * (native/build.py picks the best the CPU has, or the one INFERPLANE_NATIVE_ISA names):
 *  - avx512-vnni (-march=x86-64-v4 -mavx512vnni): 16 floats a vector, vpdpbusd for int8.
 *  - avx2-vnni (-march=x86-64-v3 -mavxvnni): 8 floats a vector, the 256-bit vpdpbusd.
 *  - avx2 (-march=x86-64-v3: AVX2 + FMA, as on AMD Zen 2/3 and older Intel): 8 floats a vector;
 *    int8 products by vpmaddubsw/vpmaddwd with the sign moved onto the input (|w| * sign(x, w)),
 *    which keeps every pair sum within int16 (2 * 128 * 127 < 32768), so no product saturates.
 * The float kernels are written once over a small vector layer (vf_*) that each ISA defines.
 *
 * Threads: OpenMP. PyTorch's wheel carries its own libgomp.so.1; loaded after torch, this library
 * binds to that same runtime, so it shares torch's thread pool and torch.set_num_threads().
 * Everything is float32 in and out; integer accumulation is exact, so ip_int8_linear returns what
 * `torch._int_mm` of the same quantized operands, scaled the same way, returns, on every ISA.
 */

/* The parts, in this order (each needs only those before it). One translation unit, as the file
 * was before it was split: the static helpers are inlined where they were, and the int8 and block
 * kernels share one scratch per thread (row_scratch.h). native/build.py compiles this file alone. */
#include "common.h"
#include "kernels.h"
#include "int8_linear.c"   /* ip_int8_linear, ip_int8_dequantize */
#include "block_linear.c"  /* ip_block_linear, ip_block_dequantize */
#include "f32_linear.c"    /* ip_f32_linear */
#include "attention.c"     /* ip_paged_decode_attention */
#include "norm.c"          /* ip_rms_norm */
#include "activation.c"    /* ip_silu_mul, ip_gelu_mul */
#include "moe_route.c"     /* ip_moe_route */
#include "argmax.c"        /* ip_argmax_rows */
#include "sample.c"        /* ip_sample_rows */
#include "rope.c"          /* ip_rope_store_kv */
#include "features.c"      /* ip_features, ip_isa */
#include "decode_layers.c" /* ip_decode_layers, ip_decode_steps */
