/* ggml's integer dot products of the i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
 * IQ4_NL, IQ4_XS), the ternary types (TQ1_0, TQ2_0) and MXFP4 on 8-bit activations: Q8_K blocks for the
 * 256-value types, Q8_0 for IQ4_NL and MXFP4 (ggml's vec_dot_type of each).
 *
 * Each block's integer sums are exact, so only the float operations decide the bits:
 * - the portable kernels (`*_generic`) do ggml's generic C (ggml_vec_dot_*_generic) in its order: one
 *   float sum over the blocks, d * (integer sum) added per block (per 32 values for IQ4_XS);
 * - the AVX2 kernels do ggml's AVX2 ones: a block's integer sums in eight lanes (lane l: values 4l..4l+3
 *   of each run of 32, times the run's scale), d times the lanes added into eight float lanes by FMA,
 *   summed at the end as hsum_float_8 does;
 * - the AVX-512 kernels of IQ4_NL, MXFP4, IQ4_XS, TQ2_0 and TQ1_0 (where HAVE_AVX512()) form the AVX2
 *   kernels' lanes with VNNI (two runs a 512-bit vector but the ternary types') and take the same float
 *   operations: the same bits. (The grid types' AVX-512 kernels, `iquants_avx512.c`, keep their own
 *   float order.)
 * The lookup grids are not written here: `k3_set_iq_grids` receives them from the `gguf` package at import.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* ---- the grids (filled once by k3_set_iq_grids) ----------------------------------------------------- */

static uint8_t iq2xxs_grid[256][8], iq2xs_grid[512][8], iq2s_grid[1024][8];
static uint8_t iq3xxs_grid[256][4], iq3s_grid[512][4];
static int8_t iq1s_grid[2048][8], iq4nl_values[16], mxfp4_values[16];
static float ue4m3_halves[256]; /* NVFP4's scales by byte (`ue4m3_half`), set with the grids */
static uint8_t ksigns[128];     /* 7 sign bits, the eighth their parity (ggml's ksigns_iq2xs) */
static uint64_t sign_bytes[256]; /* bit j of the index set: byte j is -1, else +1 (for _mm256_sign_epi8) */
static uint64_t even_signs[128]; /* sign_bytes of ksigns */
/* the grids as floats and each sign byte as lane masks, for the float decoders' 8-lane loads */
static float iq2xxs_floats[256][8] __attribute__((aligned(32))), iq2xs_floats[512][8] __attribute__((aligned(32)));
static float iq2s_floats[1024][8] __attribute__((aligned(32))), iq1s_floats[2048][8] __attribute__((aligned(32)));
static float iq3xxs_floats[256][4] __attribute__((aligned(16))), iq3s_floats[512][4] __attribute__((aligned(16)));
static uint32_t sign_masks[256][8] __attribute__((aligned(32))); /* bit j of the index set: lane j 1 << 31 */
static int grids_set;

static void widen(const uint8_t *from, float *to, int n) {
    for (int i = 0; i < n; i++) to[i] = (float)from[i];
}

static void widen_float_grids(void) {
    widen(&iq2xxs_grid[0][0], &iq2xxs_floats[0][0], 256 * 8);
    widen(&iq2xs_grid[0][0], &iq2xs_floats[0][0], 512 * 8);
    widen(&iq2s_grid[0][0], &iq2s_floats[0][0], 1024 * 8);
    widen(&iq3xxs_grid[0][0], &iq3xxs_floats[0][0], 256 * 4);
    widen(&iq3s_grid[0][0], &iq3s_floats[0][0], 512 * 4);
    for (int i = 0; i < 2048 * 8; i++) (&iq1s_floats[0][0])[i] = (float)(&iq1s_grid[0][0])[i];
    for (int i = 0; i < 256; i++)
        for (int j = 0; j < 8; j++) sign_masks[i][j] = (uint32_t)((i >> j) & 1) << 31;
}

#if K3_X86_SIMD
static void tq1_tables(void); /* the AVX-512 TQ1_0 kernel's code tables */
#else
static void tq1_tables(void) {}
#endif

int k3_set_iq_grids(const void *const tables[IQ_TABLES], const int64_t bytes[IQ_TABLES], int64_t *expected) {
    void *const slots[IQ_TABLES] = {iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid,
                                    iq3s_grid,   iq1s_grid,  iq4nl_values, mxfp4_values};
    const int64_t sizes[IQ_TABLES] = {sizeof iq2xxs_grid, sizeof iq2xs_grid, sizeof iq2s_grid, sizeof iq3xxs_grid,
                                      sizeof iq3s_grid,   sizeof iq1s_grid,  sizeof iq4nl_values, sizeof mxfp4_values};
    for (int i = 0; i < IQ_TABLES; i++)
        if (bytes[i] != sizes[i]) {
            *expected = sizes[i];
            return i;
        }
    for (int i = 0; i < IQ_TABLES; i++) memcpy(slots[i], tables[i], (size_t)sizes[i]);
    for (int i = 0; i < 128; i++) ksigns[i] = (uint8_t)(i | (__builtin_popcount(i) & 1) << 7);
    for (int i = 0; i < 256; i++) ue4m3_halves[i] = ue4m3_half((uint8_t)i);
    for (int i = 0; i < 256; i++) {
        sign_bytes[i] = 0;
        for (int j = 0; j < 8; j++) sign_bytes[i] |= (uint64_t)((i >> j) & 1 ? 0xFF : 0x01) << (8 * j);
    }
    for (int i = 0; i < 128; i++) even_signs[i] = sign_bytes[ksigns[i]];
    widen_float_grids();
    const IqGrids grids = {&iq2xxs_grid[0][0], &iq2xs_grid[0][0], &iq2s_grid[0][0], &iq3xxs_grid[0][0],
                           &iq3s_grid[0][0],   ksigns,            &iq1s_grid[0][0]};
    iq_avx512_set_grids(&grids);
    tq1_tables();
    grids_set = 1;
    return -1;
}

INLINE uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

INLINE uint16_t u16_at(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

INLINE float e8m0_half(uint8_t e) { return bits_f32(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23); }

/* eight grid values times eight Q8 codes, each sign bit j of `signs` negating value j */
INLINE int signed_dot8(const uint8_t *grid, const int8_t *q8, uint8_t signs) {
    int sum = 0;
    for (int j = 0; j < 8; j++) sum += grid[j] * q8[j] * ((signs >> j) & 1 ? -1 : 1);
    return sum;
}

/* ---- ggml's generic kernels: a row's dot with one input row's blocks y ------------------------------- */

INLINE float iq2_xxs_generic(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++, x += 66) {
        const float d = f16(x) * y[i].d;
        int32_t bsum = 0;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *run = x + 2 + 8 * ib;
            const uint32_t packed = u32_at(run + 4); /* four 7-bit sign indices, the scale on top */
            int32_t sumi = 0;
            for (int l = 0; l < 4; l++)
                sumi += signed_dot8(iq2xxs_grid[run[l]], y[i].qs + 32 * ib + 8 * l, ksigns[(packed >> 7 * l) & 127]);
            bsum += sumi * (int32_t)(2 * (packed >> 28) + 1);
        }
        sumf = fmaf(d, (float)bsum, sumf);
    }
    return 0.125f * sumf;
}

INLINE float iq2_xs_generic(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++, x += 74) {
        const float d = f16(x) * y[i].d;
        int32_t bsum = 0;
        for (int ib = 0; ib < 8; ib++) {
            for (int half = 0; half < 2; half++) {
                int32_t sumi = 0;
                for (int l = 2 * half; l < 2 * half + 2; l++) {
                    const uint16_t q = u16_at(x + 2 + 8 * ib + 2 * l);
                    sumi += signed_dot8(iq2xs_grid[q & 511], y[i].qs + 32 * ib + 8 * l, ksigns[q >> 9]);
                }
                bsum += sumi * (2 * ((x[66 + ib] >> 4 * half) & 15) + 1);
            }
        }
        sumf = fmaf(d, (float)bsum, sumf);
    }
    return 0.125f * sumf;
}

INLINE float iq2_s_generic(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++, x += 82) {
        const float d = f16(x) * y[i].d;
        const uint8_t *qs = x + 2, *signs = x + 34, *qh = x + 66, *scales = x + 74;
        int32_t bsum = 0;
        for (int ib = 0; ib < 8; ib++) {
            for (int half = 0; half < 2; half++) {
                int32_t sumi = 0;
                for (int l = 2 * half; l < 2 * half + 2; l++) {
                    const int index = qs[4 * ib + l] | ((qh[ib] << (8 - 2 * l)) & 0x300);
                    sumi += signed_dot8(iq2s_grid[index], y[i].qs + 32 * ib + 8 * l, signs[4 * ib + l]);
                }
                bsum += sumi * (2 * ((scales[ib] >> 4 * half) & 15) + 1);
            }
        }
        sumf = fmaf(d, (float)bsum, sumf);
    }
    return 0.125f * sumf;
}

/* IQ3 runs: eight values from two 4-value grid entries, one sign byte */
INLINE int iq3_dot8(const uint8_t *g1, const uint8_t *g2, const int8_t *q8, uint8_t signs) {
    uint8_t grid[8];
    memcpy(grid, g1, 4);
    memcpy(grid + 4, g2, 4);
    return signed_dot8(grid, q8, signs);
}

INLINE float iq3_xxs_generic(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++, x += 98) {
        const float d = f16(x) * y[i].d;
        int32_t bsum = 0;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q3 = x + 2 + 8 * ib;
            const uint32_t packed = u32_at(x + 66 + 4 * ib);
            int32_t sumi = 0;
            for (int l = 0; l < 4; l++)
                sumi += iq3_dot8(iq3xxs_grid[q3[2 * l]], iq3xxs_grid[q3[2 * l + 1]], y[i].qs + 32 * ib + 8 * l,
                                 ksigns[(packed >> 7 * l) & 127]);
            bsum += sumi * (int32_t)(2 * (packed >> 28) + 1);
        }
        sumf = fmaf(d, (float)bsum, sumf);
    }
    return 0.25f * sumf;
}

INLINE int iq3_s_index(const uint8_t *qs, uint8_t qh, int k) { /* grid entry k (0..7) of a run */
    return qs[k] | ((qh << (8 - k)) & 256);
}

INLINE float iq3_s_generic(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++, x += 110) {
        const float d = f16(x) * y[i].d;
        const uint8_t *qh = x + 66, *signs = x + 74, *scales = x + 106;
        int32_t bsum = 0;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *qs = x + 2 + 8 * ib;
            int32_t sumi = 0;
            for (int l = 0; l < 4; l++)
                sumi += iq3_dot8(iq3s_grid[iq3_s_index(qs, qh[ib], 2 * l)], iq3s_grid[iq3_s_index(qs, qh[ib], 2 * l + 1)],
                                 y[i].qs + 32 * ib + 8 * l, signs[4 * ib + l]);
            bsum += sumi * (2 * ((scales[ib / 2] >> 4 * (ib & 1)) & 15) + 1);
        }
        sumf = fmaf(d, (float)bsum, sumf);
    }
    return sumf;
}

INLINE int iq1_dot8(const int8_t *grid, const int8_t *q8) {
    int sum = 0;
    for (int j = 0; j < 8; j++) sum += grid[j] * q8[j];
    return sum;
}

INLINE float iq1_s_generic(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++, x += 50) {
        int sumi = 0, sumi1 = 0;
        for (int ib = 0; ib < 8; ib++) {
            const uint16_t qh = u16_at(x + 34 + 2 * ib);
            const int ls = 2 * ((qh >> 12) & 7) + 1, delta = 1 - 2 * (qh >> 15);
            int lsum = 0;
            for (int l = 0; l < 4; l++)
                lsum += iq1_dot8(iq1s_grid[x[2 + 4 * ib + l] | (((qh >> 3 * l) & 7) << 8)], y[i].qs + 32 * ib + 8 * l);
            sumi += ls * lsum;
            sumi1 += ls * delta * (y[i].bsums[2 * ib] + y[i].bsums[2 * ib + 1]);
        }
        sumf = fmaf(f16(x) * y[i].d, (float)sumi + 0.125f * (float)sumi1, sumf);
    }
    return sumf;
}

INLINE float iq1_m_generic(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++, x += 56) {
        const uint8_t *qs = x, *qh = x + 32, *sc = x + 48;
        const uint16_t s0 = u16_at(sc), s1 = u16_at(sc + 2), s2 = u16_at(sc + 4), s3 = u16_at(sc + 6);
        const uint16_t scale = (uint16_t)((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000));
        const uint8_t scale_bytes[2] = {(uint8_t)(scale & 255), (uint8_t)(scale >> 8)};
        int sumi1 = 0, sumi2 = 0;
        for (int ib = 0; ib < 8; ib++) {
            const int8_t *q8 = y[i].qs + 32 * ib;
            int sum1[2] = {0, 0}, sum2[2] = {0, 0};
            for (int l = 0; l < 4; l++) {
                const uint8_t h = qh[2 * ib + l / 2];
                const int index = qs[4 * ib + l] | (((uint16_t)h << (8 - 4 * (l % 2))) & 0x700);
                const int delta = 1 - 2 * ((h >> (l % 2 ? 7 : 3)) & 1);
                int codes = 0;
                for (int j = 0; j < 8; j++) codes += q8[8 * l + j];
                sum1[l / 2] += iq1_dot8(iq1s_grid[index], q8 + 8 * l);
                sum2[l / 2] += codes * delta;
            }
            const uint16_t word = u16_at(sc + 2 * (ib / 2));
            const int ls1 = 2 * ((word >> 6 * (ib % 2)) & 7) + 1, ls2 = 2 * ((word >> (6 * (ib % 2) + 3)) & 7) + 1;
            sumi1 += sum1[0] * ls1 + sum1[1] * ls2;
            sumi2 += sum2[0] * ls1 + sum2[1] * ls2;
        }
        sumf = fmaf(f16(scale_bytes) * y[i].d, (float)sumi1 + 0.125f * (float)sumi2, sumf);
    }
    return sumf;
}

/* a 32-value block of 4-bit indices into `values` (low nibbles: values 0..15, high: 16..31) times q8 */
INLINE int nibble_dot32(const uint8_t *qs, const int8_t *q8, const int8_t *values) {
    int sum = 0;
    for (int j = 0; j < 16; j++) sum += q8[j] * values[qs[j] & 15] + q8[j + 16] * values[qs[j] >> 4];
    return sum;
}

INLINE float iq4_xs_generic(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++, x += 136) {
        const float d4d8 = f16(x) * y[i].d;
        const uint16_t high = u16_at(x + 2);
        for (int ib = 0; ib < 8; ib++) {
            const int ls = ((x[4 + ib / 2] >> 4 * (ib & 1)) & 15) | (((high >> 2 * ib) & 3) << 4);
            const float d = d4d8 * (float)(ls - 32);
            sumf = fmaf(d, (float)nibble_dot32(x + 8 + 16 * ib, y[i].qs + 32 * ib, iq4nl_values), sumf);
        }
    }
    return sumf;
}

/* the ternary digit of byte q that multiplying by pow (a power of 3) brings to the top, less 1 */
INLINE int trit(uint8_t q, uint8_t pow) { return ((((uint8_t)(q * pow)) * 3) >> 8) - 1; }

INLINE float tq1_0_generic(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++, x += 54) {
        const int8_t *q8 = y[i].qs;
        int sum = 0;
        for (int l = 0; l < 5; l++) { /* trit l of byte m: values 32l + m (bytes 0..31), 160 + 16l + m (32..47) */
            for (int m = 0; m < 32; m++) sum += trit(x[m], pow3[l]) * q8[32 * l + m];
            for (int m = 0; m < 16; m++) sum += trit(x[32 + m], pow3[l]) * q8[160 + 16 * l + m];
        }
        for (int l = 0; l < 4; l++)
            for (int j = 0; j < 4; j++) sum += trit(x[48 + j], pow3[l]) * q8[240 + 4 * l + j];
        sumf = fmaf((float)sum, f16(x + 52) * y[i].d, sumf);
    }
    return sumf;
}

INLINE float tq2_0_generic(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++, x += 66) {
        int32_t sumi = 0;
        for (int j = 0; j < 64; j += 32)
            for (int l = 0; l < 4; l++)
                for (int k = 0; k < 32; k++) sumi += y[i].qs[4 * j + 32 * l + k] * (((x[j + k] >> 2 * l) & 3) - 1);
        const float d = y[i].d * f16(x + 64);
        sumf = fmaf((float)sumi, d, sumf);
    }
    return sumf;
}

/* sumf plus one IQ4_NL or MXFP4 block's product by one fused multiply-add (ggml's generic C, and the
 * odd last block of its AVX2 vec_dot, as the compiler contracts it) */
INLINE float iq4_nl_step(const uint8_t *x, const BlockQ8_0 *y, float sumf) {
    return fmaf(y->d * f16(x), (float)nibble_dot32(x + 2, y->qs, iq4nl_values), sumf);
}

INLINE float mxfp4_step(const uint8_t *x, const BlockQ8_0 *y, float sumf) {
    return fmaf(y->d * e8m0_half(x[0]), (float)nibble_dot32(x + 1, y->qs, mxfp4_values), sumf);
}

INLINE float iq4_nl_generic(const uint8_t *x, const BlockQ8_0 *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++) sumf = iq4_nl_step(x + 18 * i, y + i, sumf);
    return sumf;
}

INLINE float mxfp4_generic(const uint8_t *x, const BlockQ8_0 *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks; i++) sumf = mxfp4_step(x + 17 * i, y + i, sumf);
    return sumf;
}

/* NVFP4 (ggml's generic C, its sum contracted as the compiler does): a block of 64 values against two
 * Q8_0 blocks, one UE4M3 scale a run of 16; `blocks` counts the Q8_0 blocks */
INLINE float nvfp4_generic(const uint8_t *x, const BlockQ8_0 *y, int64_t blocks) {
    float sumf = 0.0f;
    for (int64_t i = 0; i < blocks / 2; i++, x += 36)
        for (int s = 0; s < 4; s++) {
            const BlockQ8_0 *q = y + 2 * i + s / 2;
            const int8_t *q8 = q->qs + 16 * (s % 2);
            int32_t sumi_lo = 0, sumi_hi = 0;
            for (int j = 0; j < 8; j++) {
                sumi_lo += q8[j] * mxfp4_values[x[4 + 8 * s + j] & 15];
                sumi_hi += q8[j + 8] * mxfp4_values[x[4 + 8 * s + j] >> 4];
            }
            sumf = fmaf(q->d * ue4m3_halves[x[s]], (float)(sumi_lo + sumi_hi), sumf);
        }
    return sumf;
}

/* ---- float decoders: one block's values as gguf's dequantize (and k3stream.quant's) computes them,
 * for the float tile path (ggml_cpu.c's ROW_KERNEL) and decode_row ------------------------------- */

/* a decoder built twice, for x86-64-v3 (AVX2, FMA: its 8-value helpers vectorize) and the baseline,
 * picked once at load */
#if K3_X86_SIMD
#define DECODER __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DECODER
#endif

/* 8 lanes (GCC's vector extensions: one AVX2 register in the x86-64-v3 build, two SSE ones else); each
 * lane computes exactly the scalar expression, so the values do not depend on the build. The helpers
 * returning them always inline: no call passes them, whatever the ABI says */
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float Floats8 __attribute__((vector_size(32)));
typedef float Floats4 __attribute__((vector_size(16)));
typedef uint32_t Words8 __attribute__((vector_size(32)));

INLINE Floats8 floats8(const float *p) {
    Floats8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store8(float *restrict y, Floats8 v) { memcpy(y, &v, sizeof v); }

/* db times eight grid values, value j negated where bit j of `signs` is set (exact negation, no branch) */
INLINE void put_signed(float *restrict y, Floats8 grid, float db, uint8_t signs) {
    Words8 flip;
    memcpy(&flip, sign_masks[signs], sizeof flip);
    store8(y, (Floats8)((Words8)(db * grid) ^ flip));
}

/* the IQ3 grids' two 4-value entries as one run of eight (joined in registers: a store of each half
 * and one wide load would stall on store forwarding) */
INLINE Floats8 pair8(const float *g1, const float *g2) {
    Floats4 low, high;
    memcpy(&low, g1, sizeof low);
    memcpy(&high, g2, sizeof high);
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7);
}

/* IQ1_S, IQ1_M: 0.125, negative where bit 31 of `sign` is set (no branch: random bits would mislead one) */
INLINE float iq1_delta(uint32_t sign) { return bits_f32(0x3E000000u | (sign & 0x80000000u)); }

/* IQ1_S, IQ1_M: eight values dl * (grid[j] + delta) */
INLINE void put_iq1(float *restrict y, const float *grid, float dl, float delta) {
    store8(y, dl * (floats8(grid) + delta));
}

/* IQ4_NL, IQ4_XS: 32 values dl * iq4nl_values[code], low nibbles first */
#if K3_X86_SIMD
#include <immintrin.h>
__attribute__((target("avx2"))) static void put_nibbles32_avx2(float *restrict y, const uint8_t *qs, float dl) {
    const __m128i values = _mm_loadu_si128((const __m128i *)iq4nl_values), nibble = _mm_set1_epi8(15);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    const __m128i half[2] = {_mm_shuffle_epi8(values, _mm_and_si128(q, nibble)),
                             _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(q, 4), nibble))};
    const __m256 scale = _mm256_set1_ps(dl);
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < 2; e++) {
            const __m256i codes = _mm256_cvtepi8_epi32(e ? _mm_srli_si128(half[h], 8) : half[h]);
            _mm256_storeu_ps(y + 16 * h + 8 * e, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(codes)));
        }
}
#endif

INLINE void put_nibbles32(float *restrict y, const uint8_t *qs, float dl) {
#if K3_X86_SIMD
    if (__builtin_cpu_supports("avx2")) { /* the same values, 8 at a time */
        put_nibbles32_avx2(y, qs, dl);
        return;
    }
#endif
    for (int j = 0; j < 16; j++) {
        y[j] = dl * (float)iq4nl_values[qs[j] & 15];
        y[16 + j] = dl * (float)iq4nl_values[qs[j] >> 4];
    }
}

/* the IQ2 grids' run scale: d (0.5 + s) / 4, rounded as gguf's */
INLINE float iq2_scale(float d, int s) { return d * (0.5f + (float)s) * 0.25f; }

DECODER void dec_iq2_xxs(const uint8_t *restrict b, float *restrict y) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *run = b + 2 + 8 * ib;
        const uint32_t packed = u32_at(run + 4);
        const float db = iq2_scale(d, (int)(packed >> 28));
        for (int l = 0; l < 4; l++)
            put_signed(y + 32 * ib + 8 * l, floats8(iq2xxs_floats[run[l]]), db, ksigns[(packed >> 7 * l) & 127]);
    }
}

DECODER void dec_iq2_xs(const uint8_t *restrict b, float *restrict y) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++)
        for (int l = 0; l < 4; l++) {
            const uint16_t q = u16_at(b + 2 + 8 * ib + 2 * l);
            const float db = iq2_scale(d, (b[66 + ib] >> 4 * (l / 2)) & 15);
            put_signed(y + 32 * ib + 8 * l, floats8(iq2xs_floats[q & 511]), db, ksigns[q >> 9]);
        }
}

DECODER void dec_iq2_s(const uint8_t *restrict b, float *restrict y) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++)
        for (int l = 0; l < 4; l++) {
            const int index = b[2 + 4 * ib + l] | ((b[66 + ib] << (8 - 2 * l)) & 0x300);
            const float db = iq2_scale(d, (b[74 + ib] >> 4 * (l / 2)) & 15);
            put_signed(y + 32 * ib + 8 * l, floats8(iq2s_floats[index]), db, b[34 + 4 * ib + l]);
        }
}

DECODER void dec_iq3_xxs(const uint8_t *restrict b, float *restrict y) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q3 = b + 2 + 8 * ib;
        const uint32_t packed = u32_at(b + 66 + 4 * ib);
        const float db = d * (0.5f + (float)(packed >> 28)) * 0.5f;
        for (int l = 0; l < 4; l++)
            put_signed(y + 32 * ib + 8 * l, pair8(iq3xxs_floats[q3[2 * l]], iq3xxs_floats[q3[2 * l + 1]]), db,
                       ksigns[(packed >> 7 * l) & 127]);
    }
}

DECODER void dec_iq3_s(const uint8_t *restrict b, float *restrict y) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *qs = b + 2 + 8 * ib, qh = b[66 + ib];
        const float db = d * (float)(1 + 2 * ((b[106 + ib / 2] >> 4 * (ib & 1)) & 15));
        for (int l = 0; l < 4; l++)
            put_signed(y + 32 * ib + 8 * l,
                       pair8(iq3s_floats[iq3_s_index(qs, qh, 2 * l)], iq3s_floats[iq3_s_index(qs, qh, 2 * l + 1)]), db,
                       b[74 + 4 * ib + l]);
    }
}

DECODER void dec_iq1_s(const uint8_t *restrict b, float *restrict y) {
    const float d = f16(b);
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t qh = u16_at(b + 34 + 2 * ib);
        const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1), delta = iq1_delta((uint32_t)qh << 16);
        for (int l = 0; l < 4; l++)
            put_iq1(y + 32 * ib + 8 * l, iq1s_floats[b[2 + 4 * ib + l] | (((qh >> 3 * l) & 7) << 8)], dl, delta);
    }
}

DECODER void dec_iq1_m(const uint8_t *restrict b, float *restrict y) { /* qs: b, qh: b + 32, scales: b + 48 */
    const uint8_t *sc = b + 48;
    const uint16_t s0 = u16_at(sc), s1 = u16_at(sc + 2), s2 = u16_at(sc + 4), s3 = u16_at(sc + 6);
    const uint16_t scale = (uint16_t)((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000));
    const uint8_t scale_bytes[2] = {(uint8_t)(scale & 255), (uint8_t)(scale >> 8)};
    const float d = f16(scale_bytes);
    for (int g = 0; g < 16; g++) { /* values 16g..16g + 15: 3-bit scale g, qh byte g (a nibble per 8) */
        const float dl = d * (float)(2 * ((u16_at(sc + 2 * (g / 4)) >> 3 * (g % 4)) & 7) + 1);
        const int h = b[32 + g];
        put_iq1(y + 16 * g, iq1s_floats[b[2 * g] | (h & 7) << 8], dl, iq1_delta((uint32_t)h << 28));
        put_iq1(y + 16 * g + 8, iq1s_floats[b[2 * g + 1] | (h & 0x70) << 4], dl, iq1_delta((uint32_t)h << 24));
    }
}

void dec_iq4_nl(const uint8_t *restrict b, float *restrict y) { put_nibbles32(y, b + 2, f16(b)); }

DECODER void dec_iq4_xs(const uint8_t *restrict b, float *restrict y) {
    const float d = f16(b);
    const uint16_t high = u16_at(b + 2);
    for (int ib = 0; ib < 8; ib++) {
        const int ls = ((b[4 + ib / 2] >> 4 * (ib & 1)) & 15) | (((high >> 2 * ib) & 3) << 4);
        put_nibbles32(y + 32 * ib, b + 8 + 16 * ib, d * (float)(ls - 32));
    }
}

/* the ternary types' AVX2 decoders (with the integer kernels' code extraction, below) */
#if K3_X86_SIMD
#define AVX2_DECODER __attribute__((target("avx2,fma,f16c,bmi2"))) static void
AVX2_DECODER tq1_0_values_avx2(const uint8_t *restrict b, float *restrict y);
AVX2_DECODER tq2_0_values_avx2(const uint8_t *restrict b, float *restrict y);
#define TERNARY_AVX2(NAME, b, y)                                                                                 \
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") && \
        __builtin_cpu_supports("bmi2")) {                                                                    \
        NAME##_values_avx2(b, y);                                                                            \
        return;                                                                                              \
    }
#else
#define TERNARY_AVX2(NAME, b, y)
#endif

DECODER void dec_tq1_0(const uint8_t *restrict b, float *restrict y) { /* value order as tq1_0_generic's */
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    TERNARY_AVX2(tq1_0, b, y)
    const float d = f16(b + 52);
    for (int l = 0; l < 5; l++) {
        for (int m = 0; m < 32; m++) y[32 * l + m] = d * (float)trit(b[m], pow3[l]);
        for (int m = 0; m < 16; m++) y[160 + 16 * l + m] = d * (float)trit(b[32 + m], pow3[l]);
    }
    for (int l = 0; l < 4; l++)
        for (int j = 0; j < 4; j++) y[240 + 4 * l + j] = d * (float)trit(b[48 + j], pow3[l]);
}

DECODER void dec_tq2_0(const uint8_t *restrict b, float *restrict y) { /* bits 2l of byte 32j + k: value 128j + 32l + k */
    TERNARY_AVX2(tq2_0, b, y)
    const float d = f16(b + 64);
    for (int j = 0; j < 2; j++)
        for (int l = 0; l < 4; l++)
            for (int k = 0; k < 32; k++) y[128 * j + 32 * l + k] = d * (float)(((b[32 * j + k] >> 2 * l) & 3) - 1);
}

/* A row kernel from a row dot DOT(row, y, blocks): each weight row m against each of its input rows'
 * blocks (Y: the Product's q8 or q8_0, ELEMS values a block); AHEAD: the row's lines asked for ahead at
 * its start (else DOT asks as it goes) */
#define IQ_ROWS(NAME, ATTR, DOT, Y, ELEMS, AHEAD)                                                        \
    ATTR static void NAME(const Product *pr, int64_t b, int64_t first, int64_t last) {                 \
        const int64_t blocks = pr->in_features / (ELEMS);                                             \
        for (int64_t m = first; m < last; m++) {                                                       \
            const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;      \
            if (AHEAD) prefetch_ahead(row, pr->row_bytes);                                             \
            for (int64_t p = pr->starts[b]; p < pr->starts[b + 1]; p++)                                \
                pr->out[p * pr->out_stride + m] = DOT(row, pr->Y + pr->rows[p] * blocks, blocks);      \
        }                                                                                              \
    }

/* X(GGML type id, name, Product field of its activations, values a block): the types whose AVX2
 * kernel shares decoded runs between input rows (SHARED_RUNS, iq1_m_rows), and the others */
#define RUN_TYPES(X)                                                                                     \
    X(16, iq2_xxs, q8, 256) X(17, iq2_xs, q8, 256) X(18, iq3_xxs, q8, 256) X(21, iq3_s, q8, 256)        \
    X(22, iq2_s, q8, 256) X(23, iq4_xs, q8, 256) X(19, iq1_s, q8, 256) X(29, iq1_m, q8, 256)
#define ROW_TYPES(X)                                                                                     \
    X(20, iq4_nl, q8_0, 32) X(34, tq1_0, q8, 256)                                                      \
    X(35, tq2_0, q8, 256) X(39, mxfp4, q8_0, 32) X(40, nvfp4, q8_0, 32) /* NVFP4: a block is two Q8_0's */
#define IQ_TYPES(X) RUN_TYPES(X) ROW_TYPES(X)

#define GENERIC_ROWS(ID, NAME, Y, ELEMS) IQ_ROWS(NAME##_rows_generic, , NAME##_generic, Y, ELEMS, 1)
IQ_TYPES(GENERIC_ROWS)

/* ---- ggml's AVX2 kernels ------------------------------------------------------------------------- */
#if K3_X86_SIMD
#include <immintrin.h>
#define AVX2_ALWAYS __attribute__((target("avx2,fma,f16c,bmi2"))) static inline __attribute__((always_inline))

/* an F16 by F16C: one instruction, the same value as f16() */
AVX2_ALWAYS float f16c(const uint8_t *p) { return _cvtsh_ss(u16_at(p)); }

AVX2_ALWAYS float hsum_lanes(__m256 v) { /* ggml's hsum_float_8 */
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE uint64_t u64_at(const void *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* four 8-byte entries a (bytes 0..7) .. d (24..31): inserted in registers (four stores and one wide
 * load would stall on store forwarding) */
AVX2_ALWAYS __m256i four_u64(const void *a, const void *b, const void *c, const void *d) {
    return _mm256_set_epi64x((long long)u64_at(d), (long long)u64_at(c), (long long)u64_at(b), (long long)u64_at(a));
}

/* lanes of unsigned weights w times signed codes q8 (pairs, then pairs of pairs times 16-bit scales) */
AVX2_ALWAYS __m256i scaled_pairs(__m256i w, __m256i q8, __m256i scales) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, q8), scales);
}

/* the same for signed weights */
AVX2_ALWAYS __m256i signed_pairs(__m256i w, __m256i q8, __m256i scales) {
    return scaled_pairs(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q8, w), scales);
}

AVX2_ALWAYS __m256i two_scales(int first16, int second16) {
    return _mm256_set_m128i(_mm_set1_epi16((short)second16), _mm_set1_epi16((short)first16));
}

AVX2_ALWAYS __m256i q8_run(const BlockQ8K *y, int ib) { return _mm256_loadu_si256((const __m256i *)(y->qs + 32 * ib)); }

/* 0xFF at byte 8k + j where bit j of byte k of `bits` is set (IQ2_S's, IQ3_S's and IQ1_M's sign bytes),
 * else 0, in registers: each byte spread over its eight values, tested against its bit */
AVX2_ALWAYS __m256i set_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                                 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

/* One run (32 values) of a block decoded for any number of input rows: each row's lanes gain
 * madd(maddubs(w, sign(q8, sign)), scales) (w unsigned; sign's bytes +1, -1 or 0) */
typedef struct {
    __m256i w, sign, scales;
} Run;

/* the bits of `bits` (4 sign bytes, one for each 8 values) as bytes -1 where set, else +1 */
AVX2_ALWAYS __m256i sign_of_bits(uint32_t bits) { return _mm256_or_si256(set_bits(bits), _mm256_set1_epi8(1)); }

AVX2_ALWAYS Run iq2_xxs_run(const uint8_t *x, int ib) {
    const uint8_t *run = x + 2 + 8 * ib;
    const uint32_t packed = u32_at(run + 4);
    return (Run){four_u64(iq2xxs_grid[run[0]], iq2xxs_grid[run[1]], iq2xxs_grid[run[2]], iq2xxs_grid[run[3]]),
                 four_u64(&even_signs[packed & 127], &even_signs[(packed >> 7) & 127],
                          &even_signs[(packed >> 14) & 127], &even_signs[(packed >> 21) & 127]),
                 _mm256_set1_epi16((short)(2 * (packed >> 28) + 1))};
}

AVX2_ALWAYS Run iq2_xs_run(const uint8_t *x, int ib) {
    uint16_t q[4];
    for (int l = 0; l < 4; l++) q[l] = u16_at(x + 2 + 8 * ib + 2 * l);
    return (Run){four_u64(iq2xs_grid[q[0] & 511], iq2xs_grid[q[1] & 511], iq2xs_grid[q[2] & 511], iq2xs_grid[q[3] & 511]),
                 four_u64(&even_signs[q[0] >> 9], &even_signs[q[1] >> 9], &even_signs[q[2] >> 9], &even_signs[q[3] >> 9]),
                 two_scales(2 * (x[66 + ib] & 15) + 1, 2 * (x[66 + ib] >> 4) + 1)};
}

AVX2_ALWAYS Run iq2_s_run(const uint8_t *x, int ib) {
    const uint8_t *q = x + 2 + 4 * ib;
    const int h = x[66 + ib];
    return (Run){four_u64(iq2s_grid[q[0] | ((h << 8) & 0x300)], iq2s_grid[q[1] | ((h << 6) & 0x300)],
                          iq2s_grid[q[2] | ((h << 4) & 0x300)], iq2s_grid[q[3] | ((h << 2) & 0x300)]),
                 sign_of_bits(u32_at(x + 34 + 4 * ib)), two_scales(2 * (x[74 + ib] & 15) + 1, 2 * (x[74 + ib] >> 4) + 1)};
}

AVX2_ALWAYS __m256i eight_u32(const uint8_t (*grid)[4], const int *index) {
    return _mm256_set_epi32((int)u32_at(grid[index[7]]), (int)u32_at(grid[index[6]]), (int)u32_at(grid[index[5]]),
                            (int)u32_at(grid[index[4]]), (int)u32_at(grid[index[3]]), (int)u32_at(grid[index[2]]),
                            (int)u32_at(grid[index[1]]), (int)u32_at(grid[index[0]]));
}

AVX2_ALWAYS Run iq3_xxs_run(const uint8_t *x, int ib) {
    const uint8_t *q3 = x + 2 + 8 * ib;
    const uint32_t packed = u32_at(x + 66 + 4 * ib);
    const int index[8] = {q3[0], q3[1], q3[2], q3[3], q3[4], q3[5], q3[6], q3[7]};
    return (Run){eight_u32(iq3xxs_grid, index),
                 four_u64(&even_signs[packed & 127], &even_signs[(packed >> 7) & 127],
                          &even_signs[(packed >> 14) & 127], &even_signs[(packed >> 21) & 127]),
                 _mm256_set1_epi16((short)(2 * (packed >> 28) + 1))};
}

AVX2_ALWAYS Run iq3_s_run(const uint8_t *x, int ib) {
    int index[8];
    for (int k = 0; k < 8; k++) index[k] = iq3_s_index(x + 2 + 8 * ib, x[66 + ib], k);
    const int ls = 2 * ((x[106 + ib / 2] >> 4 * (ib & 1)) & 15) + 1;
    return (Run){eight_u32(iq3s_grid, index), sign_of_bits(u32_at(x + 74 + 4 * ib)), _mm256_set1_epi16((short)ls)};
}

AVX2_ALWAYS Run iq4_xs_run(const uint8_t *x, int ib) { /* signed values: |w| and w's signs */
    const __m128i values = _mm_loadu_si128((const __m128i *)iq4nl_values), nibble = _mm_set1_epi8(15);
    const __m128i q = _mm_loadu_si128((const __m128i *)(x + 8 + 16 * ib));
    const __m256i w = _mm256_set_m128i(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(q, 4), nibble)),
                                       _mm_shuffle_epi8(values, _mm_and_si128(q, nibble)));
    const int ls = (((x[4 + ib / 2] >> 4 * (ib & 1)) & 15) | (((u16_at(x + 2) >> 2 * ib) & 3) << 4)) - 32;
    return (Run){_mm256_sign_epi8(w, w), w, _mm256_set1_epi16((short)ls)};
}

/* IQ1_S: the grid's -1/0/1 as the signs of the codes (w: ones); the delta terms an exact integer a
 * block (`iq1_s_deltas`), d times it summed apart and 0.125 times that added at the end, as ggml's */
AVX2_ALWAYS Run iq1_s_run(const uint8_t *x, int ib) {
    const uint16_t qh = u16_at(x + 34 + 2 * ib);
    /* the four 11-bit indices in 16-bit fields: 8 bits of qs, 3 of qh each (BMI2 deposits) */
    const uint64_t index = _pdep_u64(u32_at(x + 2 + 4 * ib), 0x00FF00FF00FF00FFULL) | _pdep_u64(qh, 0x0700070007000700ULL);
    return (Run){_mm256_set1_epi8(1),
                 four_u64(iq1s_grid[index & 0xFFFF], iq1s_grid[(index >> 16) & 0xFFFF], iq1s_grid[(index >> 32) & 0xFFFF],
                          iq1s_grid[index >> 48]),
                 _mm256_set1_epi16((short)(2 * ((qh >> 12) & 7) + 1))};
}

AVX2_ALWAYS int iq1_s_deltas(const uint8_t *x, const BlockQ8K *y) {
    int sum = 0;
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t qh = u16_at(x + 34 + 2 * ib);
        sum += (y->bsums[2 * ib] + y->bsums[2 * ib + 1]) * (1 - 2 * (qh >> 15)) * (2 * ((qh >> 12) & 7) + 1);
    }
    return sum;
}

/* A row kernel from NAME##_rows(pr, row, m, p, n): input rows p..p + n - 1 (n <= RUN_ROWS) against
 * weight row m, RUN_ROWS at a time, then the rest one by one */
#define RUNS_DRIVER(NAME)                                                                                \
    __attribute__((target("avx2,fma,f16c,bmi2"))) static void NAME##_rows_avx2(const Product *pr, int64_t b, \
                                                                              int64_t first, int64_t last) { \
        for (int64_t m = first; m < last; m++) {                                                       \
            const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;      \
            prefetch_ahead(row, pr->row_bytes);                                                        \
            int64_t p = pr->starts[b];                                                                 \
            for (; p + RUN_ROWS <= pr->starts[b + 1]; p += RUN_ROWS) NAME##_rows(pr, row, m, p, RUN_ROWS); \
            for (; p < pr->starts[b + 1]; p++) NAME##_rows(pr, row, m, p, 1);                          \
        }                                                                                              \
    }

/* Up to RUN_ROWS input rows share each decoded run of a weight row (prefill, batched decode); each row
 * keeps its own lanes and float sums and sees exactly the operations it would see alone: d times its
 * lanes by FMA a block, FACTOR times their sum at the end */
#define RUN_ROWS 4
#define SHARED_RUNS(NAME, BYTES, FACTOR, DELTAS)                                                         \
    AVX2_ALWAYS void NAME##_rows(const Product *pr, const uint8_t *row, int64_t m, int64_t p, const int n) { \
        const int64_t blocks = pr->in_features / 256;                                                  \
        const BlockQ8K *y[RUN_ROWS];                                                                   \
        __m256 acc[RUN_ROWS];                                                                          \
        float deltas[RUN_ROWS];                                                                        \
        for (int r = 0; r < n; r++) y[r] = pr->q8 + pr->rows[p + r] * blocks, acc[r] = _mm256_setzero_ps(), deltas[r] = 0.0f; \
        for (int64_t i = 0; i < blocks; i++) {                                                         \
            const uint8_t *x = row + i * (BYTES);                                                      \
            __m256i sumi[RUN_ROWS];                                                                    \
            for (int r = 0; r < n; r++) sumi[r] = _mm256_setzero_si256();                              \
            _Pragma("GCC unroll 8") for (int ib = 0; ib < 8; ib++) {                                   \
                const Run run = NAME##_run(x, ib);                                                     \
                for (int r = 0; r < n; r++) {                                                          \
                    const __m256i q8 = _mm256_sign_epi8(q8_run(y[r] + i, ib), run.sign);               \
                    sumi[r] = _mm256_add_epi32(sumi[r], scaled_pairs(run.w, q8, run.scales));          \
                }                                                                                      \
            }                                                                                          \
            const float d = f16c(x);                                                                   \
            for (int r = 0; r < n; r++) {                                                              \
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y[r][i].d), _mm256_cvtepi32_ps(sumi[r]), acc[r]); \
                if (DELTAS) deltas[r] = fmaf(d * y[r][i].d, (float)iq1_s_deltas(x, y[r] + i), deltas[r]); \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < n; r++)                                                                    \
            pr->out[(p + r) * pr->out_stride + m] =                                                    \
                DELTAS ? hsum_lanes(acc[r]) + 0.125f * deltas[r] : (FACTOR) * hsum_lanes(acc[r]);      \
    }                                                                                                  \
    RUNS_DRIVER(NAME)

SHARED_RUNS(iq2_xxs, 66, 0.125f, 0)
SHARED_RUNS(iq2_xs, 74, 0.125f, 0)
SHARED_RUNS(iq2_s, 82, 0.125f, 0)
SHARED_RUNS(iq3_xxs, 98, 0.25f, 0)
SHARED_RUNS(iq3_s, 110, 1.0f, 0)
SHARED_RUNS(iq4_xs, 136, 1.0f, 0)

SHARED_RUNS(iq1_s, 50, 1.0f, 1)

/* IQ1_M's 16 run scales 2s + 1 of a block (3 bits each, four to a 16-bit word at bits 0, 3, 6, 9) as
 * 16-bit lanes: each 64-bit lane holds the four words shifted by 0, 6 (low 128 bits), 3, 9 (high), so
 * scale 4w + k sits in word w of 64-bit lane k / 2 + 2 (k & 1) */
AVX2_ALWAYS __m256i iq1_m_scales(const uint8_t *sc) {
    const __m256i words = _mm256_srlv_epi64(_mm256_set1_epi64x((long long)u64_at(sc)), _mm256_set_epi64x(9, 3, 6, 0));
    return _mm256_add_epi16(_mm256_slli_epi16(_mm256_and_si256(words, _mm256_set1_epi16(7)), 1), _mm256_set1_epi16(1));
}

/* run ib's scales on its lanes: scale 2ib on values 0..15 (low 128 bits), 2ib + 1 on 16..31 (high) */
AVX2_ALWAYS __m256i iq1_m_run_scales(__m256i scales, int ib) {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (ib / 2) + 0x0808 * (ib & 1))));
}

/* the delta signs of runs 2 pair and 2 pair + 1 (bit 3 of each qh nibble: one for each 8 values) as
 * 8 bytes, 0x80 where negative: bit 3 of nibble k deposited in bit 7 of byte k */
AVX2_ALWAYS uint64_t iq1_m_delta_bytes(const uint8_t *qh, int pair) {
    return _pdep_u64(u32_at(qh + 4 * pair) & 0x88888888u, 0xF0F0F0F0F0F0F0F0ULL);
}

/* a run's 4 delta sign bytes as 32 lanes -1 (each byte sign-extended over its 8 values) or +1 */
AVX2_ALWAYS __m256i iq1_m_delta_signs(uint32_t bytes) {
    return _mm256_or_si256(_mm256_cvtepi8_epi64(_mm_cvtsi32_si128((int)bytes)), _mm256_set1_epi8(1));
}

/* IQ1_M: the grid's lanes and the deltas' (each 8 values' codes, negated where their delta is) into
 * two accumulators, scales per 16 values; 0.125 times the second's sum added at the end: ggml's lanes
 * (lane k of a run: its values 4k..4k + 3). Runs decoded once for up to RUN_ROWS input rows, as
 * SHARED_RUNS. */
AVX2_ALWAYS void iq1_m_rows(const Product *pr, const uint8_t *row, int64_t m, int64_t p, const int n) {
    const int64_t blocks = pr->in_features / 256;
    const __m256i ones = _mm256_set1_epi8(1);
    const BlockQ8K *y[RUN_ROWS];
    __m256 acc1[RUN_ROWS], acc2[RUN_ROWS];
    for (int r = 0; r < n; r++)
        y[r] = pr->q8 + pr->rows[p + r] * blocks, acc1[r] = _mm256_setzero_ps(), acc2[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *x = row + 56 * i, *qs = x, *qh = x + 32, *sc = x + 48;
        const uint16_t s0 = u16_at(sc), s1 = u16_at(sc + 2), s2 = u16_at(sc + 4), s3 = u16_at(sc + 6);
        const uint16_t scale = (uint16_t)((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000));
        const uint8_t scale_bytes[2] = {(uint8_t)(scale & 255), (uint8_t)(scale >> 8)};
        const __m256i scales = iq1_m_scales(sc);
        __m256i sumi1[RUN_ROWS], sumi2[RUN_ROWS];
        for (int r = 0; r < n; r++) sumi1[r] = sumi2[r] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8") for (int ib = 0; ib < 8; ib++) {
            /* 8 bits of qs and the low 3 of each qh nibble (its top bit: the delta's sign) an index */
            const uint64_t index = _pdep_u64(u32_at(qs + 4 * ib), 0x00FF00FF00FF00FFULL) |
                                   _pdep_u64(u16_at(qh + 2 * ib) & 0x7777, 0x0F000F000F000F00ULL);
            const __m256i grid = four_u64(iq1s_grid[index & 0xFFFF], iq1s_grid[(index >> 16) & 0xFFFF],
                                          iq1s_grid[(index >> 32) & 0xFFFF], iq1s_grid[index >> 48]);
            const __m256i delta = iq1_m_delta_signs((uint32_t)(iq1_m_delta_bytes(qh, ib / 2) >> 32 * (ib & 1)));
            const __m256i run_scales = iq1_m_run_scales(scales, ib);
            for (int r = 0; r < n; r++) {
                const __m256i q8 = q8_run(y[r] + i, ib);
                sumi1[r] = _mm256_add_epi32(sumi1[r], scaled_pairs(ones, _mm256_sign_epi8(q8, grid), run_scales));
                sumi2[r] = _mm256_add_epi32(sumi2[r], scaled_pairs(ones, _mm256_sign_epi8(q8, delta), run_scales));
            }
        }
        const float d = f16c(scale_bytes);
        for (int r = 0; r < n; r++) {
            const __m256 dy = _mm256_set1_ps(y[r][i].d * d);
            acc1[r] = _mm256_fmadd_ps(dy, _mm256_cvtepi32_ps(sumi1[r]), acc1[r]);
            acc2[r] = _mm256_fmadd_ps(dy, _mm256_cvtepi32_ps(sumi2[r]), acc2[r]);
        }
    }
    for (int r = 0; r < n; r++)
        pr->out[(p + r) * pr->out_stride + m] = hsum_lanes(acc1[r]) + 0.125f * hsum_lanes(acc2[r]);
}

RUNS_DRIVER(iq1_m)

/* The ternary types: codes 0..2 (value + 1) in block order, 32 at a time; their pair sums in 16-bit
 * lanes over the block (exact: at most 8 * 2 * 2 * 127), less the Q8_K sums of 16, then pairs of
 * lanes: ggml's lanes; d times them added into eight float lanes (fused, as gcc builds ggml's) */
AVX2_ALWAYS void ternary_total(const BlockQ8K *y, __m256i pairs16, float d, __m256 *acc) {
    const __m256i lanes = _mm256_madd_epi16(_mm256_sub_epi16(pairs16, _mm256_loadu_si256((const __m256i *)y->bsums)),
                                            _mm256_set1_epi16(1));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(d), *acc);
}

/* TQ2_0's codes of values 32 run .. 32 run + 31: bits 2l of byte 32j + k are value 128j + 32l + k */
AVX2_ALWAYS __m256i tq2_0_codes(const uint8_t *x, int run) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(x + 32 * (run / 4)));
    return _mm256_and_si256(_mm256_srli_epi16(q, 2 * (run % 4)), _mm256_set1_epi8(3));
}

AVX2_ALWAYS __m256i tq2_0_pairs(const uint8_t *x, const BlockQ8K *y) {
    __m256i sum = _mm256_setzero_si256();
    for (int run = 0; run < 8; run++) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(tq2_0_codes(x, run), q8_run(y, run)));
    return sum;
}

/* each byte's top trit after scaling, (q * 3) >> 8 as ggml's generic code computes it, in 8-bit lanes:
 * with a = max(q - 1, 0), (a + (a + 1) / 2 + 1) / 2 (two rounding averages) has that value in its top
 * two bits, for every byte (checked over all 256) */
AVX2_ALWAYS __m256i top_trits(__m256i q) {
    const __m256i a = _mm256_subs_epu8(q, _mm256_set1_epi8(1));
    const __m256i scaled = _mm256_avg_epu8(a, _mm256_avg_epu8(a, _mm256_setzero_si256()));
    return _mm256_and_si256(_mm256_srli_epi16(scaled, 6), _mm256_set1_epi8(3));
}

AVX2_ALWAYS __m256i times3(__m256i q) { return _mm256_add_epi8(q, _mm256_add_epi8(q, q)); } /* mod 256 */

/* TQ1_0's codes in value order, 32 a vector: trit k of byte m is value 32k + m (bytes 0..31), 160 +
 * 16k + m (32..47), 240 + 4k + j (48..51) */
AVX2_ALWAYS void tq1_0_codes(const uint8_t *x, __m256i codes[8]) {
    __m256i scaled = _mm256_loadu_si256((const __m256i *)x);
    for (int k = 0; k < 5; k++, scaled = times3(scaled)) codes[k] = top_trits(scaled);
    const __m128i rest = _mm_loadu_si128((const __m128i *)(x + 32));
    const __m256i pair = _mm256_set_m128i(_mm_add_epi8(rest, _mm_add_epi8(rest, rest)), rest); /* trits 0, 1 */
    const __m256i pair9 = times3(times3(pair));                                                  /* trits 2, 3 */
    /* the last 4 bytes times 1, 3, 9, 27 in the high half, after trit 4 of bytes 32..47 */
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_set1_epi32((int)u32_at(x + 48)));
    const __m256i powers = _mm256_set_epi16(27, 27, 27, 27, 9, 9, 9, 9, 3, 3, 3, 3, 1, 1, 1, 1);
    const __m256i products = _mm256_and_si256(_mm256_mullo_epi16(wide, powers), _mm256_set1_epi16(0xFF));
    const __m128i tail = _mm_packus_epi16(_mm256_castsi256_si128(products), _mm256_extracti128_si256(products, 1));
    codes[5] = top_trits(pair);
    codes[6] = top_trits(pair9);
    codes[7] = top_trits(_mm256_inserti128_si256(times3(times3(pair9)), tail, 1));
}

AVX2_ALWAYS __m256i tq1_0_pairs(const uint8_t *x, const BlockQ8K *y) {
    __m256i codes[8], sum = _mm256_setzero_si256();
    tq1_0_codes(x, codes);
    for (int run = 0; run < 8; run++) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(codes[run], q8_run(y, run)));
    return sum;
}

/* the ternary float decoders' values: d * (code - 1) for 32 codes, exactly the scalar products */
AVX2_ALWAYS void put_ternary32(float *restrict y, __m256i codes, __m256 d) {
    const __m256i values = _mm256_sub_epi8(codes, _mm256_set1_epi8(1));
    const __m128i half[2] = {_mm256_castsi256_si128(values), _mm256_extracti128_si256(values, 1)};
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < 2; e++) {
            const __m256i wide = _mm256_cvtepi8_epi32(e ? _mm_srli_si128(half[h], 8) : half[h]);
            _mm256_storeu_ps(y + 16 * h + 8 * e, _mm256_mul_ps(d, _mm256_cvtepi32_ps(wide)));
        }
}

AVX2_DECODER tq1_0_values_avx2(const uint8_t *restrict b, float *restrict y) {
    __m256i codes[8];
    tq1_0_codes(b, codes);
    const __m256 d = _mm256_set1_ps(f16(b + 52));
    for (int run = 0; run < 8; run++) put_ternary32(y + 32 * run, codes[run], d);
}

AVX2_DECODER tq2_0_values_avx2(const uint8_t *restrict b, float *restrict y) {
    const __m256 d = _mm256_set1_ps(f16(b + 64));
    for (int run = 0; run < 8; run++) put_ternary32(y + 32 * run, tq2_0_codes(b, run), d);
}

#define TERNARY_DOT(NAME, BYTES, D_AT)                                                                  \
    AVX2_ALWAYS float NAME##_avx2(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {                 \
        __m256 acc = _mm256_setzero_ps();                                                                \
        for (int64_t i = 0; i < blocks; i++, x += (BYTES))                                               \
            ternary_total(y + i, NAME##_pairs(x, y + i), y[i].d * f16c(x + (D_AT)), &acc);                 \
        return hsum_lanes(acc);                                                                          \
    }

TERNARY_DOT(tq2_0, 66, 64)
TERNARY_DOT(tq1_0, 54, 52)

/* IQ4_NL and MXFP4: blocks in pairs, the first's lanes into one accumulator and the second's into
 * another; an odd last block into the lanes' sum by one FMA (NAME##_step), as ggml's compiled code */
#define PAIRED_DOT(NAME, BYTES, VALUES, SCALE, CODES)                                                      \
    AVX2_ALWAYS __m256 NAME##_lanes(const uint8_t *x, const BlockQ8_0 *y, __m256 acc) {                   \
        const __m128i q = _mm_loadu_si128((const __m128i *)(x + (CODES))), nibble = _mm_set1_epi8(15);      \
        const __m128i values = _mm_loadu_si128((const __m128i *)(VALUES));                                  \
        const __m256i w = _mm256_set_m128i(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(q, 4), nibble)), \
                                           _mm_shuffle_epi8(values, _mm_and_si128(q, nibble)));            \
        const __m256i lanes = signed_pairs(w, _mm256_loadu_si256((const __m256i *)y->qs), _mm256_set1_epi16(1)); \
        return _mm256_fmadd_ps(_mm256_set1_ps(y->d * (SCALE)), _mm256_cvtepi32_ps(lanes), acc);             \
    }                                                                                                     \
    AVX2_ALWAYS float NAME##_avx2(const uint8_t *x, const BlockQ8_0 *y, int64_t blocks) {                  \
        __m256 acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();                                    \
        int64_t i = 0;                                                                                    \
        for (; i + 1 < blocks; i += 2) {                                                                  \
            acc1 = NAME##_lanes(x + i * (BYTES), y + i, acc1);                                            \
            acc2 = NAME##_lanes(x + (i + 1) * (BYTES), y + i + 1, acc2);                                  \
        }                                                                                                 \
        const float sumf = hsum_lanes(_mm256_add_ps(acc1, acc2));                                         \
        return i < blocks ? NAME##_step(x + i * (BYTES), y + i, sumf) : sumf;                             \
    }

PAIRED_DOT(iq4_nl, 18, iq4nl_values, f16c(x), 2)
PAIRED_DOT(mxfp4, 17, mxfp4_values, e8m0_half(x[0]), 1)
/* NVFP4 as ggml's AVX2 vec_dot computes it: per Q8_0 block of activations (half a block), the 32 codes'
 * values as bytes (a run's low nibbles, then its high ones), 8 lanes of 4 products each (lanes 0-3 the
 * first run, 4-7 the second), one FMA with the run's scale times the activations' d, then ggml's
 * horizontal sum */
AVX2_ALWAYS float nvfp4_avx2(const uint8_t *x, const BlockQ8_0 *y, int64_t blocks) {
    const __m128i values = _mm_loadu_si128((const __m128i *)mxfp4_values), low4 = _mm_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < blocks / 2; i++, x += 36)
        for (int half = 0; half < 2; half++) {
            const BlockQ8_0 *q = y + 2 * i + half;
            const __m128i bits = _mm_loadu_si128((const __m128i *)(x + 4 + 16 * half));
            const __m128i lo = _mm_shuffle_epi8(values, _mm_and_si128(bits, low4));
            const __m128i hi = _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(bits, 4), low4));
            const __m256i w = _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
            const __m256i sums = signed_pairs(w, _mm256_loadu_si256((const __m256i *)q->qs), _mm256_set1_epi16(1));
            const __m256 scales = _mm256_set_m128(_mm_set1_ps(ue4m3_halves[x[2 * half + 1]] * q->d),
                                                  _mm_set1_ps(ue4m3_halves[x[2 * half]] * q->d));
            acc = _mm256_fmadd_ps(scales, _mm256_cvtepi32_ps(sums), acc);
        }
    return hsum_lanes(acc);
}

/* ... with AVX-512 (VBMI, VNNI): a pair of blocks in one vector, the first's 32 values in its low half
 * and the second's in its high half, so the float lanes are the AVX2 kernel's acc1 (low) and acc2
 * (high) and every output its bits. Each nibble looks up its value + 128 (unsigned); VPDPBUSD of those
 * with the codes, started from -128 times each lane's four codes, gives the lanes of ggml's
 * maddubs(|w|, sign(y, w)) summed in pairs: the exact products of values 4l..4l + 3. */
#define AVX512_ALWAYS AVX512_TARGET static inline __attribute__((always_inline))

/* the nibbles of two blocks of `bytes` (raw: their bytes) as bytes: 16 low ones of the first, its 16
 * high ones, the second's */
AVX512_ALWAYS __m512i nibble_pair(__m512i raw, int bytes, int codes_at) {
    const __m512i at = _mm512_add_epi8(_mm512_set4_epi32(0x0F0E0D0C, 0x0B0A0908, 0x07060504, 0x03020100),
                                       _mm512_set1_epi8((char)codes_at));
    const __m512i second = _mm512_maskz_set1_epi8(0xFFFFFFFF00000000ULL, (char)bytes); /* 128-bit lanes 2, 3 */
    const __m512i q = _mm512_permutexvar_epi8(_mm512_add_epi8(at, second), raw);
    const __m512i shifts = _mm512_maskz_set1_epi16(0xFF00FF00u, 4); /* 128-bit lanes 1, 3: the high nibbles */
    return _mm512_and_si512(_mm512_srlv_epi16(q, shifts), _mm512_set1_epi8(15));
}

/* the 8-bit codes of blocks y, y + 1 in the two halves */
AVX512_ALWAYS __m512i q8_0_pair(const BlockQ8_0 *y) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y[0].qs)),
                              _mm256_loadu_si256((const __m256i *)y[1].qs), 1);
}

/* IQ4_NL's d of blocks y, y + 1 times those of its blocks x, x + 18 (F16s), in the low and high half */
AVX512_ALWAYS __m512 iq4_nl_pair_d(const uint8_t *x, __m512i raw, const BlockQ8_0 *y) {
    (void)raw;
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(y[0].d * f16c(x)), _mm512_set1_ps(y[1].d * f16c(x + 18)));
}

/* ... MXFP4's: the d times the E8M0 scale halved, 2^(e - 128) (bytes 0 and 17 of raw): one VSCALEFPS,
 * d * 2^(e - 128) rounded once, as the product with e8m0_half's exact power of 2 */
AVX512_ALWAYS __m512 mxfp4_pair_d(const uint8_t *x, __m512i raw, const BlockQ8_0 *y) {
    (void)x;
    const __m512 d = _mm512_mask_broadcastss_ps(_mm512_set1_ps(y[0].d), 0xFF00, _mm_load_ss(&y[1].d));
    const __m512i at = _mm512_mask_set1_epi32(_mm512_setzero_si512(), 0xFF00, 17); /* byte 0 or 17 a dword */
    const __m512i e = _mm512_maskz_permutexvar_epi8(0x1111111111111111ULL, at, raw);
    return _mm512_scalef_ps(d, _mm512_add_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(-128.0f)));
}

#define PAIRED_DOT_AVX512(NAME, BYTES, VALUES, CODES)                                                      \
    AVX512_ALWAYS float NAME##_avx512(const uint8_t *row, const BlockQ8_0 *y, int64_t blocks) {             \
        const __m512i flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();                  \
        const __m512i values = _mm512_xor_si512(                                                            \
            _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(VALUES))), flip); /* value + 128 */    \
        __m512 acc = _mm512_setzero_ps();                                                                   \
        int64_t i = 0;                                                                                      \
        for (; i + 1 < blocks; i += 2) {                                                                    \
            const uint8_t *x = row + i * (BYTES);                                                           \
            prefetch_ahead(x, 2 * (BYTES)); /* a line a pair or two: a row's at once stalled the kernel */   \
            const __m512i q8 = q8_0_pair(y + i);                                                            \
            const __m512i start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, q8));             \
            const __m512i raw = _mm512_maskz_loadu_epi8(((__mmask64)1 << (2 * (BYTES))) - 1, x); /* in the row */ \
            const __m512i w = _mm512_shuffle_epi8(values, nibble_pair(raw, BYTES, CODES));                  \
            const __m512 d = NAME##_pair_d(x, raw, y + i);                                                  \
            acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, w, q8)), acc);          \
        }                                                                                                   \
        const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));             \
        const float sumf = hsum_lanes(_mm256_add_ps(_mm512_castps512_ps256(acc), high));                   \
        return i < blocks ? NAME##_step(row + i * (BYTES), y + i, sumf) : sumf;                            \
    }                                                                                                       \
    IQ_ROWS(NAME##_rows_avx512, AVX512_TARGET, NAME##_avx512, q8_0, 32, 0)

PAIRED_DOT_AVX512(iq4_nl, 18, iq4nl_values, 2)
PAIRED_DOT_AVX512(mxfp4, 17, mxfp4_values, 1)

/* NVFP4 with AVX-512: a block's two halves (32 values, one Q8_0 block of activations each) in the two
 * 256-bit halves of one vector, each in the AVX2 kernel's byte order (a run's low nibbles 0-7, its high
 * ones 0-7, then those of bytes 8-15), their lanes by VPDPBUSD as MXFP4's above (ggml's lanes exactly),
 * then the AVX2 kernel's two FMAs a block, in its order: its bits. A weight row against n (at most
 * NVFP4_ROWS) input rows y[r] at once, into sums[r]: each block's values and run scales are decoded once
 * for all of them, and each row's operations are those it takes alone. */
#define NVFP4_ROWS 4 /* the kernel below takes 1-4 */
AVX512_ALWAYS void nvfp4_avx512_rows_of(const uint8_t *x, const BlockQ8_0 *const *y, int64_t blocks, const int n, float *sums) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    const __m512i values = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)mxfp4_values)), flip);
    const long long ones = 0x0101010101010101LL; /* qword j: bytes 4 + 16 (j / 4) + 8 (j % 4 / 2).. */
    const __m512i at = _mm512_add_epi8(_mm512_set1_epi64(0x0706050403020100LL),
                                       _mm512_set_epi64(28 * ones, 28 * ones, 20 * ones, 20 * ones, 12 * ones, 12 * ones, 4 * ones, 4 * ones));
    const __m512i shifts = _mm512_maskz_set1_epi16(0xF0F0F0F0u, 4); /* odd qwords: high nibbles */
    __m256 acc[NVFP4_ROWS];
    for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < blocks / 2; i++, x += 36) {
        prefetch_ahead(x, 36);
        const __m512i raw = _mm512_maskz_loadu_epi8(((__mmask64)1 << 36) - 1, x); /* in the row */
        const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi8(at, raw), shifts), _mm512_set1_epi8(15));
        const __m512i w = _mm512_shuffle_epi8(values, codes);
        const float run_scales[4] = {ue4m3_halves[x[0]], ue4m3_halves[x[1]], ue4m3_halves[x[2]], ue4m3_halves[x[3]]};
        for (int r = 0; r < n; r++) {
            const __m512i q8 = q8_0_pair(y[r] + 2 * i);
            const __m512i start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, q8));
            const __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, w, q8));
            const __m256 halves[2] = {_mm512_castps512_ps256(lanes), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1))};
            for (int half = 0; half < 2; half++) {
                const float d = y[r][2 * i + half].d;
                const __m256 scales = _mm256_set_m128(_mm_set1_ps(run_scales[2 * half + 1] * d), _mm_set1_ps(run_scales[2 * half] * d));
                acc[r] = _mm256_fmadd_ps(scales, halves[half], acc[r]);
            }
        }
    }
    for (int r = 0; r < n; r++) sums[r] = hsum_lanes(acc[r]);
}

/* NVFP4's row kernel: every weight row against the matrix's input rows NVFP4_ROWS at a time (the row's
 * bytes stay in L1 from one batch to the next) */
AVX512_TARGET static void nvfp4_rows_avx512(const Product *pr, int64_t b, int64_t first, int64_t last) {
    const int64_t blocks = pr->in_features / 32;
    for (int64_t m = first; m < last; m++) {
        const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;
        for (int64_t p = pr->starts[b]; p < pr->starts[b + 1]; p += NVFP4_ROWS) {
            const int n = pr->starts[b + 1] - p < NVFP4_ROWS ? (int)(pr->starts[b + 1] - p) : NVFP4_ROWS;
            const BlockQ8_0 *y[NVFP4_ROWS];
            float sums[NVFP4_ROWS];
            for (int r = 0; r < n; r++) y[r] = pr->q8_0 + pr->rows[p + r] * blocks;
            switch (n) { /* constant counts: the accumulators stay in registers */
                case 4: nvfp4_avx512_rows_of(row, y, blocks, 4, sums); break;
                case 3: nvfp4_avx512_rows_of(row, y, blocks, 3, sums); break;
                case 2: nvfp4_avx512_rows_of(row, y, blocks, 2, sums); break;
                default: nvfp4_avx512_rows_of(row, y, blocks, 1, sums);
            }
            for (int r = 0; r < n; r++) pr->out[(p + r) * pr->out_stride + m] = sums[r];
        }
    }
}

/* IQ4_XS with AVX-512: runs 2j, 2j + 1 of a block in one vector (low, high half), their lanes
 * madd(maddubs(|w|, y negated where w is), scales) as iq4_xs_run's, folded onto eight at the block's end
 * (exact integers): the AVX2 kernel's lanes and float operations, its bits */

/* the block's eight run scales (6 bits, less 32) as int32 lanes, run ib in lane ib */
AVX512_ALWAYS __m256i iq4_xs_scales(const uint8_t *x) {
    const __m256i low = _mm256_srlv_epi32(_mm256_set1_epi32((int)u32_at(x + 4)),
                                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i high = _mm256_srlv_epi32(_mm256_set1_epi32(u16_at(x + 2)),
                                           _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i scales = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(15)),
                                           _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(3)), 4));
    return _mm256_sub_epi32(scales, _mm256_set1_epi32(32));
}

AVX512_ALWAYS float iq4_xs_avx512(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {
    const __m512i values = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)iq4nl_values));
    const __m512i halves = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0); /* 16 bytes each twice */
    const __m512i shifts = _mm512_maskz_set1_epi16(0xFF00FF00u, 4);  /* 128-bit lanes 1, 3: high nibbles */
    const __m512i nibble = _mm512_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < blocks; i++, x += 136) {
        const __m512i scales = _mm512_castsi256_si512(iq4_xs_scales(x)); /* run ib's at int16 lane 2ib */
        __m512i sumi = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m256i codes = _mm256_loadu_si256((const __m256i *)(x + 8 + 32 * j));
            const __m512i q = _mm512_permutexvar_epi64(halves, _mm512_castsi256_si512(codes));
            const __m512i w = _mm512_shuffle_epi8(values, _mm512_and_si512(_mm512_srlv_epi16(q, shifts), nibble));
            const __m512i q8 = _mm512_loadu_si512(y[i].qs + 64 * j);
            const __m512i signed_q8 = _mm512_mask_sub_epi8(q8, _mm512_movepi8_mask(w), _mm512_setzero_si512(), q8);
            const __m512i pair = _mm512_mask_set1_epi16(_mm512_set1_epi16((short)(4 * j)), 0xFFFF0000u, (short)(4 * j + 2));
            const __m512i run_scales = _mm512_permutexvar_epi16(pair, scales);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_q8), run_scales);
        }
        const __m256i lanes = _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16c(x) * y[i].d), _mm256_cvtepi32_ps(lanes), acc);
    }
    return hsum_lanes(acc);
}
IQ_ROWS(iq4_xs_rows_avx512, AVX512_TARGET, iq4_xs_avx512, q8, 256, 1)

/* The ternary types with AVX-512: VPDPBUSD (256-bit) of each run's codes 0..2 with its activations gives
 * ggml's lanes (lane l: values 4l..4l + 3 of every run), less the Q8_K sums of 32 as ternary_total takes
 * them: exact, and the AVX2 kernel's float operations. Even and odd runs in two sums (one chain of eight
 * VPDPBUSD was 1.1x slower, as slow as the AVX2 kernel, on AMD EPYC). 512-bit vectors of two runs each
 * gained nothing there, nor on Intel Xeon (TQ1_0: 1.05-1.09x the AVX2 kernel, as the 256-bit one with
 * codes 0..2). TQ1_0 takes its codes as 64 times the trits (no shift and mask a run) and divides the
 * lanes by 64: 1.18-1.23x the AVX2 kernel on Intel Xeon. */
AVX512_ALWAYS __m256i tq2_0_sums(const uint8_t *x, const BlockQ8K *y) {
    __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int run = 0; run < 8; run++)
        sums[run & 1] = _mm256_dpbusd_epi32(sums[run & 1], tq2_0_codes(x, run), q8_run(y, run));
    return _mm256_add_epi32(sums[0], sums[1]);
}

#define TERNARY_DOT_AVX512(NAME, BYTES, D_AT)                                                              \
    AVX512_ALWAYS float NAME##_avx512(const uint8_t *x, const BlockQ8K *y, int64_t blocks) {                \
        __m256 acc = _mm256_setzero_ps();                                                                   \
        for (int64_t i = 0; i < blocks; i++, x += (BYTES)) {                                                \
            const __m256i sums = NAME##_sums(x, y + i);                                                     \
            const __m256i bsums16 = _mm256_loadu_si256((const __m256i *)y[i].bsums);                         \
            const __m256i bsums = _mm256_madd_epi16(bsums16, _mm256_set1_epi16(1));                         \
            const __m256i lanes = _mm256_sub_epi32(sums, bsums);                                            \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(y[i].d * f16c(x + (D_AT))), acc); \
        }                                                                                                   \
        return hsum_lanes(acc);                                                                             \
    }                                                                                                       \
    IQ_ROWS(NAME##_rows_avx512, AVX512_TARGET, NAME##_avx512, q8, 256, 1)

TERNARY_DOT_AVX512(tq2_0, 66, 64)

/* TQ1_0 with AVX-512 (VBMI, VNNI, GFNI): a block's 52 code bytes in one vector, each byte's five trits
 * made at once, not a position at a time. Trit 0 (the top one) is top_trits' two rounding averages,
 * its two bits kept in place (64 times the trit, as the AVX2 kernel's codes). `tq1_packed` (byte q: its
 * trits 1..4 as codes 0..2 at bits 2 (k - 1)), made from `trit` when the grids are set, gives the others:
 * one 256-entry lookup, two masked VPERMI2B on the byte's top bit (the kernel's busiest port runs each
 * for two cycles), then one GF2P8AFFINEQB a position moves its code to bits 6-7.
 * The vector holds bytes 0..47, then the last 4 bytes in each of dwords 12..15 (a masked broadcast
 * load); a dword's products sum in its own int32 lane, and lanes d and d + 8 fold onto ggml's lane d % 8
 * (lane l: values 4l..4l + 3 of every run). Trit k of bytes 0..31 is value 32k + m, lane m / 4; of bytes
 * 32..47, value 160 + 16k + m - 32: lanes 0..3 for even k (dwords 8..11), 4..7 for odd k, whose codes
 * take 128-bit blocks 2 and 3 swapped; the last bytes' trit k (value 240 + 4k + j, lane 4 + k) is dword
 * 12 + k's, trits 1 and 3 taken into trit 4's codes (whose dwords 12..15 are free) by that
 * GF2P8AFFINEQB's own matrices of qwords 6 and 7. The activations are put in that order once per call
 * (`Tq1X`: the five positions' 64 bytes, zero where no value is), and each block's sums start from -64
 * times its Q8_K sums of 32 (the codes' offset of 1): the fold divided by 64 is ggml's lanes exactly, and
 * they enter the AVX2 kernel's float operations: its bits. */
#define TQ1_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c,bmi2")))
#define TQ1_ALWAYS TQ1_TARGET static inline __attribute__((always_inline))
#define TQ1_RUN_ROWS 4 /* input rows sharing each decoded block */

static uint8_t tq1_packed[256] __attribute__((aligned(64)));

static void tq1_tables(void) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    for (int q = 0; q < 256; q++) {
        tq1_packed[q] = 0;
        for (int k = 1; k < 5; k++) tq1_packed[q] |= (uint8_t)((trit((uint8_t)q, pow3[k]) + 1) << 2 * (k - 1));
    }
}

/* an input row's Q8_K block in the kernel's order: the activations of trit position k's vector, the
 * int32 lanes' start and d */
typedef struct {
    int8_t codes[5][64];
    int32_t start[8];
    float d[2]; /* this block's d and the next one's (0 after the last) */
} __attribute__((aligned(64))) Tq1X;

/* where each position's values lie in its vector: (byte, first value, count) runs */
static void tq1_x(const BlockQ8K *y, int64_t blocks, Tq1X *out) {
    static const int16_t runs[5][4][3] = {{{0, 0, 32}, {32, 160, 16}, {48, 240, 4}, {0, 0, 0}},
                                          {{0, 32, 32}, {48, 176, 16}, {0, 0, 0}, {0, 0, 0}},
                                          {{0, 64, 32}, {32, 192, 16}, {56, 248, 4}, {0, 0, 0}},
                                          {{0, 96, 32}, {48, 208, 16}, {0, 0, 0}, {0, 0, 0}},
                                          {{0, 128, 32}, {32, 224, 16}, {52, 244, 4}, {60, 252, 4}}};
    for (int64_t i = 0; i < blocks; i++) {
        memset(&out[i], 0, sizeof out[i]);
        for (int k = 0; k < 5; k++)
            for (int r = 0; r < 4; r++) memcpy(out[i].codes[k] + runs[k][r][0], y[i].qs + runs[k][r][1], (size_t)runs[k][r][2]);
        for (int l = 0; l < 8; l++) out[i].start[l] = -64 * (y[i].bsums[2 * l] + y[i].bsums[2 * l + 1]);
        out[i].d[0] = y[i].d;
        out[i].d[1] = i + 1 < blocks ? y[i + 1].d : 0.0f;
    }
}

/* the GF2P8AFFINEQB matrix (qword) moving bits `from`, `from` + 1 of each byte to bits 6, 7, others 0 */
#define TQ1_TOP(from) ((1ULL << (from)) << 8 | (1ULL << ((from) + 1)))

/* 64 bytes of a 256-entry table (four vectors) at `index`, `top` its bytes' top bits */
TQ1_ALWAYS __m512i tq1_lookup(const __m512i table[4], __m512i index, __mmask64 top) {
    const __m512i high = _mm512_mask2_permutex2var_epi8(table[2], index, top, table[3]); /* else the index */
    return _mm512_mask2_permutex2var_epi8(table[0], high, _knot_mask64(top), table[1]);
}

/* the five positions' codes (64 times the trits) of the block at x, in Tq1X's order: trit 0 computed
 * (top_trits' rounding averages, its two bits kept in place), trits 1..4 looked up */
TQ1_ALWAYS void tq1_codes(const uint8_t *x, const __m512i packed[4], __m512i codes[5]) {
    const __m512i q = _mm512_mask_broadcastd_epi32(_mm512_maskz_loadu_epi8(~0ULL >> 16, x), 0xF000, _mm_loadu_si32(x + 48));
    const __m512i a = tq1_lookup(packed, q, _mm512_movepi8_mask(q)), swapped = _mm512_shuffle_i64x2(a, a, 0xB4); /* blocks 0, 1, 3, 2 */
    const __m512i less = _mm512_subs_epu8(q, _mm512_set1_epi8(1));
    const __m512i scaled = _mm512_avg_epu8(less, _mm512_avg_epu8(less, _mm512_setzero_si512()));
    codes[0] = _mm512_and_si512(scaled, _mm512_set1_epi8((char)0xC0));
    codes[1] = _mm512_gf2p8affine_epi64_epi8(swapped, _mm512_set1_epi64((long long)TQ1_TOP(0)), 0);
    codes[2] = _mm512_gf2p8affine_epi64_epi8(a, _mm512_set1_epi64((long long)TQ1_TOP(2)), 0);
    codes[3] = _mm512_gf2p8affine_epi64_epi8(swapped, _mm512_set1_epi64((long long)TQ1_TOP(4)), 0);
    const long long top = (long long)TQ1_TOP(6); /* trit 4; the last bytes' trits 1, 3 at dwords 12..15 */
    codes[4] = _mm512_gf2p8affine_epi64_epi8(a, _mm512_set_epi64((long long)TQ1_TOP(4), (long long)TQ1_TOP(0), top, top, top, top, top, top), 0);
}

/* a block's 16 int32 lanes, 64 times (ggml's lanes, each twice folded): row X's */
TQ1_ALWAYS __m512i tq1_sums(const __m512i codes[5], const Tq1X *X) {
    __m512i sums = _mm512_zextsi256_si512(_mm256_load_si256((const __m256i *)X->start));
    for (int k = 0; k < 5; k++) sums = _mm512_dpbusd_epi32(sums, codes[k], _mm512_load_si512(X->codes[k]));
    return sums;
}

/* blocks i and i + 1 of weight row `row` against n input rows (TWO: the second is there) */
TQ1_ALWAYS void tq1_pair(const uint8_t *row, int64_t i, const int two, const __m512i packed[4],
                         const Tq1X *const *xs, __m256 *acc, const int n) {
    __m512i codes[2][5];
    prefetch_ahead(row + 54 * i, 108); /* a line or two a pair: a row's lines asked for at once stalled it */
    for (int h = 0; h < 1 + two; h++) tq1_codes(row + 54 * (i + h), packed, codes[h]);
    const uint32_t halves = (uint32_t)u16_at(row + 54 * i + 52) | (two ? (uint32_t)u16_at(row + 54 * (i + 1) + 52) << 16 : 0);
    const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128((int)halves)); /* the pair's d in lanes 0, 1 */
    for (int r = 0; r < n; r++) {
        const __m128 d = _mm_mul_ps(dw, _mm_castpd_ps(_mm_load_sd((const double *)(const void *)xs[r][i].d)));
        const __m512i first = tq1_sums(codes[0], xs[r] + i);
        const __m512i second = two ? tq1_sums(codes[1], xs[r] + i + 1) : _mm512_setzero_si512();
        const __m512i low = _mm512_shuffle_i64x2(first, second, 0x44), high = _mm512_shuffle_i64x2(first, second, 0xEE);
        const __m512 lanes = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_add_epi32(low, high), 6));
        acc[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(lanes), _mm256_broadcastss_ps(d), acc[r]);
        if (two)
            acc[r] = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)),
                                     _mm256_broadcastss_ps(_mm_movehdup_ps(d)), acc[r]);
    }
}

/* weight row `row` against n input rows: each one's hsum_lanes of its eight float lanes into out[r] */
TQ1_ALWAYS void tq1_row(const uint8_t *row, int64_t blocks, const Tq1X *const *xs, float *out, const int n) {
    __m512i packed[4];
    for (int t = 0; t < 4; t++) packed[t] = _mm512_load_si512(tq1_packed + 64 * t);
    __m256 acc[TQ1_RUN_ROWS];
    for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 1 < blocks; i += 2) tq1_pair(row, i, 1, packed, xs, acc, n);
    if (i < blocks) tq1_pair(row, i, 0, packed, xs, acc, n);
    for (int r = 0; r < n; r++) out[r] = hsum_lanes(acc[r]);
}

/* rows first..last - 1 of matrix b against its input rows, TQ1_RUN_ROWS at a time put in Tq1X order */
TQ1_TARGET static void tq1_0_rows_avx512(const Product *pr, int64_t b, int64_t first, int64_t last) {
    const int64_t blocks = pr->in_features / 256;
    Tq1X *buffer = aligned_alloc(64, (size_t)(TQ1_RUN_ROWS * blocks) * sizeof(Tq1X));
    if (buffer == NULL) { /* no memory for the activations: the AVX2 kernel (the same bits) */
        iq_q8_kernel_avx2(34)(pr, b, first, last);
        return;
    }
    for (int64_t p = pr->starts[b]; p < pr->starts[b + 1]; p += TQ1_RUN_ROWS) {
        const int n = pr->starts[b + 1] - p < TQ1_RUN_ROWS ? (int)(pr->starts[b + 1] - p) : TQ1_RUN_ROWS;
        const Tq1X *xs[TQ1_RUN_ROWS];
        for (int r = 0; r < n; r++) {
            tq1_x(pr->q8 + pr->rows[p + r] * blocks, blocks, buffer + r * blocks);
            xs[r] = buffer + r * blocks;
        }
        for (int64_t m = first; m < last; m++) {
            const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;
            float out[TQ1_RUN_ROWS];
            switch (n) { /* each count compiled apart */
                case 4: tq1_row(row, blocks, xs, out, 4); break;
                case 3: tq1_row(row, blocks, xs, out, 3); break;
                case 2: tq1_row(row, blocks, xs, out, 2); break;
                default: tq1_row(row, blocks, xs, out, 1); break;
            }
            for (int r = 0; r < n; r++) pr->out[(p + r) * pr->out_stride + m] = out[r];
        }
    }
    free(buffer);
}

/* the AVX-512 kernel of IQ4_NL, MXFP4, NVFP4, IQ4_XS, TQ2_0 or TQ1_0 where HAVE_AVX512(), else NULL */
static RowKernel nibble_kernel_avx512(int ggml_type) {
    if (!HAVE_AVX512()) return NULL;
    switch (ggml_type) {
        case 20: return iq4_nl_rows_avx512;
        case 39: return mxfp4_rows_avx512;
        case 40: return nvfp4_rows_avx512;
        case 23: return iq4_xs_rows_avx512;
        case 35: return tq2_0_rows_avx512;
        case 34: return __builtin_cpu_supports("gfni") ? tq1_0_rows_avx512 : NULL;
        default: return NULL;
    }
}

/* X(GGML type id, name, bytes a block, FACTOR, DELTAS): the SHARED_RUNS types, whose blocks
 * `iq_run_type` decodes for the multi-row kernels (`tiles_cpu.c`) */
#define SHARED_RUN_TYPES(X)                                                                              \
    X(16, iq2_xxs, 66, 0.125f, 0) X(17, iq2_xs, 74, 0.125f, 0) X(22, iq2_s, 82, 0.125f, 0)              \
    X(18, iq3_xxs, 98, 0.25f, 0) X(21, iq3_s, 110, 1.0f, 0) X(23, iq4_xs, 136, 1.0f, 0) X(19, iq1_s, 50, 1.0f, 1)

#define BLOCK_RUNS(ID, NAME, BYTES, FACTOR, DELTAS)                                                      \
    __attribute__((target("avx2,fma,f16c,bmi2"))) static void NAME##_block_runs(const uint8_t *x, IqRuns *out) { \
        for (int ib = 0; ib < 8; ib++) {                                                                 \
            const Run run = NAME##_run(x, ib);                                                           \
            _mm256_store_si256((__m256i *)out->w[ib], run.w);                                            \
            _mm256_store_si256((__m256i *)out->sign[ib], run.sign);                                      \
            _mm256_store_si256((__m256i *)out->scales[ib], run.scales);                                  \
            const uint16_t qh = u16_at(x + 34 + 2 * ib); /* IQ1_S's, as iq1_s_deltas reads them */      \
            out->deltas[ib] = (DELTAS) ? (1 - 2 * (qh >> 15)) * (2 * ((qh >> 12) & 7) + 1) : 0;          \
        }                                                                                                \
        out->d = f16c(x);                                                                                \
    }
SHARED_RUN_TYPES(BLOCK_RUNS)
#define RUN_TYPE_CASE(ID, NAME, BYTES, FACTOR, DELTAS) \
    case ID: return (IqRunType){NAME##_block_runs, BYTES, DELTAS, FACTOR};
IqRunType iq_run_type(int ggml_type, int avx2) {
    if (grids_set && avx2 && __builtin_cpu_supports("bmi2")) switch (ggml_type) {
            SHARED_RUN_TYPES(RUN_TYPE_CASE)
        }
    return (IqRunType){NULL, 0, 0, 0.0f};
}

#define AVX2_ROWS(ID, NAME, Y, ELEMS) \
    IQ_ROWS(NAME##_rows_avx2, __attribute__((target("avx2,fma,f16c,bmi2"))), NAME##_avx2, Y, ELEMS, 1)
ROW_TYPES(AVX2_ROWS)
#define AVX2_ROWS_OF(NAME) NAME##_rows_avx2
#else
#define AVX2_ROWS_OF(NAME) NULL
static RowKernel nibble_kernel_avx512(int ggml_type) { return NULL; }
IqRunType iq_run_type(int ggml_type, int avx2) { return (IqRunType){NULL, 0, 0, 0.0f}; }
#endif

/* `avx2`: the machine has AVX2 and FMA (and the portable kernels are not asked for); these also take BMI2
 * (every x86-64-v3 machine has it) */
static RowKernel ggml_kernel(int ggml_type, int avx2) {
#if K3_X86_SIMD
    avx2 = avx2 && __builtin_cpu_supports("bmi2");
#endif
#define KERNEL_CASE(ID, NAME, Y, ELEMS) \
    case ID: return !grids_set ? NULL : avx2 && AVX2_ROWS_OF(NAME) != NULL ? AVX2_ROWS_OF(NAME) : NAME##_rows_generic;
    switch (ggml_type) {
        IQ_TYPES(KERNEL_CASE)
        default: return NULL;
    }
}

/* ... the AVX-512 one first where the machine has it */
RowKernel iq_q8_kernel(int ggml_type, int avx2) {
    if (!avx2 || !grids_set) return ggml_kernel(ggml_type, avx2);
    const RowKernel planes = iq_avx512_kernel(ggml_type), nibbles = nibble_kernel_avx512(ggml_type);
    return planes != NULL ? planes : nibbles != NULL ? nibbles : ggml_kernel(ggml_type, avx2);
}

RowKernel iq_q8_kernel_avx2(int ggml_type) { return ggml_kernel(ggml_type, 1); }

int iq_q8_0_activations(int ggml_type) { return ggml_type == 20 || ggml_type == 39 || ggml_type == 40; }
