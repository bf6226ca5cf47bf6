/* The integer one-row kernels of Q8_0, Q2_K, Q3_K, Q4_K and Q6_K on 8-bit activations, and Q8_0's
 * multi-row kernel, with AVX-512 (F, BW, VL, VNNI, VBMI), where the CPU has them (HAVE_AVX512();
 * K3STREAM_NO_AVX512=1 keeps the AVX2 ones of ggml_cpu.c and tiles_cpu.c).
 *
 * The contract: every output is bit for bit the AVX2 kernel's. Each block's integer sums land in the
 * same eight int32 lanes (lane l: the products of bytes 4l..4l + 3 of each 32-byte run, times their
 * sub-block scale), exact however they are formed, and enter the same float lanes by the same FMAs in
 * block order, summed at the end by hsum8. So Q8_0 and Q6_K stay llama.cpp's AVX2 vec_dot bit for bit,
 * and the multi-row tiles (tiles_cpu.c, AVX2) stay each row's one-row result.
 *
 * What AVX-512 changes: VNNI's vpdpbusd (unsigned x signed bytes into int32 lanes) and vpdpwssd (int16
 * pairs into them) fuse the AVX2 kernels' maddubs/madd/add chains; the K-quants take two 32-value runs
 * in one 64-byte vector (their lanes folded onto eight at the block's end), their scales spread by one
 * vpermw (Q2_K: each code looks up its code-times-scale byte, one vpdpbusd a pair of runs); Q8_0's
 * multi-row kernel holds two weight rows in one 64-byte vector, each half that row's eight lanes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)

#define AVX512_INLINE AVX512_TARGET static inline __attribute__((always_inline))

AVX512_INLINE float f16_scale(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
}

/* ---- Q8_0: signed codes times signed codes -------------------------------------------------------
 * w . y = (w + 128) . y - 128 sum(y): the first by vpdpbusd on w's bytes with the top bit flipped
 * (unsigned w + 128), started from -128 times each lane's four activations: the int32 lanes of ggml's
 * maddubs(|w|, sign(y, w)) pairs. One weight row at a time, one sequential stream (four rows against
 * each activation block, four streams, ran 0.6-0.9x as fast from RAM on AMD EPYC, Zen 4), its lines
 * PREFETCH_BYTES ahead asked for in software as the AVX2 kernels do (every one-row kernel here): on
 * Intel Xeon (Emerald Rapids) the one-row kernels ran 1.5-2x as fast from RAM with it (Q8_0 1.7-2x, Q6_K
 * 1.6x, Q2_K 1.5-1.7x, Q4_K 1.8x; one thread, 4 KiB and 2 MiB pages alike); on Zen 4 it gained nothing. */
AVX512_TARGET static void q8_0_avx512(const Product *pr, int64_t b, int64_t first, int64_t last) {
    const int64_t blocks = pr->in_features / 32;
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    for (int64_t m = first; m < last; m++) {
        const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;
        for (int64_t p = pr->starts[b]; p < pr->starts[b + 1]; p++) {
            const BlockQ8_0 *y = pr->q8_0 + pr->rows[p] * blocks;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t k = 0; k < blocks; k++) {
                const uint8_t *block = row + 34 * k;
                prefetch_ahead(block, 34);
                const __m256i q8 = _mm256_loadu_si256((const __m256i *)y[k].qs);
                const __m256i start = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, flip, q8));
                const __m256i codes = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(block + 2)), flip);
                const __m256i sums = _mm256_dpbusd_epi32(start, codes, q8);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_scale(block) * y[k].d), _mm256_cvtepi32_ps(sums), acc);
            }
            pr->out[p * pr->out_stride + m] = hsum8(acc);
        }
    }
}

/* ---- K-quants: runs 2j and 2j + 1 of a block (its 64 values from 64j) in one vector --------------- */

/* the int16 scales of runs 2j, 2j + 1 from a block's 16 sub-block scales (int16 lanes of `scales`):
 * scale 4j + i on int16 lanes 8i..8i + 7, the pairs of products of sub-block 4j + i */
AVX512_INLINE __m512i run_pair_scales(__m512i scales, int j) {
    const __m512i lane = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                         7, 6, 5, 4, 3, 2, 1, 0),
        3);
    return _mm512_permutexvar_epi16(_mm512_add_epi16(lane, _mm512_set1_epi16((short)(4 * j))), scales);
}

/* 32 bytes at p in both halves */
AVX512_INLINE __m512i both_halves(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

/* each 16-bit lane of the low half shifted right by `low`, of the high half by `high` */
AVX512_INLINE __m512i shift_halves(__m512i v, int low, int high) {
    const __m512i counts = _mm512_inserti64x4(_mm512_set1_epi16((short)low), _mm256_set1_epi16((short)high), 1);
    return _mm512_srlv_epi16(v, counts);
}

/* the eight int32 lanes of both halves summed: each lane's sum over all runs */
AVX512_INLINE __m256i fold(__m512i sums) {
    return _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
}

/* sums[r] += input row r's products with the run pair's codes, each pair of products times its scale */
AVX512_INLINE void run_pair_dot(__m512i codes, __m512i scales, const BlockQ8K *const *y, int64_t at, int j,
                                __m512i *sums, const int n) {
    for (int r = 0; r < n; r++) {
        const __m512i q8 = _mm512_loadu_si512((const void *)(y[r][at].qs + 64 * j));
        sums[r] = _mm512_dpwssd_epi32(sums[r], _mm512_maddubs_epi16(codes, q8), scales);
    }
}

/* every byte of 128-bit lane i set to base + 4i (the table's bytes of sub-block base / 4 + i start there) */
AVX512_INLINE __m512i lane_bytes(int base) {
    const int at = base * 0x01010101, step = 4 * 0x01010101;
    return _mm512_set_epi32(at + 3 * step, at + 3 * step, at + 3 * step, at + 3 * step, at + 2 * step, at + 2 * step,
                            at + 2 * step, at + 2 * step, at + step, at + step, at + step, at + step, at, at, at, at);
}

/* Q2_K's scaled codes: byte 4i + c holds c times sub-block i's scale (at most 45: an unsigned byte) */
AVX512_INLINE __m512i q2_k_scaled_codes(__m128i scales) {
    const __m512i quarter = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(0x01010101));
    const __m512i scale = _mm512_permutexvar_epi8(quarter, _mm512_castsi128_si512(scales));
    const __m512i odd = _mm512_set1_epi32((int)0xFF00FF00), high = _mm512_set1_epi32((int)0xFFFF0000);
    return _mm512_add_epi8(_mm512_and_si512(scale, odd), _mm512_and_si512(_mm512_add_epi8(scale, scale), high));
}

/* Q2_K's runs 2j, 2j + 1 (codes at bits 2f of bytes 16 + 32g.. for run 4g + f), each code times its
 * sub-block's scale, looked up in `table` (q2_k_scaled_codes): sub-block 4j + i on 128-bit lane i */
AVX512_INLINE __m512i q2_k_pair(const uint8_t *restrict b, __m512i table, int j) {
    const int f = 2 * (j & 1);
    const __m512i codes = shift_halves(both_halves(b + 16 + 32 * (j >> 1)), 2 * f, 2 * f + 2);
    /* (codes & 3) | 4 (sub-block): the table's byte */
    const __m512i at = _mm512_ternarylogic_epi32(codes, _mm512_set1_epi8(3), lane_bytes(16 * j), 0xEA);
    return _mm512_permutexvar_epi8(at, table);
}

/* acc[r] += one Q2_K block times input row r's Q8_K block, as ggml_cpu.c's q8_q2_k: the scaled codes'
 * sums by one vpdpbusd a pair of runs */
AVX512_INLINE void q2_k_block(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, __m256 *acc,
                              const int n) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)b), nibble = _mm_set1_epi8(15);
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
    const __m512i table = q2_k_scaled_codes(_mm_and_si128(packed, nibble));
    __m512i sums[4];
    for (int r = 0; r < n; r++) sums[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m512i scaled = q2_k_pair(b, table, j);
        for (int r = 0; r < n; r++)
            sums[r] = _mm512_dpbusd_epi32(sums[r], scaled, _mm512_loadu_si512((const void *)(y[r][at].qs + 64 * j)));
    }
    const float step = f16_scale(b + 80), min_step = f16_scale(b + 82);
    for (int r = 0; r < n; r++) {
        const __m256i offsets = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)y[r][at].bsums));
        const float d = y[r][at].d * step, dmin = -y[r][at].d * min_step;
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(fold(sums[r])), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(offsets), acc[r]);
    }
}

/* Q3_K's codes + 4 of runs 2j, 2j + 1 (q8_q3_k's): the low two bits, plus 4 where bit 4g + f of hmask is
 * set (found by a mask test) */
AVX512_INLINE __m512i q3_k_pair(const uint8_t *restrict b, int j) {
    const int g = j >> 1, f = 2 * (j & 1), bit = 4 * g + f;
    const __m512i low = _mm512_and_si512(shift_halves(both_halves(b + 32 + 32 * g), 2 * f, 2 * f + 2), _mm512_set1_epi8(3));
    const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << bit)), _mm256_set1_epi8((char)(2 << bit)), 1);
    const __mmask64 high = _mm512_test_epi8_mask(both_halves(b), bits);
    return _mm512_mask_add_epi8(low, high, low, _mm512_set1_epi8(4));
}

/* acc[r] += one Q3_K block times input row r's Q8_K block, as ggml_cpu.c's q8_q3_k (the 4 taken back
 * from the Q8_K sums) */
AVX512_INLINE void q3_k_block(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, __m256 *acc,
                              const int n) {
    const __m256i wide = _mm256_cvtepi8_epi16(q3_k_scales8(b));
    const __m512i scales = _mm512_castsi256_si512(wide);
    __m512i sums[4];
    for (int r = 0; r < n; r++) sums[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) run_pair_dot(q3_k_pair(b, j), run_pair_scales(scales, j), y, at, j, sums, n);
    const float step = f16_scale(b + 108);
    for (int r = 0; r < n; r++) {
        const __m256i fours = _mm256_madd_epi16(wide, _mm256_loadu_si256((const __m256i *)y[r][at].bsums));
        const __m256i total = _mm256_sub_epi32(fold(sums[r]), _mm256_slli_epi32(fours, 2));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(step * y[r][at].d), _mm256_cvtepi32_ps(total), acc[r]);
    }
}

/* Q4_K's 8 sub-block scales (int16 lanes 0..7) and mins (lanes 8..15), as ggml unpacks its 12 bytes */
AVX512_INLINE __m256i q4_k_scales_mins(const uint8_t *restrict b) {
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);
    const uint32_t mins_low = u[1] & low6;
    u[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);
    u[2] = mins_low;
    u[0] &= low6;
    return _mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));
}

/* acc[r] += one Q4_K block times input row r's Q8_K block, as ggml_cpu.c's q8_q4_k: sub-blocks 2j
 * (low nibbles) and 2j + 1 (high) of bytes 16 + 32j.. in one vector; the mins' integer sum into lane 0 */
AVX512_INLINE void q4_k_block(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, __m256 *acc,
                              const int n) {
    const __m256i scales_mins = q4_k_scales_mins(b);
    const __m512i scales = _mm512_castsi256_si512(scales_mins);
    const __m512i lane = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                         7, 6, 5, 4, 3, 2, 1, 0),
        4);
    __m512i sums[4];
    for (int r = 0; r < n; r++) sums[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m512i codes = _mm512_and_si512(shift_halves(both_halves(b + 16 + 32 * j), 0, 4), _mm512_set1_epi8(15));
        const __m512i pair = _mm512_permutexvar_epi16(_mm512_add_epi16(lane, _mm512_set1_epi16((short)(2 * j))), scales);
        run_pair_dot(codes, pair, y, at, j, sums, n);
    }
    /* the mins beside the Q8_K sums of 32 (pairs of sums of 16) */
    const __m128i mins = _mm256_extracti128_si256(scales_mins, 1);
    const float step = f16_scale(b), min_step = f16_scale(b + 2);
    for (int r = 0; r < n; r++) {
        const __m256i bsums = _mm256_loadu_si256((const __m256i *)y[r][at].bsums);
        const __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
        __m128i s = _mm_madd_epi16(mins, pairs);
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        const int summs = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(y[r][at].d * step), _mm256_cvtepi32_ps(fold(sums[r])), acc[r]);
        acc[r] = _mm256_add_ps(acc[r], _mm256_setr_ps(-y[r][at].d * min_step * (float)summs, 0, 0, 0, 0, 0, 0, 0));
    }
}

/* Q6_K's codes (0..63) of runs 2j, 2j + 1: low nibbles of the 64 bytes at 64(j / 2), shift 4 (j % 2);
 * high bits at 128 + 32(j / 2), shifts 2(2j % 4) and 2(2j % 4) + 2 (q6_k_codes' layout) */
AVX512_INLINE __m512i q6_k_pair(const uint8_t *restrict b, int j) {
    const int half = j >> 1, shift = 4 * (j & 1);
    const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * half));
    const __m512i low = _mm512_and_si512(_mm512_srli_epi16(ql, shift), _mm512_set1_epi8(15));
    const __m512i high = _mm512_and_si512(shift_halves(both_halves(b + 128 + 32 * half), shift, shift + 2), _mm512_set1_epi8(3));
    return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
}

/* acc[r] += one Q6_K block times input row r's Q8_K block, as ggml_cpu.c's q8_q6_k (and ggml's AVX2
 * vec_dot): codes less 32 by the Q8_K sums */
AVX512_INLINE void q6_k_block(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, __m256 *acc,
                              const int n) {
    const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    const __m512i scales = _mm512_castsi256_si512(wide);
    __m512i sums[4];
    for (int r = 0; r < n; r++) sums[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) run_pair_dot(q6_k_pair(b, j), run_pair_scales(scales, j), y, at, j, sums, n);
    const float step = f16_scale(b + 208);
    for (int r = 0; r < n; r++) {
        const __m256i offsets = _mm256_mullo_epi32(
            _mm256_madd_epi16(wide, _mm256_loadu_si256((const __m256i *)y[r][at].bsums)), _mm256_set1_epi32(-32));
        const __m256i total = _mm256_add_epi32(offsets, fold(sums[r]));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(step * y[r][at].d), _mm256_cvtepi32_ps(total), acc[r]);
    }
}

/* One weight row m against n input rows from p: blocks in order into each row's eight lanes */
#define SHARED_ROWS(NAME, BLOCK, BLOCK_BYTES)                                                           \
    Q8K_SHARED_ROWS(AVX512_INLINE, NAME, BLOCK, BLOCK_BYTES)                                            \
    AVX512_TARGET static void NAME(const Product *pr, int64_t b, int64_t first, int64_t last) {         \
        for (int64_t m = first; m < last; m++) {                                                        \
            const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;       \
            int64_t p = pr->starts[b];                                                                  \
            for (; p + Q8_ROWS <= pr->starts[b + 1]; p += Q8_ROWS) NAME##_rows(pr, row, m, p, Q8_ROWS); \
            const int64_t rest = pr->starts[b + 1] - p;                                                 \
            if (rest == 3) NAME##_rows(pr, row, m, p, 3);                                               \
            if (rest == 2) NAME##_rows(pr, row, m, p, 2);                                               \
            if (rest == 1) NAME##_rows(pr, row, m, p, 1);                                               \
        }                                                                                               \
    }

SHARED_ROWS(q2_k_avx512, q2_k_block, 84)
SHARED_ROWS(q3_k_avx512, q3_k_block, 110)
SHARED_ROWS(q4_k_avx512, q4_k_block, 144)

SHARED_ROWS(q6_k_avx512, q6_k_block, 210)

/* ---- Q8_0 with several input rows (prefill): tiles_cpu.c's blocking, the one-row kernel's bits ------
 * TILE_PAIRS pairs of weight rows' CHUNK_BLOCKS blocks are held once as the one-row kernel uses them
 * (codes with the top bit flipped, d), a pair in one 64-byte vector (row 2i's block in the low half, row
 * 2i + 1's in the high half: each half's eight int32 and float lanes are that row's lanes, each FMA that
 * row's FMA in block order); every input row of the matrix then runs past them, INPUTS_AT_ONCE at a
 * time (each activation block's vpdpbusd start serving the four pairs). Partial sums wait in memory
 * between chunks (no rounding). One vpdpbusd, conversion, scale product and FMA serve two weight rows: on Intel
 * Xeon (Emerald Rapids) 1.5x the same blocking on 32-byte vectors at 16 input rows, 1.9x at 33. */
#define TILE_PAIRS 4
#define CHUNK_BLOCKS 16
#define PARK_ROWS 64
#define INPUTS_AT_ONCE 4

typedef struct {
    __m512i codes[TILE_PAIRS][CHUNK_BLOCKS];
    __m512 d[TILE_PAIRS][CHUNK_BLOCKS]; /* each half that row's d */
} Q80Tile;

/* the two 32-byte halves of a vector */
AVX512_INLINE __m512i join_halves(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }

AVX512_INLINE __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* parked[r][i] gains input row r's `count` blocks y[r] against the tile's `pairs` pairs of weight rows */
AVX512_INLINE void q8_0_tile_dot(const Q80Tile *tile, const BlockQ8_0 *const *y, int count, __m512 (*parked)[TILE_PAIRS],
                                 const int pairs, const int inputs) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512 acc[INPUTS_AT_ONCE][TILE_PAIRS];
    for (int r = 0; r < inputs; r++)
        for (int i = 0; i < pairs; i++) acc[r][i] = parked[r][i];
    for (int j = 0; j < count; j++)
        for (int r = 0; r < inputs; r++) {
            const __m512i q8 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)y[r][j].qs));
            const __m512i start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, q8));
            const __m512 dy = _mm512_set1_ps(y[r][j].d);
            for (int i = 0; i < pairs; i++) {
                const __m512i sums = _mm512_dpbusd_epi32(start, tile->codes[i][j], q8);
                acc[r][i] = _mm512_fmadd_ps(_mm512_mul_ps(tile->d[i][j], dy), _mm512_cvtepi32_ps(sums), acc[r][i]);
            }
        }
    for (int r = 0; r < inputs; r++)
        for (int i = 0; i < pairs; i++) parked[r][i] = acc[r][i];
}

/* blocks c..c + count - 1 of weight rows m..m + n - 1 into the tile (an odd row's pair takes it twice) */
AVX512_INLINE void q8_0_tile_fill(Q80Tile *tile, const uint8_t *rows, int64_t row_bytes, int64_t c, int count, const int n) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int i = 0; i < (n + 1) / 2; i++) {
        const uint8_t *low = rows + 2 * i * row_bytes + c * 34;
        const uint8_t *high = 2 * i + 1 < n ? low + row_bytes : low;
        for (int j = 0; j < count; j++) {
            prefetch_ahead(low + 34 * j, 34);
            if (high != low) prefetch_ahead(high + 34 * j, 34);
            tile->codes[i][j] = _mm512_xor_si512(join_halves(_mm256_loadu_si256((const __m256i *)(low + 34 * j + 2)),
                                                             _mm256_loadu_si256((const __m256i *)(high + 34 * j + 2))),
                                                 _mm512_broadcast_i64x4(flip));
            tile->d[i][j] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(f16_scale(low + 34 * j))),
                                                                _mm256_castps_pd(_mm256_set1_ps(f16_scale(high + 34 * j))), 1));
        }
    }
}

/* weight rows m..m + n - 1 (n <= 2 TILE_PAIRS) of matrix b against all its input rows */
AVX512_INLINE void q8_0_tile_group(const Product *pr, int64_t b, int64_t m, const int n) {
    const int64_t blocks = pr->in_features / 32, end = pr->starts[b + 1];
    const uint8_t *rows = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;
    const int pairs = (n + 1) / 2;
    Q80Tile tile;
    __m512 parked[PARK_ROWS][TILE_PAIRS];
    for (int64_t p0 = pr->starts[b]; p0 < end; p0 += PARK_ROWS) {
        const int64_t inputs = end - p0 < PARK_ROWS ? end - p0 : PARK_ROWS;
        for (int64_t c = 0; c < blocks; c += CHUNK_BLOCKS) {
            const int count = blocks - c < CHUNK_BLOCKS ? (int)(blocks - c) : CHUNK_BLOCKS;
            q8_0_tile_fill(&tile, rows, pr->row_bytes, c, count, n);
            for (int64_t p = 0; c == 0 && p < inputs; p++)
                for (int i = 0; i < pairs; i++) parked[p][i] = _mm512_setzero_ps();
            for (int64_t p = 0; p < inputs; p += INPUTS_AT_ONCE) {
                const BlockQ8_0 *y[INPUTS_AT_ONCE];
                const int at_once = inputs - p < INPUTS_AT_ONCE ? (int)(inputs - p) : INPUTS_AT_ONCE;
                for (int r = 0; r < at_once; r++) y[r] = pr->q8_0 + pr->rows[p0 + p + r] * blocks + c;
                switch (at_once) { /* each count compiled apart */
                    case 4: q8_0_tile_dot(&tile, y, count, parked + p, pairs, 4); break;
                    case 3: q8_0_tile_dot(&tile, y, count, parked + p, pairs, 3); break;
                    case 2: q8_0_tile_dot(&tile, y, count, parked + p, pairs, 2); break;
                    default: q8_0_tile_dot(&tile, y, count, parked + p, pairs, 1); break;
                }
            }
        }
        for (int64_t p = 0; p < inputs; p++)
            for (int w = 0; w < n; w++) {
                const __m512 sums = parked[p][w / 2];
                pr->out[(p0 + p) * pr->out_stride + m + w] = hsum8(w % 2 ? high_half(sums) : _mm512_castps512_ps256(sums));
            }
    }
}

AVX512_TARGET static void q8_0_tiles_avx512(const Product *pr, int64_t b, int64_t first, int64_t last) {
    const int rows = 2 * TILE_PAIRS;
    int64_t m = first;
    for (; m + rows <= last; m += rows) q8_0_tile_group(pr, b, m, rows);
    switch (last - m) { /* each count compiled apart */
        case 7: q8_0_tile_group(pr, b, m, 7); break;
        case 6: q8_0_tile_group(pr, b, m, 6); break;
        case 5: q8_0_tile_group(pr, b, m, 5); break;
        case 4: q8_0_tile_group(pr, b, m, 4); break;
        case 3: q8_0_tile_group(pr, b, m, 3); break;
        case 2: q8_0_tile_group(pr, b, m, 2); break;
        case 1: q8_0_tile_group(pr, b, m, 1); break;
        default: break;
    }
}

RowKernel q8_tile_kernel_avx512(int ggml_type) { return ggml_type == 8 && HAVE_AVX512() ? q8_0_tiles_avx512 : NULL; }

RowKernel q8_kernel_avx512(int ggml_type) {
    RowKernel kernel = NULL;
    switch (ggml_type) {
        case 8: kernel = q8_0_avx512; break;
        case 10: kernel = q2_k_avx512; break;
        case 11: kernel = q3_k_avx512; break;
        case 12: kernel = q4_k_avx512; break;
        case 14: kernel = q6_k_avx512; break;
        default: return NULL;
    }
    return HAVE_AVX512() ? kernel : NULL;
}

#else
RowKernel q8_kernel_avx512(int ggml_type) {
    (void)ggml_type;
    return NULL;
}
RowKernel q8_tile_kernel_avx512(int ggml_type) {
    (void)ggml_type;
    return NULL;
}
#endif
