/* Row-major F32 matrices (GGUF's [out, in]) against several input rows (a prefill, a batch of decode
 * steps, an expert's tokens): GEMM micro-kernels whose every output is bit for bit the one-row
 * kernel's (ggml_cpu.c's wide_f32 and fused_f32), so a row's bits never depend on the rows computed with
 * it and a prefill's rows are its decode steps'.
 *
 * That kernel's sum of one output: 32 lanes, lane l summing w[k] x[k] over k = l mod 32 in order by FMA
 * from zero (four chains of eight), then hsum8((lanes 0-7 + 8-15) + (16-23 + 24-31)). Here a tile of
 * GEMM_X (2) input rows by GEMM_W (6) weight rows shares each load: every load of x serves six outputs,
 * every load of w two, and each output still sees its own lanes' operations in the same order (one
 * lane's FMAs in k order, parked in memory between K_BLOCKs and reloaded without rounding; the tile and
 * the pass order only interleave different lanes' chains), then the same final sums. A tile's rows
 * past the matrix's repeat its first and are not stored.
 *
 * AVX-512: an output's 32 lanes are two vectors, a tile's twelve outputs 24 accumulators (16 loads for
 * 24 FMAs a 32-value step), summed eight outputs at a time in registers (`z_sums`). AVX2 (sixteen
 * registers): one pass per group of eight lanes (12 accumulators), the groups' lanes parked between
 * passes, the tile's data in L1 for the four. The six weight rows are packed K_BLOCK values at a time
 * into one stream (rows 4 KiB apart would share L1 sets), the next ones prefetched a part after each
 * tile; the input rows go in blocks of about X_BLOCK_BYTES (kept in L2 while every weight row of the
 * task passes them). Without AVX2 the portable row kernel (a tile of weights dotted with each row in
 * turn) is row-exact as it is.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if K3_X86_SIMD
#define GEMM_X 2
#define GEMM_W 6
#define K_BLOCK 1024
#define X_BLOCK_BYTES (1024 * 1024)
#define LANES (GEMM_X * GEMM_W * 32) /* a tile's parked lanes: output (r, c)'s 32 at 32 (GEMM_W r + c) */

/* A tile over values at..at + span - 1: its GEMM_X input rows and GEMM_W weight rows there, each packed
 * (`pack`), its outputs' lanes between values (`parked`), and where its outputs go */
typedef struct {
    const float *x[GEMM_X], *w;
    int64_t span;
    float *parked;
    int first, last;   /* the first values (the lanes start from zero), the last (the outputs are stored) */
    const Product *pr; /* the outputs: rows p..p + n - 1, m..m + count - 1 */
    int64_t m, p;
    int count, n;
} Tile;

/* Values at..at + span - 1 of rows rows[0..count - 1] of `matrix` (past `count`, rows[0] again),
 * interleaved a 32-value step at a time into packed [span / 32][width][32]: a tile reads two streams, not
 * eight rows whose equal offsets in 4 KiB pages share L1 sets */
static void pack(const float *matrix, const int64_t *rows, int count, int width, int64_t in, int64_t at,
                 int64_t span, float *packed) {
    for (int r = 0; r < width; r++) {
        const float *row = matrix + rows[r < count ? r : 0] * in + at;
        for (int64_t k = 0; k < span; k += 32) memcpy(packed + width * k + 32 * r, row + k, 128);
    }
}

/* Input row r's outputs from each one's eight lanes (its four chains summed as the one-row kernel sums
 * them): their hsum8s, four at a time */
AVX2_INLINE void store_row(const Tile *t, int r, const __m256 chains[GEMM_W]) {
    float sums[8];
    _mm_storeu_ps(sums, hsum8_x4(chains[0], chains[1], chains[2], chains[3]));
    _mm_storeu_ps(sums + 4, hsum8_x4(chains[4], chains[5], chains[4], chains[5]));
    float *out = t->pr->out + (t->p + r) * t->pr->out_stride + t->m;
    for (int c = 0; c < t->count; c++) out[c] = sums[c];
}

typedef void (*TileFn)(const Tile *);

/* What one pass of a matrix's weight rows over a block of packed input rows works with */
typedef struct {
    const Product *pr;
    const float *matrix;     /* the weight rows */
    float *w, *parked;       /* K_BLOCK values of GEMM_W weight rows packed; each tile's lanes between */
    int64_t p0, p1;          /* the block's input rows */
} Pass;

/* Asks for lines first..first + lines - 1 (of 64 bytes) of values at..at + span - 1 of weight rows m..m +
 * count - 1 (the next ones packed: their reads from RAM overlap the tiles' arithmetic) */
static void prefetch_lines(const Pass *pass, int64_t m, int count, int64_t at, int64_t span, int64_t first,
                           int64_t lines) {
    const int64_t last = first + lines < span / 16 ? first + lines : span / 16;
    for (int c = 0; c < count; c++)
        for (int64_t line = first; line < last; line++)
            __builtin_prefetch(pass->matrix + (m + c) * pass->pr->in_features + at + 16 * line, 0, 3);
}

/* Weight rows m..m + count - 1 (values at..at + span - 1 packed in pass->w) against the block's input
 * rows, GEMM_X at a time; the next weight values (rows from `next`, from `next_at`) asked for meanwhile,
 * a part after each tile */
static void pass_tiles(const Pass *pass, TileFn tile, int64_t m, int count, int64_t at, int64_t span,
                       int64_t next, int next_count, int64_t next_at) {
    const int64_t in = pass->pr->in_features, tiles = (pass->p1 - pass->p0 + GEMM_X - 1) / GEMM_X;
    const int64_t next_span = in - next_at < K_BLOCK ? in - next_at : K_BLOCK;
    const int64_t lines = (next_span / 16 + tiles - 1) / tiles;
    for (int64_t p = pass->p0, part = 0; p < pass->p1; p += GEMM_X, part++) {
        const int n = pass->p1 - p < GEMM_X ? (int)(pass->p1 - p) : GEMM_X;
        const float *x = pass->pr->x + at;
        const Tile t = {{x + pass->pr->rows[p] * in, x + pass->pr->rows[p + n - 1] * in}, pass->w, span,
                        pass->parked + part * LANES, at == 0, at + span == in, pass->pr, m, p, count, n};
        tile(&t);
        prefetch_lines(pass, next, next_count, next_at, next_span, part * lines, lines);
    }
}

/* Output rows first..last - 1 of the pass's matrix, GEMM_W at a time, K_BLOCK values of them at a
 * time (kept in L1 while the block's input rows pass) */
static void pass_rows(const Pass *pass, TileFn tile, int64_t first, int64_t last) {
    const int64_t in = pass->pr->in_features;
    for (int64_t m = first; m < last; m += GEMM_W) {
        const int count = last - m < GEMM_W ? (int)(last - m) : GEMM_W;
        const int64_t wanted[GEMM_W] = {m, m + 1, m + 2, m + 3, m + 4, m + 5};
        for (int64_t at = 0; at < in; at += K_BLOCK) {
            const int64_t span = in - at < K_BLOCK ? in - at : K_BLOCK;
            pack(pass->matrix, wanted, count, GEMM_W, in, at, span, pass->w);
            const int same = at + span < in; /* next: this row's next values, else the next rows' first */
            const int64_t next = same ? m : m + GEMM_W;
            const int next_count = same ? count : last - next < GEMM_W ? (int)(last - next) : GEMM_W;
            pass_tiles(pass, tile, m, count, at, span, next, next_count > 0 ? next_count : 0, same ? at + span : 0);
        }
    }
}

/* Output rows first..last - 1 of matrix b against its input rows in blocks of about X_BLOCK_BYTES (kept
 * in L2 while the weight rows pass): 0, or -2 without memory (nothing computed) */
static int tiled(const Product *pr, int64_t b, int64_t first, int64_t last, TileFn tile) {
    const int64_t start = pr->starts[b], end = pr->starts[b + 1], in = pr->in_features;
    int64_t block = X_BLOCK_BYTES / (4 * in) / GEMM_X * GEMM_X;
    block = block < GEMM_X ? GEMM_X : block;
    const int64_t held = end - start < block ? (end - start + GEMM_X - 1) / GEMM_X * GEMM_X : block;
    const int64_t w_floats = GEMM_W * (in < K_BLOCK ? in : K_BLOCK);
    float *w = aligned_alloc(64, sizeof(float) * (size_t)(w_floats + held / GEMM_X * LANES));
    if (w == NULL) return -2;
    Pass pass = {pr, (const float *)(uintptr_t)pr->addresses[b], w, w + w_floats, 0, 0};
    for (pass.p0 = start; pass.p0 < end; pass.p0 = pass.p1) {
        pass.p1 = end - pass.p0 < block ? end : pass.p0 + block;
        pass_rows(&pass, tile, first, last);
    }
    free(w);
    return 0;
}

/* ---- AVX-512: accumulators a<r><c><h>, lanes 16h..16h + 15 of input row r and weight row c ---- */
#define Z_AT(r, c, h) (t->parked + 32 * (GEMM_W * (r) + (c)) + 16 * (h))
#define Z_LOAD(r, c) __m512 a##r##c##0 = z_lanes(t, Z_AT(r, c, 0)), a##r##c##1 = z_lanes(t, Z_AT(r, c, 1));
#define Z_ROW(r) Z_LOAD(r, 0) Z_LOAD(r, 1) Z_LOAD(r, 2) Z_LOAD(r, 3) Z_LOAD(r, 4) Z_LOAD(r, 5)
#define Z_WEIGHT(c, h)                                                                                   \
    {                                                                                                    \
        __m512 wv = _mm512_load_ps(t->w + GEMM_W * k + 32 * (c) + 16 * (h));                             \
        __asm__("" : "+v"(wv)); /* one load in a register for both FMAs, not two folded loads */        \
        a0##c##h = _mm512_fmadd_ps(wv, x0, a0##c##h), a1##c##h = _mm512_fmadd_ps(wv, x1, a1##c##h);     \
    }
#define Z_HALF(h)                                                                                        \
    {                                                                                                    \
        const __m512 x0 = _mm512_loadu_ps(t->x[0] + k + 16 * (h)), x1 = _mm512_loadu_ps(t->x[1] + k + 16 * (h)); \
        Z_WEIGHT(0, h) Z_WEIGHT(1, h) Z_WEIGHT(2, h) Z_WEIGHT(3, h) Z_WEIGHT(4, h) Z_WEIGHT(5, h)         \
    }
#define Z_PARK(r, c) _mm512_storeu_ps(Z_AT(r, c, 0), a##r##c##0), _mm512_storeu_ps(Z_AT(r, c, 1), a##r##c##1);
#define Z_PARK_ROW(r) Z_PARK(r, 0) Z_PARK(r, 1) Z_PARK(r, 2) Z_PARK(r, 3) Z_PARK(r, 4) Z_PARK(r, 5)
#define Z_STORE(r)                                                                                       \
    if (r < t->n) {                                                                                      \
        const __m512 pair0 = z_pair(a##r##00, a##r##01, a##r##10, a##r##11);                             \
        const __m512 pair1 = z_pair(a##r##20, a##r##21, a##r##30, a##r##31);                             \
        const __m512 pair2 = z_pair(a##r##40, a##r##41, a##r##50, a##r##51);                             \
        _mm256_mask_storeu_ps(t->pr->out + (t->p + r) * t->pr->out_stride + t->m, (__mmask8)((1u << t->count) - 1), \
                              z_sums(pair0, pair1, pair2, pair2));                                       \
    }

#define Z_INLINE AVX512_TARGET static inline __attribute__((always_inline))

/* Outputs A's and B's eight lanes [A, B] from their 32 (a0, b0: lanes 0-15; a1, b1: 16-31), each
 * (0-7 + 8-15) + (16-23 + 24-31) as the one-row kernel's hsum_all sums its four chains */
Z_INLINE __m512 z_pair(__m512 a0, __m512 a1, __m512 b0, __m512 b1) {
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(a0, b0, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a0, b0, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(a1, b1, _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_f32x4(a1, b1, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(low, high);
}

/* Four pairs' outputs' eight lanes each summed as hsum8 sums them (halves, then lanes i and i + 2, then
 * the two left): [outputs 0..7] */
Z_INLINE __m256 z_sums(__m512 p0, __m512 p1, __m512 p2, __m512 p3) {
    /* quarter j: output j's lanes i + lanes i + 4 (outputs 0-3, and 4-7) */
    const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(p0, p1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(p0, p1, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(p2, p3, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(p2, p3, _MM_SHUFFLE(3, 1, 3, 1)));
    /* quarter j: lanes 0 + 2 and 1 + 3 of output j, then of output j + 4 */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(s, t, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(s, t, _MM_SHUFFLE(3, 2, 3, 2)));
    /* quarter j: outputs j and j + 4 */
    const __m512 v = _mm512_add_ps(_mm512_shuffle_ps(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, v));
}

Z_INLINE __m512 z_lanes(const Tile *t, const float *at) {
    return t->first ? _mm512_setzero_ps() : _mm512_loadu_ps(at);
}

AVX512_TARGET __attribute__((noinline)) static void tile_512(const Tile *t) {
    Z_ROW(0) Z_ROW(1)
    for (int64_t k = 0; k < t->span; k += 32) {
        Z_HALF(0) Z_HALF(1)
    }
    if (t->last) {
        Z_STORE(0) Z_STORE(1)
    } else {
        Z_PARK_ROW(0) Z_PARK_ROW(1)
    }
}

static int f32_rows_avx512(const Product *pr, int64_t b, int64_t first, int64_t last) {
    return tiled(pr, b, first, last, tile_512);
}

/* ---- AVX2: one group g of eight lanes at a time, accumulators a<r><c> ---- */
#define Y_AT(r, c) (t->parked + 32 * (GEMM_W * (r) + (c)) + 8 * g)
#define Y_LOAD(r, c) __m256 a##r##c = t->first ? _mm256_setzero_ps() : _mm256_loadu_ps(Y_AT(r, c));
#define Y_ROW(r) Y_LOAD(r, 0) Y_LOAD(r, 1) Y_LOAD(r, 2) Y_LOAD(r, 3) Y_LOAD(r, 4) Y_LOAD(r, 5)
#define Y_WEIGHT(c)                                                                                      \
    {                                                                                                    \
        const __m256 wv = _mm256_load_ps(t->w + GEMM_W * k + 32 * (c) + 8 * g);                          \
        a0##c = _mm256_fmadd_ps(wv, x0, a0##c), a1##c = _mm256_fmadd_ps(wv, x1, a1##c);                 \
    }
#define Y_PARK(c) _mm256_storeu_ps(Y_AT(0, c), a0##c), _mm256_storeu_ps(Y_AT(1, c), a1##c);

/* Lanes 8g..8g + 7 of the tile's outputs (their data stays in L1 for the four groups) */
AVX2_INLINE void y_pass(const Tile *t, int g) {
    Y_ROW(0) Y_ROW(1)
    for (int64_t k = 0; k < t->span; k += 32) {
        const __m256 x0 = _mm256_loadu_ps(t->x[0] + k + 8 * g), x1 = _mm256_loadu_ps(t->x[1] + k + 8 * g);
        Y_WEIGHT(0) Y_WEIGHT(1) Y_WEIGHT(2) Y_WEIGHT(3) Y_WEIGHT(4) Y_WEIGHT(5)
    }
    Y_PARK(0) Y_PARK(1) Y_PARK(2) Y_PARK(3) Y_PARK(4) Y_PARK(5)
}

/* One output's parked lanes as (0-7 + 8-15) + (16-23 + 24-31) */
AVX2_INLINE __m256 y_chains(const float *lanes) {
    const __m256 low = _mm256_add_ps(_mm256_loadu_ps(lanes), _mm256_loadu_ps(lanes + 8));
    return _mm256_add_ps(low, _mm256_add_ps(_mm256_loadu_ps(lanes + 16), _mm256_loadu_ps(lanes + 24)));
}

__attribute__((target("avx2,fma,f16c"), noinline)) static void tile_avx2(const Tile *t) {
    for (int g = 0; g < 4; g++) y_pass(t, g);
    for (int r = 0; t->last && r < t->n; r++) {
        __m256 chains[GEMM_W];
        for (int c = 0; c < GEMM_W; c++) chains[c] = y_chains(t->parked + 32 * (GEMM_W * r + c));
        store_row(t, r, chains);
    }
}

static int f32_rows_avx2(const Product *pr, int64_t b, int64_t first, int64_t last) {
    return tiled(pr, b, first, last, tile_avx2);
}

F32RowsKernel f32_rows_kernel(int avx512, int avx2) {
    return avx512 ? f32_rows_avx512 : avx2 ? f32_rows_avx2 : NULL;
}
#else
F32RowsKernel f32_rows_kernel(int avx512, int avx2) {
    (void)avx512, (void)avx2;
    return NULL;
}
#endif
