/* linear_avx512.h: the parameters of linear_body.h that the two AVX-512 variants share.
 *
 * "avx512" and "avx512vnni" differ only in their name, their target attribute and their
 * integer dot product (VPMADDUBSW + VPMADDWD, or VPDPBUSD): linear_kernels.h defines
 * ISA_NAME, ISA_ATTR, v_qdot, v_q4dot, v_q6dot, v_i4x16dot and v_i8x16dot, then includes this
 * file, which defines the rest -- 16 floats per vector, register tiles of 4 x 4 (16
 * accumulators, 4 activation vectors and a weight vector in 32 registers) -- and instantiates
 * the kernels. linear_body.h undefines every parameter at its end, so the next variant starts
 * clean.
 */
#define VEC __m512
#define VW 16
#define MR 4
#define NR 4
#define MR16 8 /* bfloat16x16 tiles: 8 rows of x x 16 weight rows: 8 accumulators */
#define v_zero _mm512_setzero_ps
#define v_set1 _mm512_set1_ps
#define v_loadx _mm512_loadu_ps
#define v_storex _mm512_storeu_ps
#define v_fma _mm512_fmadd_ps
#define v_mul _mm512_mul_ps
#define v_add _mm512_add_ps
#define v_hsum mie_avx512_hsum
#define v_load_bf16 mie_avx512_load_bf16
#define v_load_bf16_pair mie_avx512_load_bf16_pair
#define v_load_f16 mie_avx512_load_f16
#define v_load_i8 mie_avx512_load_i8
#define v_load_i4 mie_avx512_load_i4
#define v_load_u2 mie_avx512_load_u2
#define v_i6_decode mie_avx2_i6_decode
#define v_qscale mie_avx512_qscale
#define v_qscales mie_avx512_qscales
#define v_q4scale mie_avx512_q4scale
#define v_q4scales mie_avx512_q4scales
#define s_f16 _cvtsh_ss
#include "linear_body.h"
