/* Products of one weight matrix with several input rows on 8-bit activations (prefill, batched decode,
 * an expert's tokens), for the types whose one-row kernel spends most of its time decoding weights:
 * each weight block is decoded ONCE into a small buffer (codes and scales as the one-row kernel holds
 * them in registers) and then dotted with every input row of the matrix.
 *
 * The contract: every output is bit for bit what the type's one-row kernel gives (on AVX2 machines
 * llama.cpp's vec_dot; Q2_K's, Q3_K's and Q4_K's a few ulp apart from it): per block the same integer
 * sums in the same lanes, converted and accumulated into the same float lanes in block order, summed at
 * the end as that kernel sums them. A row's result never depends on the other rows of its call. ggml_cpu.c's run_rows takes these kernels for a matrix whose input
 * rows they run faster than the one-row kernels (`q8_tiles_take`).
 *
 * Blocking (AVX2): TILE_ROWS weight rows are decoded together, CHUNK_BLOCKS blocks of each at a time
 * (a few KiB, in L1 beside the input rows streaming past); each input row's 8-bit blocks are loaded
 * once per run for all TILE_ROWS weight rows, and (all but Q4_K, Q8_0) two input rows share each load
 * of the tile. Partial sums of up to PARK_ROWS input rows wait in memory between chunks (a store and a
 * load of the same lanes: no rounding). Without AVX2 only Q6_K has a multi-row kernel (a block's codes
 * decoded once, each input row's integer sum as the portable one-row kernel's); the others keep theirs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define TILE_ROWS 4
#define CHUNK_BLOCKS 4
#define PARK_ROWS 64

/* ---- portable: Q6_K's codes less 32 and scales of one block, then each input row's integer sum ---- */

typedef struct {
    int8_t values[256], scales[16];
    float d;
} Q6Block;

static void q6_k_values(const uint8_t *restrict b, Q6Block *out) {
    for (int e = 0; e < 256; e++) { /* as q8_q6_k_generic: run r = e / 32 */
        const int run = e / 32, half = run >> 2, rest = (run & 3) * 32, i = e % 32;
        const int low = (b[64 * half + (rest & 63) + i] >> (4 * (rest >> 6))) & 15;
        const int high = (b[128 + 32 * half + i] >> (2 * (run & 3))) & 3;
        out->values[e] = (int8_t)((low | high << 4) - 32);
    }
    memcpy(out->scales, b + 192, 16);
    out->d = f16(b + 208);
}

static void q6_k_tiles_generic(const Product *pr, int64_t b, int64_t first, int64_t last) {
    const int64_t blocks = pr->in_features / 256, end = pr->starts[b + 1];
    Q6Block block;
    for (int64_t m = first; m < last; m++) {
        const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;
        for (int64_t p0 = pr->starts[b]; p0 < end; p0 += PARK_ROWS) {
            const int64_t count = end - p0 < PARK_ROWS ? end - p0 : PARK_ROWS;
            float acc[PARK_ROWS] = {0};
            for (int64_t i = 0; i < blocks; i++) {
                q6_k_values(row + 210 * i, &block);
                for (int64_t p = 0; p < count; p++) {
                    const BlockQ8K *y = pr->q8 + pr->rows[p0 + p] * blocks + i;
                    int isum = 0;
                    for (int e = 0; e < 256; e++) isum += block.scales[e / 16] * block.values[e] * y->qs[e];
                    acc[p] = acc[p] + block.d * y->d * (float)isum;
                }
            }
            for (int64_t p = 0; p < count; p++) pr->out[(p0 + p) * pr->out_stride + m] = acc[p];
        }
    }
}

#if K3_X86_SIMD
#define AVX2_TILE __attribute__((target("avx2,fma,f16c")))

/* What a weight-row group's kernel is: Q2_K, Q3_K, Q6_K, Q4_K, Q8_0, or an i-quant of `type` (IQ1_S with
 * deltas) */
typedef enum { Q2_K_TILES, Q3_K_TILES, Q6_K_TILES, Q4_K_TILES, Q8_0_TILES, IQ_TILES, IQ_DELTA_TILES } TileKind;

/* TILE_ROWS weight rows' CHUNK_BLOCKS Q2_K, Q3_K or Q6_K blocks as their one-row kernels use them: each
 * run's 32 unsigned codes, its two sub-blocks' int16 scales (low, high 16 values), int16 factors of
 * the Q8_K sums of 16 (Q2_K: the mins; Q3_K: the scales times -4, Q6_K: times -32, the codes' offsets),
 * d and Q2_K's dmin */
typedef struct {
    uint8_t codes[TILE_ROWS][CHUNK_BLOCKS][256] __attribute__((aligned(32)));
    __m256i scales[TILE_ROWS][CHUNK_BLOCKS][8];
    __m256i offsets[TILE_ROWS][CHUNK_BLOCKS];
    float d[TILE_ROWS][CHUNK_BLOCKS], dmin[TILE_ROWS][CHUNK_BLOCKS];
} KTile;

/* run r's pair of scales: scales[2r] on its first 16 values, scales[2r + 1] on the rest */
AVX2_INLINE void k_run_scales(const int *scales, KTile *tile, int w, int j) {
    for (int run = 0; run < 8; run++)
        tile->scales[w][j][run] = _mm256_set_m128i(_mm_set1_epi16((short)scales[2 * run + 1]), _mm_set1_epi16((short)scales[2 * run]));
}

AVX2_INLINE void q6_k_decode(const uint8_t *restrict b, KTile *tile, int w, int j) {
    int scales[16];
    for (int run = 0; run < 8; run++)
        _mm256_store_si256((__m256i *)(tile->codes[w][j] + 32 * run), q6_k_codes(b, run));
    for (int s = 0; s < 16; s++) scales[s] = (int8_t)b[192 + s];
    k_run_scales(scales, tile, w, j);
    const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    tile->offsets[w][j] = _mm256_mullo_epi16(wide, _mm256_set1_epi16(-32));
    tile->d[w][j] = f16(b + 208);
}

/* as q8_q2_k: codes 2f..2f + 1 of the bytes 16 + 32g.. for run 4g + f */
AVX2_INLINE void q2_k_decode(const uint8_t *restrict b, KTile *tile, int w, int j) {
    int scales[16];
    for (int g = 0; g < 2; g++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * g));
        for (int f = 0; f < 4; f++)
            _mm256_store_si256((__m256i *)(tile->codes[w][j] + 32 * (4 * g + f)),
                               _mm256_and_si256(_mm256_srli_epi16(q, 2 * f), _mm256_set1_epi8(3)));
    }
    for (int s = 0; s < 16; s++) scales[s] = b[s] & 15;
    k_run_scales(scales, tile, w, j);
    const __m128i packed = _mm_loadu_si128((const __m128i *)b);
    tile->offsets[w][j] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15)));
    tile->d[w][j] = f16(b + 80), tile->dmin[w][j] = f16(b + 82);
}

/* as q8_q3_k: code + 4 = low + 4 h (h: bit 4g + f of hmask), the 4 taken back from each pair's product */
AVX2_INLINE void q3_k_decode(const uint8_t *restrict b, KTile *tile, int w, int j) {
    int scales[16];
    const __m256i hmask = _mm256_loadu_si256((const __m256i *)b);
    for (int g = 0; g < 2; g++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * g));
        for (int f = 0; f < 4; f++) {
            const int bit = 4 * g + f; /* moved to bit 2 of each byte */
            const __m256i moved = bit >= 2 ? _mm256_srli_epi16(hmask, bit - 2) : _mm256_slli_epi16(hmask, 2 - bit);
            const __m256i codes = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * f), _mm256_set1_epi8(3)),
                                                  _mm256_and_si256(moved, _mm256_set1_epi8(4)));
            _mm256_store_si256((__m256i *)(tile->codes[w][j] + 32 * bit), codes);
        }
    }
    for (int s = 0; s < 16; s++) scales[s] = q3_k_int_scale(b, s);
    k_run_scales(scales, tile, w, j);
    tile->d[w][j] = f16(b + 108);
}

/* acc[r][w] (n weight rows, `inputs` input rows: 1 or 2, each 32-byte load of the tile then serving
 * both) gains input row r's `count` blocks y[r]; Q2_K's offsets' sums enter by an FMA with -d_y dmin
 * before the codes' (ggml's order), Q6_K's start the integer sums, Q3_K's 4s leave each pair's product
 * (maddubs of 4 and y, once an input row for all the weight rows) */
AVX2_INLINE void k_tile_dot(const KTile *tile, const BlockQ8K *const *y, int count, __m256 (*acc)[TILE_ROWS],
                            const int n, const int inputs, const TileKind kind) {
    const int mins = kind == Q2_K_TILES, fours = kind == Q3_K_TILES;
    for (int j = 0; j < count; j++) {
        __m256i sumi[2][TILE_ROWS];
        for (int r = 0; r < inputs; r++) {
            const __m256i bsums = _mm256_loadu_si256((const __m256i *)y[r][j].bsums);
            for (int w = 0; w < n; w++)
                sumi[r][w] = mins || fours ? _mm256_setzero_si256() : _mm256_madd_epi16(tile->offsets[w][j], bsums);
        }
        for (int run = 0; run < 8; run++) {
            __m256i q8[2], taken[2];
            for (int r = 0; r < inputs; r++) {
                q8[r] = _mm256_loadu_si256((const __m256i *)(y[r][j].qs + 32 * run));
                taken[r] = fours ? _mm256_maddubs_epi16(_mm256_set1_epi8(4), q8[r]) : _mm256_setzero_si256();
            }
            for (int w = 0; w < n; w++) {
                const __m256i codes = _mm256_load_si256((const __m256i *)(tile->codes[w][j] + 32 * run));
                const __m256i scales = tile->scales[w][j][run];
                for (int r = 0; r < inputs; r++) {
                    __m256i pairs = _mm256_maddubs_epi16(codes, q8[r]);
                    if (fours) pairs = _mm256_sub_epi16(pairs, taken[r]);
                    sumi[r][w] = _mm256_add_epi32(sumi[r][w], _mm256_madd_epi16(pairs, scales));
                }
            }
        }
        for (int r = 0; r < inputs; r++)
            for (int w = 0; w < n; w++) {
                if (mins) {
                    const __m256i bsums = _mm256_loadu_si256((const __m256i *)y[r][j].bsums);
                    const __m256i offsets = _mm256_madd_epi16(tile->offsets[w][j], bsums);
                    acc[r][w] = _mm256_fmadd_ps(_mm256_set1_ps(-y[r][j].d * tile->dmin[w][j]), _mm256_cvtepi32_ps(offsets),
                                                acc[r][w]);
                }
                acc[r][w] = _mm256_fmadd_ps(_mm256_set1_ps(tile->d[w][j] * y[r][j].d), _mm256_cvtepi32_ps(sumi[r][w]),
                                            acc[r][w]);
            }
    }
}

/* ... Q4_K blocks as q8_q4_k uses them: each sub-block's 32 codes (0..15) and int16 scale, the mins
 * (int16 lanes 0..7, q4_k_min_lanes), d and dmin */
typedef struct {
    uint8_t codes[TILE_ROWS][CHUNK_BLOCKS][256] __attribute__((aligned(32)));
    int16_t scales[TILE_ROWS][CHUNK_BLOCKS][8];
    __m128i mins[TILE_ROWS][CHUNK_BLOCKS];
    float d[TILE_ROWS][CHUNK_BLOCKS], dmin[TILE_ROWS][CHUNK_BLOCKS];
} Q4Tile;

AVX2_INLINE void q4_k_decode(const uint8_t *restrict b, Q4Tile *tile, int w, int j) {
    const __m256i nibble = _mm256_set1_epi8(15);
    int16_t mins[8];
    for (int pair = 0; pair < 4; pair++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * pair));
        _mm256_store_si256((__m256i *)(tile->codes[w][j] + 64 * pair), _mm256_and_si256(q, nibble));
        _mm256_store_si256((__m256i *)(tile->codes[w][j] + 64 * pair + 32), _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble));
    }
    for (int s = 0; s < 8; s++) {
        int scale, min;
        k_scale_min(b + 4, s, &scale, &min);
        tile->scales[w][j][s] = (int16_t)scale;
        mins[s] = (int16_t)min;
    }
    tile->mins[w][j] = _mm_loadu_si128((const __m128i *)mins);
    tile->d[w][j] = f16(b), tile->dmin[w][j] = f16(b + 2);
}

/* as q8_q4_k: scaled code sums in the lanes acc, the mins' four lanes in mins times -d_y dmin */
AVX2_INLINE void q4_k_tile_dot(const Q4Tile *tile, const BlockQ8K *y, int count, __m256 *acc, __m128 *mins,
                               const int n) {
    for (int j = 0; j < count; j++) {
        __m256i sumi[TILE_ROWS];
        for (int w = 0; w < n; w++) sumi[w] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            const __m256i q8 = _mm256_loadu_si256((const __m256i *)(y[j].qs + 32 * s));
            for (int w = 0; w < n; w++) {
                const __m256i codes = _mm256_load_si256((const __m256i *)(tile->codes[w][j] + 32 * s));
                const __m256i scale = _mm256_set1_epi16(tile->scales[w][j][s]);
                sumi[w] = _mm256_add_epi32(sumi[w], _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q8), scale));
            }
        }
        for (int w = 0; w < n; w++) {
            const __m128 offsets = _mm_cvtepi32_ps(q4_k_min_lanes(tile->mins[w][j], y[j].bsums));
            mins[w] = _mm_fmadd_ps(_mm_set1_ps(-y[j].d * tile->dmin[w][j]), offsets, mins[w]);
            acc[w] = _mm256_fmadd_ps(_mm256_set1_ps(y[j].d * tile->d[w][j]), _mm256_cvtepi32_ps(sumi[w]), acc[w]);
        }
    }
}

/* ... Q8_0 blocks (Q8_0_CHUNK of them, as many values as CHUNK_BLOCKS K-quant blocks) as q8_q8_0 uses
 * them: |w|, w (the signs its activations take) and d */
#define Q8_0_CHUNK (CHUNK_BLOCKS * 8)
typedef struct {
    uint8_t magnitudes[TILE_ROWS][Q8_0_CHUNK][32] __attribute__((aligned(32)));
    int8_t codes[TILE_ROWS][Q8_0_CHUNK][32] __attribute__((aligned(32)));
    float d[TILE_ROWS][Q8_0_CHUNK];
} Q80Tile;

AVX2_INLINE void q8_0_decode(const uint8_t *restrict b, Q80Tile *tile, int w, int j) {
    const __m256i codes = _mm256_loadu_si256((const __m256i *)(b + 2));
    _mm256_store_si256((__m256i *)tile->codes[w][j], codes);
    _mm256_store_si256((__m256i *)tile->magnitudes[w][j], _mm256_sign_epi8(codes, codes));
    tile->d[w][j] = f16(b);
}

AVX2_INLINE void q8_0_tile_dot(const Q80Tile *tile, const BlockQ8_0 *y, int count, __m256 *acc, const int n) {
    for (int j = 0; j < count; j++) {
        const __m256i q8 = _mm256_loadu_si256((const __m256i *)y[j].qs);
        for (int w = 0; w < n; w++) {
            const __m256i codes = _mm256_load_si256((const __m256i *)tile->codes[w][j]);
            const __m256i magnitudes = _mm256_load_si256((const __m256i *)tile->magnitudes[w][j]);
            const __m256i pairs = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(q8, codes));
            const __m256i sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            acc[w] = _mm256_fmadd_ps(_mm256_set1_ps(tile->d[w][j] * y[j].d), _mm256_cvtepi32_ps(sums), acc[w]);
        }
    }
}

/* TILE_ROWS weight rows' CHUNK_BLOCKS i-quant blocks as SHARED_RUNS decodes them */
typedef struct {
    IqRuns blocks[TILE_ROWS][CHUNK_BLOCKS];
} IqTile;

/* as k_tile_dot, as SHARED_RUNS sums a block: each run's activations signed, times the unsigned
 * weights, pairs of pairs scaled; IQ1_S's deltas (an exact integer a block) into `deltas` */
AVX2_INLINE void iq_tile_dot(const IqTile *tile, const BlockQ8K *const *y, int count, __m256 (*acc)[TILE_ROWS],
                             float (*deltas)[TILE_ROWS], const int n, const int inputs, const int with_deltas) {
    for (int j = 0; j < count; j++) {
        __m256i sumi[2][TILE_ROWS];
        for (int r = 0; r < inputs; r++)
            for (int w = 0; w < n; w++) sumi[r][w] = _mm256_setzero_si256();
        for (int run = 0; run < 8; run++) {
            __m256i q8[2];
            for (int r = 0; r < inputs; r++) q8[r] = _mm256_loadu_si256((const __m256i *)(y[r][j].qs + 32 * run));
            for (int w = 0; w < n; w++) {
                const IqRuns *block = &tile->blocks[w][j];
                const __m256i sign = _mm256_load_si256((const __m256i *)block->sign[run]);
                const __m256i weights = _mm256_load_si256((const __m256i *)block->w[run]);
                const __m256i scales = _mm256_load_si256((const __m256i *)block->scales[run]);
                for (int r = 0; r < inputs; r++) {
                    const __m256i pairs = _mm256_maddubs_epi16(weights, _mm256_sign_epi8(q8[r], sign));
                    sumi[r][w] = _mm256_add_epi32(sumi[r][w], _mm256_madd_epi16(pairs, scales));
                }
            }
        }
        for (int r = 0; r < inputs; r++)
            for (int w = 0; w < n; w++) {
                const float dy = tile->blocks[w][j].d * y[r][j].d;
                acc[r][w] = _mm256_fmadd_ps(_mm256_set1_ps(dy), _mm256_cvtepi32_ps(sumi[r][w]), acc[r][w]);
                if (with_deltas) {
                    int sum = 0;
                    for (int ib = 0; ib < 8; ib++)
                        sum += (y[r][j].bsums[2 * ib] + y[r][j].bsums[2 * ib + 1]) * tile->blocks[w][j].deltas[ib];
                    deltas[r][w] = fmaf(dy, (float)sum, deltas[r][w]);
                }
            }
    }
}

typedef union {
    KTile k;
    Q4Tile q4;
    Q80Tile q80;
    IqTile iq;
} Tile;

AVX2_INLINE void tile_decode(const uint8_t *block, Tile *tile, int w, int j, const TileKind kind, const IqRunType *type) {
    if (kind == Q2_K_TILES)
        q2_k_decode(block, &tile->k, w, j);
    else if (kind == Q3_K_TILES)
        q3_k_decode(block, &tile->k, w, j);
    else if (kind == Q6_K_TILES)
        q6_k_decode(block, &tile->k, w, j);
    else if (kind == Q4_K_TILES)
        q4_k_decode(block, &tile->q4, w, j);
    else if (kind == Q8_0_TILES)
        q8_0_decode(block, &tile->q80, w, j);
    else
        type->decode(block, &tile->iq.blocks[w][j]);
}

/* input rows rows[0..inputs - 1]'s blocks from `first` on against the tile (count blocks) */
AVX2_INLINE void tile_dot(const Product *pr, const Tile *tile, const int64_t *rows, int64_t first, int count,
                          __m256 (*acc)[TILE_ROWS], float (*deltas)[TILE_ROWS], __m128 (*mins)[TILE_ROWS],
                          const int n, const int inputs, const TileKind kind) {
    const int64_t blocks = pr->in_features / (kind == Q8_0_TILES ? 32 : 256);
    const BlockQ8K *y[2];
    for (int r = 0; r < inputs; r++) y[r] = pr->q8 + rows[r] * blocks + first;
    if (kind == Q2_K_TILES || kind == Q3_K_TILES || kind == Q6_K_TILES)
        k_tile_dot(&tile->k, y, count, acc, n, inputs, kind);
    else if (kind == IQ_TILES || kind == IQ_DELTA_TILES)
        iq_tile_dot(&tile->iq, y, count, acc, deltas, n, inputs, kind == IQ_DELTA_TILES);
    else
        for (int r = 0; r < inputs; r++) {
            if (kind == Q4_K_TILES)
                q4_k_tile_dot(&tile->q4, y[r], count, acc[r], mins[r], n);
            else
                q8_0_tile_dot(&tile->q80, pr->q8_0 + rows[r] * blocks + first, count, acc[r], n);
        }
}

/* weight rows m..m + n - 1 of matrix b against all its input rows: CHUNK_BLOCKS blocks of the n rows
 * decoded at a time, then each input row's sums carried on (parked between chunks) */
AVX2_INLINE void tile_group(const Product *pr, int64_t b, int64_t m, const int n, const TileKind kind,
                            const IqRunType *type) {
    const int64_t blocks = pr->in_features / (kind == Q8_0_TILES ? 32 : 256), end = pr->starts[b + 1];
    const int block_bytes = kind == Q2_K_TILES   ? 84
                            : kind == Q3_K_TILES ? 110
                            : kind == Q6_K_TILES ? 210
                            : kind == Q4_K_TILES ? 144
                            : kind == Q8_0_TILES ? 34
                                                 : type->bytes;
    const int chunk = kind == Q8_0_TILES ? Q8_0_CHUNK : CHUNK_BLOCKS;
    const uint8_t *rows = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;
    Tile tile;
    __m256 parked[PARK_ROWS][TILE_ROWS];
    float parked_deltas[PARK_ROWS][TILE_ROWS];
    __m128 parked_mins[PARK_ROWS][TILE_ROWS];
    for (int64_t p0 = pr->starts[b]; p0 < end; p0 += PARK_ROWS) {
        const int64_t inputs = end - p0 < PARK_ROWS ? end - p0 : PARK_ROWS;
        for (int64_t c = 0; c < blocks; c += chunk) {
            const int count = blocks - c < chunk ? (int)(blocks - c) : chunk;
            for (int w = 0; w < n; w++)
                for (int j = 0; j < count; j++) {
                    const uint8_t *block = rows + w * pr->row_bytes + (c + j) * block_bytes;
                    prefetch_ahead(block, block_bytes);
                    tile_decode(block, &tile, w, j, kind, type);
                }
            if (c == 0)
                for (int64_t p = 0; p < inputs; p++)
                    for (int w = 0; w < n; w++)
                        parked[p][w] = _mm256_setzero_ps(), parked_deltas[p][w] = 0.0f, parked_mins[p][w] = _mm_setzero_ps();
            int64_t p = 0;
            for (; p + 2 <= inputs; p += 2)
                tile_dot(pr, &tile, pr->rows + p0 + p, c, count, parked + p, parked_deltas + p, parked_mins + p, n, 2, kind);
            if (p < inputs)
                tile_dot(pr, &tile, pr->rows + p0 + p, c, count, parked + p, parked_deltas + p, parked_mins + p, n, 1, kind);
            if (c + count < blocks) continue;
            for (p = 0; p < inputs; p++)
                for (int w = 0; w < n; w++) {
                    float *out = pr->out + (p0 + p) * pr->out_stride + m + w;
                    if (kind == IQ_DELTA_TILES)
                        *out = hsum8(parked[p][w]) + 0.125f * parked_deltas[p][w];
                    else if (kind == Q4_K_TILES)
                        *out = min_lanes_total((MinLanes){parked[p][w], parked_mins[p][w]});
                    else
                        *out = (kind == IQ_TILES ? type->factor : 1.0f) * hsum8(parked[p][w]);
                }
        }
    }
}

/* rows first..last - 1 of matrix b in groups of TILE_ROWS, then the last one to three together */
AVX2_INLINE void tile_rows(const Product *pr, int64_t b, int64_t first, int64_t last, const TileKind kind,
                           const IqRunType *type) {
    int64_t m = first;
    for (; m + TILE_ROWS <= last; m += TILE_ROWS) tile_group(pr, b, m, TILE_ROWS, kind, type);
    if (last - m == 3) tile_group(pr, b, m, 3, kind, type);
    if (last - m == 2) tile_group(pr, b, m, 2, kind, type);
    if (last - m == 1) tile_group(pr, b, m, 1, kind, type);
}

#define TILES_OF(NAME, KIND)                                                                             \
    AVX2_TILE static void NAME##_tiles(const Product *pr, int64_t b, int64_t first, int64_t last) {     \
        tile_rows(pr, b, first, last, KIND, NULL);                                                     \
    }
TILES_OF(q2_k, Q2_K_TILES)
TILES_OF(q3_k, Q3_K_TILES)
TILES_OF(q6_k, Q6_K_TILES)
TILES_OF(q4_k, Q4_K_TILES)
TILES_OF(q8_0, Q8_0_TILES)

#define IQ_TILES_OF(ID, KIND)                                                                            \
    AVX2_TILE static void iq_tiles_##ID(const Product *pr, int64_t b, int64_t first, int64_t last) {    \
        const IqRunType type = iq_run_type(ID, 1);                                                       \
        tile_rows(pr, b, first, last, KIND, &type);                                                     \
    }
IQ_TILES_OF(16, IQ_TILES)
IQ_TILES_OF(17, IQ_TILES)
IQ_TILES_OF(18, IQ_TILES)
IQ_TILES_OF(19, IQ_DELTA_TILES)
IQ_TILES_OF(21, IQ_TILES)
IQ_TILES_OF(22, IQ_TILES)
IQ_TILES_OF(23, IQ_TILES)

static RowKernel iq_tiles(int ggml_type) {
    switch (ggml_type) {
        case 16: return iq_tiles_16;
        case 17: return iq_tiles_17;
        case 18: return iq_tiles_18;
        case 19: return iq_tiles_19;
        case 21: return iq_tiles_21;
        case 22: return iq_tiles_22;
        case 23: return iq_tiles_23;
        default: return NULL;
    }
}
#define AVX2_TILES(NAME) NAME##_tiles
#define IQ_TILES(ggml_type) iq_tiles(ggml_type)
#else
#define AVX2_TILES(NAME) NAME##_tiles_generic
#define IQ_TILES(ggml_type) NULL
#endif

RowKernel q8_tile_kernel(int ggml_type, int avx2) {
    const RowKernel avx512 = q8_tile_kernel_avx512(ggml_type);
    if (avx512 != NULL) return avx512;
    if (avx2 && iq_avx512_kernel(ggml_type) != NULL) return NULL; /* its one-row kernel takes many rows */
    if (ggml_type == 14) return avx2 ? AVX2_TILES(q6_k) : q6_k_tiles_generic;
#if K3_X86_SIMD
    if (ggml_type == 10) return avx2 ? q2_k_tiles : NULL;
    if (ggml_type == 11) return avx2 ? q3_k_tiles : NULL;
    if (ggml_type == 12) return avx2 ? q4_k_tiles : NULL;
    if (ggml_type == 8) return avx2 ? q8_0_tiles : NULL;
#endif
    return avx2 && iq_run_type(ggml_type, avx2).decode != NULL ? IQ_TILES(ggml_type) : NULL;
}

/* Measured (1024 x 1024, one thread, AVX2), against the kernels they replace: Q6_K's one-row kernel is
 * faster for two rows (its AVX-512 one, codes shared by four input rows, at every count: 1.7-2.1x these
 * tiles at 3-8 rows, 1.03-1.14x at 16-64, 3072 x 3584 on Intel Xeon), Q8_0's up to four (Q8_0's AVX-512 multi-row kernel, two weight rows a vector, is
 * the faster from two rows: 1.45x the one-row kernel at two rows of 12288 x 7168 on Intel Xeon); Q2_K's,
 * Q3_K's and Q4_K's own kernels share decoded codes between 4 input rows in registers (Q2_K, Q3_K: as
 * fast as the tiles at 10 rows, faster below, 1.1-1.2x slower at 16, 1.4x at 128; their AVX-512 ones,
 * on Intel Xeon, 3072 x 3584: faster than these AVX2 tiles at 10-32 rows (Q2_K 1.3-1.4x at 10-16, 1.2x
 * at 32; Q3_K 1.2x at 10-16, as fast at 32), 0.94-0.97x at 64; Q4_K: as fast at 16 rows, 1.1x slower
 * at 24, 1.2x at 64); the i-quants' kernels share each decoded run between RUN_ROWS =
 * 4 input rows, faster than the tiles at exactly 4 rows (none left over to run one at a time), as fast
 * or slower elsewhere */
int q8_tiles_take(int ggml_type, int64_t rows) {
    switch (ggml_type) {
        case 14: return q8_kernel_avx512(ggml_type) == NULL && rows >= 3;
        case 8: return rows >= (q8_tile_kernel_avx512(8) != NULL ? 2 : 5);
        case 3:
        case 6:
        case 7: return rows >= 2; /* AVX-512's tiles (on AVX2 their row kernels share each block between Q8_ROWS rows) */
        case 12: return rows >= 24;
        case 10:
        case 11: return rows >= (q8_kernel_avx512(ggml_type) != NULL ? 48 : 10);
        default: return rows >= 2 && rows != 4;
    }
}
