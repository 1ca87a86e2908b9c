/* linear_avx2.h: the parameters of linear_body.h that the two AVX2 variants share.
 *
 * "avx2" and "avx2vnni" differ only in their name, their target attribute and their integer
 * dot product (VPMADDUBSW + VPMADDWD, or VPDPBUSD): linear_kernels.h defines ISA_NAME,
 * ISA_ATTR, v_qdot, v_q4dot, v_q6dot, v_i4x16dot and v_i8x16dot, then includes this file,
 * which defines the rest -- 8 floats per vector, register tiles of 4 x 3 (12 accumulators in
 * 16 registers, linear_kernels.h's "avx2" section says why) -- and instantiates the kernels.
 * linear_body.h undefines every parameter at its end, so the next variant starts clean.
 */
#define VEC __m256
#define VW 8
#define MR 4
#define NR 3
#define MR16 4 /* bfloat16x16 tiles: 4 rows of x x 16 weight rows: 8 accumulators */
#define v_zero _mm256_setzero_ps
#define v_set1 _mm256_set1_ps
#define v_loadx _mm256_loadu_ps
#define v_storex _mm256_storeu_ps
#define v_fma _mm256_fmadd_ps
#define v_mul _mm256_mul_ps
#define v_add _mm256_add_ps
#define v_hsum mie_avx2_hsum
#define v_load_bf16 mie_avx2_load_bf16
#define v_load_bf16_pair mie_avx2_load_bf16_pair
#define v_load_f16 mie_avx2_load_f16
#define v_load_i8 mie_avx2_load_i8
#define v_load_i4 mie_avx2_load_i4
#define v_load_u2 mie_avx2_load_u2
#define v_i6_decode mie_avx2_i6_decode
#define v_q4scale mie_avx2_q4scale
#define v_q4scales mie_avx2_q4scales
#define s_f16 _cvtsh_ss
#include "linear_body.h"
