/* CPU kernels for products with GGUF-block weights (k3stream.quant.kernels.cpu calls them as the
 * extension module `_ggml_cpu`'s functions).
 *
 * out[p, m] = sum_k x[rows[p], k] * W_b[m, k] for the rows p in starts[b]..starts[b+1] of matrix b.
 * A worker takes a chunk of one matrix's output rows. On x86-64 with AVX2 every type has a fused
 * kernel (below) that expands codes in registers; elsewhere (or with K3STREAM_GENERIC_KERNELS=1) a
 * type decodes up to 256 weights at a time into a float32 tile on the stack (exactly the reference
 * dequantizer's values: the same float operations, built with -ffp-contract=off) and dots the tile
 * with every input row of that matrix.
 * No float32 copy of a weight matrix is ever written. Each output is summed in one fixed order that
 * depends only on K, so results do not depend on the thread count or on what else shared the call.
 *
 * Matrices are passed as addresses, so the experts of one step (separate buffers) need no copying.
 * Built for x86-64-v3 (AVX2, FMA, F16C) with a generic fallback chosen at load time.
 */
#ifndef K3STREAM_WITHOUT_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

#include "kernels.h"

#include <dlfcn.h>

#define TILE 256
#define ROWS_PER_TASK 32

#if K3_X86_SIMD
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLONES
#endif



/* ---- block decoders: one block at b -> its values at y ------------------------------------ */

INLINE void dec_f32(const uint8_t *restrict b, float *restrict y) { memcpy(y, b, 32 * 4); }

INLINE void dec_f16(const uint8_t *restrict b, float *restrict y) {
    for (int i = 0; i < 32; i++) y[i] = f16(b + 2 * i);
}

INLINE void dec_bf16(const uint8_t *restrict b, float *restrict y) {
    for (int i = 0; i < 32; i++) y[i] = bits_f32(((uint32_t)b[2 * i] << 16) | ((uint32_t)b[2 * i + 1] << 24));
}

INLINE void dec_q4_0(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b);
    for (int i = 0; i < 16; i++) {
        y[i] = ((float)(b[2 + i] & 15) - 8.0f) * d;
        y[i + 16] = ((float)(b[2 + i] >> 4) - 8.0f) * d;
    }
}

INLINE void dec_q4_1(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b), m = f16(b + 2);
    for (int i = 0; i < 16; i++) {
        y[i] = (float)(b[4 + i] & 15) * d + m;
        y[i + 16] = (float)(b[4 + i] >> 4) * d + m;
    }
}

INLINE uint32_t word_at(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

INLINE void dec_q5(const uint8_t *restrict b, float *restrict y, int affine) {
    float d = f16(b), m = affine ? f16(b + 2) : 0.0f;
    uint32_t high = word_at(b + (affine ? 4 : 2));
    const uint8_t *q = b + (affine ? 8 : 6);
    for (int i = 0; i < 16; i++) {
        float lo = (float)((q[i] & 15) | (((high >> i) & 1) << 4));
        float hi = (float)((q[i] >> 4) | (((high >> (i + 16)) & 1) << 4));
        y[i] = affine ? lo * d + m : (lo - 16.0f) * d;
        y[i + 16] = affine ? hi * d + m : (hi - 16.0f) * d;
    }
}

INLINE void dec_q5_0(const uint8_t *restrict b, float *restrict y) { dec_q5(b, y, 0); }
INLINE void dec_q5_1(const uint8_t *restrict b, float *restrict y) { dec_q5(b, y, 1); }

INLINE void dec_q8_0(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b);
    for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)b[2 + i] * d;
}

static const float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

INLINE void dec_mxfp4(const uint8_t *restrict b, float *restrict y) {
    uint32_t e = b[0];
    float scale = bits_f32(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    for (int i = 0; i < 16; i++) {
        y[i] = MXFP4_VALUES[b[1 + i] & 15] * scale;
        y[i + 16] = MXFP4_VALUES[b[1 + i] >> 4] * scale;
    }
}

/* NVFP4: four runs of 16 values, each a UE4M3 scale (bytes 0..3) and 8 bytes of E2M1 codes (low nibbles
 * the run's first 8 values, high nibbles its last 8) */
INLINE void dec_nvfp4(const uint8_t *restrict b, float *restrict y) {
    for (int s = 0; s < 4; s++) {
        const float scale = ue4m3_half(b[s]);
        for (int i = 0; i < 8; i++) {
            y[16 * s + i] = scale * MXFP4_VALUES[b[4 + 8 * s + i] & 15];
            y[16 * s + 8 + i] = scale * MXFP4_VALUES[b[4 + 8 * s + i] >> 4];
        }
    }
}

/* Q2_K/Q3_K codes: byte 32g + 16h + i of the 64 holds, at bits 2f, the code of element
 * 128g + 32f + 16h + i, which is in sub-block 8g + 2f + h. Each pass takes 16 bytes (g, h) and
 * writes their four codes, so the innermost loop reads contiguous bytes and vectorizes. */

INLINE void dec_q2_k(const uint8_t *restrict b, float *restrict y) {
    const float d = f16(b + 80), dmin = f16(b + 82);
    for (int pass = 0; pass < 4; pass++) {
        const int first = (pass >> 1) * 8 + (pass & 1);
        const uint8_t *restrict q = b + 16 + 16 * pass;
        float step[4], offset[4];
        for (int f = 0; f < 4; f++) {
            step[f] = (float)(b[first + 2 * f] & 15) * d;
            offset[f] = (float)(b[first + 2 * f] >> 4) * dmin;
        }
        float *restrict out = y + first * 16;
        for (int i = 0; i < 16; i++) {
            out[i] = (float)(q[i] & 3) * step[0] - offset[0];
            out[32 + i] = (float)((q[i] >> 2) & 3) * step[1] - offset[1];
            out[64 + i] = (float)((q[i] >> 4) & 3) * step[2] - offset[2];
            out[96 + i] = (float)(q[i] >> 6) * step[3] - offset[3];
        }
    }
}

INLINE float q3_k_scale(const uint8_t *restrict b, int s) {
    int low = (b[96 + (s & 7)] >> (4 * (s >> 3))) & 15;
    int high = (b[104 + (s & 3)] >> (2 * (s >> 2))) & 3;
    return (float)((low | (high << 4)) - 32);
}

INLINE void dec_q3_k(const uint8_t *restrict b, float *restrict y) { /* high bit 4g+f of hmask[16h+i] */
    const float d = f16(b + 108);
    for (int pass = 0; pass < 4; pass++) {
        const int first = (pass >> 1) * 8 + (pass & 1), g = pass >> 1;
        const uint8_t *restrict q = b + 32 + 16 * pass, *restrict h = b + 16 * (pass & 1);
        float step[4];
        for (int f = 0; f < 4; f++) step[f] = q3_k_scale(b, first + 2 * f) * d;
        float *restrict out = y + first * 16;
        const int hb = 4 * g;
        for (int i = 0; i < 16; i++) {
            out[i] = (float)((q[i] & 3) - ((((h[i] >> hb) & 1) ^ 1) << 2)) * step[0];
            out[32 + i] = (float)(((q[i] >> 2) & 3) - ((((h[i] >> (hb + 1)) & 1) ^ 1) << 2)) * step[1];
            out[64 + i] = (float)(((q[i] >> 4) & 3) - ((((h[i] >> (hb + 2)) & 1) ^ 1) << 2)) * step[2];
            out[96 + i] = (float)((q[i] >> 6) - ((((h[i] >> (hb + 3)) & 1) ^ 1) << 2)) * step[3];
        }
    }
}

INLINE void dec_q45_k(const uint8_t *restrict b, float *restrict y, int fifth_bit) {
    float d = f16(b), dmin = f16(b + 2);
    const uint8_t *low = b + (fifth_bit ? 48 : 16), *high = b + 16;
    for (int s = 0; s < 8; s++) {
        int scale, min;
        k_scale_min(b + 4, s, &scale, &min);
        float step = (float)scale * d, offset = (float)min * dmin;
        const uint8_t *q = low + (s >> 1) * 32;
        int shift = (s & 1) * 4;
        for (int i = 0; i < 32; i++) {
            int code = (q[i] >> shift) & 15;
            if (fifth_bit) code |= ((high[i] >> s) & 1) << 4;
            y[s * 32 + i] = (float)code * step - offset;
        }
    }
}

INLINE void dec_q4_k(const uint8_t *restrict b, float *restrict y) { dec_q45_k(b, y, 0); }
INLINE void dec_q5_k(const uint8_t *restrict b, float *restrict y) { dec_q45_k(b, y, 1); }

INLINE void dec_q6_k(const uint8_t *restrict b, float *restrict y) {
    float d = f16(b + 208);
    for (int s = 0; s < 16; s++) { /* element s*16+i is number rest+i of half s/8 */
        float step = (float)(int8_t)b[192 + s] * d;
        int half = s >> 3, rest = (s & 7) * 16;
        const uint8_t *ql = b + half * 64 + (rest & 63), *qh = b + 128 + half * 32 + (rest & 31);
        int low_shift = (rest >> 6) * 4, high_shift = (rest >> 5) * 2;
        for (int i = 0; i < 16; i++) {
            int code = ((ql[i] >> low_shift) & 15) | (((qh[i] >> high_shift) & 3) << 4);
            y[s * 16 + i] = (float)(code - 32) * step;
        }
    }
}

/* ---- the product ---------------------------------------------------------------------------- */

INLINE float dot(const float *restrict a, const float *restrict b, int n) { /* n: a multiple of 32; 16 fixed lanes */
    float lanes[16] = {0};
    for (int i = 0; i < n; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += a[i + l] * b[i + l];
    for (int width = 8; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}



/* The bits of the F16 nearest to `value` (ties to even), as numpy and F16C convert */
static uint16_t f16_bits(float value) {
    uint32_t x;
    memcpy(&x, &value, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) return sign | 0x7C00u | (x > 0x7F800000u ? 0x200u : 0u); /* inf, NaN */
    if (x >= 0x477FF000u) return sign | 0x7C00u;                                   /* rounds past 65504 */
    if (x < 0x38800000u) return sign | (uint16_t)nearbyintf(fabsf(value) * 0x1p24f); /* subnormal: exact */
    const uint32_t rebased = x - 0x38000000u;                                       /* exponent - 112 */
    return sign | (uint16_t)((rebased + 0xFFFu + ((rebased >> 13) & 1u)) >> 13);
}

/* value rounded to the nearest F16 (ties to even), as a float */
static float f16_rounded(float value) {
    const uint16_t bits = f16_bits(value);
    const uint8_t half[2] = {(uint8_t)(bits & 255), (uint8_t)(bits >> 8)};
    return f16(half);
}

/* One block of quantize_row_q8_0 (ggml's AVX2 one): id = 127 / amax (correctly rounded), codes round half
 * to even, *d the F16 amax / 127; returns amax / 127 unrounded (Q8_1's sum takes it) */
static float q8_block(const float *restrict x, int8_t *restrict qs, float *restrict d) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float step = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    *d = f16_rounded(step);
    for (int j = 0; j < 32; j++) qs[j] = (int8_t)nearbyintf(x[j] * id);
    return step;
}

static void quantize_q8_0(const float *restrict x, int64_t blocks, BlockQ8_0 *restrict y) {
    for (int64_t i = 0; i < blocks; i++, x += 32) q8_block(x, y[i].qs, &y[i].d);
}

/* quantize_row_q8_1 (ggml's AVX2 one): Q8_0's codes and d, and s = F16(d * sum(codes)), d unrounded */
static void quantize_q8_1(const float *restrict x, int64_t blocks, BlockQ8_1 *restrict y) {
    for (int64_t i = 0; i < blocks; i++, x += 32) {
        const float step = q8_block(x, y[i].qs, &y[i].d);
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += y[i].qs[j];
        y[i].s = f16_rounded(step * (float)sum);
    }
}

INLINE float q8_q8_0_generic(const uint8_t *restrict b, const BlockQ8_0 *restrict y, float acc) {
    int isum = 0;
    for (int i = 0; i < 32; i++) isum += (int8_t)b[2 + i] * y->qs[i];
    return acc + f16(b) * y->d * (float)isum;
}

INLINE float q8_q4_0_generic(const uint8_t *restrict b, const BlockQ8_0 *restrict y, float acc) {
    int isum = 0;
    for (int i = 0; i < 16; i++) isum += ((b[2 + i] & 15) - 8) * y->qs[i] + ((b[2 + i] >> 4) - 8) * y->qs[16 + i];
    return acc + f16(b) * y->d * (float)isum;
}

/* Q5_0 and Q5_1's code of element i (0..31): its nibble (low of byte i, high of byte i - 16) and bit i of qh */
INLINE int q5_code(const uint8_t *restrict qs, uint32_t qh, int i) {
    return ((i < 16 ? qs[i] & 15 : qs[i - 16] >> 4) | ((qh >> i) & 1) << 4);
}

INLINE float q8_q5_0_generic(const uint8_t *restrict b, const BlockQ8_0 *restrict y, float acc) {
    int isum = 0;
    for (int i = 0; i < 32; i++) isum += (q5_code(b + 6, word_at(b + 2), i) - 16) * y->qs[i];
    return acc + f16(b) * y->d * (float)isum;
}

/* Q4_1 and Q5_1 (codes from `qs`, fifth bits from qh: 0 for Q4_1) against Q8_1: d d_y sum(code q) plus
 * the block's offset m times the activations' s */
INLINE float q8_affine_generic(const uint8_t *restrict b, const uint8_t *restrict qs, uint32_t qh,
                               const BlockQ8_1 *restrict y, float acc) {
    int isum = 0;
    for (int i = 0; i < 32; i++) isum += q5_code(qs, qh, i) * y->qs[i];
    return acc + f16(b) * y->d * (float)isum + f16(b + 2) * y->s;
}

INLINE float q8_q4_1_generic(const uint8_t *restrict b, const BlockQ8_1 *restrict y, float acc) {
    return q8_affine_generic(b, b + 4, 0, y, acc);
}

INLINE float q8_q5_1_generic(const uint8_t *restrict b, const BlockQ8_1 *restrict y, float acc) {
    return q8_affine_generic(b, b + 8, word_at(b + 4), y, acc);
}

/* quantize_row_q8_K_ref: the scale is -127 over the signed value of largest magnitude (its first
 * occurrence), codes round half to even (ggml's nearest_int) and are clamped to 127 */
static void quantize_q8_k(const float *restrict x, int64_t blocks, BlockQ8K *restrict y) {
    for (int64_t i = 0; i < blocks; i++, x += 256) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 256; j++)
            if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
        memset(&y[i], 0, sizeof(BlockQ8K));
        if (amax == 0.0f) continue;
        const float iscale = -127.0f / max;
        for (int j = 0; j < 256; j++) {
            const float v = nearbyintf(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v > 127.0f ? 127 : v);
        }
        for (int j = 0; j < 16; j++)
            for (int l = 0; l < 16; l++) y[i].bsums[j] += y[i].qs[16 * j + l];
        y[i].d = 1.0f / iscale;
    }
}

/* Integer dot products of one weight block with one Q8_K block, as ggml_vec_dot_q2_K_q8_K and
 * ggml_vec_dot_q3_K_q8_K: exact integer sums per sub-block, two float operations per block. */
INLINE float q8_q2_k_generic(const uint8_t *restrict b, const BlockQ8K *restrict y, float acc) {
    int summs = 0, isum = 0;
    for (int s = 0; s < 16; s++) summs += (b[s] >> 4) * y->bsums[s];
    for (int e = 0; e < 256; e++) { /* element e: byte 32(e / 128) + e % 32, bits 2((e % 128) / 32) */
        const int s = e / 16, code = (b[16 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        isum += (b[s] & 15) * code * y->qs[e];
    }
    return acc + (y->d * f16(b + 80) * (float)isum - y->d * f16(b + 82) * (float)summs);
}

INLINE float q8_q3_k_generic(const uint8_t *restrict b, const BlockQ8K *restrict y, float acc) {
    int isum = 0;
    for (int e = 0; e < 256; e++) {
        const int g = e / 128, f = (e % 128) / 32, i = e % 32;
        const int low = (b[32 + 32 * g + i] >> (2 * f)) & 3, high = (b[i] >> (4 * g + f)) & 1;
        isum += q3_k_int_scale(b, e / 16) * (low - (high ? 0 : 4)) * y->qs[e];
    }
    return acc + f16(b + 108) * y->d * (float)isum;
}

/* Q4_K and Q5_K (fifth_bit: codes from byte 48, bit s of byte 16 + i the fifth of sub-block s's element i) */
INLINE float q8_q45_k_generic(const uint8_t *restrict b, const BlockQ8K *restrict y, float acc, int fifth_bit) {
    const uint8_t *low = b + (fifth_bit ? 48 : 16);
    int isum = 0, summs = 0;
    for (int s = 0; s < 8; s++) { /* sub-block s: nibbles (s odd: high) of bytes 32(s / 2) .. + 31 */
        int scale, min, dot = 0;
        k_scale_min(b + 4, s, &scale, &min);
        for (int i = 0; i < 32; i++) {
            const int code = ((low[32 * (s / 2) + i] >> (4 * (s & 1))) & 15) | (fifth_bit ? ((b[16 + i] >> s) & 1) << 4 : 0);
            dot += code * y->qs[32 * s + i];
        }
        isum += scale * dot;
        summs += min * (y->bsums[2 * s] + y->bsums[2 * s + 1]);
    }
    return acc + (y->d * f16(b) * (float)isum - y->d * f16(b + 2) * (float)summs);
}

INLINE float q8_q4_k_generic(const uint8_t *restrict b, const BlockQ8K *restrict y, float acc) {
    return q8_q45_k_generic(b, y, acc, 0);
}

INLINE float q8_q5_k_generic(const uint8_t *restrict b, const BlockQ8K *restrict y, float acc) {
    return q8_q45_k_generic(b, y, acc, 1);
}

INLINE float q8_q6_k_generic(const uint8_t *restrict b, const BlockQ8K *restrict y, float acc) {
    int isum = 0;
    for (int e = 0; e < 256; e++) { /* as dot_q6_k: run r = e / 32 */
        const int run = e / 32, half = run >> 2, rest = (run & 3) * 32, i = e % 32;
        const int low = (b[64 * half + (rest & 63) + i] >> (4 * (rest >> 6))) & 15;
        const int high = (b[128 + 32 * half + i] >> (2 * (run & 3))) & 3;
        isum += (int8_t)b[192 + e / 16] * ((low | high << 4) - 32) * y->qs[e];
    }
    return acc + f16(b + 208) * y->d * (float)isum;
}

/* One weight row m against each of its input rows' 8-bit blocks (Y: Q8_K, Q8_0 or Q8_1, ELEMS values each),
 * blocks summed in order into ACC (from ZERO; a float, or eight lanes summed at the end by TOTAL) */
#define Q8_ROW(NAME, ATTR, DOT, BLOCK_BYTES, Y, ELEMS, ACC, ZERO, TOTAL)                               \
    ATTR static void NAME(const Product *pr, int64_t b, int64_t first, int64_t last) {                 \
        const int64_t blocks = pr->in_features / (ELEMS);                                             \
        for (int64_t m = first; m < last; m++) {                                                       \
            const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;      \
            prefetch_ahead(row, pr->row_bytes);                                                        \
            for (int64_t p = pr->starts[b]; p < pr->starts[b + 1]; p++) {                              \
                const __typeof__(*pr->Y) *y = pr->Y + pr->rows[p] * blocks;                            \
                ACC acc = ZERO;                                                                        \
                for (int64_t block = 0; block < blocks; block++) acc = DOT(row + block * (BLOCK_BYTES), y + block, acc); \
                pr->out[p * pr->out_stride + m] = TOTAL(acc);                                            \
            }                                                                                          \
        }                                                                                              \
    }
#define FLOAT_TOTAL(acc) (acc)


/* One output row m of matrix b for all of its input rows, ROWS_AT_ONCE input rows per pass (a
 * pass decodes the row's tiles once and keeps its sums in registers). The decoders inline here. */
#define ROWS_AT_ONCE 16
#define ROW_KERNEL(NAME, DECODE, BLOCK_ELEMS, BLOCK_BYTES)                                         \
    CLONES static void NAME(const Product *pr, int64_t b, int64_t first, int64_t last) {           \
        const int64_t blocks = pr->row_bytes / (BLOCK_BYTES), per_tile = TILE / (BLOCK_ELEMS);       \
        float tile[TILE] __attribute__((aligned(32)));                                              \
        for (int64_t m = first; m < last; m++) {                                                    \
            const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;  \
            for (int64_t p0 = pr->starts[b]; p0 < pr->starts[b + 1]; p0 += ROWS_AT_ONCE) {          \
                const int64_t rows = pr->starts[b + 1] - p0 < ROWS_AT_ONCE ? pr->starts[b + 1] - p0  \
                                                                            : ROWS_AT_ONCE;         \
                float sums[ROWS_AT_ONCE] = {0};                                                      \
                for (int64_t block = 0; block < blocks; block += per_tile) {                        \
                    const int64_t count = blocks - block < per_tile ? blocks - block : per_tile;     \
                    for (int64_t j = 0; j < count; j++)                                              \
                        DECODE(row + (block + j) * (BLOCK_BYTES), tile + j * (BLOCK_ELEMS));         \
                    for (int64_t r = 0; r < rows; r++) {                                             \
                        const float *xs = pr->x + pr->rows[p0 + r] * pr->in_features + block * (BLOCK_ELEMS); \
                        sums[r] += dot(tile, xs, (int)(count * (BLOCK_ELEMS)));                      \
                    }                                                                                \
                }                                                                                    \
                for (int64_t r = 0; r < rows; r++) pr->out[(p0 + r) * pr->out_stride + m] = sums[r];   \
            }                                                                                        \
        }                                                                                            \
    }

/* Every type with a decoder: X(GGML type id, name, values and bytes per block) */
#define DECODED_TYPES(X)                                                                                \
    X(0, f32, 32, 128) X(1, f16, 32, 64) X(30, bf16, 32, 64) X(2, q4_0, 32, 18) X(3, q4_1, 32, 20)      \
    X(6, q5_0, 32, 22) X(7, q5_1, 32, 24) X(8, q8_0, 32, 34) X(39, mxfp4, 32, 17) X(10, q2_k, 256, 84)  \
    X(11, q3_k, 256, 110) X(12, q4_k, 256, 144) X(13, q5_k, 256, 176) X(14, q6_k, 256, 210)            \
    X(16, iq2_xxs, 256, 66) X(17, iq2_xs, 256, 74) X(18, iq3_xxs, 256, 98) X(19, iq1_s, 256, 50)        \
    X(20, iq4_nl, 32, 18) X(21, iq3_s, 256, 110) X(22, iq2_s, 256, 82) X(23, iq4_xs, 256, 136)          \
    X(29, iq1_m, 256, 56) X(34, tq1_0, 256, 54) X(35, tq2_0, 256, 66) X(40, nvfp4, 64, 36)

#define DEFINE_ROW_KERNEL(ID, NAME, ELEMS, BYTES) ROW_KERNEL(row_##NAME, dec_##NAME, ELEMS, BYTES)
DECODED_TYPES(DEFINE_ROW_KERNEL)

/* A type's decoder: one block's values into out (the reference dequantizer's), values and bytes a block */
typedef struct {
    void (*decode)(const uint8_t *restrict, float *restrict);
    int elems, bytes;
} BlockDecoder;

static BlockDecoder block_decoder(int ggml_type) {
#define DECODER_CASE(ID, NAME, ELEMS, BYTES) \
    case ID: return (BlockDecoder){dec_##NAME, ELEMS, BYTES};
    switch (ggml_type) {
        DECODED_TYPES(DECODER_CASE)
        default: return (BlockDecoder){NULL, 0, 0};
    }
}


/* Weight rows m..m + count - 1 (count <= TILE_W) of matrix b against all its input rows, for matrices
 * with at least TILE_MIN of them (prefill; measured: from two rows on at least as fast as the rows) */
typedef void (*TileKernel)(const Product *, int64_t b, int64_t m, int count);
#define TILE_W 4
#define TILE_MIN 2

/* Rows m, m + stride, .. (the first `count` of STREAMS) of matrix b, read as that many streams at once */
typedef void (*WideKernel)(const Product *, int64_t b, int64_t m, int count, int64_t stride);
#define STREAMS 4

/* F32 matrices as k3stream keeps them for its row-exact products: input-major ([in, out], `seam.Products`),
 * type INPUT_MAJOR_F32 (no GGML type). Each output's sum is one chain over its inputs in order,
 * acc = fma(x_k, w_k, acc) from zero, so a mat-vec and a GEMM of any blocking give it the same bits, and
 * many rows cost a GEMM's work (no horizontal sums). */
#define INPUT_MAJOR_F32 1000
#define INPUT_MAJOR_ROWS 4

/* Outputs first..last - 1 of input-major F32 matrix b, one at a time (fmaf, exact: the vector kernel's
 * lanes) */
static void input_major_generic(const Product *pr, int64_t b, int64_t first, int64_t last) {
    const float *w = (const float *)(uintptr_t)pr->addresses[b];
    for (int64_t m = first; m < last; m++)
        for (int64_t p = pr->starts[b]; p < pr->starts[b + 1]; p++) {
            const float *x = pr->x + pr->rows[p] * pr->in_features;
            float acc = 0.0f;
            for (int64_t k = 0; k < pr->in_features; k++) acc = fmaf(x[k], w[k * pr->out_rows + m], acc);
            pr->out[p * pr->out_stride + m] = acc;
        }
}

/* ---- fused AVX2 kernels: Q2_K..Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, F16, BF16, F32 ----------
 * No tile: codes are expanded in registers, multiplied by their sub-block step (the reference's first
 * operation), and accumulated against x with FMA; each sub-block's min (Q2_K, Q4_K, Q5_K) enters once, as
 * min * sum(x) over its values (from sums of 16, precomputed per x row). A different (but fixed) summation than the
 * reference's 256-value tile (`ROW_KERNEL`): chosen per type and machine, never per call, so results still do not
 * depend on grouping. */
#if K3_X86_SIMD
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c")))
/* K3STREAM_GENERIC_KERNELS=1 takes the portable kernels on any machine (so tests reach them too) */
#define HAVE_AVX2() \
    (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && getenv("K3STREAM_GENERIC_KERNELS") == NULL)

AVX2 static inline __m256 codes_lo8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

/* Up to FUSED_ROWS input rows share each expanded weight vector; every row keeps its own four FMA
 * chains and sees exactly the operations it would see alone, so results do not depend on pairing. */
#define FUSED_ROWS 3
#define ALWAYS AVX2 static inline __attribute__((always_inline))

/* an F16 scale by F16C (one instruction; the scalar f16() costs as much as a 32-value block's codes) */
ALWAYS float f16c(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
}

/* acc[r][j] += (codes * step) * x_r over 32 elements at `at`, 8 per chain j: codes (signed bytes)
 * of sub-blocks s (first 16) and s + 1 */
ALWAYS void fma32(__m256i codes, const float *steps, int s, const float *const *x, int64_t at,
                  __m256 acc[FUSED_ROWS][4], const int n) {
    const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
    const __m256 a = _mm256_broadcast_ss(steps + s), b = _mm256_broadcast_ss(steps + s + 1);
    const __m256 w[4] = {_mm256_mul_ps(codes_lo8(lo), a), _mm256_mul_ps(codes_lo8(_mm_srli_si128(lo, 8)), a),
                         _mm256_mul_ps(codes_lo8(hi), b), _mm256_mul_ps(codes_lo8(_mm_srli_si128(hi, 8)), b)};
    for (int r = 0; r < n; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x[r] + at + 8 * j), acc[r][j]);
}

/* 16 values (b[i] >> shift) & 15 as floats times `scale`, into out[16] */
AVX2 static inline void nibbles_times(const uint8_t *b, int shift, float scale, float *out) {
    const __m128i bytes = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)b), shift), _mm_set1_epi8(15));
    const __m256 factor = _mm256_set1_ps(scale);
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), factor));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))), factor));
}

AVX2 static inline float hsum_all(__m256 acc[4]) {
    return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

/* offsets[r] += mins . sums_r over the 16 sub-blocks of the block at `at` (Q2_K's min offsets) */
ALWAYS void add_min_offsets(const float *mins, const float *const *sums, int64_t at, __m256 offsets[FUSED_ROWS],
                            const int n) {
    for (int r = 0; r < n; r++) {
        const float *row_sums = sums[r] + at / 16;
        offsets[r] = _mm256_fmadd_ps(_mm256_loadu_ps(mins), _mm256_loadu_ps(row_sums), offsets[r]);
        offsets[r] = _mm256_fmadd_ps(_mm256_loadu_ps(mins + 8), _mm256_loadu_ps(row_sums + 8), offsets[r]);
    }
}

/* Q2_K and Q3_K run each row's four FMA chains (and Q2_K's min offsets, eight lanes) across all the
 * blocks of a weight row and sum them once at its end: acc[r][c] += w . x_r over one block's 256 values
 * at `at`, offsets[r] += mins . sums_r (sums: each row's 16-value sums). */
ALWAYS void dot_q2_k(const uint8_t *restrict b, const float *const *x, const float *const *sums, int64_t at,
                     __m256 acc[FUSED_ROWS][4], __m256 offsets[FUSED_ROWS], const int n) {
    float steps[16], mins[16];
    nibbles_times(b, 0, f16c(b + 80), steps);
    nibbles_times(b, 4, f16c(b + 82), mins);
    /* a code (0..3) times its step is a lookup in step * [0 1 2 3 | 0 1 2 3] by the code's bits at the
     * bottom of its dword: the same product as converting the code and multiplying. The table is the
     * same in both 128-bit lanes, so the in-lane `vpermilps` reads it as the lane-crossing `vpermps`
     * did: the same bits, Q2_K 1.2-1.3x faster on this Zen machine */
    const __m256 levels = _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3);
    for (int g = 0; g < 2; g++) { /* byte 32g + i, bits 2f: element 128g + 32f + i, sub-block 8g + 2f + i/16 */
        __m256 table[8];
        for (int t = 0; t < 8; t++) table[t] = _mm256_mul_ps(levels, _mm256_broadcast_ss(steps + 8 * g + t));
        for (int c = 0; c < 4; c++) { /* bytes 8c..8c+7 of the 32: chain c, sub-block 8g + 2f + c/2 */
            const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 16 + 32 * g + 8 * c)));
            for (int f = 0; f < 4; f++) {
                const __m256 w = _mm256_permutevar_ps(table[2 * f + c / 2], _mm256_srli_epi32(bytes, 2 * f));
                for (int r = 0; r < n; r++)
                    acc[r][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[r] + at + 128 * g + 32 * f + 8 * c), acc[r][c]);
            }
        }
    }
    add_min_offsets(mins, sums, at, offsets, n);
}

/* Q3_K's 16 scales times d, into out[16] */
ALWAYS void q3_k_steps(const uint8_t *b, float d, float *out) {
    const __m128i codes = q3_k_scales8(b);
    const __m256 scale = _mm256_set1_ps(d);
    _mm256_storeu_ps(out, _mm256_mul_ps(codes_lo8(codes), scale));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(codes_lo8(_mm_srli_si128(codes, 8)), scale));
}

ALWAYS void dot_q3_k(const uint8_t *restrict b, const float *const *x, const float *const *sums, int64_t at,
                     __m256 acc[FUSED_ROWS][4], __m256 offsets[FUSED_ROWS], const int n) {
    (void)sums, (void)offsets;
    float steps[16];
    q3_k_steps(b, f16c(b + 108), steps);
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i hmask = _mm256_loadu_si256((const __m256i *)b);
    for (int g = 0; g < 2; g++) { /* as Q2_K; a clear bit 4g + f of hmask[i] subtracts 4 */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * g));
        for (int f = 0; f < 4; f++) {
            const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 2 * f), three);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hmask, 4 * g + f), one);
            const __m256i codes = _mm256_sub_epi8(low, _mm256_slli_epi16(_mm256_xor_si256(high, one), 2));
            fma32(codes, steps, 8 * g + 2 * f, x, at + 128 * g + 32 * f, acc, n);
        }
    }
}

ALWAYS void zero_acc(__m256 acc[FUSED_ROWS][4], const int n) {
    for (int r = 0; r < n; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
}

/* acc[r][j] += w * x_r[at .. at + 8] */
ALWAYS void fma8(__m256 w, const float *const *x, int64_t at, __m256 acc[FUSED_ROWS][4], int j, const int n) {
    for (int r = 0; r < n; r++) acc[r][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[r] + at), acc[r][j]);
}

/* 32 signed byte codes times one step, against x at `at` (chains 0-3) */
ALWAYS void fma32_step(__m256i codes, float step, const float *const *x, int64_t at, __m256 acc[FUSED_ROWS][4],
                       const int n) {
    const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
    const __m256 s = _mm256_set1_ps(step);
    fma8(_mm256_mul_ps(codes_lo8(lo), s), x, at, acc, 0, n);
    fma8(_mm256_mul_ps(codes_lo8(_mm_srli_si128(lo, 8)), s), x, at + 8, acc, 1, n);
    fma8(_mm256_mul_ps(codes_lo8(hi), s), x, at + 16, acc, 2, n);
    fma8(_mm256_mul_ps(codes_lo8(_mm_srli_si128(hi, 8)), s), x, at + 24, acc, 3, n);
}

/* 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4): a block's 32 codes as bytes (element i at
 * byte i) and its step d (and Q4_1/Q5_1's offset m); each value is code * d (+ m), the reference's
 * product (and sum), exact in the codes */
typedef struct {
    __m256i codes;
    float d, m;
} Block32;

/* element i: the low nibble of q[i] (i < 16), element 16 + i: its high nibble; less `bias`, per 128-bit
 * half (so fma32_step, which takes the halves apart again, finds them as they were made: Q4_0's decode
 * rows 3-4% slower with one 256-bit subtraction) */
ALWAYS __m256i nibble_codes(const uint8_t *q, char bias) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q), nibble = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    if (bias == 0) return _mm256_set_m128i(high, low);
    const __m128i offset = _mm_set1_epi8(bias);
    return _mm256_set_m128i(_mm_sub_epi8(high, offset), _mm_sub_epi8(low, offset));
}

/* Q5_0/Q5_1's fifth bits: bit j of the 32-bit qh as 16 (set) or 0 in byte j */
ALWAYS __m256i fifth_bits(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303)); /* byte j: qh byte j/8 */
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);          /* byte j: 1 << j%8 */
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

ALWAYS Block32 block_q8_0(const uint8_t *b) {
    return (Block32){_mm256_loadu_si256((const __m256i *)(b + 2)), f16c(b), 0.0f};
}

ALWAYS Block32 block_q4_0(const uint8_t *b) {
    return (Block32){nibble_codes(b + 2, 8), f16c(b), 0.0f};
}

ALWAYS Block32 block_q4_1(const uint8_t *b) { return (Block32){nibble_codes(b + 4, 0), f16c(b), f16c(b + 2)}; }

ALWAYS Block32 block_q5_0(const uint8_t *b) {
    const __m256i codes = _mm256_or_si256(nibble_codes(b + 6, 0), fifth_bits(b + 2));
    return (Block32){_mm256_sub_epi8(codes, _mm256_set1_epi8(16)), f16c(b), 0.0f};
}

ALWAYS Block32 block_q5_1(const uint8_t *b) {
    return (Block32){_mm256_or_si256(nibble_codes(b + 8, 0), fifth_bits(b + 4)), f16c(b), f16c(b + 2)};
}

/* MXFP4: each nibble's E2M1 value (an integer times 1/2, doubled here) looked up as a byte, times the
 * block's E8M0 scale halved (as dec_mxfp4) */
ALWAYS Block32 block_mxfp4(const uint8_t *b) {
    const __m256i values = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6,
                                            8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const uint32_t e = b[0];
    return (Block32){_mm256_shuffle_epi8(values, nibble_codes(b + 1, 0)),
                     bits_f32(e < 2 ? 0x00200000u << e : (e - 1) << 23), 0.0f};
}

/* 32 unsigned byte codes times d plus m (Q4_1, Q5_1), against x at `at` (chains 0-3) */
ALWAYS void fma32_affine(__m256i codes, float d, float m, const float *const *x, int64_t at,
                         __m256 acc[FUSED_ROWS][4], const int n) {
    const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
    const __m256 s = _mm256_set1_ps(d), o = _mm256_set1_ps(m);
    fma8(_mm256_add_ps(_mm256_mul_ps(codes_lo8(lo), s), o), x, at, acc, 0, n);
    fma8(_mm256_add_ps(_mm256_mul_ps(codes_lo8(_mm_srli_si128(lo, 8)), s), o), x, at + 8, acc, 1, n);
    fma8(_mm256_add_ps(_mm256_mul_ps(codes_lo8(hi), s), o), x, at + 16, acc, 2, n);
    fma8(_mm256_add_ps(_mm256_mul_ps(codes_lo8(_mm_srli_si128(hi, 8)), s), o), x, at + 24, acc, 3, n);
}

/* `count` blocks of a 32-value type into each row's four chains */
#define BLOCK32_DOT(TYPE, ID, BYTES, AFFINE)                                                              \
    ALWAYS void dot_##TYPE(const uint8_t *restrict b, const float *const *x, const float *const *sums, \
                           int64_t at, float *out, const int n, const int count) {                      \
        (void)sums;                                                                                     \
        __m256 acc[FUSED_ROWS][4];                                                                      \
        zero_acc(acc, n);                                                                               \
        for (int k = 0; k < count; k++) {                                                               \
            const Block32 block = block_##TYPE(b + (BYTES) * k);                                        \
            if (AFFINE)                                                                                 \
                fma32_affine(block.codes, block.d, block.m, x, at + 32 * k, acc, n);                   \
            else                                                                                        \
                fma32_step(block.codes, block.d, x, at + 32 * k, acc, n);                               \
        }                                                                                               \
        for (int r = 0; r < n; r++) out[r] = hsum_all(acc[r]);                                          \
    }

/* the 32-value types: name, GGML type id, bytes a block, whether affine (code * d + m) */
#define BLOCK32_TYPES(X) \
    X(q8_0, 8, 34, 0) X(q4_0, 2, 18, 0) X(q4_1, 3, 20, 1) X(q5_0, 6, 22, 0) X(q5_1, 7, 24, 1) X(mxfp4, 39, 17, 0)
BLOCK32_TYPES(BLOCK32_DOT)

/* Q4_K's 8 sub-block steps (scale * d) and each 16 values' min (min * dmin, a 32-value sub-block's
 * twice: its offset enters as two 16-value sums, as Q2_K's) */
ALWAYS void q4_k_steps(const uint8_t *restrict b, float *steps, float *mins) {
    const float d = f16c(b), dmin = f16c(b + 2);
    for (int s = 0; s < 8; s++) {
        int scale, min;
        k_scale_min(b + 4, s, &scale, &min);
        steps[s] = (float)scale * d;
        mins[2 * s] = mins[2 * s + 1] = (float)min * dmin;
    }
}

/* Q4_K's 32 codes of sub-block s: byte 16 + 32(s/2) + i holds element 32s + i in nibble s%2 */
ALWAYS __m256i q4_k_codes(const uint8_t *restrict b, int s) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (s >> 1)));
    return _mm256_and_si256(_mm256_srli_epi16(q, 4 * (s & 1)), _mm256_set1_epi8(15));
}

/* Q5_K's 32 codes of sub-block s: Q4_K's nibbles (from byte 48) and bit s of byte 16 + i as the fifth */
ALWAYS __m256i q5_k_codes(const uint8_t *restrict b, int s) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (s >> 1)));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 4 * (s & 1)), _mm256_set1_epi8(15));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)), s),
                                          _mm256_set1_epi8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}

/* Q4_K, Q5_K and Q6_K run each row's chains (and Q4_K/Q5_K's min offsets) across the row, as Q2_K */
#define K45_DOT(TYPE)                                                                                   \
    ALWAYS void dot_##TYPE(const uint8_t *restrict b, const float *const *x, const float *const *sums, \
                           int64_t at, __m256 acc[FUSED_ROWS][4], __m256 offsets[FUSED_ROWS], const int n) { \
        float steps[8], mins[16];                                                                       \
        q4_k_steps(b, steps, mins);                                                                     \
        for (int s = 0; s < 8; s++) fma32_step(TYPE##_codes(b, s), steps[s], x, at + 32 * s, acc, n);  \
        add_min_offsets(mins, sums, at, offsets, n);                                                    \
    }

K45_DOT(q4_k)
K45_DOT(q5_k)

/* Q6_K's 16 sub-block steps (scale * d) */
ALWAYS void q6_k_steps(const uint8_t *restrict b, float *steps) {
    const float d = f16c(b + 208);
    for (int s = 0; s < 16; s++) steps[s] = (float)(int8_t)b[192 + s] * d;
}

/* Q6_K: run r of 32 values (sub-blocks 2r, 2r + 1), codes less 32 */
ALWAYS void dot_q6_k(const uint8_t *restrict b, const float *const *x, const float *const *sums, int64_t at,
                     __m256 acc[FUSED_ROWS][4], __m256 offsets[FUSED_ROWS], const int n) {
    (void)sums, (void)offsets;
    float steps[16];
    q6_k_steps(b, steps);
    for (int run = 0; run < 8; run++)
        fma32(_mm256_sub_epi8(q6_k_codes(b, run), _mm256_set1_epi8(32)), steps, 2 * run, x, at + 32 * run, acc, n);
}

/* F16 (F16C's exact conversion) and BF16 (the bits shifted up): `count` runs of 32 values */
ALWAYS __m256 half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

ALWAYS __m256 bf16x8(const uint8_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#define FLOAT_DOT(NAME, LOAD8, WIDTH)                                                                   \
    ALWAYS void NAME(const uint8_t *restrict b, const float *const *x, const float *const *sums, int64_t at, \
                     float *out, const int n, const int count) {                                        \
        (void)sums;                                                                                     \
        __m256 acc[FUSED_ROWS][4];                                                                      \
        zero_acc(acc, n);                                                                               \
        for (int k = 0; k < count; k++)                                                                 \
            for (int j = 0; j < 4; j++)                                                                 \
                fma8(LOAD8(b + (WIDTH) * (32 * k + 8 * j)), x, at + 32 * k + 8 * j, acc, j, n);         \
        for (int r = 0; r < n; r++) out[r] = hsum_all(acc[r]);                                          \
    }

ALWAYS __m256 f32x8(const uint8_t *p) { return _mm256_loadu_ps((const float *)p); }

FLOAT_DOT(dot_f16, half8, 2)
FLOAT_DOT(dot_bf16, bf16x8, 2)
FLOAT_DOT(dot_f32, f32x8, 4)

/* Float rows (F32, F16, BF16: read at the memory's speed, not compute-bound) four at a time from four
 * streams: rows m, m + stride, m + 2 stride, m + 3 stride (the first `count`). One core reads several
 * distant streams faster than one: 3 KB F32 rows 14 GB/s as one stream, 22 GB/s as four (measured from
 * one to six; at most 4 KB rows, four adjacent rows are one stream). x is loaded once for the four rows,
 * and a row's sum is its own four chains over the whole row, whatever rows it is computed with. */
#define WIDE_FLOAT(NAME, LOAD8, WIDTH)                                                                  \
    AVX2 static void NAME(const Product *pr, int64_t b, int64_t m, const int count, int64_t stride) { \
        const uint8_t *first = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes, *w[4]; \
        for (int i = 0; i < 4; i++) w[i] = first + (i < count ? i * stride : 0) * pr->row_bytes;       \
        for (int64_t p = pr->starts[b]; p < pr->starts[b + 1]; p++) {                                  \
            const float *x = pr->x + pr->rows[p] * pr->in_features;                                    \
            __m256 acc[4][4];                                                                          \
            for (int i = 0; i < 4; i++)                                                                \
                for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();                           \
            for (int64_t k = 0; k < pr->in_features; k += 32)                                          \
                for (int j = 0; j < 4; j++) {                                                          \
                    const __m256 xj = _mm256_loadu_ps(x + k + 8 * j);                                  \
                    for (int i = 0; i < 4; i++)                                                        \
                        acc[i][j] = _mm256_fmadd_ps(LOAD8(w[i] + (WIDTH) * (k + 8 * j)), xj, acc[i][j]); \
                }                                                                                      \
            for (int i = 0; i < count; i++) pr->out[p * pr->out_stride + m + i * stride] = hsum_all(acc[i]); \
        }                                                                                              \
    }

WIDE_FLOAT(wide_f32, f32x8, 4)
WIDE_FLOAT(wide_f16, half8, 2)
WIDE_FLOAT(wide_bf16, bf16x8, 2)

/* Q8_0 rows against one input row, four at a time from four streams as the float rows, in 512-bit
 * registers: lanes 0-7 and 8-15 of a block's first register hold dot_q8_0's chains 0 and 1, of its
 * second chains 2 and 3, each the same operations as dot_q8_0's (the same bits); each 16 codes one
 * widening load, not dot_q8_0's shuffles of 32. One core, Zen 4, Kimi-K3's Q8_0 attention output
 * (7168 x 12288) from RAM: 8.4 GB/s by dot_q8_0 a row at a time, 16.2 GB/s so; q_b (18432 x 1536)
 * 15.4 and 19.5; its k_b heads (128 values a row) 11.8 and 12.4. */
AVX512_TARGET static void wide_q8_0_avx512(const Product *pr, int64_t b, int64_t m, const int count,
                                           int64_t stride) {
    const uint8_t *first = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes, *w[4];
    for (int i = 0; i < 4; i++) w[i] = first + (i < count ? i * stride : 0) * pr->row_bytes;
    const int64_t p = pr->starts[b];
    const float *x = pr->x + pr->rows[p] * pr->in_features;
    __m512 acc[4][2];
    for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < pr->row_bytes / 34; k++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * k), x1 = _mm512_loadu_ps(x + 32 * k + 16);
        for (int i = 0; i < 4; i++) {
            const uint8_t *block = w[i] + 34 * k;
            const __m512 step = _mm512_set1_ps(f16c(block));
            const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 2))));
            const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 18))));
            acc[i][0] = _mm512_fmadd_ps(_mm512_mul_ps(low, step), x0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(_mm512_mul_ps(high, step), x1, acc[i][1]);
        }
    }
    for (int i = 0; i < count; i++) {
        __m256 chains[4];
        for (int h = 0; h < 2; h++) {
            chains[2 * h] = _mm512_castps512_ps256(acc[i][h]);
            chains[2 * h + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i][h]), 1));
        }
        pr->out[p * pr->out_stride + m + i * stride] = hsum_all(chains);
    }
}

/* The wide kernel of a matrix with one input row (NULL: none; the float types' take any rows) */
static WideKernel wide_one_kernel(int ggml_type) {
    return ggml_type == 8 && HAVE_AVX512() ? wide_q8_0_avx512 : NULL;
}

static WideKernel wide_kernel(int ggml_type) {
    if (!HAVE_AVX2()) return NULL;
    switch (ggml_type) {
        case 0: return wide_f32;
        case 1: return __builtin_cpu_supports("f16c") ? wide_f16 : NULL;
        case 30: return wide_bf16;
        default: return NULL;
    }
}

/* 32 signed byte codes times their steps (`low` the first 16's, `high` the last 16's) into w[32]: the
 * products fma32 and fma32_step form in registers */
ALWAYS void codes_times(__m256i codes, float low, float high, float *w) {
    const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
    const __m256 a = _mm256_set1_ps(low), b = _mm256_set1_ps(high);
    _mm256_storeu_ps(w, _mm256_mul_ps(codes_lo8(lo), a));
    _mm256_storeu_ps(w + 8, _mm256_mul_ps(codes_lo8(_mm_srli_si128(lo, 8)), a));
    _mm256_storeu_ps(w + 16, _mm256_mul_ps(codes_lo8(hi), b));
    _mm256_storeu_ps(w + 24, _mm256_mul_ps(codes_lo8(_mm_srli_si128(hi, 8)), b));
}

/* One block expanded into floats for the tiles below: the products code * step the dots above form
 * in registers (256 into w) and the sub-block mins of Q2_K, Q4_K and Q5_K (16 into mins). */
ALWAYS void expand_q2_k(const uint8_t *restrict b, float *w, float *mins) {
    float steps[16];
    nibbles_times(b, 0, f16c(b + 80), steps);
    nibbles_times(b, 4, f16c(b + 82), mins);
    const __m256 levels = _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3);
    for (int g = 0; g < 2; g++)
        for (int c = 0; c < 4; c++) {
            const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 16 + 32 * g + 8 * c)));
            for (int f = 0; f < 4; f++) {
                const __m256 table = _mm256_mul_ps(levels, _mm256_broadcast_ss(steps + 8 * g + 2 * f + c / 2));
                _mm256_storeu_ps(w + 128 * g + 32 * f + 8 * c,
                                 _mm256_permutevar_ps(table, _mm256_srli_epi32(bytes, 2 * f)));
            }
        }
}

ALWAYS void expand_q3_k(const uint8_t *restrict b, float *w, float *mins) {
    (void)mins;
    float steps[16];
    q3_k_steps(b, f16c(b + 108), steps);
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i hmask = _mm256_loadu_si256((const __m256i *)b);
    for (int g = 0; g < 2; g++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * g));
        for (int f = 0; f < 4; f++) {
            const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 2 * f), three);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hmask, 4 * g + f), one);
            const __m256i codes = _mm256_sub_epi8(low, _mm256_slli_epi16(_mm256_xor_si256(high, one), 2));
            const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
            const __m256 a = _mm256_broadcast_ss(steps + 8 * g + 2 * f), c = _mm256_broadcast_ss(steps + 8 * g + 2 * f + 1);
            float *out = w + 128 * g + 32 * f;
            _mm256_storeu_ps(out, _mm256_mul_ps(codes_lo8(lo), a));
            _mm256_storeu_ps(out + 8, _mm256_mul_ps(codes_lo8(_mm_srli_si128(lo, 8)), a));
            _mm256_storeu_ps(out + 16, _mm256_mul_ps(codes_lo8(hi), c));
            _mm256_storeu_ps(out + 24, _mm256_mul_ps(codes_lo8(_mm_srli_si128(hi, 8)), c));
        }
    }
}

/* The `n` (<= FUSED_ROWS) input rows from p of a K-quant row product: their x and sums, chains at 0 */
ALWAYS void start_rows(const Product *pr, int64_t p, const int n, const float **x, const float **sums,
                       __m256 acc[FUSED_ROWS][4], __m256 offsets[FUSED_ROWS]) {
    for (int r = 0; r < n; r++) {
        x[r] = pr->x + pr->rows[p + r] * pr->in_features;
        sums[r] = pr->sums16 + pr->rows[p + r] * (pr->in_features / 16);
        offsets[r] = _mm256_setzero_ps();
    }
    zero_acc(acc, n);
}

/* Each row's output for weight row m: its chains summed, less its min offsets (Q2_K) */
ALWAYS void store_rows(const Product *pr, __m256 acc[FUSED_ROWS][4], __m256 offsets[FUSED_ROWS], const int has_mins,
                       int64_t m, int64_t p, const int n) {
    for (int r = 0; r < n; r++)
        pr->out[(p + r) * pr->out_stride + m] = hsum_all(acc[r]) - (has_mins ? hsum8(offsets[r]) : 0.0f);
}

/* One weight row m against `n` (<= FUSED_ROWS) input rows from p: blocks in order into the chains.
 * Inlined into its caller's two calls (n = FUSED_ROWS, n = 1), so each is compiled for its n: left to
 * GCC's heuristics, one build made a single copy for any n and a Q2_K decode row ran 1.5x slower. */
#define KQUANT_ROWS(NAME, DOT, HAS_MINS, BLOCK_BYTES)                                                 \
    ALWAYS void NAME(const Product *pr, const uint8_t *row, int64_t m, int64_t p, const int n) {       \
        const float *x[FUSED_ROWS], *sums[FUSED_ROWS];                                                 \
        __m256 acc[FUSED_ROWS][4], offsets[FUSED_ROWS];                                                \
        start_rows(pr, p, n, x, sums, acc, offsets);                                                   \
        for (int64_t block = 0; block < pr->row_bytes / (BLOCK_BYTES); block++) {                      \
            prefetch_ahead(row + block * (BLOCK_BYTES), BLOCK_BYTES);                                  \
            DOT(row + block * (BLOCK_BYTES), x, sums, 256 * block, acc, offsets, n);                   \
        }                                                                                              \
        store_rows(pr, acc, offsets, HAS_MINS, m, p, n);                                               \
    }

/* Many input rows of one matrix (prefill), TILE_W weight rows at a time: their blocks are expanded,
 * TILE_K values at a time, into floats (the products code * step the dots above form in registers, the
 * sub-block mins of Q2_K, Q4_K and Q5_K; F16 and BF16 converted); then TILE_X input rows at a time run
 * against them chain by chain, the TILE_X x TILE_W pairs' eight-lane sums of chain c (elements 32i + 8c,
 * in order) in twelve registers, parked between chunks in `parts`. Every chain sees the same FMAs in the
 * same order as in the dots above, so a row's result is bit for bit what it is alone; the tile spends 7
 * loads on 12 FMAs where one weight row against three input rows spent 4 on 3. */
#define TILE_X 3
#define TILE_K 1024
#define TILE_ROWS 48 /* input rows whose sums are parked at once (a multiple of TILE_X) */
#define PAIR_FLOATS 40 /* a pair's parked sums: four chains and the min offsets, eight lanes each */

/* the parked sums at `parked` (zeros for the first chunk) */
ALWAYS __m256 unpark(const float *parked, int first) { return first ? _mm256_setzero_ps() : _mm256_loadu_ps(parked); }

/* chain sums of TILE_W expanded weight rows (w, `span` values each) against nx input rows x (at the
 * chunk's start), parked in parts[r][j] */
ALWAYS void tile_chains(const float *w, int64_t span, const float *const *x, float *parts, int first, const int nx) {
    for (int c = 0; c < 4; c++) {
        __m256 acc[TILE_X][TILE_W];
        for (int r = 0; r < nx; r++)
            for (int j = 0; j < TILE_W; j++) acc[r][j] = unpark(parts + (r * TILE_W + j) * PAIR_FLOATS + 8 * c, first);
        for (int64_t at = 8 * c; at < span; at += 32) {
            __m256 xs[TILE_X];
            for (int r = 0; r < nx; r++) xs[r] = _mm256_loadu_ps(x[r] + at);
            for (int j = 0; j < TILE_W; j++) {
                const __m256 wj = _mm256_loadu_ps(w + j * span + at);
                for (int r = 0; r < nx; r++) acc[r][j] = _mm256_fmadd_ps(wj, xs[r], acc[r][j]);
            }
        }
        for (int r = 0; r < nx; r++)
            for (int j = 0; j < TILE_W; j++)
                _mm256_storeu_ps(parts + (r * TILE_W + j) * PAIR_FLOATS + 8 * c, acc[r][j]);
    }
}

/* the min offsets of TILE_W weight rows' blocks in a chunk (mins: span / 16 per row) for nx input rows'
 * sums at the chunk's start: as add_min_offsets, block by block */
ALWAYS void tile_offsets(const float *mins, int64_t span, const float *const *sums, float *parts, int first,
                         const int nx) {
    __m256 offset[TILE_X][TILE_W];
    for (int r = 0; r < nx; r++)
        for (int j = 0; j < TILE_W; j++) offset[r][j] = unpark(parts + (r * TILE_W + j) * PAIR_FLOATS + 32, first);
    for (int64_t s = 0; s < span / 16; s += 16)
        for (int half = 0; half < 16; half += 8) {
            __m256 row_sums[TILE_X];
            for (int r = 0; r < nx; r++) row_sums[r] = _mm256_loadu_ps(sums[r] + s + half);
            for (int j = 0; j < TILE_W; j++) {
                const __m256 m = _mm256_loadu_ps(mins + j * (span / 16) + s + half);
                for (int r = 0; r < nx; r++) offset[r][j] = _mm256_fmadd_ps(m, row_sums[r], offset[r][j]);
            }
        }
    for (int r = 0; r < nx; r++)
        for (int j = 0; j < TILE_W; j++) _mm256_storeu_ps(parts + (r * TILE_W + j) * PAIR_FLOATS + 32, offset[r][j]);
}

/* nx input rows from p (x and sums at value `at`) against the expanded chunk */
ALWAYS void tile_rows(const Product *pr, const float *w, const float *mins, int64_t span, int64_t at, int64_t p,
                      float *parts, const int nx) {
    const float *x[TILE_X], *sums[TILE_X];
    for (int r = 0; r < nx; r++) {
        x[r] = pr->x + pr->rows[p + r] * pr->in_features + at;
        sums[r] = pr->sums16 + pr->rows[p + r] * (pr->in_features / 16) + at / 16;
    }
    tile_chains(w, span, x, parts, at == 0, nx);
    if (mins != NULL) tile_offsets(mins, span, sums, parts, at == 0, nx);
}

/* A pair's chains summed as hsum_all sums them, before its hsum8 */
ALWAYS __m256 parked_chains(const float *parked) {
    const __m256 low = _mm256_add_ps(_mm256_loadu_ps(parked), _mm256_loadu_ps(parked + 8));
    return _mm256_add_ps(low, _mm256_add_ps(_mm256_loadu_ps(parked + 16), _mm256_loadu_ps(parked + 24)));
}

/* Each pair's output: its chains summed as hsum_all sums them, less its min offsets (has_mins); a
 * whole tile's four outputs of an input row summed together and stored at once */
ALWAYS void tile_outputs(const Product *pr, const float *parts, int64_t m, int count, int64_t p, int64_t n,
                         const int has_mins) {
    for (int64_t r = 0; r < n; r++) {
        const float *parked = parts + r * TILE_W * PAIR_FLOATS;
        float *out = pr->out + (p + r) * pr->out_stride + m;
        if (count == 4 && TILE_W == 4) {
            __m128 sums = hsum8_x4(parked_chains(parked), parked_chains(parked + PAIR_FLOATS),
                                   parked_chains(parked + 2 * PAIR_FLOATS), parked_chains(parked + 3 * PAIR_FLOATS));
            if (has_mins)
                sums = _mm_sub_ps(sums, hsum8_x4(_mm256_loadu_ps(parked + 32), _mm256_loadu_ps(parked + PAIR_FLOATS + 32),
                                                 _mm256_loadu_ps(parked + 2 * PAIR_FLOATS + 32),
                                                 _mm256_loadu_ps(parked + 3 * PAIR_FLOATS + 32)));
            _mm_storeu_ps(out, sums);
            continue;
        }
        for (int j = 0; j < count; j++) {
            const float offset = has_mins ? hsum8(_mm256_loadu_ps(parked + j * PAIR_FLOATS + 32)) : 0.0f;
            out[j] = hsum8(parked_chains(parked + j * PAIR_FLOATS)) - offset;
        }
    }
}

/* Weight rows m..m + count - 1 (count <= TILE_W; the rest of the tile repeats row m) of matrix b
 * against input rows p..p + n - 1 (n <= TILE_ROWS) */
#define EXPANDED_TILE(NAME, EXPAND, HAS_MINS, BLOCK_BYTES)                                             \
    AVX2 static void NAME##_group(const Product *pr, int64_t b, int64_t m, int count, int64_t p, int64_t n) { \
        const uint8_t *first = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes, *row[TILE_W]; \
        for (int j = 0; j < TILE_W; j++) row[j] = first + (j < count ? j : 0) * pr->row_bytes;        \
        prefetch_ahead(first, TILE_W * pr->row_bytes); /* the next tile's rows */                     \
        float w[TILE_W * TILE_K], mins[TILE_W * TILE_K / 16], parts[TILE_ROWS * TILE_W * PAIR_FLOATS];   \
        for (int64_t at = 0; at < pr->in_features; at += TILE_K) {                                    \
            const int64_t span = pr->in_features - at < TILE_K ? pr->in_features - at : TILE_K;       \
            for (int j = 0; j < TILE_W; j++)                                                           \
                for (int64_t k = 0; k < span; k += 256)                                                \
                    EXPAND(row[j] + (at + k) / 256 * (BLOCK_BYTES), w + j * span + k, mins + (j * span + k) / 16); \
            const float *m16 = HAS_MINS ? mins : NULL;                                                 \
            int64_t r = 0;                                                                             \
            for (; r + TILE_X <= n; r += TILE_X)                                                       \
                tile_rows(pr, w, m16, span, at, p + r, parts + r * TILE_W * PAIR_FLOATS, TILE_X);      \
            if (n - r == 2) tile_rows(pr, w, m16, span, at, p + r, parts + r * TILE_W * PAIR_FLOATS, 2); \
            if (n - r == 1) tile_rows(pr, w, m16, span, at, p + r, parts + r * TILE_W * PAIR_FLOATS, 1); \
        }                                                                                              \
        tile_outputs(pr, parts, m, count, p, n, HAS_MINS);                                             \
    }                                                                                                  \
    AVX2 static void NAME(const Product *pr, int64_t b, int64_t m, int count) {                      \
        for (int64_t p = pr->starts[b]; p < pr->starts[b + 1]; p += TILE_ROWS)                         \
            NAME##_group(pr, b, m, count, p, pr->starts[b + 1] - p < TILE_ROWS ? pr->starts[b + 1] - p : TILE_ROWS); \
    }

/* Weight rows first..last - 1 of matrix b, each against its matrix's input rows (decode: a few),
 * GROUP (FUSED_ROWS, Q8_ROWS) at a time by NAME##_rows: one call for a task's rows, so what a call sets
 * up is paid once for them (at 512-value rows it cost as much as a row's two blocks). Past the groups,
 * a group of four leaves its last three or two together (Q8_ROWS: two rows 1.3-1.4x faster so), the
 * float rows' group of three its last ones one at a time (those compiled for one and three alone). */
#define ROW_RANGE(NAME, GROUP)                                                                         \
    AVX2 static void NAME(const Product *pr, int64_t b, int64_t first, int64_t last) {                 \
        for (int64_t m = first; m < last; m++) {                                                       \
            const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;      \
            int64_t p = pr->starts[b];                                                                 \
            for (; p + (GROUP) <= pr->starts[b + 1]; p += (GROUP)) NAME##_rows(pr, row, m, p, GROUP);  \
            const int64_t rest = pr->starts[b + 1] - p;                                                \
            if ((GROUP) > 3 && rest == 3) NAME##_rows(pr, row, m, p, 3), p += 3;                       \
            if ((GROUP) > 3 && rest == 2) NAME##_rows(pr, row, m, p, 2), p += 2;                       \
            for (; p < pr->starts[b + 1]; p++) NAME##_rows(pr, row, m, p, 1);                          \
        }                                                                                              \
    }

#define KQUANT_ROW(NAME, DOT, HAS_MINS, BLOCK_BYTES)                                                   \
    KQUANT_ROWS(NAME##_rows, DOT, HAS_MINS, BLOCK_BYTES)                                               \
    ROW_RANGE(NAME, FUSED_ROWS)

#define K45_EXPAND(TYPE)                                                                                \
    ALWAYS void expand_##TYPE(const uint8_t *restrict b, float *w, float *mins) {                      \
        float steps[8];                                                                                 \
        q4_k_steps(b, steps, mins);                                                                     \
        for (int s = 0; s < 8; s++) codes_times(TYPE##_codes(b, s), steps[s], steps[s], w + 32 * s);   \
    }

K45_EXPAND(q4_k)
K45_EXPAND(q5_k)

ALWAYS void expand_q6_k(const uint8_t *restrict b, float *w, float *mins) {
    (void)mins;
    float steps[16];
    q6_k_steps(b, steps);
    for (int run = 0; run < 8; run++)
        codes_times(_mm256_sub_epi8(q6_k_codes(b, run), _mm256_set1_epi8(32)), steps[2 * run], steps[2 * run + 1],
                    w + 32 * run);
}

KQUANT_ROW(fused_q2_k, dot_q2_k, 1, 84)
KQUANT_ROW(fused_q3_k, dot_q3_k, 0, 110)
KQUANT_ROW(fused_q4_k, dot_q4_k, 1, 144)
KQUANT_ROW(fused_q5_k, dot_q5_k, 1, 176)
KQUANT_ROW(fused_q6_k, dot_q6_k, 0, 210)
EXPANDED_TILE(tile_q2_k, expand_q2_k, 1, 84)
EXPANDED_TILE(tile_q3_k, expand_q3_k, 0, 110)
EXPANDED_TILE(tile_q4_k, expand_q4_k, 1, 144)
EXPANDED_TILE(tile_q5_k, expand_q5_k, 1, 176)
EXPANDED_TILE(tile_q6_k, expand_q6_k, 0, 210)

/* w[0..32] += m (Q4_1 and Q5_1's offsets, after the products codes_times stored) */
ALWAYS void add_to_32(float *w, float m) {
    for (int i = 0; i < 32; i += 8) _mm256_storeu_ps(w + i, _mm256_add_ps(_mm256_loadu_ps(w + i), _mm256_set1_ps(m)));
}

/* eight 32-value blocks expanded: each code times its block's step (plus m: Q4_1, Q5_1), the products
 * (and sums) fma32_step and fma32_affine form in registers */
#define BLOCK32_EXPAND(TYPE, ID, BYTES, AFFINE)                                                           \
    ALWAYS void expand_##TYPE(const uint8_t *restrict b, float *w, float *mins) {                      \
        (void)mins;                                                                                     \
        for (int k = 0; k < 8; k++) {                                                                   \
            const Block32 block = block_##TYPE(b + (BYTES) * k);                                        \
            codes_times(block.codes, block.d, block.d, w + 32 * k);                                     \
            if (AFFINE) add_to_32(w + 32 * k, block.m);                                                \
        }                                                                                               \
    }                                                                                                   \
    EXPANDED_TILE(tile_##TYPE, expand_##TYPE, 0, 8 * (BYTES))

BLOCK32_TYPES(BLOCK32_EXPAND)

/* F16 and BF16: 256 values converted, for the tiles (their chains are the whole-row float dots') */
#define EXPAND_FLOAT(NAME, LOAD8)                                                                      \
    ALWAYS void NAME(const uint8_t *restrict b, float *w, float *mins) {                               \
        (void)mins;                                                                                    \
        for (int i = 0; i < 32; i++) _mm256_storeu_ps(w + 8 * i, LOAD8(b + 16 * i));                   \
    }

EXPAND_FLOAT(expand_f16, half8)
EXPAND_FLOAT(expand_bf16, bf16x8)
EXPANDED_TILE(tile_f16, expand_f16, 0, 512)
EXPANDED_TILE(tile_bf16, expand_bf16, 0, 512)

#define BLOCK32_TILE_CASE(TYPE, ID, BYTES, AFFINE) \
    case ID: return tile_##TYPE;
static TileKernel tile_kernel(int ggml_type) {
    if (!HAVE_AVX2()) return NULL;
    switch (ggml_type) {
        case 10: return tile_q2_k;
        case 11: return tile_q3_k;
        case 1: return __builtin_cpu_supports("f16c") ? tile_f16 : NULL;
        case 30: return tile_bf16;
        case 12: return tile_q4_k;
        case 14: return tile_q6_k;
        case 13: return tile_q5_k;
        BLOCK32_TYPES(BLOCK32_TILE_CASE)
        default: return NULL;
    }
}

/* One weight row m of a type in 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, F16, BF16, F32)
 * against its matrix's input rows, FUSED_ROWS at a time: DOT over the whole row, its four chains across
 * it (as the wide rows and the tiles sum it). No software prefetch: these rows are read as one stream,
 * which the hardware follows; asking for the lines a page ahead slowed them (3 KB F32 rows on one core:
 * 13.9-15.7 GB/s with it, 15.6-17.6 without). One copy for one input row and one for FUSED_ROWS, each
 * compiled for its n and its own registers (with six more of these, GCC stopped making the copies
 * itself, and inlined into ROW_RANGE they kept their constants on the stack: Q4_0 and Q8_0 decode rows
 * 3-7% slower) */
#define FUSED_ROW(NAME, DOT, BLOCK_BYTES)                                                              \
    ALWAYS void NAME##_body(const Product *pr, const uint8_t *row, int64_t m, int64_t p, const int n) { \
        const float *x[FUSED_ROWS], *sums[FUSED_ROWS];                                                 \
        float total[FUSED_ROWS];                                                                       \
        for (int r = 0; r < n; r++) {                                                                  \
            x[r] = pr->x + pr->rows[p + r] * pr->in_features;                                          \
            sums[r] = pr->sums16 + pr->rows[p + r] * (pr->in_features / 16);                           \
        }                                                                                              \
        DOT(row, x, sums, 0, total, n, (int)(pr->row_bytes / (BLOCK_BYTES)));                          \
        for (int r = 0; r < n; r++) pr->out[(p + r) * pr->out_stride + m] = total[r];                    \
    }                                                                                                  \
    AVX2 __attribute__((noinline)) static void NAME##_one(const Product *pr, const uint8_t *row, int64_t m, \
                                                          int64_t p) {                                 \
        NAME##_body(pr, row, m, p, 1);                                                                 \
    }                                                                                                  \
    AVX2 __attribute__((noinline)) static void NAME##_many(const Product *pr, const uint8_t *row, int64_t m, \
                                                           int64_t p) {                                \
        NAME##_body(pr, row, m, p, FUSED_ROWS);                                                        \
    }                                                                                                  \
    ALWAYS void NAME##_rows(const Product *pr, const uint8_t *row, int64_t m, int64_t p, const int n) { \
        if (n == 1)                                                                                    \
            NAME##_one(pr, row, m, p);                                                                 \
        else                                                                                           \
            NAME##_many(pr, row, m, p);                                                                \
    }                                                                                                  \
    ROW_RANGE(NAME, FUSED_ROWS)

#define BLOCK32_ROW(TYPE, ID, BYTES, AFFINE) FUSED_ROW(fused_##TYPE, dot_##TYPE, BYTES)
BLOCK32_TYPES(BLOCK32_ROW)
FUSED_ROW(fused_f16, dot_f16, 64)
FUSED_ROW(fused_bf16, dot_bf16, 64)
FUSED_ROW(fused_f32, dot_f32, 128)

#define BLOCK32_FUSED_CASE(TYPE, ID, BYTES, AFFINE) \
    case ID: return fused_##TYPE;
static RowKernel fused_kernel(int ggml_type) {
    if (!HAVE_AVX2()) return NULL;
    switch (ggml_type) {
        case 10: return fused_q2_k;
        case 11: return fused_q3_k;
        case 12: return fused_q4_k;
        case 13: return fused_q5_k;
        case 14: return fused_q6_k;
        BLOCK32_TYPES(BLOCK32_FUSED_CASE)
        case 1: return __builtin_cpu_supports("f16c") ? fused_f16 : NULL;
        case 30: return fused_bf16;
        case 0: return fused_f32;
        default: return NULL;
    }
}

/* The 16 sub-block scales (int8 in `scales8`) as int16, one half per group of 128 values, copied to
 * both 128-bit lanes; `pair_scales(half, f)` then spreads scales 2f and 2f + 1 of that half over the
 * low and high 8 int16 lanes, to weigh the products of a 32-value run (maddubs pairs). */
ALWAYS void scale_halves(__m128i scales8, __m256i halves[2]) {
    const __m256i wide = _mm256_cvtepi8_epi16(scales8);
    const __m128i lo = _mm256_castsi256_si128(wide), hi = _mm256_extracti128_si256(wide, 1);
    halves[0] = _mm256_set_m128i(lo, lo);
    halves[1] = _mm256_set_m128i(hi, hi);
}

ALWAYS __m256i pair_scales(__m256i half, int f) {
    const short first = (short)((4 * f + 1) << 8 | 4 * f), second = (short)((4 * f + 3) << 8 | (4 * f + 2));
    return _mm256_shuffle_epi8(half, _mm256_set_m128i(_mm_set1_epi16(second), _mm_set1_epi16(first)));
}

/* acc[r] += per-lane float sums of one Q2_K block times input row r's Q8_K block y[r] + at: d_y (d
 * sum_s sc_s q.y_s - dmin sum_s m_s bsum_s), with exact integer sums, the mins' FMA first (ggml's order) */
ALWAYS void q8_q2_k(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, __m256 *acc, const int n) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)b), nibble = _mm_set1_epi8(15);
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
    __m256i halves[2], sumi[Q8_ROWS];
    scale_halves(_mm_and_si128(packed, nibble), halves);
    const __m256i three = _mm256_set1_epi8(3);
    for (int r = 0; r < n; r++) sumi[r] = _mm256_setzero_si256();
    for (int g = 0; g < 2; g++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * g));
        for (int f = 0; f < 4; f++) {
            const __m256i codes = _mm256_and_si256(_mm256_srli_epi16(q, 2 * f), three), scales = pair_scales(halves[g], f);
            for (int r = 0; r < n; r++) {
                const __m256i q8 = _mm256_loadu_si256((const __m256i *)(y[r][at].qs + 128 * g + 32 * f));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q8), scales));
            }
        }
    }
    const float step = f16c(b + 80), min_step = f16c(b + 82);
    for (int r = 0; r < n; r++) {
        const __m256i offsets = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)y[r][at].bsums));
        const float d = y[r][at].d * step, dmin = -y[r][at].d * min_step;
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(offsets), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
}

/* Q3_K: code + 4 = low + 4 h (0..7, unsigned for maddubs; h: bit 4g + f of hmask[i] set), the 4 taken
 * back from each pair's product before its scale (maddubs of 4 and y): each int32 lane ggml's AVX2
 * vec_dot forms, so the lanes' float sums are its bits */
ALWAYS void q8_q3_k(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, __m256 *acc, const int n) {
    const __m128i scales8 = q3_k_scales8(b);
    __m256i halves[2], sumi[Q8_ROWS];
    scale_halves(scales8, halves);
    for (int r = 0; r < n; r++) sumi[r] = _mm256_setzero_si256();
    const __m256i hmask = _mm256_loadu_si256((const __m256i *)b), three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int g = 0; g < 2; g++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * g));
        for (int f = 0; f < 4; f++) {
            const int bit = 4 * g + f; /* moved to bit 2 of each byte */
            const __m256i moved = bit >= 2 ? _mm256_srli_epi16(hmask, bit - 2) : _mm256_slli_epi16(hmask, 2 - bit);
            const __m256i codes = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * f), three),
                                                  _mm256_and_si256(moved, four));
            const __m256i scales = pair_scales(halves[g], f);
            for (int r = 0; r < n; r++) {
                const __m256i q8 = _mm256_loadu_si256((const __m256i *)(y[r][at].qs + 128 * g + 32 * f));
                const __m256i pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(codes, q8), _mm256_maddubs_epi16(four, q8));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(pairs, scales));
            }
        }
    }
    const float step = f16c(b + 108);
    for (int r = 0; r < n; r++)
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(step * y[r][at].d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
}

/* Q4_K: sub-blocks 2j (low nibbles) and 2j + 1 (high) of bytes 32j..; the mins against the Q8_K sums
 * into four lanes apart (MinLanes), as ggml's AVX2 vec_dot */
ALWAYS void q8_q4_k(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, MinLanes *acc, const int n) {
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256i sumi[Q8_ROWS];
    int16_t mins[8];
    for (int r = 0; r < n; r++) sumi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        int scale_lo, min_lo, scale_hi, min_hi;
        k_scale_min(b + 4, 2 * j, &scale_lo, &min_lo);
        k_scale_min(b + 4, 2 * j + 1, &scale_hi, &min_hi);
        mins[2 * j] = (int16_t)min_lo, mins[2 * j + 1] = (int16_t)min_hi;
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
        const __m256i lo = _mm256_and_si256(q, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
        const __m256i scales_lo = _mm256_set1_epi16((short)scale_lo), scales_hi = _mm256_set1_epi16((short)scale_hi);
        for (int r = 0; r < n; r++) {
            const __m256i y_lo = _mm256_loadu_si256((const __m256i *)(y[r][at].qs + 64 * j));
            const __m256i y_hi = _mm256_loadu_si256((const __m256i *)(y[r][at].qs + 64 * j + 32));
            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y_lo), scales_lo));
            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y_hi), scales_hi));
        }
    }
    const __m128i min_codes = _mm_loadu_si128((const __m128i *)mins);
    const float step = f16c(b), min_step = f16c(b + 2);
    for (int r = 0; r < n; r++) {
        const __m128 offsets = _mm_cvtepi32_ps(q4_k_min_lanes(min_codes, y[r][at].bsums));
        acc[r].mins = _mm_fmadd_ps(_mm_set1_ps(-y[r][at].d * min_step), offsets, acc[r].mins);
        acc[r].lanes = _mm256_fmadd_ps(_mm256_set1_ps(y[r][at].d * step), _mm256_cvtepi32_ps(sumi[r]), acc[r].lanes);
    }
}

/* Q6_K: codes 0..63 times y, less 32 times each sub-block's sum of y (its Q8_K bsum), by int8 scale
 * (one input row: sharing its decoded codes with more rows, as Q2_K-Q4_K do, ran 2-row products 1.6x
 * slower here) */
ALWAYS __m256 q8_q6_k(const uint8_t *restrict b, const BlockQ8K *restrict y, __m256 acc) {
    const __m128i scales8 = _mm_loadu_si128((const __m128i *)(b + 192));
    __m256i halves[2];
    scale_halves(scales8, halves);
    __m256i sumi = _mm256_mullo_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(scales8),
                                                        _mm256_loadu_si256((const __m256i *)y->bsums)),
                                      _mm256_set1_epi32(-32));
    for (int run = 0; run < 8; run++) {
        const __m256i q8 = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * run));
        const __m256i products = _mm256_maddubs_epi16(q6_k_codes(b, run), q8);
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(products, pair_scales(halves[run >> 2], run & 3)));
    }
    return _mm256_fmadd_ps(_mm256_set1_ps(f16c(b + 208) * y->d), _mm256_cvtepi32_ps(sumi), acc);
}

/* quantize_q8_k eight values at a time: the same largest magnitude (its first occurrence's sign), the same
 * products rounded half to even and clamped, the same sums: the same bytes */
AVX2 static void quantize_q8_k_avx2(const float *restrict x, int64_t blocks, BlockQ8K *restrict y) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < blocks; i++, x += 256) {
        __m256 most = _mm256_setzero_ps();
        for (int j = 0; j < 256; j += 8) /* a NaN (first operand) is skipped, as `>` skips it */
            most = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), magnitude), most);
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, most);
        for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
        memset(&y[i], 0, sizeof(BlockQ8K));
        if (amax == 0.0f) continue;
        int first = 0;
        while (fabsf(x[first]) != amax) first++;
        const float iscale = -127.0f / x[first];
        const __m256 scale = _mm256_set1_ps(iscale), top = _mm256_set1_ps(127.0f);
        for (int j = 0; j < 256; j += 32) {
            __m256i codes[4];
            for (int k = 0; k < 4; k++) {
                const __m256 v = _mm256_round_ps(_mm256_mul_ps(scale, _mm256_loadu_ps(x + j + 8 * k)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                codes[k] = _mm256_cvtps_epi32(_mm256_min_ps(v, top));
            }
            const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3]));
            _mm256_storeu_si256((__m256i *)(y[i].qs + j), _mm256_permutevar8x32_epi32(packed, order));
        }
        for (int j = 0; j < 16; j++)
            for (int l = 0; l < 16; l++) y[i].bsums[j] += y[i].qs[16 * j + l];
        y[i].d = 1.0f / iscale;
    }
}
/* Q8_0 weights: signed codes times signed codes, by maddubs on |w| and y with w's sign */
ALWAYS __m256 q8_signed_dot(__m256i w, __m256i q8, float scale, __m256 acc) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q8, w));
    const __m256i sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(sums), acc);
}

ALWAYS __m256 q8_q8_0(const uint8_t *restrict b, const BlockQ8_0 *restrict y, __m256 acc) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 2));
    return q8_signed_dot(w, _mm256_loadu_si256((const __m256i *)y->qs), f16c(b) * y->d, acc);
}

ALWAYS __m256 q8_q4_0(const uint8_t *restrict b, const BlockQ8_0 *restrict y, __m256 acc) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), nibble = _mm_set1_epi8(15);
    const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), nibble), _mm_and_si128(q, nibble));
    const __m256i w = _mm256_sub_epi8(codes, _mm256_set1_epi8(8));
    return q8_signed_dot(w, _mm256_loadu_si256((const __m256i *)y->qs), f16c(b) * y->d, acc);
}

/* a signed-code block (Q5_0: codes less 16, block_q5_0) against a Q8_0 block, as Q4_0's */
ALWAYS __m256 q8_signed_block(Block32 block, const BlockQ8_0 *restrict y, __m256 acc) {
    return q8_signed_dot(block.codes, _mm256_loadu_si256((const __m256i *)y->qs), block.d * y->d, acc);
}

/* Q4_1 and Q5_1 against Q8_1, as ggml's AVX2 vec_dot: unsigned codes times y by maddubs into the lanes
 * (times d d_y), the offset m times y's s into the sum beside them */
ALWAYS Lanes q8_affine(Block32 block, const BlockQ8_1 *restrict y, Lanes acc) {
    const __m256i pairs = _mm256_maddubs_epi16(block.codes, _mm256_loadu_si256((const __m256i *)y->qs));
    const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    return (Lanes){_mm256_fmadd_ps(_mm256_set1_ps(block.d * y->d), sums, acc.lanes), acc.sum + block.m * y->s};
}

/* a 32-value block decoded once for `n` (<= Q8_ROWS) input rows' blocks y[r] + at, each row's sum its
 * one-row sum (ROW_DOT) */
#define BLOCK32_SHARED(TYPE, Y, ACC, ROW_DOT)                                                              \
    ALWAYS void q8_##TYPE(const uint8_t *restrict b, const Y *const *y, int64_t at, ACC *acc, const int n) { \
        const Block32 block = block_##TYPE(b);                                                           \
        for (int r = 0; r < n; r++) acc[r] = ROW_DOT(block, y[r] + at, acc[r]);                          \
    }
BLOCK32_SHARED(q5_0, BlockQ8_0, __m256, q8_signed_block)
BLOCK32_SHARED(q4_1, BlockQ8_1, Lanes, q8_affine)
BLOCK32_SHARED(q5_1, BlockQ8_1, Lanes, q8_affine)

/* Q5_K: sub-block s's codes (q5_k_codes) times its scale into the lanes, as Q4_K's; dmin times the mins'
 * integer sum against the Q8_K sums into the sum beside them by one fused multiply-add (the compiler
 * contracts ggml's AVX2 vec_dot so): its bits */
ALWAYS void q8_q5_k(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, Lanes *acc, const int n) {
    __m256i sumi[Q8_ROWS];
    int scales[8], mins[8], summs[Q8_ROWS];
    for (int s = 0; s < 8; s++) k_scale_min(b + 4, s, &scales[s], &mins[s]);
    for (int r = 0; r < n; r++) {
        sumi[r] = _mm256_setzero_si256(), summs[r] = 0;
        for (int s = 0; s < 8; s++) summs[r] += mins[s] * (y[r][at].bsums[2 * s] + y[r][at].bsums[2 * s + 1]);
    }
    for (int s = 0; s < 8; s++) {
        const __m256i codes = q5_k_codes(b, s), scale = _mm256_set1_epi16((short)scales[s]);
        for (int r = 0; r < n; r++) {
            const __m256i q8 = _mm256_loadu_si256((const __m256i *)(y[r][at].qs + 32 * s));
            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q8), scale));
        }
    }
    const float step = f16c(b), min_step = f16c(b + 2);
    for (int r = 0; r < n; r++) {
        acc[r].lanes = _mm256_fmadd_ps(_mm256_set1_ps(y[r][at].d * step), _mm256_cvtepi32_ps(sumi[r]), acc[r].lanes);
        acc[r].sum = fmaf(-y[r][at].d * min_step, (float)summs[r], acc[r].sum); /* ggml's, contracted */
    }
}


/* One weight row against `n` (<= Q8_ROWS) input rows' 8-bit blocks (Q8_SHARED_ROWS), as Q8_ROW sums
 * one row's */
#define Q8_SHARED_ROW(NAME, DOT, BLOCK_BYTES, Y, ELEMS, ACC, ZERO, TOTAL)                              \
    Q8_SHARED_ROWS(ALWAYS, NAME, DOT, BLOCK_BYTES, Y, ELEMS, ACC, ZERO, TOTAL)                         \
    ROW_RANGE(NAME, Q8_ROWS)

Q8_SHARED_ROW(q8_row_q2_k_avx2, q8_q2_k, 84, q8, 256, __m256, _mm256_setzero_ps(), hsum8)
Q8_SHARED_ROW(q8_row_q3_k_avx2, q8_q3_k, 110, q8, 256, __m256, _mm256_setzero_ps(), hsum8)
Q8_SHARED_ROW(q8_row_q4_k_avx2, q8_q4_k, 144, q8, 256, MinLanes, MIN_LANES_ZERO, min_lanes_total)
Q8_SHARED_ROW(q8_row_q5_k_avx2, q8_q5_k, 176, q8, 256, Lanes, LANES_ZERO, lanes_total)
Q8_ROW(q8_row_q6_k_avx2, AVX2, q8_q6_k, 210, q8, 256, __m256, _mm256_setzero_ps(), hsum8)
Q8_ROW(q8_row_q8_0_avx2, AVX2, q8_q8_0, 34, q8_0, 32, __m256, _mm256_setzero_ps(), hsum8)
Q8_ROW(q8_row_q4_0_avx2, AVX2, q8_q4_0, 18, q8_0, 32, __m256, _mm256_setzero_ps(), hsum8)
Q8_SHARED_ROW(q8_row_q5_0_avx2, q8_q5_0, 22, q8_0, 32, __m256, _mm256_setzero_ps(), hsum8)
Q8_SHARED_ROW(q8_row_q4_1_avx2, q8_q4_1, 20, q8_1, 32, Lanes, LANES_ZERO, lanes_total)
Q8_SHARED_ROW(q8_row_q5_1_avx2, q8_q5_1, 24, q8_1, 32, Lanes, LANES_ZERO, lanes_total)

/* Outputs m..m + 15 of an input-major F32 matrix w [in, out] for input rows p..p + n - 1: per output
 * acc = fma(x_k, w_k, acc) over k in order from zero, eight outputs a vector; `masked`: the last ones of
 * a matrix whose outputs are not whole 16s, `masks` the outputs kept of each vector (masked loads are
 * slow on some cores: only there) */
ALWAYS void input_major_block(const Product *pr, const float *w, int64_t m, int64_t p, const int n,
                              const __m256i masks[2], const int masked) {
    const int64_t in = pr->in_features, width = pr->out_rows;
    const float *x[INPUT_MAJOR_ROWS];
    __m256 acc[INPUT_MAJOR_ROWS][2];
    for (int r = 0; r < n; r++) {
        x[r] = pr->x + pr->rows[p + r] * in;
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < in; k++) {
        const float *row = w + k * width + m;
        const __m256 w0 = masked ? _mm256_maskload_ps(row, masks[0]) : _mm256_loadu_ps(row);
        const __m256 w1 = masked ? _mm256_maskload_ps(row + 8, masks[1]) : _mm256_loadu_ps(row + 8);
        for (int r = 0; r < n; r++) {
            const __m256 xk = _mm256_broadcast_ss(x[r] + k);
            acc[r][0] = _mm256_fmadd_ps(xk, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xk, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < n; r++) {
        float *out = pr->out + (p + r) * pr->out_stride + m;
        if (masked) {
            _mm256_maskstore_ps(out, masks[0], acc[r][0]);
            _mm256_maskstore_ps(out + 8, masks[1], acc[r][1]);
        } else {
            _mm256_storeu_ps(out, acc[r][0]);
            _mm256_storeu_ps(out + 8, acc[r][1]);
        }
    }
}

/* The lanes of outputs m.. below `last`, for two vectors */
ALWAYS void output_masks(int64_t m, int64_t last, __m256i masks[2]) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t left = last - m;
    masks[0] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 16 ? left : 16)), lanes);
    masks[1] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 16 ? left : 16) - 8), lanes);
}

AVX2 __attribute__((noinline)) static void input_major_rows(const Product *pr, const float *w, int64_t m, int64_t p,
                                                           int64_t last) {
    __m256i masks[2];
    output_masks(m, last, masks);
    if (last - m >= 16)
        input_major_block(pr, w, m, p, INPUT_MAJOR_ROWS, masks, 0);
    else
        input_major_block(pr, w, m, p, INPUT_MAJOR_ROWS, masks, 1);
}

AVX2 __attribute__((noinline)) static void input_major_one(const Product *pr, const float *w, int64_t m, int64_t p,
                                                          int64_t last) {
    __m256i masks[2];
    output_masks(m, last, masks);
    if (last - m >= 16)
        input_major_block(pr, w, m, p, 1, masks, 0);
    else
        input_major_block(pr, w, m, p, 1, masks, 1);
}

/* Outputs m..m + 63 for input row p alone (a decode step's): eight chains, so the FMAs do not wait on
 * each other */
AVX2 __attribute__((noinline)) static void input_major_row(const Product *pr, const float *w, int64_t m, int64_t p) {
    const int64_t in = pr->in_features, width = pr->out_rows;
    const float *x = pr->x + pr->rows[p] * in;
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in; k++) {
        const __m256 xk = _mm256_broadcast_ss(x + k);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(xk, _mm256_loadu_ps(w + k * width + m + 8 * j), acc[j]);
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(pr->out + p * pr->out_stride + m + 8 * j, acc[j]);
}

/* Outputs first..last - 1 of input-major F32 matrix w for input row p alone: 64 at a time, the last
 * ones sixteen at a time */
AVX2 static void input_major_alone(const Product *pr, const float *w, int64_t p, int64_t first, int64_t last) {
    int64_t m = first;
    for (; m + 64 <= last; m += 64) input_major_row(pr, w, m, p);
    for (; m < last; m += 16) input_major_one(pr, w, m, p, last);
}

/* Outputs first..last - 1 of input-major F32 matrix b: sixteen at a time (the last ones masked) for
 * INPUT_MAJOR_ROWS input rows at a time, 64 at a time for a row left alone (the same operations) */
AVX2 static void input_major_avx2(const Product *pr, int64_t b, int64_t first, int64_t last) {
    const float *w = (const float *)(uintptr_t)pr->addresses[b];
    const int64_t start = pr->starts[b], end = pr->starts[b + 1];
    const int64_t grouped = start + (end - start) / INPUT_MAJOR_ROWS * INPUT_MAJOR_ROWS;
    for (int64_t m = first; m < last; m += 16)
        for (int64_t p = start; p < grouped; p += INPUT_MAJOR_ROWS) input_major_rows(pr, w, m, p, last);
    for (int64_t p = grouped; p < end; p++) input_major_alone(pr, w, p, first, last);
}

/* The AVX-512 input-major F32 product: outputs m..m + 63 (four vectors of 16, the last ones masked) for
 * INPUT_MAJOR_ROWS_512 input rows at a time, 24 FMA chains on ten loads a step; rows left over take the
 * AVX2 kernel's one-row path. Each output is the
 * same one chain acc = fma(x_k, w_k, acc) over k in order from zero as in the AVX2 and portable
 * kernels, so every ISA gives it the same bits. */
#define INPUT_MAJOR_ROWS_512 6
#define INPUT_MAJOR_VECS_512 4
#define INPUT_MAJOR_WIDTH_512 (16 * INPUT_MAJOR_VECS_512)

/* Row r's four accumulators (named, not an array: GCC keeps an array of 24 vectors in memory, storing
 * it every step), its step over input k, and its store */
#define IM512_DECLARE(r)                                                                                     \
    __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0, a##r##3 = a##r##0;            \
    const float *x##r = pr->x + pr->rows[p + r] * in;
#define IM512_STEP(r)                                                                                        \
    {                                                                                                        \
        const __m512 xk = _mm512_set1_ps(x##r[k]);                                                           \
        a##r##0 = _mm512_fmadd_ps(xk, w0, a##r##0), a##r##1 = _mm512_fmadd_ps(xk, w1, a##r##1);             \
        a##r##2 = _mm512_fmadd_ps(xk, w2, a##r##2), a##r##3 = _mm512_fmadd_ps(xk, w3, a##r##3);             \
    }
#define IM512_STORE(r)                                                                                       \
    {                                                                                                        \
        float *out = pr->out + (p + r) * pr->out_stride;                                                     \
        _mm512_mask_storeu_ps(out, masks[0], a##r##0), _mm512_mask_storeu_ps(out + 16, masks[1], a##r##1);   \
        _mm512_mask_storeu_ps(out + 32, masks[2], a##r##2), _mm512_mask_storeu_ps(out + 48, masks[3], a##r##3); \
    }

/* Outputs 0..63 of the block at w (rows `width` apart; `masks`: the outputs kept of each vector) for
 * input rows p..p + 5 */
AVX512_TARGET __attribute__((noinline)) static void input_major_block_512(const Product *pr, const float *w,
                                                                         int64_t width, int64_t p,
                                                                         const __mmask16 *masks) {
    const int64_t in = pr->in_features;
    IM512_DECLARE(0) IM512_DECLARE(1) IM512_DECLARE(2) IM512_DECLARE(3) IM512_DECLARE(4) IM512_DECLARE(5)
    for (int64_t k = 0; k < in; k++) {
        const float *row = w + k * width;
        const __m512 w0 = _mm512_maskz_loadu_ps(masks[0], row), w1 = _mm512_maskz_loadu_ps(masks[1], row + 16);
        const __m512 w2 = _mm512_maskz_loadu_ps(masks[2], row + 32), w3 = _mm512_maskz_loadu_ps(masks[3], row + 48);
        IM512_STEP(0) IM512_STEP(1) IM512_STEP(2) IM512_STEP(3) IM512_STEP(4) IM512_STEP(5)
    }
    IM512_STORE(0) IM512_STORE(1) IM512_STORE(2) IM512_STORE(3) IM512_STORE(4) IM512_STORE(5)
}

/* Outputs first..last - 1 of input-major F32 matrix b, 64 at a time for six input rows at a time, the
 * rows left over (fewer than six) one at a time. With more than one group of rows the 64 outputs' columns are first copied into one
 * contiguous strip [in, 64] (the same values; the matrix's rows may lie a power of two apart, whose
 * columns would share a few cache sets), read by every group. */
AVX512_TARGET static void input_major_avx512(const Product *pr, int64_t b, int64_t first, int64_t last) {
    const float *w = (const float *)(uintptr_t)pr->addresses[b];
    const int64_t start = pr->starts[b], end = pr->starts[b + 1], in = pr->in_features;
    const int64_t width = INPUT_MAJOR_WIDTH_512;
    const int64_t grouped = start + (end - start) / INPUT_MAJOR_ROWS_512 * INPUT_MAJOR_ROWS_512;
    float *strip = grouped - start > INPUT_MAJOR_ROWS_512 ? malloc(sizeof(float) * width * (size_t)in) : NULL;
    Product at = *pr;
    for (int64_t m = first; m < last; m += width) {
        __mmask16 masks[INPUT_MAJOR_VECS_512];
        for (int v = 0; v < INPUT_MAJOR_VECS_512; v++) {
            const int64_t left = last - m - 16 * v;
            masks[v] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        }
        if (strip != NULL)
            for (int64_t k = 0; k < in; k++)
                for (int v = 0; v < INPUT_MAJOR_VECS_512; v++)
                    _mm512_storeu_ps(strip + width * k + 16 * v,
                                     _mm512_maskz_loadu_ps(masks[v], w + k * pr->out_rows + m + 16 * v));
        at.out = pr->out + m; /* output m of the matrix is output 0 of the block */
        for (int64_t p = start; p < grouped; p += INPUT_MAJOR_ROWS_512)
            input_major_block_512(&at, strip != NULL ? strip : w + m, strip != NULL ? width : pr->out_rows, p, masks);
    }
    free(strip);
    for (int64_t p = grouped; p < end; p++) input_major_alone(pr, w, p, first, last); /* the AVX2 kernel's */
}
#else
static RowKernel fused_kernel(int ggml_type) { (void)ggml_type; return NULL; }
static TileKernel tile_kernel(int ggml_type) { (void)ggml_type; return NULL; }
static WideKernel wide_kernel(int ggml_type) { (void)ggml_type; return NULL; }
static WideKernel wide_one_kernel(int ggml_type) { (void)ggml_type; return NULL; }
#define HAVE_AVX2() 0
#define input_major_avx2 input_major_generic
#define input_major_avx512 input_major_generic
#define q8_row_q2_k_avx2 q8_row_q2_k_generic
#define q8_row_q3_k_avx2 q8_row_q3_k_generic
#define q8_row_q4_k_avx2 q8_row_q4_k_generic
#define q8_row_q6_k_avx2 q8_row_q6_k_generic
#define q8_row_q8_0_avx2 q8_row_q8_0_generic
#define q8_row_q4_0_avx2 q8_row_q4_0_generic
#define q8_row_q5_k_avx2 q8_row_q5_k_generic
#define q8_row_q5_0_avx2 q8_row_q5_0_generic
#define q8_row_q4_1_avx2 q8_row_q4_1_generic
#define q8_row_q5_1_avx2 q8_row_q5_1_generic
#endif

Q8_ROW(q8_row_q2_k_generic, , q8_q2_k_generic, 84, q8, 256, float, 0.0f, FLOAT_TOTAL)
Q8_ROW(q8_row_q3_k_generic, , q8_q3_k_generic, 110, q8, 256, float, 0.0f, FLOAT_TOTAL)
Q8_ROW(q8_row_q4_k_generic, , q8_q4_k_generic, 144, q8, 256, float, 0.0f, FLOAT_TOTAL)
Q8_ROW(q8_row_q6_k_generic, , q8_q6_k_generic, 210, q8, 256, float, 0.0f, FLOAT_TOTAL)
Q8_ROW(q8_row_q8_0_generic, , q8_q8_0_generic, 34, q8_0, 32, float, 0.0f, FLOAT_TOTAL)
Q8_ROW(q8_row_q4_0_generic, , q8_q4_0_generic, 18, q8_0, 32, float, 0.0f, FLOAT_TOTAL)
Q8_ROW(q8_row_q5_k_generic, , q8_q5_k_generic, 176, q8, 256, float, 0.0f, FLOAT_TOTAL)
Q8_ROW(q8_row_q5_0_generic, , q8_q5_0_generic, 22, q8_0, 32, float, 0.0f, FLOAT_TOTAL)
Q8_ROW(q8_row_q4_1_generic, , q8_q4_1_generic, 20, q8_1, 32, float, 0.0f, FLOAT_TOTAL)
Q8_ROW(q8_row_q5_1_generic, , q8_q5_1_generic, 24, q8_1, 32, float, 0.0f, FLOAT_TOTAL)

static RowKernel q8_kernel(int ggml_type) {
    const RowKernel avx512 = q8_kernel_avx512(ggml_type);
    if (avx512 != NULL) return avx512;
    const int avx2 = HAVE_AVX2();
    switch (ggml_type) {
        case 10: return avx2 ? q8_row_q2_k_avx2 : q8_row_q2_k_generic;
        case 11: return avx2 ? q8_row_q3_k_avx2 : q8_row_q3_k_generic;
        case 12: return avx2 ? q8_row_q4_k_avx2 : q8_row_q4_k_generic;
        case 14: return avx2 ? q8_row_q6_k_avx2 : q8_row_q6_k_generic;
        case 8: return avx2 ? q8_row_q8_0_avx2 : q8_row_q8_0_generic;
        case 2: return avx2 ? q8_row_q4_0_avx2 : q8_row_q4_0_generic;
        case 13: return avx2 ? q8_row_q5_k_avx2 : q8_row_q5_k_generic;
        case 6: return avx2 ? q8_row_q5_0_avx2 : q8_row_q5_0_generic;
        case 3: return avx2 ? q8_row_q4_1_avx2 : q8_row_q4_1_generic;
        case 7: return avx2 ? q8_row_q5_1_avx2 : q8_row_q5_1_generic;
        default: return iq_q8_kernel(ggml_type, avx2);
    }
}

static RowKernel row_kernel(int ggml_type) {
#define ROW_KERNEL_CASE(ID, NAME, ELEMS, BYTES) \
    case ID: return row_##NAME;
    switch (ggml_type) {
        DECODED_TYPES(ROW_KERNEL_CASE)
        default: return NULL;
    }
}

static int64_t rows_used(const int64_t *starts, const int64_t *rows, int64_t matrices) {
    int64_t x_rows = 0;
    for (int64_t p = 0; p < starts[matrices]; p++) x_rows = rows[p] + 1 > x_rows ? rows[p] + 1 : x_rows;
    return x_rows;
}

/* Products smaller than this many multiply-adds run on the calling thread: waking a second OpenMP pool
 * next to torch's (whose threads spin after each op) costs more than it saves. Since the F32 mat-vecs
 * run here too (torch's rarely runs in decode), 1/4 M is where a mid-size decode gained most (1 M and
 * 4 M tried: up to 20% slower on 2 threads). */
#define PARALLEL_MIN_MACS (1 << 18)
/* Threads take runs of consecutive tasks, each run 1 / (RUN_SHARE x threads) of the multiply-adds not
 * yet in a run and none under 1 / RUNS_MAX of them, taken in order as the threads come free: the
 * first runs are long, so each thread reads a few long streams of rows, not every other 32-row task
 * (whose start then finds nothing prefetched; a 2-thread wide decode token 5-8% faster than tasks
 * taken one at a time); the last are short, so a thread whose core another thread takes a while (a
 * pack reader's system call or digest) leaves the other a short run to wait for, not an equal share. */
#define RUN_SHARE 2
#define RUNS_MAX 64

/* A product ready to run: its Product, kernels and tasks (ROWS_PER_TASK output rows of one matrix each),
 * and the buffers it allocated (x's sub-block sums or its 8-bit blocks) */
typedef struct {
    Product pr;
    RowKernel kernel;
    RowKernel q8_tile; /* on 8-bit activations, for a matrix with several input rows (NULL: none) */
    F32RowsKernel f32_rows; /* row-major F32, for a matrix with several input rows (NULL: none) */
    int ggml_type;
    WideKernel wide;
    WideKernel wide_one; /* for a matrix with one input row (NULL: none) */
    TileKernel tile;
    int64_t chunks, tasks;
    void *owned;
} Plan;

/* The 8-bit blocks a type's activations take (ggml's vec_dot_type): Q8_1 for Q4_1 and Q5_1, Q8_0 for
 * Q4_0, Q5_0, Q8_0, IQ4_NL and MXFP4, Q8_K for the others */
enum { Q8_K_BLOCKS, Q8_0_BLOCKS, Q8_1_BLOCKS };
static int activation_blocks(int ggml_type) {
    if (ggml_type == 3 || ggml_type == 7) return Q8_1_BLOCKS;
    if (ggml_type == 2 || ggml_type == 6 || ggml_type == 8 || iq_q8_0_activations(ggml_type)) return Q8_0_BLOCKS;
    return Q8_K_BLOCKS;
}

/* A product's blocks of x of that kind (NULL: none) */
static void *blocks_of(const Product *pr, int kind) {
    return kind == Q8_K_BLOCKS ? (void *)pr->q8 : kind == Q8_0_BLOCKS ? (void *)pr->q8_0 : (void *)pr->q8_1;
}

/* The 8-bit blocks of x of that kind that one of `count` earlier plans on the same x rows holds, or NULL */
static void *blocks_planned(const Plan *earlier, int64_t count, int kind) {
    for (int64_t i = 0; i < count; i++) {
        void *blocks = blocks_of(&earlier[i].pr, kind);
        if (blocks != NULL) return blocks;
    }
    return NULL;
}

/* Whether x[0..count) holds a NaN or an infinity (one pass that vectorizes: no early exit) */
static int any_non_finite(const float *restrict x, int64_t count) {
    int bad = 0;
    for (int64_t j = 0; j < count; j++) bad |= !(fabsf(x[j]) <= 3.402823466e38f);
    return bad;
}

/* ggml's quantizers skip a NaN and turn it, or an infinity, into codes: the products such a block enters
 * would be finite where float arithmetic gives NaN (a damaged routed expert, an overflow), and the NaN
 * logits the sampler refuses would be finite nonsense. Each block of x holding one gets a NaN scale
 * (Q8_1 a NaN sum too); the other blocks keep ggml's bytes. */
static void mark_non_finite(int kind, const float *x, int64_t blocks, void *q8) {
    const int64_t elems = kind == Q8_K_BLOCKS ? 256 : 32;
    if (!any_non_finite(x, blocks * elems)) return;
    for (int64_t i = 0; i < blocks; i++) {
        if (!any_non_finite(x + i * elems, elems)) continue;
        if (kind == Q8_K_BLOCKS)
            ((BlockQ8K *)q8)[i].d = NAN;
        else if (kind == Q8_0_BLOCKS)
            ((BlockQ8_0 *)q8)[i].d = NAN;
        else
            ((BlockQ8_1 *)q8)[i].d = ((BlockQ8_1 *)q8)[i].s = NAN;
    }
}

/* `blocks` blocks of x of that kind into q8 (NULL: no memory), as ggml quantizes them; a block holding a
 * NaN or an infinity with a NaN scale (`mark_non_finite`) */
static void *quantized(int kind, const float *x, int64_t blocks) {
    static const size_t sizes[] = {sizeof(BlockQ8K), sizeof(BlockQ8_0), sizeof(BlockQ8_1)};
    void *q8 = malloc(sizes[kind] * (size_t)(blocks + 1));
    if (q8 == NULL) return NULL;
    if (kind == Q8_0_BLOCKS)
        quantize_q8_0(x, blocks, q8);
    else if (kind == Q8_1_BLOCKS)
        quantize_q8_1(x, blocks, q8);
#if K3_X86_SIMD
    else if (HAVE_AVX2())
        quantize_q8_k_avx2(x, blocks, q8);
#endif
    else
        quantize_q8_k(x, blocks, q8);
    mark_non_finite(kind, x, blocks, q8);
    return q8;
}

/* Plans one product (arguments as k3_grouped_product's, with the output's row stride): 0, -1 for a GGML type
 * without a kernel, -2 without memory (nothing left to free on failure). `earlier`: `planned` plans of the
 * same call on the same x rows, whose 8-bit blocks of x this one takes rather than quantizing x again. */
static int plan_product(Plan *plan, const float *x, int64_t in_features, const int64_t *addresses, int64_t matrices,
                        int64_t out_rows, int64_t row_bytes, int ggml_type, const int64_t *starts, const int64_t *rows,
                        float *out, int64_t out_stride, int q8_activations, const Plan *earlier, int64_t planned) {
    const Product pr = {x, in_features, out_rows, row_bytes, addresses, starts, rows, matrices, out, out_stride,
                        NULL, NULL, NULL, NULL};
    plan->pr = pr;
    plan->owned = NULL;
    RowKernel kernel = q8_activations ? q8_kernel(ggml_type) : fused_kernel(ggml_type);
    if (ggml_type == INPUT_MAJOR_F32) {
        if (q8_activations) return -1;
        kernel = HAVE_AVX512() ? input_major_avx512 : HAVE_AVX2() ? input_major_avx2 : input_major_generic;
    } else if (q8_activations) {
        const int kind = activation_blocks(ggml_type), elems = kind == Q8_K_BLOCKS ? 256 : 32;
        if (kernel == NULL || in_features % elems != 0) return -1;
        const int64_t blocks = rows_used(starts, rows, matrices) * (in_features / elems);
        void *q8 = blocks_planned(earlier, planned, kind);
        if (q8 == NULL && (q8 = plan->owned = quantized(kind, x, blocks)) == NULL) return -2;
        if (kind == Q8_K_BLOCKS)
            plan->pr.q8 = q8;
        else if (kind == Q8_0_BLOCKS)
            plan->pr.q8_0 = q8;
        else
            plan->pr.q8_1 = q8;
    } else if (kernel != NULL) { /* x's sub-block sums, once per call: [x rows, in / 16], 16 values in order */
        const int64_t x_rows = rows_used(starts, rows, matrices);
        float *sums16 = plan->owned = malloc(sizeof(float) * (size_t)(x_rows * (in_features / 16) + 1));
        if (sums16 == NULL) kernel = NULL;
        for (int64_t i = 0; sums16 != NULL && i < x_rows * (in_features / 16); i++) {
            float sum = 0.0f;
            for (int j = 0; j < 16; j++) sum += x[16 * i + j];
            sums16[i] = sum;
        }
        plan->pr.sums16 = sums16;
    }
    if (kernel == NULL) kernel = row_kernel(ggml_type);
    if (kernel == NULL) {
        free(plan->owned);
        return -1;
    }
    plan->kernel = kernel;
    plan->q8_tile = q8_activations ? q8_tile_kernel(ggml_type, HAVE_AVX2()) : NULL;
    plan->f32_rows = ggml_type == 0 ? f32_rows_kernel(HAVE_AVX512(), HAVE_AVX2()) : NULL;
    plan->ggml_type = ggml_type;
    plan->wide = q8_activations ? NULL : wide_kernel(ggml_type);
    plan->wide_one = q8_activations ? NULL : wide_one_kernel(ggml_type);
    /* the tiles expand 256 values at a time (the K-quants' block; F16 and BF16 rows of whole 256s) */
    const int tiles = !q8_activations && plan->pr.sums16 != NULL && in_features % 256 == 0;
    plan->tile = tiles ? tile_kernel(ggml_type) : NULL;
    plan->chunks = (out_rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    plan->tasks = matrices * plan->chunks;
    return 0;
}

/* A task's multiply-adds: its matrix's input rows times its output rows times the row's length */
static double task_macs(const Plan *plan, int64_t task) {
    const Product *pr = &plan->pr;
    const int64_t b = task / plan->chunks, first = (task % plan->chunks) * ROWS_PER_TASK;
    const int64_t rows = first + ROWS_PER_TASK < pr->out_rows ? ROWS_PER_TASK : pr->out_rows - first;
    return (double)(pr->starts[b + 1] - pr->starts[b]) * (double)rows * (double)pr->in_features;
}

/* The tasks (all the plans', in order) cut into runs of consecutive tasks, each about a share of the
 * multiply-adds left (see RUN_SHARE): run r is tasks bounds[r]..bounds[r + 1]; returns the runs (at
 * most RUNS_MAX + 1; bounds holds RUNS_MAX + 2) */
static int split_tasks(const Plan *plans, int64_t tasks, double macs, int threads, int64_t *bounds) {
    double done = 0.0, until = 0.0;
    int64_t task = 0;
    int runs = 0;
    bounds[0] = 0;
    while (task < tasks && runs < RUNS_MAX) {
        const double share = (macs - until) / (RUN_SHARE * threads);
        until += share > macs / RUNS_MAX ? share : macs / RUNS_MAX;
        for (int64_t i = 0, own = task; task < tasks && done < until; task++, own++) {
            while (own >= plans[i].tasks) own -= plans[i++].tasks;
            done += task_macs(&plans[i], own);
        }
        bounds[++runs] = task;
    }
    if (task < tasks) bounds[++runs] = tasks;
    return runs;
}

/* Rows first..last - 1 of the plan's matrix b: TILE_W at a time by `tile` for many input rows, as
 * STREAMS streams by `wide` where there is one, else by the row kernel */
static void run_rows(const Plan *plan, int64_t b, int64_t first, int64_t last) {
    const Product *pr = &plan->pr;
    if (pr->starts[b + 1] == pr->starts[b]) return;
    if (plan->q8_tile != NULL && q8_tiles_take(plan->ggml_type, pr->starts[b + 1] - pr->starts[b])) {
        plan->q8_tile(pr, b, first, last);
    } else if (plan->f32_rows != NULL && pr->starts[b + 1] - pr->starts[b] >= 2 && plan->f32_rows(pr, b, first, last) == 0) {
        /* done (without memory for its packed rows, the rows below) */
    } else if (plan->tile != NULL && pr->starts[b + 1] - pr->starts[b] >= TILE_MIN) {
        for (int64_t m = first; m < last; m += TILE_W) plan->tile(pr, b, m, last - m < TILE_W ? (int)(last - m) : TILE_W);
    } else if (plan->wide != NULL || (plan->wide_one != NULL && pr->starts[b + 1] - pr->starts[b] == 1)) {
        const WideKernel wide = plan->wide != NULL ? plan->wide : plan->wide_one;
        const int64_t stride = (last - first + STREAMS - 1) / STREAMS;
        for (int64_t m = first; m < first + stride; m++) {
            int count = 1;
            while (count < STREAMS && m + count * stride < last) count++;
            wide(pr, b, m, count, stride);
        }
    } else {
        plan->kernel(pr, b, first, last);
    }
}

/* Tasks from..to - 1 of the plans (numbered across them in order): each matrix's consecutive tasks as
 * one range of rows (a thread's streams run through all of its rows) */
static void run_tasks(const Plan *plans, int64_t from, int64_t to) {
    int64_t i = 0, own = from;
    for (int64_t task = from; task < to;) {
        while (own >= plans[i].tasks) own -= plans[i++].tasks;
        const Plan *plan = &plans[i];
        const int64_t b = own / plan->chunks, next = (b + 1) * plan->chunks;
        const int64_t end = next - own < to - task ? next : own + (to - task);
        const int64_t last = ((end - 1) % plan->chunks + 1) * ROWS_PER_TASK;
        run_rows(plan, b, (own % plan->chunks) * ROWS_PER_TASK, last < plan->pr.out_rows ? last : plan->pr.out_rows);
        task += end - own;
        own = end;
    }
}

/* Whether the expert store's pack reads are in flight in this process (`set_reads_busy`, set by its
 * readers) and whether a mat-vec region then leaves one of its threads' CPUs to them (`set_reads_yield`, on
 * unless turned off): the readers' wake-ups, their digests and the disk's interrupts otherwise preempt one
 * of the region's threads, and the region waits for its slowest (docs/real-model.md, What the reads cost
 * the compute beside them). A mat-vec (x one row: a decode's) waits on memory and loses less than a
 * thread's share with a thread fewer; products of several rows of x (a prefill's) keep every thread.
 * Each output row is computed whole by one thread: the same bits on any count. */
static int reads_busy, reads_yield = 1;

/* The threads a mat-vec region takes of the `threads` asked for: one fewer while pack reads are in flight */
static int region_threads(int threads) {
    const int busy = __atomic_load_n(&reads_busy, __ATOMIC_RELAXED);
    return threads > 1 && busy && __atomic_load_n(&reads_yield, __ATOMIC_RELAXED) ? threads - 1 : threads;
}

/* Runs the planned products' tasks in one go: on up to `threads` threads (one OpenMP region for all of
 * them) when they come to PARALLEL_MIN_MACS or more; then frees their buffers */
static void run_plans(Plan *plans, int64_t count, int threads) {
    int64_t tasks = 0;
    double macs = 0.0;
    int one_row = 1; /* every product on x's row 0 alone: mat-vecs */
    for (int64_t i = 0; i < count; i++) {
        const Product *pr = &plans[i].pr;
        tasks += plans[i].tasks;
        macs += (double)pr->starts[pr->matrices] * (double)pr->out_rows * (double)pr->in_features;
        for (int64_t p = 0; p < pr->starts[pr->matrices] && one_row; p++) one_row = pr->rows[p] == 0;
    }
    if (one_row) threads = region_threads(threads);
    if (macs < PARALLEL_MIN_MACS) threads = 1;
    if (threads <= 1) { /* no OpenMP region at all: a one-thread team between torch's resizes its pool */
        run_tasks(plans, 0, tasks);
    } else {
        int64_t bounds[RUNS_MAX + 2];
        const int runs = split_tasks(plans, tasks, macs, threads, bounds);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int run = 0; run < runs; run++) run_tasks(plans, bounds[run], bounds[run + 1]);
    }
    for (int64_t i = 0; i < count; i++) free(plans[i].owned);
}

/* Returns 0, -1 for a GGML type without a kernel, -2 without memory. Workers take ROWS_PER_TASK rows of
 * a matrix; `threads` is the most used (one below PARALLEL_MIN_MACS). `q8_activations`: quantize x as ggml
 * does for the type (Q8_K for K-quants, Q8_0 for Q4_0 and Q8_0) and take the integer kernels (types with a
 * q8_kernel). */
int k3_grouped_product(const float *x, int64_t in_features, const int64_t *addresses, int64_t matrices,
                       int64_t out_rows, int64_t row_bytes, int ggml_type, const int64_t *starts,
                       const int64_t *rows, float *out, int threads, int q8_activations) {
    Plan plan;
    const int status = plan_product(&plan, x, in_features, addresses, matrices, out_rows, row_bytes, ggml_type, starts,
                                    rows, out, out_rows, q8_activations, NULL, 0);
    if (status == 0) run_plans(&plan, 1, threads);
    return status;
}

/* The products of several matrices, each of its own GGML type and output rows, on the same `n` rows of x
 * (the projections a layer takes of one input): matrix i's outputs fill columns c_i..c_i + out_rows[i] of
 * out [n, sum of out_rows], c_i the output rows of the matrices before it; each computed as
 * k3_grouped_product computes it alone (the same results; `q8_activations` per matrix), all their tasks
 * in one OpenMP region. Returns k3_grouped_product's status. */
int k3_products(const float *x, int64_t in_features, int64_t n, int64_t matrices, const int64_t *addresses,
                const int64_t *types, const int64_t *out_rows, const int64_t *row_bytes, const int64_t *q8_activations,
                float *out, int threads) {
    int64_t width = 0, *rows = malloc(sizeof(int64_t) * (size_t)(n + 1));
    Plan *plans = calloc((size_t)(matrices + 1), sizeof(Plan)); /* zeroed: no 8-bit blocks planned yet */
    int status = rows == NULL || plans == NULL ? -2 : 0;
    for (int64_t p = 0; p < n && status == 0; p++) rows[p] = p;
    for (int64_t i = 0; i < matrices; i++) width += out_rows[i];
    const int64_t starts[2] = {0, n};
    int64_t planned = 0;
    for (int64_t column = 0; planned < matrices && status == 0; column += out_rows[planned++])
        status = plan_product(&plans[planned], x, in_features, addresses + planned, 1, out_rows[planned],
                              row_bytes[planned], (int)types[planned], starts, rows, out + column, width,
                              (int)q8_activations[planned], plans, planned);
    if (status == 0) {
        run_plans(plans, matrices, threads);
    } else {
        for (int64_t i = 0; i + 1 < planned; i++) free(plans[i].owned); /* those planned before the failure */
    }
    free(rows);
    free(plans);
    return status;
}

void k3_rms_norm(const float *x, int64_t n, int64_t width, const float *weight, float eps, float *out);
void k3_situ(const float *gate, const float *up, int64_t count, float beta, float linear_beta, float *out);
void k3_route(const float *logits, const float *bias, int64_t n, int64_t experts, int64_t k, int normalize,
              float min_sum, float scale, float *probs, int64_t *chosen, float *weights);

/* k3_situ over `count` values in chunks on up to `threads` threads when there are enough of them (a
 * prefill's: 1,024 pairs of 512 values take ~1.5 ms on one core); elementwise, so the same values */
#define SITU_CHUNK 16384
static void situ_on_threads(const float *gate, const float *up, int64_t count, float beta, float linear_beta,
                            float *out, int threads) {
    const int64_t chunks = (count + SITU_CHUNK - 1) / SITU_CHUNK;
    if (threads <= 1 || chunks < 4) {
        k3_situ(gate, up, count, beta, linear_beta, out);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int64_t start = chunk * SITU_CHUNK, n = count - start < SITU_CHUNK ? count - start : SITU_CHUNK;
        k3_situ(gate + start, up + start, n, beta, linear_beta, out + start);
    }
}

int k3_expert_mlp(const float *x, int64_t in_features, Role gate, Role up, Role down, int64_t experts,
                  const int64_t *starts, const int64_t *rows, float beta, float linear_beta, float *out, int threads,
                  int q8_activations) {
    const int64_t pairs = starts[experts], hidden = gate.out_rows;
    float *gated = malloc(sizeof(float) * (size_t)(2 * pairs * hidden + 1));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(pairs + 1));
    int status = gated == NULL || order == NULL ? -2 : 0;
    float *upped = gated + pairs * hidden;
    Plan plans[2]; /* gate and up in one OpenMP region */
    if (status == 0)
        status = plan_product(&plans[0], x, in_features, gate.addresses, experts, hidden, gate.row_bytes,
                              gate.ggml_type, starts, rows, gated, hidden, q8_activations, NULL, 0);
    if (status == 0) {
        status = plan_product(&plans[1], x, in_features, up.addresses, experts, hidden, up.row_bytes, up.ggml_type,
                              starts, rows, upped, hidden, q8_activations, plans, 1);
        if (status == 0)
            run_plans(plans, 2, threads);
        else
            free(plans[0].owned);
    }
    if (status == 0) {
        situ_on_threads(gated, upped, pairs * hidden, beta, linear_beta, gated, threads);
        for (int64_t p = 0; p < pairs; p++) order[p] = p;
        status = k3_grouped_product(gated, hidden, down.addresses, experts, down.out_rows, down.row_bytes,
                                    down.ggml_type, starts, order, out, threads, q8_activations);
    }
    free(gated);
    free(order);
    return status;
}

int k3_decode_row(int ggml_type, const uint8_t *blocks, int64_t values, float *out) {
    const BlockDecoder decoder = block_decoder(ggml_type);
    if (decoder.decode == NULL || values % decoder.elems != 0) return -1;
    for (int64_t block = 0; block < values / decoder.elems; block++)
        decoder.decode(blocks + block * decoder.bytes, out + block * decoder.elems);
    return 0;
}

const char *k3_isa(void) { return HAVE_AVX512() ? "avx512" : HAVE_AVX2() ? "avx2" : "portable"; }

/* ---- the extension module: Python's calls onto the entry points above and steps_cpu.c's --------- */
#ifndef K3STREAM_WITHOUT_PYTHON

/* Arguments of the fast calls: `kinds` has one letter per argument, 'i' an int (into ints), 'f' a float
 * (into floats), 'l' a list of ints (its index into lists); -1 with a one-line TypeError. */
static int parse_args(const char *name, PyObject *const *args, Py_ssize_t nargs, const char *kinds, int64_t *ints,
                      double *floats, PyObject **lists) {
    if (nargs != (Py_ssize_t)strlen(kinds)) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments, got %d", name, (int)strlen(kinds), (int)nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (kinds[i] == 'l') {
            if (!PyList_Check(args[i])) {
                PyErr_Format(PyExc_TypeError, "%s: argument %d must be a list of addresses", name, (int)i + 1);
                return -1;
            }
            *lists++ = args[i];
        } else if (kinds[i] == 'f') {
            *floats++ = PyFloat_AsDouble(args[i]);
        } else {
            *ints++ = PyLong_AsLongLong(args[i]);
        }
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* The addresses in a Python list of ints: into `local` (16) or a new array (free it when it is not
 * `local`); NULL with an exception set. */
static int64_t *addresses_of(PyObject *list, int64_t *local) {
    const Py_ssize_t count = PyList_GET_SIZE(list);
    int64_t *addresses = count <= 16 ? local : malloc(sizeof(int64_t) * (size_t)count);
    if (addresses == NULL) return (int64_t *)PyErr_NoMemory();
    for (Py_ssize_t b = 0; b < count && !PyErr_Occurred(); b++) addresses[b] = PyLong_AsLongLong(PyList_GET_ITEM(list, b));
    if (PyErr_Occurred()) {
        if (addresses != local) free(addresses);
        return NULL;
    }
    return addresses;
}

/* The arguments of a fast call with several lists of addresses of one length (`count` of them, the 'l's
 * of `kinds`), each taken as `addresses_of` takes one */
#define MAX_LISTS 5
typedef struct {
    int64_t local[MAX_LISTS][16];
    int64_t *numbers[MAX_LISTS];
    int count;
    Py_ssize_t length;
} AddressLists;

static void free_lists(AddressLists *taken) {
    for (int i = 0; i < taken->count; i++)
        if (taken->numbers[i] != NULL && taken->numbers[i] != taken->local[i]) free(taken->numbers[i]);
}

/* parse_args, then the lists into `taken`; -1 with a one-line exception (lists of different lengths
 * name the call) and nothing left to free, else free_lists(taken) after the call */
static int parse_with_lists(const char *name, PyObject *const *args, Py_ssize_t nargs, const char *kinds,
                            int64_t *ints, double *floats, AddressLists *taken) {
    PyObject *lists[MAX_LISTS];
    taken->count = 0;
    for (const char *kind = kinds; *kind; kind++) taken->count += *kind == 'l';
    if (taken->count > MAX_LISTS || parse_args(name, args, nargs, kinds, ints, floats, lists) != 0) return -1;
    for (int i = 0; i < taken->count; i++) taken->numbers[i] = NULL;
    taken->length = PyList_GET_SIZE(lists[0]);
    int status = 0;
    for (int i = 1; i < taken->count && status == 0; i++)
        if (PyList_GET_SIZE(lists[i]) != taken->length) {
            PyErr_Format(PyExc_TypeError, "%s: its address lists differ in length", name);
            status = -1;
        }
    for (int i = 0; i < taken->count && status == 0; i++)
        status = (taken->numbers[i] = addresses_of(lists[i], taken->local[i])) == NULL ? -1 : 0;
    if (status != 0) free_lists(taken);
    return status;
}

/* grouped_product(x, in_features, [addresses], out_rows, row_bytes, ggml_type, starts, rows, out,
 * threads, q8_activations) -> k3_grouped_product's status; pointers as ints. The one hot call (about
 * 130 per decoded token) is a METH_FASTCALL function: a call with next to no work costs 0.5-0.7 us
 * here, 2.8-3.8 us through ctypes (measured). The computation runs without the GIL, as under ctypes. */
static PyObject *py_grouped_product(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[10], local[16];
    PyObject *list;
    if (parse_args("grouped_product", args, nargs, "iiliiiiiiii", v, NULL, &list) != 0) return NULL;
    int64_t *addresses = addresses_of(list, local);
    if (addresses == NULL) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = k3_grouped_product((const float *)(uintptr_t)v[0], v[1], addresses, PyList_GET_SIZE(list), v[2], v[3],
                                (int)v[4], (const int64_t *)(uintptr_t)v[5], (const int64_t *)(uintptr_t)v[6],
                                (float *)(uintptr_t)v[7], (int)v[8], (int)v[9]);
    Py_END_ALLOW_THREADS
    if (addresses != local) free(addresses);
    return PyLong_FromLong(status);
}

/* products(x, in_features, n, [addresses], [types], [out_rows], [row_bytes], [q8_activations], out, threads)
 * -> k3_products' status; without the GIL. */
static PyObject *py_products(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[5];
    AddressLists taken;
    if (parse_with_lists("products", args, nargs, "iiilllllii", v, NULL, &taken) != 0) return NULL;
    int status;
    int64_t **numbers = taken.numbers;
    Py_BEGIN_ALLOW_THREADS
    status = k3_products((const float *)(uintptr_t)v[0], v[1], v[2], taken.length, numbers[0],
                         numbers[1], numbers[2], numbers[3], numbers[4], (float *)(uintptr_t)v[3], (int)v[4]);
    Py_END_ALLOW_THREADS
    free_lists(&taken);
    return PyLong_FromLong(status);
}

/* expert_mlp(x, in_features, [gate addresses], gate_type, gate_row_bytes, [up addresses], up_type,
 * up_row_bytes, [down addresses], down_type, down_row_bytes, hidden, out_features, starts, rows,
 * beta, linear_beta, out, threads, q8_activations) -> k3_expert_mlp's status; without the GIL. */
static PyObject *py_expert_mlp(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[15];
    double betas[2];
    AddressLists taken;
    if (parse_with_lists("expert_mlp", args, nargs, "iiliiliiliiiiiiffiii", v, betas, &taken) != 0) return NULL;
    int status;
    const Role gate = {taken.numbers[0], (int)v[2], v[8], v[3]}, up = {taken.numbers[1], (int)v[4], v[8], v[5]};
    const Role down = {taken.numbers[2], (int)v[6], v[9], v[7]};
    Py_BEGIN_ALLOW_THREADS
    status = k3_expert_mlp((const float *)(uintptr_t)v[0], v[1], gate, up, down, taken.length,
                           (const int64_t *)(uintptr_t)v[10], (const int64_t *)(uintptr_t)v[11], (float)betas[0],
                           (float)betas[1], (float *)(uintptr_t)v[12], (int)v[13], (int)v[14]);
    Py_END_ALLOW_THREADS
    free_lists(&taken);
    return PyLong_FromLong(status);
}

/* The bound one-row expert calls' arguments, v[0..] after their own: x, in_features, index, k, then gate,
 * up and down each as (base, stride, ggml_type, row_bytes), hidden, out_features, (beta, linear_beta in
 * betas), out, threads, q8_activations. */
#define MAX_CHOSEN 256
enum { ROLE_ARGS = 4, FIRST_ROLE = 4, HIDDEN = FIRST_ROLE + 3 * ROLE_ARGS };

/* k3_expert_mlp of one row x through k experts, each one pair in the order of choice, role r's matrix of
 * the j-th at base_r + index[j] * stride_r (v: the arguments above); call without the GIL. */
static int indexed_experts(const int64_t *v, const double *betas) {
    const int64_t *index = (const int64_t *)(uintptr_t)v[2], k = v[3];
    int64_t addresses[3][MAX_CHOSEN], starts[MAX_CHOSEN + 1], rows[MAX_CHOSEN];
    for (int64_t j = 0; j < k; j++) {
        for (int r = 0; r < 3; r++)
            addresses[r][j] = v[FIRST_ROLE + ROLE_ARGS * r] + index[j] * v[FIRST_ROLE + ROLE_ARGS * r + 1];
        starts[j] = j, rows[j] = 0;
    }
    starts[k] = k;
    Role roles[3];
    for (int r = 0; r < 3; r++) {
        const int64_t *role = v + FIRST_ROLE + ROLE_ARGS * r;
        roles[r] = (Role){addresses[r], (int)role[2], v[HIDDEN + (r == 2)], role[3]};
    }
    return k3_expert_mlp((const float *)(uintptr_t)v[0], v[1], roles[0], roles[1], roles[2], k, starts, rows,
                         (float)betas[0], (float)betas[1], (float *)(uintptr_t)v[HIDDEN + 2], (int)v[HIDDEN + 3],
                         (int)v[HIDDEN + 4]);
}

/* 0, or -1 with a one-line ValueError where k is not 1..MAX_CHOSEN */
static int chosen_count(const char *name, int64_t k) {
    if (k >= 1 && k <= MAX_CHOSEN) return 0;
    PyErr_Format(PyExc_ValueError, "%s: %lld experts, not 1..%d", name, (long long)k, MAX_CHOSEN);
    return -1;
}

/* chosen_experts(x, in_features, chosen, k, experts, then gate, up and down each as (base, bytes per
 * expert, ggml_type, row_bytes), hidden, out_features, beta, linear_beta, out, threads, q8_activations)
 * -> k3_expert_mlp's status: one row x through the k experts chosen[0..k) picked, whose matrices of a role
 * lie at base + expert * bytes per expert (a layer's experts all in RAM), each one pair in the order of
 * choice. Without the GIL. */
static PyObject *py_chosen_experts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[22], taken[21];
    double betas[2];
    if (parse_args("chosen_experts", args, nargs, "iiiiiiiiiiiiiiiiiiiffiii", v, betas, NULL) != 0) return NULL;
    const int64_t *chosen = (const int64_t *)(uintptr_t)v[2], k = v[3], count = v[4];
    if (chosen_count("chosen_experts", k) != 0) return NULL;
    for (int64_t j = 0; j < k; j++)
        if (chosen[j] < 0 || chosen[j] >= count) {
            PyErr_Format(PyExc_ValueError, "chosen_experts: expert %lld outside 0..%lld", (long long)chosen[j],
                         (long long)count - 1);
            return NULL;
        }
    memcpy(taken, v, sizeof(int64_t) * 4); /* all but `experts` */
    memcpy(taken + 4, v + 5, sizeof(int64_t) * 17);
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = indexed_experts(taken, betas);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

void k3_combine(const float *pairs, const float *weights, int64_t n, int64_t k, int64_t width, float *out);

/* experts_at(x, in_features, objects, k, then gate, up and down each as (offset, ggml_type, row_bytes),
 * hidden, out_features, beta, linear_beta, pairs, weights, out, threads, q8_activations) -> k3_expert_mlp's
 * status: one row x through k experts, each one pair in order into pairs [k, out_features], the j-th's
 * matrix of a role at objects[j] + the role's offset (experts each in an object of its own: a store's,
 * kept in place by the caller through the call), then their sum by weights [k] (k3_combine) into out
 * [out_features]. objects[0] == 0 (no object is at address 0): nothing to compute (the caller computed
 * the step another way). Without the GIL. */
static PyObject *py_experts_at(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[20], taken[21];
    double betas[2];
    if (parse_args("experts_at", args, nargs, "iiiiiiiiiiiiiiiffiiiii", v, betas, NULL) != 0) return NULL;
    if (chosen_count("experts_at", v[3]) != 0) return NULL;
    if (((const int64_t *)(uintptr_t)v[2])[0] == 0) return PyLong_FromLong(0);
    memcpy(taken, v, sizeof(int64_t) * 4);
    for (int r = 0; r < 3; r++) {
        int64_t *role = taken + FIRST_ROLE + ROLE_ARGS * r;
        role[0] = v[4 + 3 * r], role[1] = 1, role[2] = v[5 + 3 * r], role[3] = v[6 + 3 * r];
    }
    memcpy(taken + HIDDEN, v + 13, sizeof(int64_t) * 3); /* hidden, out_features, pairs */
    taken[HIDDEN + 3] = v[18], taken[HIDDEN + 4] = v[19];
    const float *pairs = (const float *)(uintptr_t)v[15], *weights = (const float *)(uintptr_t)v[16];
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = indexed_experts(taken, betas);
    if (status == 0) k3_combine(pairs, weights, 1, v[3], v[14], (float *)(uintptr_t)v[17]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

/* rms_norm(x, rows, width, weight or 0, eps, out) and situ(gate, up, count, beta, linear_beta, out,
 * threads): k3_rms_norm and k3_situ (situ_on_threads) on float32 buffers (pointers as ints), with the
 * GIL held. */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[5];
    double eps;
    if (parse_args("rms_norm", args, nargs, "iiiifi", v, &eps, NULL) != 0) return NULL;
    k3_rms_norm((const float *)(uintptr_t)v[0], v[1], v[2], (const float *)(uintptr_t)v[3], (float)eps,
                (float *)(uintptr_t)v[4]);
    Py_RETURN_NONE;
}

static PyObject *py_situ(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[5];
    double betas[2];
    if (parse_args("situ", args, nargs, "iiiffii", v, betas, NULL) != 0) return NULL;
    situ_on_threads((const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], v[2], (float)betas[0],
                    (float)betas[1], (float *)(uintptr_t)v[3], (int)v[4]);
    Py_RETURN_NONE;
}

/* route(logits, bias, rows, experts, k, normalize, min_sum, scale, chosen, weights): k3_route on
 * float32/int64 buffers (pointers as ints), with the GIL held; a k outside 1..experts is a ValueError. */
static PyObject *py_route(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[8];
    double floats[2];
    if (parse_args("route", args, nargs, "iiiiiiffii", v, floats, NULL) != 0) return NULL;
    if (v[4] < 1 || v[4] > v[3]) {
        PyErr_Format(PyExc_ValueError, "route: top-k %lld outside 1..%lld experts", (long long)v[4], (long long)v[3]);
        return NULL;
    }
    float *probs = malloc(sizeof(float) * (size_t)v[3]);
    if (probs == NULL) return PyErr_NoMemory();
    k3_route((const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], v[2], v[3], v[4], (int)v[5],
             (float)floats[0], (float)floats[1], probs, (int64_t *)(uintptr_t)v[6], (float *)(uintptr_t)v[7]);
    free(probs);
    Py_RETURN_NONE;
}

int k3_kda_recurrent(const float *proj, float *const *histories, const float *conv_w, int64_t taps, const float *f,
                     const float *dt_bias, const float *ssm_a, int has_bound, float bound, const float *b_logits,
                     float *const *states, const float *g_logits, const float *o_norm, int64_t batch, int64_t tokens,
                     int64_t heads, int64_t dim, float eps, float scale, float *out, int threads);
int k3_residual_mix(const float *const *rows, int64_t count, int64_t n, int64_t width, const float *score, float eps,
                    float *out, int threads);

/* kda_recurrent(qkv, [histories], conv, taps, f, dt_bias, ssm_a, has_bound, bound, b_logits, [states],
 * g_logits, o_norm, tokens, heads, dim, eps, scale, out, threads) -> k3_kda_recurrent's status, one history
 * and state per sequence of `tokens` rows; without the GIL. */
static PyObject *py_kda_recurrent(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[15];
    double floats[3];
    AddressLists taken;
    if (parse_with_lists("kda_recurrent", args, nargs, "iliiiiiifiliiiiiffii", v, floats, &taken) != 0) return NULL;
    int status;
    float *const *histories = (float *const *)taken.numbers[0], *const *states = (float *const *)taken.numbers[1];
    Py_BEGIN_ALLOW_THREADS
    status = k3_kda_recurrent((const float *)(uintptr_t)v[0], histories, (const float *)(uintptr_t)v[1], v[2],
                              (const float *)(uintptr_t)v[3], (const float *)(uintptr_t)v[4],
                              (const float *)(uintptr_t)v[5], (int)v[6], (float)floats[0],
                              (const float *)(uintptr_t)v[7], states, (const float *)(uintptr_t)v[8],
                              (const float *)(uintptr_t)v[9], taken.length, v[10], v[11], v[12], (float)floats[1],
                              (float)floats[2], (float *)(uintptr_t)v[13], (int)v[14]);
    Py_END_ALLOW_THREADS
    free_lists(&taken);
    return PyLong_FromLong(status);
}

/* residual_mix([rows], n, width, score, eps, out, threads) -> k3_residual_mix's status; with the GIL held. */
static PyObject *py_residual_mix(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[5], local[16];
    double eps;
    PyObject *list;
    if (parse_args("residual_mix", args, nargs, "liiifii", v, &eps, &list) != 0) return NULL;
    int64_t *rows = addresses_of(list, local);
    if (rows == NULL) return NULL;
    const int status = k3_residual_mix((const float *const *)rows, PyList_GET_SIZE(list), v[0], v[1],
                                       (const float *)(uintptr_t)v[2], (float)eps, (float *)(uintptr_t)v[3], (int)v[4]);
    if (rows != local) free(rows);
    return PyLong_FromLong(status);
}

void k3_add(const float *a, const float *b, int64_t n, float *out);
void k3_combine(const float *pairs, const float *weights, int64_t n, int64_t k, int64_t width, float *out);

/* name(a, b, n, out): an elementwise step over n values of two float32 buffers (pointers as ints), with
 * the GIL held: add (k3_add) and sigmoid_gate (k3_sigmoid_gate) */
typedef void (*Elementwise)(const float *, const float *, int64_t, float *);

static PyObject *elementwise(const char *name, Elementwise step, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[4];
    if (parse_args(name, args, nargs, "iiii", v, NULL, NULL) != 0) return NULL;
    step((const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], v[2], (float *)(uintptr_t)v[3]);
    Py_RETURN_NONE;
}

static PyObject *py_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return elementwise("add", k3_add, args, nargs);
}

/* combine(pairs, weights, rows, k, width, out): k3_combine on float32 buffers (pointers as ints), with
 * the GIL held. */
static PyObject *py_combine(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[6];
    if (parse_args("combine", args, nargs, "iiiiii", v, NULL, NULL) != 0) return NULL;
    k3_combine((const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], v[2], v[3], v[4],
               (float *)(uintptr_t)v[5]);
    Py_RETURN_NONE;
}

/* decode_row(ggml_type, address, values, out): the first `values` values (whole blocks) of the GGUF
 * bytes at `address` into float32 `out` (pointers as ints; the embedding of a decode token), the
 * reference dequantizer's values; -1 for a type without a decoder or values not in whole blocks. */
static PyObject *py_decode_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[4];
    if (parse_args("decode_row", args, nargs, "iiii", v, NULL, NULL) != 0) return NULL;
    return PyLong_FromLong(k3_decode_row((int)v[0], (const uint8_t *)(uintptr_t)v[1], v[2], (float *)(uintptr_t)v[3]));
}

void k3_sigmoid_gate(const float *values, const float *logits, int64_t n, float *out);
void k3_copy(const float *src, int64_t src_stride, float *dst, int64_t dst_stride, int64_t rows, int64_t cols);

static PyObject *py_sigmoid_gate(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return elementwise("sigmoid_gate", k3_sigmoid_gate, args, nargs);
}

/* copy(src, src_stride, dst, dst_stride, rows, cols): k3_copy on float32 buffers (pointers as ints),
 * with the GIL held. */
static PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[6];
    if (parse_args("copy", args, nargs, "iiiiii", v, NULL, NULL) != 0) return NULL;
    k3_copy((const float *)(uintptr_t)v[0], v[1], (float *)(uintptr_t)v[2], v[3], v[4], v[5]);
    Py_RETURN_NONE;
}

int64_t k3_mla_scratch(int64_t length, int64_t heads, int64_t kv, int threads);
int64_t k3_mla_ggml_scratch(int64_t length, int64_t kv, int threads);
void k3_mla_attend(const float *query, const float *cache, int64_t length, int64_t heads, int64_t width, int64_t kv,
                   float scale, float *scratch, float *out, int threads);
void k3_mla_attend_ggml(const float *query, const float *cache, int64_t length, int64_t heads, int64_t width,
                        int64_t kv, float scale, float *scratch, float *out, int threads);

/* mla_attend(query, cache, length, heads, width, kv, scale, out, threads, ggml_order): k3_mla_attend
 * (k3_mla_attend_ggml where ggml_order is not 0) on float32 buffers (pointers as ints), without the GIL;
 * -2 without memory. */
static PyObject *py_mla_attend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[9];
    double scale;
    if (parse_args("mla_attend", args, nargs, "iiiiiifiii", v, &scale, NULL) != 0) return NULL;
    const int threads = v[7] < 1 ? 1 : (int)v[7];
    const int64_t floats = v[8] ? k3_mla_ggml_scratch(v[2], v[5], threads) : k3_mla_scratch(v[2], v[3], v[5], threads);
    float *scratch = malloc(sizeof(float) * (size_t)floats);
    if (scratch == NULL) return PyLong_FromLong(-2);
    Py_BEGIN_ALLOW_THREADS
    (v[8] ? k3_mla_attend_ggml : k3_mla_attend)((const float *)(uintptr_t)v[0], (const float *)(uintptr_t)v[1], v[2],
                                                v[3], v[4], v[5], (float)scale, scratch, (float *)(uintptr_t)v[6],
                                                threads);
    Py_END_ALLOW_THREADS
    free(scratch);
    return PyLong_FromLong(0);
}

void k3_mla_attend_rows(const float *queries, const float *cache, int64_t offset, int64_t n, int64_t heads,
                        int64_t width, int64_t kv, float scale, float *scratch, float *out, int threads);
void k3_mla_attend_rows_ggml(const float *queries, const float *cache, int64_t offset, int64_t n, int64_t heads,
                             int64_t width, int64_t kv, float scale, float *scratch, float *out, int threads);

/* mla_attend_rows(queries, cache, offset, n, heads, width, kv, scale, out, threads, ggml_order):
 * k3_mla_attend_rows (k3_mla_attend_rows_ggml where ggml_order is not 0) on float32 buffers (pointers as
 * ints), without the GIL; -2 without memory. */
static PyObject *py_mla_attend_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[10];
    double scale;
    if (parse_args("mla_attend_rows", args, nargs, "iiiiiiifiii", v, &scale, NULL) != 0) return NULL;
    const int threads = v[8] < 1 ? 1 : (int)v[8];
    const int64_t length = v[2] + v[3];
    const int64_t floats = v[9] ? k3_mla_ggml_scratch(length, v[6], threads) : k3_mla_scratch(length, v[4], v[6], threads);
    float *scratch = malloc(sizeof(float) * (size_t)floats);
    if (scratch == NULL) return PyLong_FromLong(-2);
    Py_BEGIN_ALLOW_THREADS
    (v[9] ? k3_mla_attend_rows_ggml : k3_mla_attend_rows)((const float *)(uintptr_t)v[0],
                                                          (const float *)(uintptr_t)v[1], v[2], v[3], v[4], v[5],
                                                          v[6], (float)scale, scratch, (float *)(uintptr_t)v[7],
                                                          threads);
    Py_END_ALLOW_THREADS
    free(scratch);
    return PyLong_FromLong(0);
}

/* Reads `length` bytes at `offset` of `descriptor` into `to`: 0, -1 if the file ends first, else errno */
static int read_part(int descriptor, int64_t offset, int64_t length, uint8_t *to) {
    int64_t done = 0;
    while (done < length) {
        const ssize_t got = pread(descriptor, to + done, (size_t)(length - done), (off_t)(offset + done));
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return got < 0 ? errno : -1;
        done += got;
    }
    return 0;
}

/* Parts of at least this many bytes in all are read on `threads` threads at once (copies out of the
 * page cache scale with the threads; a small step is not worth waking them) */
#define PARALLEL_MIN_READ (1 << 20)

/* read_parts([descriptors], [offsets], [lengths], address, threads) -> how many parts were read whole:
 * part i's `lengths[i]` bytes at `offsets[i]` of `descriptors[i]`, one after another from `address` (the
 * caller's buffer). Fewer than all: that part ends early (the file shrank); a failed read raises
 * OSError. One call for the 8-16 experts' 3 matrices of a decode step, without the GIL (each part
 * through Python's os.preadv cost about four times its read). */
static PyObject *py_read_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int64_t v[2];
    PyObject *lists[3];
    if (parse_args("read_parts", args, nargs, "lllii", v, NULL, lists) != 0) return NULL;
    const Py_ssize_t parts = PyList_GET_SIZE(lists[0]);
    if (PyList_GET_SIZE(lists[1]) != parts || PyList_GET_SIZE(lists[2]) != parts) {
        PyErr_SetString(PyExc_TypeError, "read_parts: the descriptor, offset and length lists differ in length");
        return NULL;
    }
    /* descriptors, offsets, lengths, then where each part starts in the buffer and its outcome */
    int64_t *numbers = malloc(sizeof(int64_t) * (size_t)(5 * parts + 1));
    if (numbers == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < 3 * parts && !PyErr_Occurred(); i++)
        numbers[i] = PyLong_AsLongLong(PyList_GET_ITEM(lists[i / parts], i % parts));
    if (PyErr_Occurred()) {
        free(numbers);
        return NULL;
    }
    int64_t *starts = numbers + 3 * parts, *outcomes = numbers + 4 * parts, total = 0;
    for (Py_ssize_t i = 0; i < parts; i++) {
        starts[i] = total;
        total += numbers[2 * parts + i];
    }
    uint8_t *to = (uint8_t *)(uintptr_t)v[0];
    const int threads = total >= PARALLEL_MIN_READ ? (int)v[1] : 1;
    Py_BEGIN_ALLOW_THREADS
    if (threads <= 1) { /* in order, stopping at the first part that fails */
        for (Py_ssize_t i = 0; i < parts; i++)
            if ((outcomes[i] = read_part((int)numbers[i], numbers[parts + i], numbers[2 * parts + i], to + starts[i])) != 0)
                break;
    } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (Py_ssize_t i = 0; i < parts; i++)
            outcomes[i] = read_part((int)numbers[i], numbers[parts + i], numbers[2 * parts + i], to + starts[i]);
    }
    Py_END_ALLOW_THREADS
    Py_ssize_t whole = 0;
    while (whole < parts && outcomes[whole] == 0) whole++;
    const int error = whole < parts ? (int)outcomes[whole] : 0;
    free(numbers);
    if (error > 0) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(whole);
}

/* set_iq_grids(iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, iq4nl, mxfp4): k3_set_iq_grids of eight bytes objects;
 * a ValueError naming the first of the wrong size */
static PyObject *py_set_iq_grids(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer views[IQ_TABLES];
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*", &views[0], &views[1], &views[2], &views[3], &views[4],
                          &views[5], &views[6], &views[7]))
        return NULL;
    const void *tables[IQ_TABLES];
    int64_t bytes[IQ_TABLES], expected = 0;
    for (int i = 0; i < IQ_TABLES; i++) tables[i] = views[i].buf, bytes[i] = views[i].len;
    const int wrong = k3_set_iq_grids(tables, bytes, &expected);
    for (int i = 0; i < IQ_TABLES; i++) PyBuffer_Release(&views[i]);
    if (wrong >= 0)
        return PyErr_Format(PyExc_ValueError, "set_iq_grids: grid %d has %lld bytes, expected %lld", wrong,
                            (long long)bytes[wrong], (long long)expected);
    Py_RETURN_NONE;
}

/* The instruction set the integer kernels take now: "avx512", "avx2" or "portable" (the environment's
 * K3STREAM_NO_AVX512 and K3STREAM_GENERIC_KERNELS included) */
static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(k3_isa());
}

/* The calling thread's idle OpenMP workers ended (OpenMP 5's omp_pause_resource_all, soft): True where
 * the runtime did, False where it cannot (a runtime without it; looked up when called, so an older one
 * still loads the extension). libgomp spins an idle worker only while the threads of every team
 * together fit the CPUs, and a thread's team lives as long as the thread: a thread that ran kernels once
 * and hands them to another leaves its workers counted beside the new team's. */
static PyObject *py_release_openmp_workers(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    int (*pause_all)(int) = (int (*)(int))dlsym(RTLD_DEFAULT, "omp_pause_resource_all");
    if (pause_all != NULL && pause_all(1 /* omp_pause_soft */) == 0) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

/* Whether the kernels were built with OpenMP (else, by a compiler without it, they run on one thread) */
static PyObject *py_openmp(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

/* set_reads_busy(flag), set_reads_yield(flag): see `region_threads` */
static PyObject *py_set_reads_busy(PyObject *self, PyObject *flag) {
    (void)self;
    __atomic_store_n(&reads_busy, PyObject_IsTrue(flag), __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyObject *py_set_reads_yield(PyObject *self, PyObject *flag) {
    (void)self;
    __atomic_store_n(&reads_yield, PyObject_IsTrue(flag), __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* region_threads(threads) -> the threads a mat-vec region takes now */
static PyObject *py_region_threads(PyObject *self, PyObject *threads) {
    (void)self;
    const long asked = PyLong_AsLong(threads);
    if (asked == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(region_threads((int)asked));
}

static PyMethodDef methods[] = {
    {"set_reads_busy", py_set_reads_busy, METH_O, NULL},
    {"set_reads_yield", py_set_reads_yield, METH_O, NULL},
    {"region_threads", py_region_threads, METH_O, NULL},
    {"openmp", py_openmp, METH_NOARGS, NULL},
    {"release_openmp_workers", py_release_openmp_workers, METH_NOARGS, NULL},
    {"set_iq_grids", py_set_iq_grids, METH_VARARGS, NULL},
    {"isa", py_isa, METH_NOARGS, NULL},
    {"grouped_product", (PyCFunction)(void (*)(void))py_grouped_product, METH_FASTCALL, NULL},
    {"products", (PyCFunction)(void (*)(void))py_products, METH_FASTCALL, NULL},
    {"expert_mlp", (PyCFunction)(void (*)(void))py_expert_mlp, METH_FASTCALL, NULL},
    {"chosen_experts", (PyCFunction)(void (*)(void))py_chosen_experts, METH_FASTCALL, NULL},
    {"experts_at", (PyCFunction)(void (*)(void))py_experts_at, METH_FASTCALL, NULL},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, NULL},
    {"situ", (PyCFunction)(void (*)(void))py_situ, METH_FASTCALL, NULL},
    {"read_parts", (PyCFunction)(void (*)(void))py_read_parts, METH_FASTCALL, NULL},
    {"route", (PyCFunction)(void (*)(void))py_route, METH_FASTCALL, NULL},
    {"kda_recurrent", (PyCFunction)(void (*)(void))py_kda_recurrent, METH_FASTCALL, NULL},
    {"residual_mix", (PyCFunction)(void (*)(void))py_residual_mix, METH_FASTCALL, NULL},
    {"add", (PyCFunction)(void (*)(void))py_add, METH_FASTCALL, NULL},
    {"combine", (PyCFunction)(void (*)(void))py_combine, METH_FASTCALL, NULL},
    {"mla_attend", (PyCFunction)(void (*)(void))py_mla_attend, METH_FASTCALL, NULL},
    {"mla_attend_rows", (PyCFunction)(void (*)(void))py_mla_attend_rows, METH_FASTCALL, NULL},
    {"sigmoid_gate", (PyCFunction)(void (*)(void))py_sigmoid_gate, METH_FASTCALL, NULL},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL, NULL},
    {"decode_row", (PyCFunction)(void (*)(void))py_decode_row, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

/* Python finds the library through this module: the products, the expert MLP, the per-token steps
 * (steps_cpu.c's too) and the batched reads of experts' bytes are its methods. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ggml_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ggml_cpu(void) { return PyModule_Create(&module); }
#endif
