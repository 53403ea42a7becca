/* The dot products of this build's instruction set, for the kernel sources (cpu_gemv.c, attention.c): the one
 * place the instruction-set headers are included, and so the one place their dispatch rule is applied.
 *
 * The dispatch rule: each header defines a function (dot_widen, dot_bf16, dot_i8, q4_row, dot_row, axpy_row,
 * exp_inplace, ...) only where no header included before it defined that function already, which it says by
 * defining SIMD_HAVE_<NAME>; the headers are included widest first, each only where the build's -march flags
 * (engine/native/variants.py) give it its instructions. So the widest header that defines a function wins, and
 * simd_portable.h, included last and always, defines whatever is left in plain C. BF16_FORM (the activation form
 * act_prepare fills for the bf16 dot) is set by whichever header defines dot_bf16. */
#ifndef MOE_OFFLOAD_SIMD_H
#define MOE_OFFLOAD_SIMD_H
#include "kernel_common.h"

#if defined(__AVX512F__)
#include "simd_avx512.h"
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include "simd_avx2.h"
#endif
#include "simd_portable.h"

#endif
