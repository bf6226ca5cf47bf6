/* What the C kernels' files share: a product's description, ggml's 8-bit activation blocks, F16. */
#ifndef K3STREAM_KERNELS_H
#define K3STREAM_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12
/* GCC before 12 has no __builtin_shufflevector: the vector of a's and b's lanes at the indices (b's
 * numbered after a's), picked one by one (exact moves, the same values; the compiler makes shuffles) */
#define __builtin_shufflevector(a, b, ...)                                                                \
    ({                                                                                                    \
        const __typeof__(a) first_ = (a), second_ = (b);                                                  \
        const int lanes_[] = {__VA_ARGS__}, width_ = sizeof(first_) / sizeof(first_[0]);                  \
        typedef __typeof__(first_[0]) Lane_;                                                              \
        typedef Lane_ Picked_ __attribute__((vector_size(sizeof(lanes_) / sizeof(int) * sizeof(Lane_)))); \
        Picked_ picked_;                                                                                  \
        for (int i_ = 0; i_ < (int)(sizeof(lanes_) / sizeof(int)); i_++)                                  \
            picked_[i_] = lanes_[i_] < width_ ? first_[lanes_[i_]] : second_[lanes_[i_] - width_];        \
        picked_;                                                                                          \
    })
#endif

/* 1 where the x86-64 SIMD kernels (AVX2, AVX-512, chosen at load by what the CPU has) are built: GCC 12
 * or later on x86-64 (clang 14 refuses some of their CPU feature tests, GCC 11 their target_clones of
 * x86-64-v3), unless K3STREAM_PORTABLE_BUILD is defined. Else every type takes the portable C kernels,
 * the same bits as with K3STREAM_GENERIC_KERNELS=1 on x86-64 (other CPUs and compilers; the portable
 * build's test on this one) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && \
    !defined(K3STREAM_PORTABLE_BUILD)
#define K3_X86_SIMD 1
#else
#define K3_X86_SIMD 0
#endif

INLINE float bits_f32(uint32_t bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

INLINE float f16(const uint8_t *p) { /* exact, NaN payloads kept, as numpy converts */
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, rest = h & 0x7FFFu;
    if (rest >= 0x7C00u) return bits_f32(sign | 0x7F800000u | ((rest & 0x3FFu) << 13));
    if (rest >= 0x0400u) return bits_f32(sign | ((rest + 0x1C000u) << 13)); /* exponent + 112 */
    float magnitude = (float)rest * 0x1p-24f;                                 /* subnormal: exact */
    return sign ? -magnitude : magnitude;
}

/* NVFP4's UE4M3 scale halved (its E2M1 values are held doubled, as MXFP4's), as ggml_ue4m3_to_fp32:
 * 0 and 0x7F are 0, bit 7 is ignored; every value is exact in float */
INLINE float ue4m3_half(uint8_t x) {
    if (x == 0 || x == 0x7F) return 0.0f;
    const int e = (x >> 3) & 15, m = x & 7;
    return (e == 0 ? (float)m * 0x1p-9f : (1.0f + (float)m / 8.0f) * bits_f32((uint32_t)(e + 120) << 23)) * 0.5f;
}

typedef struct {
    const float *x;
    int64_t in_features, out_rows, row_bytes;
    const int64_t *addresses, *starts, *rows;
    int64_t matrices;
    float *out;
    int64_t out_stride; /* floats from one output row to the next: out_rows, or more in a wider out */
    const float *sums16; /* fused kernels: sum of each 16 consecutive values of each x row */
    const struct BlockQ8K *q8;    /* Q8_K kernels: each x row quantized as ggml does, in / 256 blocks */
    const struct BlockQ8_0 *q8_0; /* Q8_0 kernels: the same in Q8_0 blocks, in / 32 of them */
    const struct BlockQ8_1 *q8_1; /* Q8_1 kernels (Q4_1, Q5_1): the same in Q8_1 blocks */
} Product;

/* Q4_K's and Q5_K's 6-bit scale and min of sub-block s (0..7) from the 12 bytes at p */
INLINE void k_scale_min(const uint8_t *p, int s, int *scale, int *min) {
    if (s < 4) {
        *scale = p[s] & 63;
        *min = p[4 + s] & 63;
    } else {
        *scale = (p[4 + s] & 15) | ((p[s - 4] >> 2) & 0x30);
        *min = (p[4 + s] >> 4) | ((p[s] >> 2) & 0x30);
    }
}

/* Q3_K's 6-bit scale of sub-block s (0..15), less 32 */
INLINE int q3_k_int_scale(const uint8_t *restrict b, int s) {
    return (((b[96 + (s & 7)] >> (4 * (s >> 3))) & 15) | ((b[104 + (s & 3)] >> (2 * (s >> 2))) & 3) << 4) - 32;
}

/* ggml's block_q8_0: 32 codes x * 127 / amax rounded, and d = amax / 127 rounded to F16 (held as float) */
typedef struct BlockQ8_0 {
    float d;
    int8_t qs[32];
} BlockQ8_0;

/* ggml's block_q8_1: block_q8_0's codes and d, and s = d * sum(codes) with d unrounded, rounded to F16
 * (held as float): what multiplies a Q4_1 or Q5_1 block's offset */
typedef struct BlockQ8_1 {
    float d, s;
    int8_t qs[32];
} BlockQ8_1;

/* ggml's block_q8_K: x * (1 / d) rounded to int8, and the sums of each 16 codes */
typedef struct BlockQ8K {
    float d;
    int8_t qs[256];
    int16_t bsums[16];
} BlockQ8K;

typedef void (*RowKernel)(const Product *, int64_t b, int64_t first, int64_t last);

/* ---- the entry points (`ggml_cpu.c`): the extension module's functions call them (its Python part is
 * left out with K3STREAM_WITHOUT_PYTHON: tests/kernels_driver.c runs them on other CPUs) ------------ */

/* The i-quants' lookup grids and value tables, set once before any i-quant kernel runs (`iquants_cpu.c`):
 * IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S and IQ1_S grids, then IQ4_NL's and MXFP4's values, a byte a value,
 * row after row (IQ1_S's and the values as int8). -1, or the index of the first table whose `bytes` is not
 * its size (that size into *expected; nothing set). */
#define IQ_TABLES 8
int k3_set_iq_grids(const void *const tables[IQ_TABLES], const int64_t bytes[IQ_TABLES], int64_t *expected);
/* The first `values` values (whole blocks) of the GGUF blocks at `blocks` into out: the reference
 * dequantizer's values; -1 for a type without a decoder or values not in whole blocks */
int k3_decode_row(int ggml_type, const uint8_t *blocks, int64_t values, float *out);
/* out[p] = x[rows[p]] @ W_b^T for the rows p in starts[b]..starts[b + 1] of each matrix b (its address
 * in addresses[b]); `q8_activations`: x quantized as ggml does for the type and its integer kernels.
 * 0, -1 for a GGML type without a kernel, -2 without memory. */
int k3_grouped_product(const float *x, int64_t in_features, const int64_t *addresses, int64_t matrices,
                       int64_t out_rows, int64_t row_bytes, int ggml_type, const int64_t *starts,
                       const int64_t *rows, float *out, int threads, int q8_activations);
/* A role of the routed experts: each expert's matrix addresses, the GGML type, output rows and row bytes */
typedef struct {
    const int64_t *addresses;
    int ggml_type;
    int64_t out_rows, row_bytes;
} Role;
/* The routed-expert MLP of one step: down(situ(gate(x), up(x))) of each expert b on its rows
 * starts[b]..starts[b+1] (input rows `rows`), into out [P, out_features]. The same products and
 * activation as three k3_grouped_product calls with k3_situ between (so the same results), in one call.
 * Returns k3_grouped_product's status. */
int k3_expert_mlp(const float *x, int64_t in_features, Role gate, Role up, Role down, int64_t experts,
                  const int64_t *starts, const int64_t *rows, float beta, float linear_beta, float *out, int threads,
                  int q8_activations);
/* The instruction set the integer kernels take now: "avx512", "avx2" or "portable" */
const char *k3_isa(void);

/* Rows of a matrix are contiguous, but each is often one 4 KiB page and hardware prefetchers stop at
 * page boundaries: ask for the lines PREFETCH_BYTES ahead of each chunk so the next row is on its way. */
#define PREFETCH_BYTES 4096
INLINE void prefetch_ahead(const uint8_t *at, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(at + PREFETCH_BYTES + line, 0, 3);
}

/* A kernel choice the CPU is measured for: the environment's `variable` set to `yes` (1) or `no` (0) takes
 * that on any machine (the tests reach both), else measure()'s answer, measured once (*measured: -1 until) */
INLINE int measured_choice(const char *variable, const char *yes, const char *no, int *measured, int (*measure)(void)) {
    const char *value = getenv(variable);
    if (value != NULL && (strcmp(value, yes) == 0 || strcmp(value, no) == 0)) return strcmp(value, yes) == 0;
    int answer = __atomic_load_n(measured, __ATOMIC_RELAXED);
    if (answer < 0) {
        answer = measure();
        __atomic_store_n(measured, answer, __ATOMIC_RELAXED);
    }
    return answer;
}

/* ggml's integer kernels of the i-quants, ternary types and MXFP4 on 8-bit activations (`iquants_cpu.c`):
 * a type's row kernel (NULL: none; the AVX-512 one where HAVE_AVX512()) and whether its activations are
 * Q8_0 (else Q8_K) blocks */
RowKernel iq_q8_kernel(int ggml_type, int avx2);
/* ... ggml's AVX2 (else portable) one alone */
RowKernel iq_q8_kernel_avx2(int ggml_type);
/* The AVX-512 kernels of the grid types (`iquants_avx512.c`): a type's row kernel where the CPU has
 * AVX-512 (HAVE_AVX512), else NULL; it takes any number of input rows (no multi-row kernel beside it) */
RowKernel iq_avx512_kernel(int ggml_type);
/* the grids (rows of bytes, IQ1_S's int8) and ksigns, once set */
typedef struct {
    const uint8_t *iq2xxs, *iq2xs, *iq2s, *iq3xxs, *iq3s, *ksigns;
    const int8_t *iq1s;
} IqGrids;
void iq_avx512_set_grids(const IqGrids *grids);
/* ... and their float decoders (ggml_cpu.c's DECODED_TYPES): one block into y */
void dec_iq2_xxs(const uint8_t *restrict b, float *restrict y);
void dec_iq2_xs(const uint8_t *restrict b, float *restrict y);
void dec_iq2_s(const uint8_t *restrict b, float *restrict y);
void dec_iq3_xxs(const uint8_t *restrict b, float *restrict y);
void dec_iq3_s(const uint8_t *restrict b, float *restrict y);
void dec_iq1_s(const uint8_t *restrict b, float *restrict y);
void dec_iq1_m(const uint8_t *restrict b, float *restrict y);
void dec_iq4_nl(const uint8_t *restrict b, float *restrict y);
void dec_iq4_xs(const uint8_t *restrict b, float *restrict y);
void dec_tq1_0(const uint8_t *restrict b, float *restrict y);
void dec_tq2_0(const uint8_t *restrict b, float *restrict y);
int iq_q8_0_activations(int ggml_type);

/* One i-quant block as its AVX2 kernel decodes it (SHARED_RUNS in `iquants_cpu.c`), for the multi-row
 * kernels: each run of 32 values' unsigned weights, the signs its activations take (a byte +1, -1 or
 * 0), the int16 scales of its pairs of pairs; d; IQ1_S's delta factor of each run (sign times scale) */
typedef struct {
    uint8_t w[8][32], sign[8][32];
    int16_t scales[8][16];
    int32_t deltas[8];
    float d;
} __attribute__((aligned(32))) IqRuns;

/* a type's block decoder (NULL: none here), bytes a block, whether IQ1_S's deltas enter, and the factor
 * its lanes' sum takes at the end */
typedef struct {
    void (*decode)(const uint8_t *block, IqRuns *out);
    int bytes, deltas;
    float factor;
} IqRunType;
IqRunType iq_run_type(int ggml_type, int avx2);

/* The AVX-512 one-row kernels on 8-bit activations (`kquants_avx512.c`): a type's (Q8_0, Q2_K, Q3_K, Q4_K,
 * Q5_K, Q6_K) where HAVE_AVX512(), else NULL; each output bit for bit its AVX2 kernel's */
RowKernel q8_kernel_avx512(int ggml_type);
/* ... and the multi-row kernels' (Q8_0, Q5_0, Q4_1, Q5_1), each output bit for bit the one-row kernel's */
RowKernel q8_tile_kernel_avx512(int ggml_type);

/* The row-major F32 kernel for several input rows (`f32_gemm.c`): each output bit for bit the one-row
 * kernel's (wide_f32), NULL without AVX2 (the portable row kernel is row-exact as it is); it returns 0,
 * or -2 without memory for its packed rows (nothing computed) */
typedef int (*F32RowsKernel)(const Product *, int64_t b, int64_t first, int64_t last);
F32RowsKernel f32_rows_kernel(int avx512, int avx2);

/* Kernels that decode a weight block once for several input rows (`tiles_cpu.c`): a type's kernel
 * for a matrix with more than one input row (NULL: none; the one-row kernel then takes every row),
 * each output bit for bit what the type's one-row kernel on 8-bit activations gives */
RowKernel q8_tile_kernel(int ggml_type, int avx2);
/* ... and whether it is the faster one for a matrix with `rows` input rows */
int q8_tiles_take(int ggml_type, int64_t rows);

#if K3_X86_SIMD
#include <immintrin.h>
#define AVX2_INLINE __attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline))

/* AVX-512 kernels (F, BW, VL, VNNI, VBMI) where the CPU has them; K3STREAM_NO_AVX512=1 takes the AVX2
 * ones on any machine (so tests reach both), K3STREAM_GENERIC_KERNELS=1 the portable ones */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c,bmi2")))
#define HAVE_AVX512()                                                                                        \
    (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&                              \
     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&                           \
     __builtin_cpu_supports("avx512vbmi") && getenv("K3STREAM_NO_AVX512") == NULL &&                         \
     getenv("K3STREAM_GENERIC_KERNELS") == NULL)

/* the sum of eight float lanes, in the one order every kernel's final sum takes */
AVX2_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* [hsum8(v0), hsum8(v1), hsum8(v2), hsum8(v3)]: each the same additions in the same order as hsum8
 * (halves, then lanes i and i + 2, then the two left), four at a time */
AVX2_INLINE __m128 hsum8_x4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    const __m256 halves01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
    const __m256 halves23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20), _mm256_permute2f128_ps(v2, v3, 0x31));
    const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(halves01, halves23, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm256_shuffle_ps(halves01, halves23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)); /* 0, 1, 2, 3 */
}

/* Q3_K's 16 six-bit scales minus 32, from its 12 scale bytes at b + 96, as int8 (q3_k_scale): scale j's
 * low four bits are the low (j < 8) or high nibble of byte j % 8, its high two bits 2 (j / 4) .. of byte
 * 8 + j % 4. In vector registers: decoded with scalar shifts and inserted, the scales had been a third
 * of a Q3_K integer dot's time (its block 1.2x faster so) */
AVX2_INLINE __m128i q3_k_scales8(const uint8_t *restrict b) {
    uint32_t high;
    memcpy(&high, b + 104, 4);
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(b + 96)), nibble = _mm_set1_epi8(15);
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(bytes, nibble), _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    const __m128i tops = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)high), _mm_setr_epi32(0, 2, 4, 6)),
                                       _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi32(tops, 4)), _mm_set1_epi8(32));
}

/* Q6_K's 32 unsigned 6-bit codes (0..63) of run r: low nibbles at 64(r/4) + 32((r%4)%2), shift
 * 4((r%4)/2); high bits at 128 + 32(r/4), shift 2(r%4) */
AVX2_INLINE __m256i q6_k_codes(const uint8_t *restrict b, int run) {
    const int half = run >> 2, rest = (run & 3) * 32;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * half + (rest & 63)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (rest >> 6)), _mm256_set1_epi8(15));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * (run & 3)), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}

/* Up to Q8_ROWS input rows share each Q2_K, Q3_K, Q4_K, Q5_K (on AVX-512 Q6_K too, on AVX2 Q5_0, Q4_1 and
 * Q5_1) weight row's decoded codes and scales (prefill, batched decode): each row keeps its own sums and sees exactly the
 * operations it would see alone. Eight 1024 x 1024 matrices, 8 rows each, one thread: 1.4-1.6x the
 * one-row-at-a-time kernels. */
#define Q8_ROWS 4

/* Eight float lanes and a float summed apart beside them: ggml's AVX2 vec_dot of Q4_1, Q5_1 and Q5_K adds
 * each block's offset product (m times the Q8_1 block's s; dmin times the mins' integer sum) to one
 * scalar in block order, and that scalar to the lanes' hsum8 at the end (lanes_total) */
typedef struct {
    __m256 lanes;
    float sum;
} Lanes;
#define LANES_ZERO ((Lanes){_mm256_setzero_ps(), 0.0f})
AVX2_INLINE float lanes_total(Lanes acc) { return hsum8(acc.lanes) + acc.sum; }

/* Eight float lanes and four beside them: ggml's AVX2 vec_dot of Q4_K takes each block's mins against
 * the Q8_K sums of 32 as four int32 lanes (lane k: mins 2k and 2k + 1), into four float lanes by one FMA
 * with -d_y dmin, and adds their sum ((0 + 2) + (1 + 3)) to the lanes' hsum8 at the end */
typedef struct {
    __m256 lanes;
    __m128 mins;
} MinLanes;
#define MIN_LANES_ZERO ((MinLanes){_mm256_setzero_ps(), _mm_setzero_ps()})
AVX2_INLINE float min_lanes_total(MinLanes acc) {
    const __m128 pairs = _mm_add_ps(acc.mins, _mm_movehl_ps(acc.mins, acc.mins));
    return hsum8(acc.lanes) + _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

/* Q4_K's four int32 min lanes of one input row: `mins` (int16 lanes 0..7) times its Q8_K sums of 32 */
AVX2_INLINE __m128i q4_k_min_lanes(__m128i mins, const int16_t *bsums) {
    const __m256i sums = _mm256_loadu_si256((const __m256i *)bsums);
    return _mm_madd_epi16(mins, _mm_hadd_epi16(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1)));
}

/* NAME##_rows: one weight row m against n (<= Q8_ROWS) input rows' 8-bit blocks from p (Y: Q8_K, Q8_0 or
 * Q8_1, ELEMS values each), blocks in order into each row's accumulator (ACC from ZERO: eight lanes, or
 * Lanes) by BLOCK, summed at the end by TOTAL (hsum8, lanes_total); ATTR: its inline and target
 * attributes (the AVX2 and AVX-512 kernels share it) */
#define Q8_SHARED_ROWS(ATTR, NAME, BLOCK, BLOCK_BYTES, Y, ELEMS, ACC, ZERO, TOTAL)                       \
    ATTR void NAME##_rows(const Product *pr, const uint8_t *row, int64_t m, int64_t p, const int n) {   \
        const int64_t blocks = pr->in_features / (ELEMS);                                               \
        const __typeof__(*pr->Y) *y[Q8_ROWS];                                                           \
        ACC acc[Q8_ROWS];                                                                               \
        for (int r = 0; r < n; r++) y[r] = pr->Y + pr->rows[p + r] * blocks, acc[r] = ZERO;            \
        for (int64_t block = 0; block < blocks; block++) {                                              \
            prefetch_ahead(row + block * (BLOCK_BYTES), BLOCK_BYTES);                                   \
            BLOCK(row + block * (BLOCK_BYTES), y, block, acc, n);                                       \
        }                                                                                               \
        for (int r = 0; r < n; r++) pr->out[(p + r) * pr->out_stride + m] = TOTAL(acc[r]);             \
    }
#define Q8K_SHARED_ROWS(ATTR, NAME, BLOCK, BLOCK_BYTES, ACC, ZERO, TOTAL) \
    Q8_SHARED_ROWS(ATTR, NAME, BLOCK, BLOCK_BYTES, q8, 256, ACC, ZERO, TOTAL)

#else
#define HAVE_AVX512() 0
#endif

#endif
