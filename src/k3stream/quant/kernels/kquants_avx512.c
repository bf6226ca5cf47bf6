/* The integer one-row kernels of Q8_0, Q5_0, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K on 8-bit
 * activations, and the 32-value types' (Q8_0, Q5_0, Q4_1, Q5_1) multi-row kernel, with AVX-512 (F, BW,
 * VL, VNNI, VBMI), where the CPU has them (HAVE_AVX512(); K3STREAM_NO_AVX512=1 keeps the AVX2 ones of
 * ggml_cpu.c and tiles_cpu.c).
 *
 * The contract: every output is bit for bit the AVX2 kernel's. Each block's integer sums land in the
 * same eight int32 lanes (lane l: the products of bytes 4l..4l + 3 of each 32-byte run, times their
 * sub-block scale), exact however they are formed, and enter the same float lanes by the same FMAs in
 * block order, summed at the end by hsum8 (Q4_1's, Q5_1's and Q5_K's offset products into one float
 * beside them, in block order). So Q8_0, Q5_0, Q4_1, Q5_1, Q5_K and Q6_K stay llama.cpp's AVX2 vec_dot
 * bit for bit, and the multi-row tiles (tiles_cpu.c, AVX2) stay each row's one-row result.
 *
 * What AVX-512 changes: VNNI's vpdpbusd (unsigned x signed bytes into int32 lanes) and vpdpwssd (int16
 * pairs into them) fuse the AVX2 kernels' maddubs/madd/add chains; the K-quants take two 32-value runs
 * in one 64-byte vector (their lanes folded onto eight at the block's end), their scales spread by one
 * vpshufb (Q2_K: each code looks up its code-times-scale byte, one vpdpbusd a pair of runs; Q2_K's and
 * Q3_K's codes come by GFNI's gf2p8affine); the 32-value types' kernels hold two weight rows in one
 * 64-byte vector, each half that row's eight lanes (so does Q8_0's one-row kernel where the CPU runs
 * 512-bit operations at full width; where it splits them in two 256-bit halves, eight weight rows a
 * pass on 32-byte vectors: eight FMA chains).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if K3_X86_SIMD

#define AVX512_INLINE AVX512_TARGET static inline __attribute__((always_inline))

AVX512_INLINE float f16_scale(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
}

/* 32 bytes at p in both halves */
AVX512_INLINE __m512i both_halves(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

/* the two 32-byte halves of a vector */
AVX512_INLINE __m512i join_halves(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }

AVX512_INLINE __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* ---- each block's float scale, from a table made once a chunk of CHUNK_BLOCKS_K blocks ------------ */
#define CHUNK_BLOCKS_K 16

/* The dwords at `at` + block_bytes k for the `count` (<= 16) blocks k of a chunk (each block's f16
 * scales), by one gather: a chunk's scales as floats by two or three vector operations, in place of a
 * scalar conversion, product and broadcast a block (the FMAs broadcast them from memory) */
AVX512_INLINE __m512i chunk_dwords(const uint8_t *at, int block_bytes, int count) {
    const __m512i k = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)((1u << count) - 1),
                                       _mm512_mullo_epi32(k, _mm512_set1_epi32(block_bytes)), at, 1);
}

/* the f16 in each dword's low (shift 0) or high (shift 16) half, as floats */
AVX512_INLINE __m512 f16_halves(__m512i dwords, int shift) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dwords, shift)));
}

/* the floats at d + stride k bytes for the `count` blocks k of a chunk (the activation blocks' d) */
AVX512_INLINE __m512 chunk_floats(const float *d, int stride, int count) {
    const __m512i k = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), (__mmask16)((1u << count) - 1),
                                    _mm512_mullo_epi32(k, _mm512_set1_epi32(stride)), d, 1);
}

/* ---- what a Q2_K or Q3_K kernel takes of one input row once for all the weight rows (decode) ------
 * its Q8_K blocks' d in a row (no gather a chunk and weight row) and Q3_K's sum starts (-127 times each
 * int32 lane's four activations, unfolded, where a block's sums start), for rows of PREPARED_BLOCKS blocks
 * at most (a Kimi-K3 row is 12 to 72); the kernels take a NULL Prepared for longer rows or several
 * input rows, making them as they go */
#define PREPARED_BLOCKS 128
typedef struct {
    float d[PREPARED_BLOCKS];
    __m512i starts127[PREPARED_BLOCKS];
    int8_t runs[PREPARED_BLOCKS][256]; /* Q2_K at full width: each block's runs f and 4 + f in bytes 64f.. */
} Prepared;

/* Q2_K and Q3_K: per input row r and block k of the chunk from block c, the block's d (the f16 at
 * `at` + block_bytes k, half `shift` of its dword) times row r's Q8_K d into steps[r][k]; where `mins`,
 * the dword's other half times -(row r's d) into mins[r][k] (Q2_K's dmin). With one input row
 * `prepared` (else NULL), its d's are loaded, not gathered. */
AVX512_INLINE void q8k_steps(const uint8_t *at, int block_bytes, int shift, const BlockQ8K *const *y, int64_t c,
                             int count, float (*steps)[CHUNK_BLOCKS_K], float (*mins)[CHUNK_BLOCKS_K], const int n,
                             const Prepared *prepared) {
    const __m512i dwords = chunk_dwords(at, block_bytes, count);
    const __m512 step = f16_halves(dwords, shift), neg = _mm512_set1_ps(-0.0f);
    for (int r = 0; r < n; r++) {
        const __m512 d = prepared != NULL ? _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), prepared->d + c)
                                : chunk_floats(&y[r][c].d, (int)sizeof(BlockQ8K), count);
        _mm512_storeu_ps(steps[r], _mm512_mul_ps(d, step));
        if (mins) _mm512_storeu_ps(mins[r], _mm512_mul_ps(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(d), _mm512_castps_si512(neg))), f16_halves(dwords, 16 - shift)));
    }
}

/* ---- the 32-value types Q8_0, Q5_0, Q4_1 and Q5_1 ---------------------------------------------------
 * Codes enter vpdpbusd unsigned, as w + bias: Q8_0's signed codes with the top bit flipped (bias 128),
 * Q5_0's five bits as stored (w + 16), Q4_1's and Q5_1's as they are (bias 0). w . y = (w + bias) . y -
 * bias sum(y): each lane started from -bias times its four activations gives the int32 lanes of ggml's
 * maddubs pairs. Those starts depend on the input row alone: made once for all the weight rows (up to
 * Q32_STARTS blocks; a longer row's further blocks make theirs as they go), so a block takes its codes, a
 * vpdpbusd, a conversion and an FMA; Q4_1 and Q5_1 add their offset m times the Q8_1 block's s to a
 * scalar sum per row in block order, as their AVX2 kernels (ggml's). Q8_0 takes two pairs of weight
 * rows where 512-bit operations run at full width (q32_rows_of) and eight weight rows a pass elsewhere
 * (q8_0_groups below); the others one weight row at a time, one
 * sequential stream (four rows against each activation block, four streams, ran 0.6-0.9x as fast from
 * RAM on AMD EPYC, Zen 4), its lines PREFETCH_BYTES ahead asked for in software as the AVX2 kernels do
 * (every one-row kernel here): on Intel Xeon (Emerald Rapids) the one-row kernels ran 1.5-2x as fast
 * from RAM with it (one thread, 4 KiB and 2 MiB pages alike); on Zen 4 it gained nothing. */
#define Q32_STARTS 768

/* an input row's first Q32_STARTS blocks: each one's vpdpbusd start and d */
typedef struct {
    __m256i starts[Q32_STARTS];
    float d[Q32_STARTS];
} Q32Starts;

/* a 32-value type's bytes a block, bias and whether its activations are Q8_1 (its offsets added apart) */
AVX512_INLINE int q32_bytes(const int type) { return type == 8 ? 34 : type == 6 ? 22 : type == 3 ? 20 : 24; }
AVX512_INLINE int q32_bias(const int type) { return type == 8 ? 128 : type == 6 ? 16 : 0; }
AVX512_INLINE int q32_affine(const int type) { return type == 3 || type == 7; }

/* the vpdpbusd start of 32 activations: -bias times each lane's four */
AVX512_INLINE __m256i q32_start(const int8_t *qs, int bias) {
    const __m256i zero = _mm256_setzero_si256();
    return _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, _mm256_set1_epi8((char)bias), _mm256_loadu_si256((const __m256i *)qs)));
}

/* the nibbles of the 16 bytes at a (low half) and at b (high half): element i < 16 the low nibble of
 * byte i, element 16 + i its high nibble (ggml_cpu.c's nibble_codes) */
AVX512_INLINE __m512i q32_nibbles(const uint8_t *a, const uint8_t *b) {
    const __m512i bytes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a))),
                                             _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b)), 1);
    const __m512i counts = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0, 0, 0x0004000400040004LL,
                                            0x0004000400040004LL, 0, 0);
    return _mm512_and_si512(_mm512_srlv_epi16(bytes, counts), _mm512_set1_epi8(15));
}

/* Q5_0's and Q5_1's fifth bits of the 32-bit qh at a (low half) and at b (high half): 16 where set */
AVX512_INLINE __m512i q32_fifths(const uint8_t *a, const uint8_t *b) {
    uint32_t low, high;
    memcpy(&low, a, 4);
    memcpy(&high, b, 4);
    return _mm512_maskz_mov_epi8((__mmask64)((uint64_t)high << 32 | low), _mm512_set1_epi8(16));
}

/* the unsigned codes (w + bias) of blocks a (low half) and b (high half) */
AVX512_INLINE __m512i q32_codes(const uint8_t *a, const uint8_t *b, const int type) {
    switch (type) {
        case 8:
            return _mm512_xor_si512(join_halves(_mm256_loadu_si256((const __m256i *)(a + 2)), _mm256_loadu_si256((const __m256i *)(b + 2))),
                                    _mm512_set1_epi8((char)0x80));
        case 6: return _mm512_or_si512(q32_nibbles(a + 6, b + 6), q32_fifths(a + 2, b + 2));
        case 3: return q32_nibbles(a + 4, b + 4);
        default: return _mm512_or_si512(q32_nibbles(a + 8, b + 8), q32_fifths(a + 4, b + 4));
    }
}

/* Pairs of weight rows a[j] and b[j] (b[j] may be a[j]: its result is then dropped) of a 32-value type
 * against input row y (Q8_0 or Q8_1 blocks; table: its first Q32_STARTS blocks' starts and d), row
 * a[j]'s block in the low half of pair j's vectors and row b[j]'s in the high half (each half's eight
 * int32 and float lanes that row's, its FMAs that row's in block order): one vpdpbusd, conversion and
 * FMA for the two; the pairs' chains in flight together, the input's block loaded once for them */
#define Q32_PAIRS 2
AVX512_INLINE void q32_pairs(const uint8_t *const *a, const uint8_t *const *b, const void *y, const Q32Starts *table,
                             int64_t blocks, float *const *out_a, float *const *out_b, const int pairs, const int type) {
    const int bytes = q32_bytes(type), bias = q32_bias(type), affine = q32_affine(type);
    const int y_bytes = affine ? (int)sizeof(BlockQ8_1) : (int)sizeof(BlockQ8_0);
    const uint8_t *blocks_y = y;
    __m512 acc[Q32_PAIRS], steps_a[Q32_PAIRS], steps_b[Q32_PAIRS];
    float sum_a[Q32_PAIRS], sum_b[Q32_PAIRS], m_a[Q32_PAIRS][CHUNK_BLOCKS_K], m_b[Q32_PAIRS][CHUNK_BLOCKS_K];
    float s[CHUNK_BLOCKS_K];
#pragma GCC unroll 4
    for (int j = 0; j < pairs; j++) acc[j] = _mm512_setzero_ps(), sum_a[j] = sum_b[j] = 0.0f;
    for (int64_t c = 0; c < blocks; c += CHUNK_BLOCKS_K) {
        const int count = blocks - c < CHUNK_BLOCKS_K ? (int)(blocks - c) : CHUNK_BLOCKS_K;
        const __m512 yd = c < Q32_STARTS ? _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), table->d + c)
                                         : chunk_floats((const float *)(blocks_y + y_bytes * c), y_bytes, count);
#pragma GCC unroll 4
        for (int j = 0; j < pairs; j++) {
            const __m512i dwords_a = chunk_dwords(a[j] + bytes * c, bytes, count);
            const __m512i dwords_b = chunk_dwords(b[j] + bytes * c, bytes, count);
            steps_a[j] = _mm512_mul_ps(yd, f16_halves(dwords_a, 0));
            steps_b[j] = _mm512_mul_ps(yd, f16_halves(dwords_b, 0));
            if (affine) {
                _mm512_storeu_ps(m_a[j], f16_halves(dwords_a, 16));
                _mm512_storeu_ps(m_b[j], f16_halves(dwords_b, 16));
            }
        }
        if (affine) _mm512_storeu_ps(s, chunk_floats(&((const BlockQ8_1 *)y)[c].s, y_bytes, count));
        /* block i's step of row a in the low half, of row b in the high half */
        __m512i at = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(CHUNK_BLOCKS_K), 1);
        for (int i = 0; i < count; i++, at = _mm512_add_epi32(at, _mm512_set1_epi32(1))) {
            const int64_t k = c + i;
            const int8_t *qs = affine ? ((const BlockQ8_1 *)y)[k].qs : ((const BlockQ8_0 *)y)[k].qs;
            const __m256i start = bias == 0 ? _mm256_setzero_si256() : k < Q32_STARTS ? _mm256_load_si256(table->starts + k) : q32_start(qs, bias);
            const __m512i starts = _mm512_broadcast_i64x4(start), activations = both_halves((const uint8_t *)qs);
#pragma GCC unroll 4
            for (int j = 0; j < pairs; j++) {
                prefetch_ahead(a[j] + bytes * k, bytes);
                prefetch_ahead(b[j] + bytes * k, bytes);
                const __m512i sums = _mm512_dpbusd_epi32(starts, q32_codes(a[j] + bytes * k, b[j] + bytes * k, type), activations);
                acc[j] = _mm512_fmadd_ps(_mm512_permutex2var_ps(steps_a[j], at, steps_b[j]), _mm512_cvtepi32_ps(sums), acc[j]);
                if (affine) sum_a[j] += m_a[j][i] * s[i], sum_b[j] += m_b[j][i] * s[i];
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < pairs; j++) {
        *out_a[j] = affine ? hsum8(_mm512_castps512_ps256(acc[j])) + sum_a[j] : hsum8(_mm512_castps512_ps256(acc[j]));
        *out_b[j] = affine ? hsum8(high_half(acc[j])) + sum_b[j] : hsum8(high_half(acc[j]));
    }
}

/* ---- Q8_0 against one input row, Q8_0_GROUP adjacent weight rows a pass ----------------------------
 * Each row's blocks as dot_q8_0's: the eight int32 lanes by one 256-bit vpdpbusd (codes plus 128, from
 * the lanes' start), converted, times the block's d product, one FMA into that row's eight float lanes
 * in block order, hsum8 at the end: the AVX2 kernel's bits. Eight rows give eight FMA chains in flight
 * (a chain waits about four cycles a block on Zen 4), each 256 bits: Zen 4 runs a 512-bit operation as
 * two 256-bit halves, so pairing two rows in one 512-bit vector saves no execution time there. Each
 * chunk of CHUNK_BLOCKS_K blocks' d come by four two-table word permutes of its 128-byte quarters (a
 * 16-element gather costs twice as much there). The rows are read as Q8_0_GROUP streams; beside each
 * block the memory is asked for the same block of the rows Q8_0_AHEAD groups ahead: Q8_0_GROUP
 * prefetch streams in read order, crossing 4 KiB pages at different times (the hardware prefetchers
 * stop at a page's end). On Zen 4 from RAM on 4 KiB pages, one thread: 1.5x the rate of the next
 * group asked for as one sequential stream, 1.2-1.3x the plain read; 1.0-1.05x that kernel on 2 MiB pages,
 * 0.97-0.98x in the cache (docs/kernels.md). */
#define Q8_0_GROUP 8
#define Q8_0_AHEAD 2 /* groups: each row's lines asked for this many groups ahead */

/* the f16 d of the `count` (1..16) Q8_0 blocks from `at` (word 17k of the chunk), in words 0..count-1 */
AVX512_INLINE __m256i q8_0_chunk_d(const uint8_t *at, int count) {
    const __m512i pick = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 63, 46, 29, 12, 59, 42, 25,
                                          8, 55, 38, 21, 4, 51, 34, 17, 0); /* quarter j's d 4j + i: its word 4j + 17i */
    const int64_t bytes = 34 * (int64_t)count - 32; /* the chunk's bytes up to its last d's end */
    __m512i d = _mm512_setzero_si512();
    for (int j = 0; 4 * j < count; j++) {
        const int64_t low = bytes - 128 * j, high = low - 64; /* the quarter's bytes to read, in each half */
        const __m512i lo = _mm512_maskz_loadu_epi8(low >= 64 ? ~0ULL : _bzhi_u64(~0ULL, (unsigned)low), at + 128 * j);
        const __m512i hi = _mm512_maskz_loadu_epi8(high >= 64 ? ~0ULL : high <= 0 ? 0 : _bzhi_u64(~0ULL, (unsigned)high), at + 128 * j + 64);
        d = _mm512_mask_mov_epi16(d, (__mmask32)(0xFu << (4 * j)), _mm512_permutex2var_epi16(lo, pick, hi));
    }
    return _mm512_castsi512_si256(d);
}

/* weight rows rows .. rows + (n - 1) row_bytes against input row y (table: its first Q32_STARTS blocks'
 * starts and d) into out[0..n - 1]; where `ahead` (else NULL), rows ahead .. ahead + (n - 1) row_bytes
 * asked for into the L2 block by block beside them (each block's last byte: every line they span) */
AVX512_INLINE void q8_0_group(const uint8_t *rows, int64_t row_bytes, const BlockQ8_0 *y, const Q32Starts *table,
                              int64_t blocks, const uint8_t *ahead, float *out, const int n) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[Q8_0_GROUP];
    float steps[Q8_0_GROUP][CHUNK_BLOCKS_K] __attribute__((aligned(64)));
    for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < blocks; c += CHUNK_BLOCKS_K) {
        const int count = blocks - c < CHUNK_BLOCKS_K ? (int)(blocks - c) : CHUNK_BLOCKS_K;
        const __mmask16 valid = (__mmask16)((1u << count) - 1);
        const __m512 yd = c + CHUNK_BLOCKS_K <= Q32_STARTS ? _mm512_maskz_loadu_ps(valid, table->d + c)
                                                           : chunk_floats(&y[c].d, (int)sizeof(BlockQ8_0), count);
        for (int r = 0; r < n; r++)
            _mm512_store_ps(steps[r], _mm512_mul_ps(_mm512_cvtph_ps(q8_0_chunk_d(rows + r * row_bytes + 34 * c, count)), yd));
        for (int i = 0; i < count; i++) {
            const int64_t k = c + i;
            const __m256i start = k < Q32_STARTS ? _mm256_load_si256(table->starts + k) : q32_start(y[k].qs, 128);
            const __m256i q8 = _mm256_loadu_si256((const __m256i *)y[k].qs);
            if (ahead != NULL) {
#pragma GCC unroll 8
                for (int r = 0; r < n; r++) _mm_prefetch((const char *)(ahead + r * row_bytes + 34 * k + 33), _MM_HINT_T1);
            }
#pragma GCC unroll 8
            for (int r = 0; r < n; r++) {
                const __m256i codes = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rows + r * row_bytes + 34 * k + 2)), flip);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(steps[r][i]), _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start, codes, q8)), acc[r]);
            }
        }
    }
    for (int r = 0; r < n; r++) out[r] = hsum8(acc[r]);
}

/* rows first..last - 1 of a Q8_0 matrix against input row y, Q8_0_GROUP at a time */
AVX512_INLINE void q8_0_groups(const uint8_t *matrix, int64_t row_bytes, int64_t first, int64_t last, const BlockQ8_0 *y,
                               const Q32Starts *table, int64_t blocks, float *out) {
    const int64_t ahead_rows = Q8_0_AHEAD * Q8_0_GROUP;
    int64_t m = first;
    for (; m + Q8_0_GROUP <= last; m += Q8_0_GROUP) {
        const uint8_t *rows = matrix + m * row_bytes;
        const uint8_t *ahead = m + ahead_rows + Q8_0_GROUP <= last ? rows + ahead_rows * row_bytes : NULL;
        q8_0_group(rows, row_bytes, y, table, blocks, ahead, out + m, Q8_0_GROUP);
    }
    const uint8_t *rows = matrix + m * row_bytes;
    switch (last - m) { /* each count compiled apart */
        case 7: q8_0_group(rows, row_bytes, y, table, blocks, NULL, out + m, 7); break;
        case 6: q8_0_group(rows, row_bytes, y, table, blocks, NULL, out + m, 6); break;
        case 5: q8_0_group(rows, row_bytes, y, table, blocks, NULL, out + m, 5); break;
        case 4: q8_0_group(rows, row_bytes, y, table, blocks, NULL, out + m, 4); break;
        case 3: q8_0_group(rows, row_bytes, y, table, blocks, NULL, out + m, 3); break;
        case 2: q8_0_group(rows, row_bytes, y, table, blocks, NULL, out + m, 2); break;
        case 1: q8_0_group(rows, row_bytes, y, table, blocks, NULL, out + m, 1); break;
        default: break;
    }
}

/* Rows first..last - 1 of a 32-value type against input row y: Q8_0's by q8_0_groups (MLA's k_b heads,
 * 128-value rows, in the cache, one core, Zen 4: 19.9-20.0 GB/s, 12.5-12.7 by the pairs below) but for
 * rows of more than SHORT_ROW_BYTES where `wide` (512-bit operations at full width, wide_vectors()); the
 * others' rows of SHORT_ROW_BYTES at most Q32_PAIRS pairs of adjacent rows at a time, one stream: one
 * pair's chunk set-up and FMA chain outweigh its few blocks (Q8_0's k_b: 10.3 GB/s one pair at a time,
 * 12.7 two). Longer rows in pairs (m, m + half): two sequential streams, each asked for ahead (on Zen 4
 * Q8_0's v_b, 544-byte rows, ran at half the rate as adjacent pairs, with or without the prefetches, and
 * 0.7x as two pairs of streams); Q8_0's where `wide` in two pairs (m, m + part), (m + 2 part, m + 3
 * part): four streams, two FMA chains (Zen 5, one thread, thread CPU time: 1.2-1.5x the eight-row
 * groups from RAM and in the cache, 1.04x one pair of streams from RAM and 1.2x in the cache). */
#define SHORT_ROW_BYTES 256
AVX512_INLINE void q32_rows_of(const Product *pr, int64_t b, int64_t first, int64_t last, const void *y,
                               const Q32Starts *table, float *out, const int type, const int wide) {
    const int64_t blocks = pr->in_features / 32;
    const uint8_t *matrix = (const uint8_t *)(uintptr_t)pr->addresses[b];
    float dropped;
    if (type == 8 && !(wide && pr->row_bytes > SHORT_ROW_BYTES)) {
        q8_0_groups(matrix, pr->row_bytes, first, last, y, table, blocks, out);
        return;
    }
    if (pr->row_bytes <= SHORT_ROW_BYTES) {
        for (int64_t m = first; m < last; m += 2 * Q32_PAIRS) {
            const uint8_t *rows_a[Q32_PAIRS], *rows_b[Q32_PAIRS];
            float *outs_a[Q32_PAIRS], *outs_b[Q32_PAIRS];
            for (int j = 0; j < Q32_PAIRS; j++) { /* past `last`: row m again, its result dropped */
                const int64_t row_a = m + 2 * j < last ? m + 2 * j : m, row_b = m + 2 * j + 1 < last ? m + 2 * j + 1 : m;
                rows_a[j] = matrix + row_a * pr->row_bytes, rows_b[j] = matrix + row_b * pr->row_bytes;
                outs_a[j] = m + 2 * j < last ? out + row_a : &dropped;
                outs_b[j] = m + 2 * j + 1 < last ? out + row_b : &dropped;
            }
            q32_pairs(rows_a, rows_b, y, table, blocks, outs_a, outs_b, Q32_PAIRS, type);
        }
        return;
    }
    const int pairs = type == 8 ? Q32_PAIRS : 1, streams = 2 * pairs;
    const int64_t part = (last - first + streams - 1) / streams;
    for (int64_t m = first; m < first + part; m++) {
        const uint8_t *rows_a[Q32_PAIRS], *rows_b[Q32_PAIRS];
        float *outs_a[Q32_PAIRS], *outs_b[Q32_PAIRS];
        for (int j = 0; j < pairs; j++) { /* past `last`: row m again, its result dropped */
            const int64_t row_a = m + 2 * j * part, row_b = row_a + part;
            rows_a[j] = matrix + (row_a < last ? row_a : m) * pr->row_bytes;
            rows_b[j] = matrix + (row_b < last ? row_b : m) * pr->row_bytes;
            outs_a[j] = row_a < last ? out + row_a : &dropped;
            outs_b[j] = row_b < last ? out + row_b : &dropped;
        }
        q32_pairs(rows_a, rows_b, y, table, blocks, outs_a, outs_b, pairs, type);
    }
}

/* Rows first..last - 1 of a 32-value type against each of the matrix's input rows */
AVX512_INLINE void q32_rows(const Product *pr, int64_t b, int64_t first, int64_t last, const int type, const int wide) {
    const int64_t blocks = pr->in_features / 32;
    const int bias = q32_bias(type);
    Q32Starts table;
    for (int64_t p = pr->starts[b]; p < pr->starts[b + 1]; p++) {
        const void *y = q32_affine(type) ? (const void *)(pr->q8_1 + pr->rows[p] * blocks) : (const void *)(pr->q8_0 + pr->rows[p] * blocks);
        for (int64_t k = 0; k < blocks && k < Q32_STARTS; k++) {
            const int8_t *qs = q32_affine(type) ? ((const BlockQ8_1 *)y)[k].qs : ((const BlockQ8_0 *)y)[k].qs;
            table.d[k] = q32_affine(type) ? ((const BlockQ8_1 *)y)[k].d : ((const BlockQ8_0 *)y)[k].d;
            if (bias != 0) table.starts[k] = q32_start(qs, bias);
        }
        q32_rows_of(pr, b, first, last, y, &table, pr->out + p * pr->out_stride, type, wide);
    }
}

#define Q32_KERNEL(NAME, TYPE, WIDE)                                                      \
    AVX512_TARGET static void NAME(const Product *pr, int64_t b, int64_t first, int64_t last) { \
        q32_rows(pr, b, first, last, TYPE, WIDE);                                         \
    }
Q32_KERNEL(q8_0_avx512, 8, 0)
Q32_KERNEL(q8_0_wide_avx512, 8, 1)
Q32_KERNEL(q5_0_avx512, 6, 0)
Q32_KERNEL(q4_1_avx512, 3, 0)
Q32_KERNEL(q5_1_avx512, 7, 0)

/* whether this CPU runs a 512-bit vpdpbusd in about the time of a 256-bit one (full-width 512-bit units:
 * AMD Zen 5, Intel Xeon), not as two 256-bit halves (AMD Zen 4): 12 independent chains of each, 32 rounds,
 * best of 9 alternated runs in TSC ticks (a few microseconds, once) */
AVX512_TARGET static int wide_measured(void) {
    static volatile int seed = 1;
    const __m512i x = _mm512_set1_epi32(seed);
    __m512i wide[12];
    __m256i narrow[12];
    for (int c = 0; c < 12; c++) wide[c] = _mm512_set1_epi32(c + seed), narrow[c] = _mm256_set1_epi32(c + seed);
    uint64_t best[2] = {UINT64_MAX, UINT64_MAX};
    for (int trial = 0; trial < 9; trial++) {
        uint64_t start = __rdtsc();
        for (int round = 0; round < 32; round++) {
#pragma GCC unroll 12
            for (int c = 0; c < 12; c++) wide[c] = _mm512_dpbusd_epi32(wide[c], x, x);
        }
        uint64_t ticks = __rdtsc() - start;
        best[1] = ticks < best[1] ? ticks : best[1];
        start = __rdtsc();
        for (int round = 0; round < 32; round++) {
#pragma GCC unroll 12
            for (int c = 0; c < 12; c++) narrow[c] = _mm256_dpbusd_epi32(narrow[c], _mm512_castsi512_si256(x), _mm512_castsi512_si256(x));
        }
        ticks = __rdtsc() - start;
        best[0] = ticks < best[0] ? ticks : best[0];
    }
    for (int c = 0; c < 12; c++) __asm__ volatile("" : : "v"(wide[c]), "v"(narrow[c])); /* the chains are used */
    return 2 * best[1] < 3 * best[0];
}

/* K3STREAM_WIDE_VECTORS=1 or =0 takes either on any AVX-512 machine (the same bits), else the measured one */
static int wide_vectors(void) {
    static int measured = -1;
    return measured_choice("K3STREAM_WIDE_VECTORS", "1", "0", &measured, wide_measured);
}

/* ---- K-quants: runs 2j and 2j + 1 of a block (its 64 values from 64j) in one vector --------------- */

/* a block's 16 int16 sub-block scales as two vectors, scales 0..7 (low) and 8..15 (high) in every
 * 128-bit lane: each run pair's scales then come by one vpshufb (one uop; a vpermw of 16-bit lanes is two
 * on Intel Xeon, Q3_K and Q6_K 1.04-1.07x as fast with this, Emerald Rapids, one core, in cache) */
typedef struct {
    __m512i low, high;
} ScaleLanes;

AVX512_INLINE ScaleLanes scale_lanes(__m256i scales) {
    const __m512i wide = _mm512_castsi256_si512(scales);
    return (ScaleLanes){_mm512_shuffle_i32x4(wide, wide, 0x00), _mm512_shuffle_i32x4(wide, wide, 0x55)};
}

/* the vpshufb dword picking int16 lane w of its 128-bit lane, twice */
#define PICK(w) ((int)(0x01010101u * (2u * (unsigned)(w)) + 0x01000100u))

/* the int16 scales of runs 2j, 2j + 1: scale 4j + i on int16 lanes 8i..8i + 7, the pairs of products
 * of sub-block 4j + i */
AVX512_INLINE __m512i run_pair_scales(ScaleLanes scales, int j) {
    const int w = 4 * (j & 1);
    const __m512i pick = _mm512_set_epi32(PICK(w + 3), PICK(w + 3), PICK(w + 3), PICK(w + 3), PICK(w + 2), PICK(w + 2),
                                          PICK(w + 2), PICK(w + 2), PICK(w + 1), PICK(w + 1), PICK(w + 1), PICK(w + 1),
                                          PICK(w), PICK(w), PICK(w), PICK(w));
    return _mm512_shuffle_epi8(j < 2 ? scales.low : scales.high, pick);
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

/* ---- Q2_K and Q3_K: a pair of runs' codes by one gf2p8affine (GFNI) -----------------------------------
 * gf2p8affine maps each byte through an 8 x 8 bit matrix (one a qword: row 7 - i gives output bit i),
 * plus a constant: one instruction moves code f of every byte to bits 0-1 with nothing above, the shift
 * and mask of the AVX2 kernels. The low half of a vector takes one matrix, the high half another, so a
 * 32-byte load in both halves gives two runs. Both kernels also take each block's float scales from a
 * table made once a chunk of CHUNK_BLOCKS_K blocks (q8k_steps), broadcast from memory by the FMAs. */
#define KQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,gfni,avx2,fma,f16c,bmi2")))
#define KQ_INLINE KQ_TARGET static inline __attribute__((always_inline))
/* the matrix qword row moving input bit `input` to output bit `bit` */
#define TAKE_BIT(bit, input) ((1ULL << (input)) << (8 * (7 - (bit))))
/* the matrix qword moving input bits `from`, `from` + 1 to output bits 0, 1 (other output bits 0) */
#define TAKE_CODE(from) (TAKE_BIT(0, from) | TAKE_BIT(1, (from) + 1))

/* `low` in the four qwords of the low half, `high` in the high half's */
AVX512_INLINE __m512i halves64(uint64_t low, uint64_t high) {
    return _mm512_inserti64x4(_mm512_set1_epi64((long long)low), _mm256_set1_epi64x((long long)high), 1);
}

/* each byte of v through matrix `take`, plus 4j (its immediate a constant for each j) */
KQ_INLINE __m512i take_plus(__m512i v, __m512i take, int j) {
    switch (j) {
        case 0: return _mm512_gf2p8affine_epi64_epi8(v, take, 0);
        case 1: return _mm512_gf2p8affine_epi64_epi8(v, take, 4);
        case 2: return _mm512_gf2p8affine_epi64_epi8(v, take, 8);
        default: return _mm512_gf2p8affine_epi64_epi8(v, take, 12);
    }
}

/* Q2_K's codes times scales, looked up by vpshufb: 128-bit lane i, byte 4j + c holds c times sub-block
 * 4j + i's scale (at most 45), so pair j's lookup index is code + 4j. Each dword (lane i, slot j) is
 * the scale times 0x03020100: the scale in both int16 halves (vpermb), times 0x0100 and 0x0302. */
static const uint8_t Q2_K_SPREAD[64] = {
    0, 0, 0, 0, 4, 0, 4, 0, 8, 0, 8, 0, 12, 0, 12, 0, 1, 0, 1, 0, 5, 0, 5, 0, 9, 0, 9, 0, 13, 0, 13, 0,
    2, 0, 2, 0, 6, 0, 6, 0, 10, 0, 10, 0, 14, 0, 14, 0, 3, 0, 3, 0, 7, 0, 7, 0, 11, 0, 11, 0, 15, 0, 15, 0};
/* ... with runs f and 4 + f in one vector (pair_code_bytes): lane i, slot f sub-block 2f + i (+ 6 from lane 2) */
static const uint8_t Q2_K_WIDE_SPREAD[64] = {
    0, 0, 0, 0, 2, 0, 2, 0, 4, 0, 4, 0, 6, 0, 6, 0, 1, 0, 1, 0, 3, 0, 3, 0, 5, 0, 5, 0, 7, 0, 7, 0,
    8, 0, 8, 0, 10, 0, 10, 0, 12, 0, 12, 0, 14, 0, 14, 0, 9, 0, 9, 0, 11, 0, 11, 0, 13, 0, 13, 0, 15, 0, 15, 0};
KQ_INLINE __m512i q2_k_table(__m128i scales, const uint8_t *spread) {
    const __m512i each = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, _mm512_loadu_si512((const void *)spread),
                                                       _mm512_castsi128_si512(scales));
    return _mm512_mullo_epi16(each, _mm512_set1_epi32(0x03020100));
}

/* A K-quant block's code bytes from `from` for run pair j: `wide`, the 64 bytes at from (a vector holds
 * runs j and 4 + j: one load, where a 32-byte broadcast costs about a shuffle on Zen 5); else the 32 at
 * from + 32 (j / 2) in both halves (runs 2j, 2j + 1) */
KQ_INLINE __m512i pair_code_bytes(const uint8_t *from, int j, const int wide) {
    return wide ? _mm512_loadu_si512((const void *)from) : both_halves(from + 32 * (j >> 1));
}

/* ... and the gf2p8affine matrix taking pair j's codes to bits 0-1: `wide`, code j of both halves; else
 * codes 2 (j % 2) (low half) and 2 (j % 2) + 1 (high half) */
KQ_INLINE __m512i pair_take(int j, const int wide) {
    const int f = 2 * (j & 1);
    return wide ? _mm512_set1_epi64((long long)TAKE_CODE(2 * j)) : halves64(TAKE_CODE(2 * f), TAKE_CODE(2 * f + 2));
}

/* sums[r] = the int32 lanes (both halves, unfolded) of one Q2_K block's codes times their scales against
 * input row r's activations qs[r] (256 bytes: the Q8_K block's, or `wide` Prepared's runs), as
 * ggml_cpu.c's q8_q2_k once folded: each code (at bits 2f of bytes 16 + 32g.. for run 4g + f) times its
 * sub-block's scale (q2_k_table), one vpdpbusd a pair of runs */
KQ_INLINE void q2_k_sums(const uint8_t *restrict b, const int8_t *const *qs, __m512i *sums, const int n, const int wide) {
    const __m512i table = q2_k_table(_mm_and_si128(_mm_loadu_si128((const __m128i *)b), _mm_set1_epi8(15)),
                                     wide ? Q2_K_WIDE_SPREAD : Q2_K_SPREAD);
    for (int r = 0; r < n; r++) sums[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m512i scaled = _mm512_shuffle_epi8(table, take_plus(pair_code_bytes(b + 16, j, wide), pair_take(j, wide), j));
        for (int r = 0; r < n; r++) sums[r] = _mm512_dpbusd_epi32(sums[r], scaled, _mm512_loadu_si512((const void *)(qs[r] + 64 * j)));
    }
}

/* input rows r's activations of Q8_K block `at` */
AVX512_INLINE void block_qs(const BlockQ8K *const *y, int64_t at, const int n, const int8_t **qs) {
    for (int r = 0; r < n; r++) qs[r] = y[r][at].qs;
}

/* acc[r] += one Q2_K block (block k of the chunk) times input row r's Q8_K block, as ggml_cpu.c's
 * q8_q2_k: the mins against the Q8_K sums, then the folded sums (q2_k_sums) */
KQ_INLINE void q2_k_block(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, __m256 *acc, const int n,
                          float (*steps)[CHUNK_BLOCKS_K], float (*mins)[CHUNK_BLOCKS_K], int k, const Prepared *prepared) {
    (void)prepared;
    const __m256i low_mins = _mm256_srli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b)), 4);
    __m512i sums[Q8_ROWS];
    const int8_t *qs[Q8_ROWS];
    block_qs(y, at, n, qs);
    q2_k_sums(b, qs, sums, n, 0);
    for (int r = 0; r < n; r++) {
        const __m256i offsets = _mm256_madd_epi16(low_mins, _mm256_loadu_si256((const __m256i *)y[r][at].bsums));
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&mins[r][k]), _mm256_cvtepi32_ps(offsets), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&steps[r][k]), _mm256_cvtepi32_ps(fold(sums[r])), acc[r]);
    }
}

KQ_INLINE void q2_k_steps(const uint8_t *row, const BlockQ8K *const *y, int64_t c, int count,
                          float (*steps)[CHUNK_BLOCKS_K], float (*mins)[CHUNK_BLOCKS_K], const int n,
                          const Prepared *prepared) {
    q8k_steps(row + 84 * c + 80, 84, 0, y, c, count, steps, mins, n, prepared);
}

/* Q3_K's sum start of one Q8_K block: -127 times each int32 lane's four activations (unfolded) */
AVX512_INLINE __m512i q3_k_start(const BlockQ8K *y) {
    const __m512i offset = _mm512_set1_epi8(127);
    __m512i sums = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) sums = _mm512_dpbusd_epi32(sums, offset, _mm512_loadu_si512((const void *)(y->qs + 64 * j)));
    return _mm512_sub_epi32(_mm512_setzero_si512(), sums);
}

/* One input row's `blocks` (<= PREPARED_BLOCKS) Q8_K blocks y into `prepared`: their d's, their
 * activations by run pairs (f, 4 + f), and with `offsets` Q3_K's sum starts */
AVX512_INLINE void prepare(const BlockQ8K *y, int64_t blocks, const int offsets, Prepared *prepared) {
    for (int64_t k = 0; k < blocks; k++) {
        prepared->d[k] = y[k].d;
        if (offsets) prepared->starts127[k] = q3_k_start(y + k);
        for (int f = 0; f < 4; f++) {
            memcpy(prepared->runs[k] + 64 * f, y[k].qs + 32 * f, 32);
            memcpy(prepared->runs[k] + 64 * f + 32, y[k].qs + 128 + 32 * f, 32);
        }
    }
}

/* the gf2p8affine matrix qword taking input bits `from`, `from` + 1 to the two of output bits 0-2 that
 * are not bit `at` (q3_k_index_code) */
AVX512_INLINE uint64_t q3_k_take(int from, int at) { return TAKE_BIT(at ? 0 : 1, from) | TAKE_BIT(2, from + 1); }

/* Q3_K's 16 scales (int16, 0..63) of block a (words 0..15) and of block b (words 16..31), from their 12
 * scale bytes each (loaded from a + 94 and b + 94: byte 96 + i at 2 + i). Qword q of each half (scales
 * 4q..4q + 3) gathers the four bytes of their low four bits and the four of their high two (one vpermb
 * of both loads); vpmultishiftqb takes each field to its byte (low bits 4(q / 2) of byte t, high bits
 * 2q of byte 4 + t); maddubs joins them (low + 16 high). */
KQ_INLINE __m512i q3_k_scales_pair(const uint8_t *restrict a, const uint8_t *restrict b) {
    uint8_t gather[64] __attribute__((aligned(64))), fields[64] __attribute__((aligned(64)));
    for (int i = 0; i < 64; i++) {
        const int q = (i / 8) % 4, k = i % 8, t = k / 2, high = i % 2;
        gather[i] = (uint8_t)(64 * (i / 32) + (k < 4 ? 2 + 4 * (q % 2) + k : 6 + k));
        fields[i] = (uint8_t)(high ? 8 * (4 + t) + 2 * q : 8 * t + 4 * (q / 2));
    }
    const __m512i bytes = _mm512_permutex2var_epi8(_mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(a + 94))),
                                                   _mm512_load_si512(gather),
                                                   _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b + 94))));
    const __m512i parts = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(fields), bytes), _mm512_set1_epi16(0x030F));
    return _mm512_maddubs_epi16(parts, _mm512_set1_epi16(0x1001));
}

/* A Q3_K table index (0..15, one byte of vpshufb's): bit 3 the pair j % 2, bit j % 2 the code's high
 * bit h, the other two of bits 0-2 its low bits (q3_k_take), so one vpternlogd joins the gf2p8affine of
 * the low bits and the hmask shifted (q3_k_sums); the code (0..7) index idx stands for: */
AVX512_INLINE int q3_k_index_code(int idx) {
    const int at = (idx >> 3) & 1, high = (idx >> at) & 1;
    const int low0 = at ? idx & 1 : (idx >> 1) & 1, low1 = (idx >> 2) & 1;
    return low0 + 2 * low1 + 4 * high;
}

/* Q3_K's codes times scales, looked up by vpshufb (as Q2_K's): run pair j's 128-bit lane i (sub-block
 * t = 4j + i) holds at index idx (8 (j % 2) + 0..7) the weight (c - 4) (s_t - 32) + 127 of the code c =
 * low + 4 h (0..7) idx stands for (q3_k_index_code), s_t its scale: at most 4 * 32 + 127 = 255, at
 * least 127 - 4 * 31 = 3, so an unsigned byte. Table j / 2, 16-bit lane w: s of its sub-block (vpermb of
 * the int16 scales' two bytes, words 16 `half`.. of `scales`) times F = (c0 - 4) + 256 (c1 - 4) (c0, c1
 * the codes of its two indexes), plus 0x7F7F - 32 F: each byte its weight (the -32 in the constant, no
 * subtraction), no carry between them. `wide`: pair j's lane i holds sub-block 2j + i (+ 6 from lane 2),
 * runs j and 4 + j. */
KQ_INLINE void q3_k_tables(__m512i scales, const int half, __m512i tables[2], const int wide) {
    uint8_t pick[2][64] __attribute__((aligned(64)));
    int16_t times[32] __attribute__((aligned(64))), plus[32] __attribute__((aligned(64)));
    for (int w = 0; w < 32; w++) {
        const int lane = w / 8, k = w % 8;
        times[w] = (int16_t)((q3_k_index_code(2 * k) - 4) + 256 * (q3_k_index_code(2 * k + 1) - 4));
        plus[w] = (int16_t)(0x7F7F - 32 * times[w]);
        for (int g = 0; g < 2; g++)
            for (int e = 0; e < 2; e++) {
                const int pair = 2 * g + k / 4, block = wide ? 2 * pair + lane + (lane >= 2 ? 6 : 0) : 4 * pair + lane;
                pick[g][2 * w + e] = (uint8_t)(32 * half + 2 * block + e);
            }
    }
    const __m512i factors = _mm512_load_si512(times), constant = _mm512_load_si512(plus);
    for (int g = 0; g < 2; g++)
        tables[g] = _mm512_add_epi16(_mm512_mullo_epi16(_mm512_permutexvar_epi8(_mm512_load_si512(pick[g]), scales), factors), constant);
}

/* sums[r] (and without a `start`, offsets[r]) of one Q3_K block against input row r's activations qs[r]
 * (as q2_k_sums; `wide`, runs j and 4 + j a vector), folded the int32 lanes of ggml_cpu.c's q8_q3_k (ggml's: s_t times the pairs of products (c - 4) y): each byte's weight (c - 4) s_t
 * + 127 (q3_k_tables; its index (q3_k_index_code): the low two bits of bytes 32 + 32g.. at 2f by
 * gf2p8affine, its constant the pair bit, and bit 4g + f of hmask shifted to bit j % 2, joined by one
 * vpternlogd (a vptestmb and a masked add ran 0.95x as fast), for run 4g + f) times y by one vpdpbusd a
 * run pair, and 127 times y by another, taken away at the end: the same exact lanes, two vpdpbusd a run
 * pair and row where maddubs, maddubs, a subtraction and a vpdpwssd were. The offsets depend on the input
 * row alone: one input row's come `prepared` (q3_k_start), once for all the weight rows, and its sums
 * start from them (`start`; then n is 1), so nothing is taken away. */
KQ_INLINE void q3_k_sums(const uint8_t *restrict b, __m512i scales, const int half, const int8_t *const *qs, __m512i *sums,
                         __m512i *offsets, const int n, const __m512i *start, const int wide) {
    __m512i tables[2];
    q3_k_tables(scales, half, tables, wide);
    const __m512i hmask = both_halves(b), offset = _mm512_set1_epi8(127);
    for (int r = 0; r < n; r++) offsets[r] = _mm512_setzero_si512(), sums[r] = start ? *start : offsets[r];
    for (int j = 0; j < 4; j++) {
        const __m512i bits = pair_code_bytes(b + 32, j, wide);
        const int at = j & 1, f = wide ? 2 * j : 2 * (2 * (j & 1)), g = wide ? f : f + 2;
        const __m512i take = halves64(q3_k_take(f, at), q3_k_take(g, at));
        const __m512i codes = j & 1 ? _mm512_gf2p8affine_epi64_epi8(bits, take, 8) : _mm512_gf2p8affine_epi64_epi8(bits, take, 0);
        const int bit = wide ? j : 4 * (j >> 1) + 2 * (j & 1), next = wide ? j + 4 : bit + 1;
        const __m512i high = shift_halves(hmask, bit - at, next - at);
        const __m512i index = _mm512_ternarylogic_epi32(_mm512_set1_epi8((char)(1 << at)), high, codes, 0xCA);
        const __m512i weights = _mm512_shuffle_epi8(tables[j >> 1], index);
        for (int r = 0; r < n; r++) {
            const __m512i q8 = _mm512_loadu_si512((const void *)(qs[r] + 64 * j));
            sums[r] = _mm512_dpbusd_epi32(sums[r], weights, q8);
            if (!start) offsets[r] = _mm512_dpbusd_epi32(offsets[r], offset, q8);
        }
    }
}

KQ_INLINE void q3_k_block(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, __m256 *acc, const int n,
                          float (*steps)[CHUNK_BLOCKS_K], float (*mins)[CHUNK_BLOCKS_K], int k, const Prepared *prepared) {
    (void)mins;
    __m512i sums[Q8_ROWS], offsets[Q8_ROWS];
    const int8_t *qs[Q8_ROWS];
    block_qs(y, at, n, qs);
    q3_k_sums(b, q3_k_scales_pair(b, b), 0, qs, sums, offsets, n, prepared ? prepared->starts127 + at : NULL, 0);
    for (int r = 0; r < n; r++) {
        const __m256i lanes = fold(_mm512_sub_epi32(sums[r], offsets[r]));
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&steps[r][k]), _mm256_cvtepi32_ps(lanes), acc[r]);
    }
}

KQ_INLINE void q3_k_steps(const uint8_t *row, const BlockQ8K *const *y, int64_t c, int count,
                          float (*steps)[CHUNK_BLOCKS_K], float (*mins)[CHUNK_BLOCKS_K], const int n,
                          const Prepared *prepared) {
    (void)mins;
    q8k_steps(row + 110 * c + 106, 110, 16, y, c, count, steps, NULL, n, prepared);
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

/* Input row r's eight int32 lanes of one Q4_K or Q5_K block (fifth: Q5_K's, codes from byte 48 and the
 * fifth bits 2j, 2j + 1 of bytes 16..47 for runs 2j, 2j + 1) into lanes[r], and the mins against its
 * Q8_K sums into the four int32 lanes summs[r] (q4_k_min_lanes): sub-blocks 2j (low nibbles) and 2j + 1
 * (high) in one vector */
AVX512_INLINE void q45_k_sums(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, const int n,
                              const int fifth, __m256i *lanes, __m128i *summs) {
    const __m256i scales_mins = q4_k_scales_mins(b);
    const __m512i scales = _mm512_castsi256_si512(scales_mins);
    const __m512i lane = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                         7, 6, 5, 4, 3, 2, 1, 0),
        4);
    __m512i sums[4];
    for (int r = 0; r < n; r++) sums[r] = _mm512_setzero_si512();
    const __m512i high = both_halves(b + 16);
    for (int j = 0; j < 4; j++) {
        __m512i codes = _mm512_and_si512(shift_halves(both_halves(b + (fifth ? 48 : 16) + 32 * j), 0, 4), _mm512_set1_epi8(15));
        if (fifth)
            codes = _mm512_or_si512(codes, _mm512_slli_epi16(_mm512_and_si512(shift_halves(high, 2 * j, 2 * j + 1), _mm512_set1_epi8(1)), 4));
        const __m512i pair = _mm512_permutexvar_epi16(_mm512_add_epi16(lane, _mm512_set1_epi16((short)(2 * j))), scales);
        run_pair_dot(codes, pair, y, at, j, sums, n);
    }
    /* the mins beside the Q8_K sums of 32 (pairs of sums of 16) */
    const __m128i mins = _mm256_extracti128_si256(scales_mins, 1);
    for (int r = 0; r < n; r++) summs[r] = q4_k_min_lanes(mins, y[r][at].bsums), lanes[r] = fold(sums[r]);
}

/* acc[r] += one Q4_K block times input row r's Q8_K block, as ggml_cpu.c's q8_q4_k: the mins' four lanes apart */
AVX512_INLINE void q4_k_block(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, MinLanes *acc,
                              const int n) {
    __m256i lanes[Q8_ROWS];
    __m128i summs[Q8_ROWS];
    q45_k_sums(b, y, at, n, 0, lanes, summs);
    const float step = f16_scale(b), min_step = f16_scale(b + 2);
    for (int r = 0; r < n; r++) {
        acc[r].mins = _mm_fmadd_ps(_mm_set1_ps(-y[r][at].d * min_step), _mm_cvtepi32_ps(summs[r]), acc[r].mins);
        acc[r].lanes = _mm256_fmadd_ps(_mm256_set1_ps(y[r][at].d * step), _mm256_cvtepi32_ps(lanes[r]), acc[r].lanes);
    }
}

/* ... one Q5_K block, as ggml_cpu.c's q8_q5_k: the mins' sum beside the lanes by one fused multiply-add */
AVX512_INLINE void q5_k_block(const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at, Lanes *acc,
                              const int n) {
    __m256i lanes[Q8_ROWS];
    __m128i summs[Q8_ROWS];
    q45_k_sums(b, y, at, n, 1, lanes, summs);
    const float step = f16_scale(b), min_step = f16_scale(b + 2);
    for (int r = 0; r < n; r++) {
        __m128i s = _mm_add_epi32(summs[r], _mm_shuffle_epi32(summs[r], 0x4E));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
        acc[r].lanes = _mm256_fmadd_ps(_mm256_set1_ps(y[r][at].d * step), _mm256_cvtepi32_ps(lanes[r]), acc[r].lanes);
        acc[r].sum = fmaf(-y[r][at].d * min_step, (float)_mm_cvtsi128_si32(s), acc[r].sum);
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
    const ScaleLanes scales = scale_lanes(wide);
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

/* ---- Q2_K and Q3_K at one input row where 512-bit operations run at full width (wide_vectors()) -----
 * Weight rows m and m + half take one vector's alternate float lanes (lane 2i row m's lane i, 2i + 1
 * row m + half's): each block pair's fold, conversions and FMAs (and Q2_K's mins product) serve both
 * rows, each lane's FMAs its row's in block order (the one-row bits). */

/* the dword indices taking lane i of a (from `from`) to 2i and of b to 2i + 1 (permutex2var) */
AVX512_INLINE __m512i alternate_lanes(int from) {
    return _mm512_add_epi32(_mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0), _mm512_set1_epi32(from));
}

/* rows a's and b's unfolded sums folded into alternate int32 lanes (each lane fold's sum) */
AVX512_INLINE __m512i fold_pair(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, alternate_lanes(0), b), _mm512_permutex2var_epi32(a, alternate_lanes(8), b));
}

/* eight int32 lanes (a row's, 256 bits at p) each twice: lane i at 2i and 2i + 1 */
AVX512_INLINE __m512i lanes_twice(const void *p) {
    const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)));
}

/* 16 floats of a and of b alternating into pair[32] */
AVX512_INLINE void alternate_floats(const float *a, const float *b, float *pair) {
    const __m512 x = _mm512_loadu_ps(a), y = _mm512_loadu_ps(b);
    _mm512_storeu_ps(pair, _mm512_permutex2var_ps(x, alternate_lanes(0), y));
    _mm512_storeu_ps(pair + 16, _mm512_permutex2var_ps(x, alternate_lanes(8), y));
}

/* the float pair at p in every qword */
AVX512_INLINE __m512 float_pair(const float *p) {
    long long bits;
    memcpy(&bits, p, 8);
    return _mm512_castsi512_ps(_mm512_set1_epi64(bits));
}

/* rows a's and b's Q2_K mins (high nibbles of their 16 scale bytes) as int16, alternating by dwords:
 * words 4i + e row a's min 2i + e, words 4i + 2 + e row b's (e = 0, 1) */
KQ_INLINE __m512i q2_k_mins_pair(const uint8_t *restrict a, const uint8_t *restrict b) {
    uint8_t pick[64] __attribute__((aligned(64)));
    for (int w = 0; w < 32; w++) pick[2 * w] = (uint8_t)(64 * ((w >> 1) & 1) + 2 * (w >> 2) + (w & 1)), pick[2 * w + 1] = 0;
    const __m512i bytes = _mm512_maskz_permutex2var_epi8(0x5555555555555555ULL, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)a)),
                                                         _mm512_load_si512(pick), _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)b)));
    return _mm512_srli_epi16(bytes, 4);
}

/* acc += Q2_K blocks a and b (rows m, m + half) times the input row's block `at` (q2_k_block's lanes and
 * FMAs, alternating): steps and mins their float pairs */
KQ_INLINE void q2_k_pair_block(const uint8_t *restrict a, const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at,
                               __m512 *acc, const float *steps, const float *mins, const Prepared *prepared) {
    const int8_t *runs[1] = {prepared->runs[at]};
    __m512i sums_a, sums_b;
    q2_k_sums(a, runs, &sums_a, 1, 1);
    q2_k_sums(b, runs, &sums_b, 1, 1);
    const __m512i offsets = _mm512_madd_epi16(q2_k_mins_pair(a, b), lanes_twice(y[0][at].bsums));
    *acc = _mm512_fmadd_ps(float_pair(mins), _mm512_cvtepi32_ps(offsets), *acc);
    *acc = _mm512_fmadd_ps(float_pair(steps), _mm512_cvtepi32_ps(fold_pair(sums_a, sums_b)), *acc);
}

/* ... Q3_K blocks (q3_k_block's lanes, both rows' sums started from the input row's `prepared` starts) */
KQ_INLINE void q3_k_pair_block(const uint8_t *restrict a, const uint8_t *restrict b, const BlockQ8K *const *y, int64_t at,
                               __m512 *acc, const float *steps, const float *mins, const Prepared *prepared) {
    (void)mins;
    const int8_t *runs[1] = {prepared->runs[at]};
    __m512i sums_a, sums_b, unused;
    const __m512i scales = q3_k_scales_pair(a, b);
    q3_k_sums(a, scales, 0, runs, &sums_a, &unused, 1, prepared->starts127 + at, 1);
    q3_k_sums(b, scales, 1, runs, &sums_b, &unused, 1, prepared->starts127 + at, 1);
    *acc = _mm512_fmadd_ps(float_pair(steps), _mm512_cvtepi32_ps(fold_pair(sums_a, sums_b)), *acc);
}

/* NAME##_wide_pair: weight rows m and m + half against the prepared input row p by PAIR_BLOCK (MINS: its
 * STEPS make Q2_K's mins) */
#define WIDE_PAIR(NAME, PAIR_BLOCK, STEPS, BLOCK_BYTES, MINS)                                                    \
    KQ_INLINE void NAME##_wide_pair(const Product *pr, const uint8_t *row, int64_t m, int64_t half, int64_t p,   \
                                    const Prepared *prepared) {                                                  \
        const int64_t blocks = pr->in_features / 256;                                                            \
        const BlockQ8K *y[1] = {pr->q8 + pr->rows[p] * blocks};                                                  \
        const uint8_t *rows[2] = {row, row + half * pr->row_bytes};                                              \
        __m512 acc = _mm512_setzero_ps();                                                                        \
        float steps[2][1][CHUNK_BLOCKS_K], mins[2][1][CHUNK_BLOCKS_K], step_pairs[2 * CHUNK_BLOCKS_K],           \
            min_pairs[2 * CHUNK_BLOCKS_K];                                                                       \
        for (int64_t c = 0; c < blocks; c += CHUNK_BLOCKS_K) {                                                   \
            const int count = blocks - c < CHUNK_BLOCKS_K ? (int)(blocks - c) : CHUNK_BLOCKS_K;                  \
            for (int w = 0; w < 2; w++) STEPS(rows[w], y, c, count, steps[w], mins[w], 1, prepared);             \
            alternate_floats(steps[0][0], steps[1][0], step_pairs);                                              \
            if (MINS) alternate_floats(mins[0][0], mins[1][0], min_pairs);                                       \
            for (int k = 0; k < count; k++) {                                                                    \
                const uint8_t *a = rows[0] + (c + k) * (BLOCK_BYTES), *b = rows[1] + (c + k) * (BLOCK_BYTES);    \
                prefetch_ahead(a, BLOCK_BYTES);                                                                  \
                prefetch_ahead(b, BLOCK_BYTES);                                                                  \
                PAIR_BLOCK(a, b, y, c + k, &acc, step_pairs + 2 * k, min_pairs + 2 * k, prepared);               \
            }                                                                                                    \
        }                                                                                                        \
        const __m512 split = _mm512_permutexvar_ps(_mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0), acc); \
        pr->out[p * pr->out_stride + m] = hsum8(_mm512_castps512_ps256(split));                                 \
        pr->out[p * pr->out_stride + m + half] = hsum8(high_half(split));                                        \
    }

WIDE_PAIR(q2_k_avx512, q2_k_pair_block, q2_k_steps, 84, 1)
WIDE_PAIR(q3_k_avx512, q3_k_pair_block, q3_k_steps, 110, 0)

/* NAME: rows first..last - 1 of matrix b, each against its input rows Q8_ROWS at a time (ROWS) */
#define ROW_GROUPS(TARGET, NAME, ROWS)                                                                  \
    TARGET static void NAME(const Product *pr, int64_t b, int64_t first, int64_t last) {               \
        for (int64_t m = first; m < last; m++) {                                                        \
            const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;       \
            int64_t p = pr->starts[b];                                                                  \
            for (; p + Q8_ROWS <= pr->starts[b + 1]; p += Q8_ROWS) ROWS(pr, row, m, p, Q8_ROWS);         \
            const int64_t rest = pr->starts[b + 1] - p;                                                 \
            if (rest == 3) ROWS(pr, row, m, p, 3);                                                      \
            if (rest == 2) ROWS(pr, row, m, p, 2);                                                      \
            if (rest == 1) ROWS(pr, row, m, p, 1);                                                      \
        }                                                                                               \
    }

/* One weight row m against n input rows from p: blocks in order into each row's eight lanes */
#define SHARED_ROWS(NAME, BLOCK, BLOCK_BYTES, ACC, ZERO, TOTAL)                \
    Q8K_SHARED_ROWS(AVX512_INLINE, NAME, BLOCK, BLOCK_BYTES, ACC, ZERO, TOTAL) \
    ROW_GROUPS(AVX512_TARGET, NAME, NAME##_rows)

/* ... the same with each block's float scales from a table made once a chunk (STEPS); with one input
 * row (decode), weight rows m and m + half of the range together (NAME##_pair): two sequential streams,
 * as Q8_0's one-row kernel reads, their blocks alternating in one loop, each row's FMAs its own chain in
 * block order (the one-row bits). From RAM on Intel Xeon (Emerald Rapids), 4 KiB and 2 MiB pages, one
 * and two threads, Q2_K and Q3_K ran 1.06-1.31x as fast as one row at a time (in cache 0.99-1.01x). */
#define STEPPED_ROWS(NAME, BLOCK, STEPS, BLOCK_BYTES, OFFSETS)                                           \
    KQ_INLINE void NAME##_prepared_rows(const Product *pr, const uint8_t *row, int64_t m, int64_t p, const int n, \
                                        const Prepared *prepared) {                                      \
        const int64_t blocks = pr->in_features / 256;                                                    \
        const BlockQ8K *y[Q8_ROWS];                                                                      \
        __m256 acc[Q8_ROWS];                                                                             \
        float steps[Q8_ROWS][CHUNK_BLOCKS_K], mins[Q8_ROWS][CHUNK_BLOCKS_K];                             \
        for (int r = 0; r < n; r++) y[r] = pr->q8 + pr->rows[p + r] * blocks, acc[r] = _mm256_setzero_ps(); \
        for (int64_t c = 0; c < blocks; c += CHUNK_BLOCKS_K) {                                           \
            const int count = blocks - c < CHUNK_BLOCKS_K ? (int)(blocks - c) : CHUNK_BLOCKS_K;          \
            STEPS(row, y, c, count, steps, mins, n, prepared);                                           \
            for (int k = 0; k < count; k++) {                                                            \
                const uint8_t *block = row + (c + k) * (BLOCK_BYTES);                                    \
                prefetch_ahead(block, BLOCK_BYTES);                                                      \
                BLOCK(block, y, c + k, acc, n, steps, mins, k, prepared);                                \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < n; r++) pr->out[(p + r) * pr->out_stride + m] = hsum8(acc[r]);             \
    }                                                                                                    \
    KQ_INLINE void NAME##_rows(const Product *pr, const uint8_t *row, int64_t m, int64_t p, const int n) { \
        NAME##_prepared_rows(pr, row, m, p, n, NULL);                                                    \
    }                                                                                                    \
    KQ_INLINE void NAME##_pair(const Product *pr, const uint8_t *row, int64_t m, int64_t half, int64_t p, \
                               const Prepared *prepared) {                                               \
        const int64_t blocks = pr->in_features / 256;                                                    \
        const BlockQ8K *y[1] = {pr->q8 + pr->rows[p] * blocks};                                          \
        const uint8_t *rows[2] = {row, row + half * pr->row_bytes};                                      \
        __m256 acc[2][1] = {{_mm256_setzero_ps()}, {_mm256_setzero_ps()}};                             \
        float steps[2][1][CHUNK_BLOCKS_K], mins[2][1][CHUNK_BLOCKS_K];                                   \
        for (int64_t c = 0; c < blocks; c += CHUNK_BLOCKS_K) {                                           \
            const int count = blocks - c < CHUNK_BLOCKS_K ? (int)(blocks - c) : CHUNK_BLOCKS_K;          \
            for (int w = 0; w < 2; w++) STEPS(rows[w], y, c, count, steps[w], mins[w], 1, prepared);     \
            for (int k = 0; k < count; k++)                                                              \
                for (int w = 0; w < 2; w++) {                                                            \
                    const uint8_t *block = rows[w] + (c + k) * (BLOCK_BYTES);                            \
                    prefetch_ahead(block, BLOCK_BYTES);                                                  \
                    BLOCK(block, y, c + k, acc[w], 1, steps[w], mins[w], k, prepared);                   \
                }                                                                                        \
        }                                                                                                \
        for (int w = 0; w < 2; w++) pr->out[p * pr->out_stride + m + w * half] = hsum8(acc[w][0]);       \
    }                                                                                                    \
    ROW_GROUPS(KQ_TARGET, NAME##_groups, NAME##_rows)                                                    \
    KQ_TARGET static void NAME(const Product *pr, int64_t b, int64_t first, int64_t last) {              \
        const int64_t half = (last - first) / 2, p = pr->starts[b];                                      \
        const uint8_t *rows = (const uint8_t *)(uintptr_t)pr->addresses[b];                              \
        if (pr->starts[b + 1] - p != 1) {                                                                \
            NAME##_groups(pr, b, first, last);                                                           \
            return;                                                                                      \
        }                                                                                                \
        const int64_t blocks = pr->in_features / 256;                                                    \
        Prepared prepared;                                                                               \
        if (blocks <= PREPARED_BLOCKS) { /* each call compiled apart */                                   \
            prepare(pr->q8 + pr->rows[p] * blocks, blocks, OFFSETS, &prepared);                          \
            const int wide = wide_vectors();                                                             \
            for (int64_t m = first; m < first + half; m++)                                               \
                if (wide) NAME##_wide_pair(pr, rows + m * pr->row_bytes, m, half, p, &prepared);         \
                else NAME##_pair(pr, rows + m * pr->row_bytes, m, half, p, &prepared);                   \
        } else {                                                                                         \
            for (int64_t m = first; m < first + half; m++) NAME##_pair(pr, rows + m * pr->row_bytes, m, half, p, NULL); \
        }                                                                                                \
        if ((last - first) % 2)                                                                          \
            NAME##_prepared_rows(pr, rows + (last - 1) * pr->row_bytes, last - 1, p, 1,                  \
                                 blocks <= PREPARED_BLOCKS ? &prepared : NULL);                          \
    }

STEPPED_ROWS(q2_k_avx512, q2_k_block, q2_k_steps, 84, 0)
STEPPED_ROWS(q3_k_avx512, q3_k_block, q3_k_steps, 110, 1)
SHARED_ROWS(q4_k_avx512, q4_k_block, 144, MinLanes, MIN_LANES_ZERO, min_lanes_total)
SHARED_ROWS(q5_k_avx512, q5_k_block, 176, Lanes, LANES_ZERO, lanes_total)
SHARED_ROWS(q6_k_avx512, q6_k_block, 210, __m256, _mm256_setzero_ps(), hsum8)

/* ---- the 32-value types with several input rows (prefill): tiles_cpu.c's blocking, the one-row kernel's bits
 * TILE_PAIRS pairs of weight rows' CHUNK_BLOCKS blocks are held once as the one-row kernel uses them
 * (codes plus bias, d, and Q4_1's and Q5_1's offsets m), a pair in one 64-byte vector (row 2i's block in
 * the low half, row 2i + 1's in the high half: each half's eight int32 and float lanes are that row's
 * lanes, each FMA that row's FMA in block order); every input row of the matrix then runs past them,
 * INPUTS_AT_ONCE at a time (each activation block's vpdpbusd start serving the four pairs). Partial
 * sums (and the offsets' scalar sums) wait in memory between chunks (no rounding). One vpdpbusd,
 * conversion, scale product and FMA serve two weight rows: on Intel Xeon (Emerald Rapids) Q8_0's 1.5x
 * the same blocking on 32-byte vectors at 16 input rows, 1.9x at 33. */
#define TILE_PAIRS 4
#define CHUNK_BLOCKS 16
#define PARK_ROWS 64
#define INPUTS_AT_ONCE 4

typedef struct {
    __m512i codes[TILE_PAIRS][CHUNK_BLOCKS];
    __m512 d[TILE_PAIRS][CHUNK_BLOCKS]; /* each half that row's d */
    float m[2 * TILE_PAIRS][CHUNK_BLOCKS];
} Q32Tile;

/* an input row's parked lane sums (one vector a pair) and offsets' sums (one a weight row) */
typedef struct {
    __m512 lanes[TILE_PAIRS];
    float sums[2 * TILE_PAIRS];
} Q32Parked;

/* input row r's block j: Q8_0 or Q8_1 (type's), its codes, d and (Q8_1) s */
AVX512_INLINE const int8_t *q32_y_qs(const void *y, int64_t j, const int type) {
    return q32_affine(type) ? ((const BlockQ8_1 *)y)[j].qs : ((const BlockQ8_0 *)y)[j].qs;
}
AVX512_INLINE float q32_y_d(const void *y, int64_t j, const int type) {
    return q32_affine(type) ? ((const BlockQ8_1 *)y)[j].d : ((const BlockQ8_0 *)y)[j].d;
}

/* parked[r] gains input row r's `count` blocks y[r] against the tile's `pairs` pairs of weight rows */
AVX512_INLINE void q32_tile_dot(const Q32Tile *tile, const void *const *y, int count, Q32Parked *parked, const int pairs,
                                const int inputs, const int type) {
    const int bias = q32_bias(type), affine = q32_affine(type);
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[INPUTS_AT_ONCE][TILE_PAIRS];
    float sums[INPUTS_AT_ONCE][2 * TILE_PAIRS];
    for (int r = 0; r < inputs; r++)
        for (int i = 0; i < pairs; i++) acc[r][i] = parked[r].lanes[i], sums[r][2 * i] = parked[r].sums[2 * i], sums[r][2 * i + 1] = parked[r].sums[2 * i + 1];
    for (int j = 0; j < count; j++)
        for (int r = 0; r < inputs; r++) {
            const __m512i q8 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)q32_y_qs(y[r], j, type)));
            const __m512i start = bias == 0 ? zero : _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8((char)bias), q8));
            const __m512 dy = _mm512_set1_ps(q32_y_d(y[r], j, type));
            for (int i = 0; i < pairs; i++) {
                const __m512i lanes = _mm512_dpbusd_epi32(start, tile->codes[i][j], q8);
                acc[r][i] = _mm512_fmadd_ps(_mm512_mul_ps(tile->d[i][j], dy), _mm512_cvtepi32_ps(lanes), acc[r][i]);
            }
            if (affine) {
                const float s = ((const BlockQ8_1 *)y[r])[j].s;
                for (int w = 0; w < 2 * pairs; w++) sums[r][w] += tile->m[w][j] * s;
            }
        }
    for (int r = 0; r < inputs; r++)
        for (int i = 0; i < pairs; i++) parked[r].lanes[i] = acc[r][i], parked[r].sums[2 * i] = sums[r][2 * i], parked[r].sums[2 * i + 1] = sums[r][2 * i + 1];
}

/* blocks c..c + count - 1 of weight rows m..m + n - 1 into the tile (an odd row's pair takes it twice) */
AVX512_INLINE void q32_tile_fill(Q32Tile *tile, const uint8_t *rows, int64_t row_bytes, int64_t c, int count, const int n,
                                 const int type) {
    const int bytes = q32_bytes(type);
    for (int i = 0; i < (n + 1) / 2; i++) {
        const uint8_t *low = rows + 2 * i * row_bytes + c * bytes;
        const uint8_t *high = 2 * i + 1 < n ? low + row_bytes : low;
        for (int j = 0; j < count; j++) {
            prefetch_ahead(low + bytes * j, bytes);
            if (high != low) prefetch_ahead(high + bytes * j, bytes);
            tile->codes[i][j] = q32_codes(low + bytes * j, high + bytes * j, type);
            tile->d[i][j] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(f16_scale(low + bytes * j))),
                                                                _mm256_castps_pd(_mm256_set1_ps(f16_scale(high + bytes * j))), 1));
            if (q32_affine(type)) tile->m[2 * i][j] = f16_scale(low + bytes * j + 2), tile->m[2 * i + 1][j] = f16_scale(high + bytes * j + 2);
        }
    }
}

/* weight rows m..m + n - 1 (n <= 2 TILE_PAIRS) of matrix b against all its input rows */
AVX512_INLINE void q32_tile_group(const Product *pr, int64_t b, int64_t m, const int n, const int type) {
    const int64_t blocks = pr->in_features / 32, end = pr->starts[b + 1];
    const uint8_t *rows = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;
    const int pairs = (n + 1) / 2;
    Q32Tile tile;
    Q32Parked parked[PARK_ROWS];
    for (int64_t p0 = pr->starts[b]; p0 < end; p0 += PARK_ROWS) {
        const int64_t inputs = end - p0 < PARK_ROWS ? end - p0 : PARK_ROWS;
        for (int64_t c = 0; c < blocks; c += CHUNK_BLOCKS) {
            const int count = blocks - c < CHUNK_BLOCKS ? (int)(blocks - c) : CHUNK_BLOCKS;
            q32_tile_fill(&tile, rows, pr->row_bytes, c, count, n, type);
            for (int64_t p = 0; c == 0 && p < inputs; p++) memset(&parked[p], 0, sizeof(Q32Parked));
            for (int64_t p = 0; p < inputs; p += INPUTS_AT_ONCE) {
                const void *y[INPUTS_AT_ONCE];
                const int at_once = inputs - p < INPUTS_AT_ONCE ? (int)(inputs - p) : INPUTS_AT_ONCE;
                for (int r = 0; r < at_once; r++) {
                    const int64_t at = pr->rows[p0 + p + r] * blocks + c;
                    y[r] = q32_affine(type) ? (const void *)(pr->q8_1 + at) : (const void *)(pr->q8_0 + at);
                }
                switch (at_once) { /* each count compiled apart */
                    case 4: q32_tile_dot(&tile, y, count, parked + p, pairs, 4, type); break;
                    case 3: q32_tile_dot(&tile, y, count, parked + p, pairs, 3, type); break;
                    case 2: q32_tile_dot(&tile, y, count, parked + p, pairs, 2, type); break;
                    default: q32_tile_dot(&tile, y, count, parked + p, pairs, 1, type); break;
                }
            }
        }
        for (int64_t p = 0; p < inputs; p++)
            for (int w = 0; w < n; w++) {
                const __m512 lanes = parked[p].lanes[w / 2];
                const float total = hsum8(w % 2 ? high_half(lanes) : _mm512_castps512_ps256(lanes));
                pr->out[(p0 + p) * pr->out_stride + m + w] = q32_affine(type) ? total + parked[p].sums[w] : total;
            }
    }
}

AVX512_INLINE void q32_tiles(const Product *pr, int64_t b, int64_t first, int64_t last, const int type) {
    const int rows = 2 * TILE_PAIRS;
    int64_t m = first;
    for (; m + rows <= last; m += rows) q32_tile_group(pr, b, m, rows, type);
    switch (last - m) { /* each count compiled apart */
        case 7: q32_tile_group(pr, b, m, 7, type); break;
        case 6: q32_tile_group(pr, b, m, 6, type); break;
        case 5: q32_tile_group(pr, b, m, 5, type); break;
        case 4: q32_tile_group(pr, b, m, 4, type); break;
        case 3: q32_tile_group(pr, b, m, 3, type); break;
        case 2: q32_tile_group(pr, b, m, 2, type); break;
        case 1: q32_tile_group(pr, b, m, 1, type); break;
        default: break;
    }
}

#define Q32_TILES(NAME, TYPE) \
    AVX512_TARGET static void NAME(const Product *pr, int64_t b, int64_t first, int64_t last) { q32_tiles(pr, b, first, last, TYPE); }
Q32_TILES(q8_0_tiles_avx512, 8)
Q32_TILES(q5_0_tiles_avx512, 6)
Q32_TILES(q4_1_tiles_avx512, 3)
Q32_TILES(q5_1_tiles_avx512, 7)

RowKernel q8_tile_kernel_avx512(int ggml_type) {
    RowKernel kernel = NULL;
    switch (ggml_type) {
        case 8: kernel = q8_0_tiles_avx512; break;
        case 6: kernel = q5_0_tiles_avx512; break;
        case 3: kernel = q4_1_tiles_avx512; break;
        case 7: kernel = q5_1_tiles_avx512; break;
        default: return NULL;
    }
    return HAVE_AVX512() ? kernel : NULL;
}

RowKernel q8_kernel_avx512(int ggml_type) {
    RowKernel kernel = NULL;
    switch (ggml_type) {
        case 8: kernel = !HAVE_AVX512() ? NULL : wide_vectors() ? q8_0_wide_avx512 : q8_0_avx512; break;
        case 6: kernel = q5_0_avx512; break;
        case 3: kernel = q4_1_avx512; break;
        case 7: kernel = q5_1_avx512; break;
        case 10: kernel = __builtin_cpu_supports("gfni") ? q2_k_avx512 : NULL; break;
        case 11: kernel = __builtin_cpu_supports("gfni") ? q3_k_avx512 : NULL; break;
        case 12: kernel = q4_k_avx512; break;
        case 13: kernel = q5_k_avx512; break;
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
