/* AVX-512 (VBMI, VNNI) integer kernels of the 1-3-bit grid i-quants on Q8_K activations, where the CPU
 * has them (HAVE_AVX512; K3STREAM_NO_AVX512=1 keeps ggml's AVX2 kernels of `iquants_cpu.c`). IQ1_S and
 * IQ1_M gather their grid entries (below, "the grid gathered"); the others work in byte planes.
 *
 * Byte planes: two blocks (512 values) are 64 "entries" k of 8 values 8k..8k + 7 (an IQ2 grid entry;
 * two IQ3 ones), and plane j (0..7) is value 8k + j of every k, 64 bytes. The grids' entries are
 * held as codes of their few levels (code tables, below); 64 grid indices look up 64 code bytes in
 * two-table byte permutes (128 entries each) blended on the index's high bits, and one byte permute a
 * plane turns codes into levels. The activations are put in plane order once per kernel call (x is
 * shared by every weight row): `x_planes`. The signs go to the activations (a masked negate), the
 * unsigned levels times them by VPDPBUSD; a 32-bit lane then sums 4 adjacent entries of a plane, one
 * 32-value sub-block, so the 8 planes' products give each sub-block's exact sum in its own lane. IQ2_XS
 * and IQ2_S, a scale each 16 values (two entries): VPMADDUBSW sums a plane's two entries in a 16-bit
 * lane, two planes' lanes are added (below 2^15: levels of at most 63) and VPDPWSSD multiplies them by
 * their scales into the sub-block's 32-bit lane, the same integer.
 *
 * The float step (every input-row count, one or many, gives a row the same bits; IQ1_S and IQ1_M
 * take it a block at a time, their 16 lanes any exact split of the block's sum):
 * lane t (0..15) of a pair of blocks: sub-block t's scaled integer sum (exact in float32), times
 * d_w * d_y of its block (a float product), added by FMA into lane t of 16 float lanes, block pair after
 * pair; at the end the 16 lanes summed (hsum16) and multiplied by the type's factor. This is not ggml's
 * lane order: the results are within a few ulp of llama.cpp's vec_dot, not bit for bit.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if K3_X86_SIMD
#include <x86intrin.h>

#define AVX512 AVX512_TARGET static inline __attribute__((always_inline))

#define RUN_ROWS 4 /* input rows sharing each decoded pair of blocks */

/* The weight lines a kernel asks for ahead of what it reads, `ahead` bytes over the rows it reads in turn
 * (`streams`: GRID_PREFETCH_BYTES, 2 KiB ahead of one row, 1 KiB of each of two; the hardware prefetchers bring
 * each stream from RAM). From RAM on AMD Zen 4, one thread: one stream (IQ3) ran 1.02-1.04x as fast 2-3 KiB
 * ahead as 1 KiB or 4 KiB ahead, two (IQ2 against one input row) 1.01-1.03x as fast 0.5-1 KiB ahead of each
 * as 2-4 KiB. IQ2_S asks IQ2_S_PREFETCH_BYTES ahead (3 KiB of each of two rows): on AMD Zen 5 its kernel
 * waited for RAM at 1 KiB (one thread, thread CPU time: 1.28-1.37x as fast 2-3 KiB ahead of each row, the
 * other grid types 1.00-1.04x), where on Zen 4 3 KiB ran 0.96-0.98x as fast as 1 KiB. */
#define GRID_PREFETCH_BYTES 2048
#define IQ2_S_PREFETCH_BYTES 6144
AVX512 void prefetch_soon(const uint8_t *at, int64_t bytes, const int streams, const int ahead) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(at + ahead / streams + line, 0, 3);
}

/* Each grid's values are a few levels: IQ2's three (a 2-bit code), IQ3's eight (3 bits). A grid's code
 * tables (one byte an entry each) hold its entries' codes, four bytes of an IQ2 entry a table (code of
 * byte 4h + j at bits 2j), two of an IQ3 one (byte 2h + j at bits 3j); a 64-byte level table (VPERMB:
 * the index's low 6 bits) gives the level of one code position. Filled by iq_avx512_set_grids. */
static uint8_t iq2xxs_codes[2][256] __attribute__((aligned(64))), iq2xs_codes[2][512] __attribute__((aligned(64)));
static uint8_t iq2s_codes[2][1024] __attribute__((aligned(64)));
/* IQ2_S: an entry's two code bytes (its tables' bytes) in a dword, for gathers; the byte permute
 * putting byte h of dword i of two vectors (i < 16: the first's) at byte 32 h + i */
static uint32_t iq2s_words[1024] __attribute__((aligned(64)));
static uint8_t word_pack[64] __attribute__((aligned(64)));
/* IQ2_S: the multishift taking bits 8-9 of entry 16 h + i's index (bits 32 h + 2 i of its block's 8 bytes)
 * to byte 1 of int32 lane i, for h = 0, 1 */
static uint8_t iq2s_high_shifts[2][64] __attribute__((aligned(64)));
static uint8_t iq3xxs_codes[2][256] __attribute__((aligned(64))), iq3s_codes[2][512] __attribute__((aligned(64)));
static uint8_t iq2xxs_levels[3][64] __attribute__((aligned(64))), iq2xs_levels[3][64] __attribute__((aligned(64)));
static uint8_t iq2s_levels[3][64] __attribute__((aligned(64)));
/* below: "signed levels" */
static int8_t iq2xxs_signed_levels[2][64] __attribute__((aligned(64))), iq2xs_signed_levels[2][64] __attribute__((aligned(64)));
static int8_t iq2s_signed_levels[2][64] __attribute__((aligned(64)));
static uint8_t iq3xxs_levels[2][64] __attribute__((aligned(64))), iq3s_levels[2][64] __attribute__((aligned(64)));
/* at most 3 (IQ2; IQ1_S's values + 1), 8 (IQ3) distinct values */
static int iq2xxs_fit, iq2xs_fit, iq2s_fit, iq3xxs_fit, iq3s_fit;
static uint8_t ksigns_table[128] __attribute__((aligned(64)));
static uint8_t entry_order[64] __attribute__((aligned(64))); /* entry k: byte 8q + l of sub-block vectors */
static uint8_t even_bytes[2][64] __attribute__((aligned(64))); /* bytes 2k (+ 1) of two vectors */
static uint8_t plane_order[64] __attribute__((aligned(64))); /* byte 8j + e <- byte 8e + j */
static int64_t half_fields[8] __attribute__((aligned(64))); /* half_scales' bit offsets */
static int64_t transpose_low[3][8] __attribute__((aligned(64))), transpose_high[3][8] __attribute__((aligned(64)));

/* a grid's distinct values, ascending, into levels (at most `most` kept): whether there are at most `most` */
static int grid_levels(const uint8_t *grid, int bytes, uint8_t *levels, int most) {
    int count = 0;
    for (int v = 0; v < 256; v++) {
        int seen = 0;
        for (int i = 0; i < bytes && !seen; i++) seen = grid[i] == v;
        if (seen && count < most) levels[count] = (uint8_t)v;
        count += seen;
    }
    return count <= most;
}

/* tables h = 0..width / per_table - 1 of a grid of `entries` entries of `width` bytes */
static void code_tables(const uint8_t *grid, int entries, int width, int per_table, int bits, const uint8_t *levels,
                        int count, uint8_t *tables) {
    for (int h = 0; h < width / per_table; h++)
        for (int e = 0; e < entries; e++) {
            uint8_t packed = 0;
            for (int j = 0; j < per_table; j++) {
                int code = 0;
                while (code < count - 1 && levels[code] != grid[width * e + per_table * h + j]) code++;
                packed |= (uint8_t)(code << bits * j);
            }
            tables[h * entries + e] = packed;
        }
}

static void level_tables(const uint8_t *levels, int count, int bits, int positions, uint8_t (*tables)[64]) {
    for (int j = 0; j < positions; j++)
        for (int i = 0; i < 64; i++) tables[j][i] = levels[((i >> bits * j) & ((1 << bits) - 1)) % count];
}

/* a grid's code and level tables (IQ2: 8-byte entries, 3 levels; IQ3: 4-byte, 8): whether its values fit */
static int grid_codes(const uint8_t *grid, int entries, int width, uint8_t *codes, uint8_t (*levels)[64]) {
    const int count = width == 8 ? 3 : 8, bits = width == 8 ? 2 : 3, per_table = width / 2;
    uint8_t values[8];
    const int fit = grid_levels(grid, entries * width, values, count);
    level_tables(values, count, bits, width == 8 ? 3 : 2, levels);
    code_tables(grid, entries, width, per_table, bits, values, count, codes);
    return fit;
}

/* whether a grid's levels are at most 63: the 16-bit sums of two planes (HALVES) stay below 2^15 */
static int small_levels(const uint8_t (*levels)[64]) {
    int most = 0;
    for (int i = 0; i < 64; i++) most = levels[0][i] > most ? levels[0][i] : most;
    return most <= 63;
}
static void iq1_set_grid(const int8_t *grid);

/* the signed levels of an IQ2 grid's codes: index bits 0-1, 4: the first plane's code and sign; 2-3, 5: the
 * second's */
static void signed_levels(const uint8_t (*levels)[64], int8_t (*out)[64]) {
    for (int i = 0; i < 64; i++) {
        out[0][i] = (int8_t)(levels[0][i & 3] * (i & 16 ? -1 : 1));
        out[1][i] = (int8_t)(levels[0][(i >> 2) & 3] * (i & 32 ? -1 : 1));
    }
}

void iq_avx512_set_grids(const IqGrids *grids) {
    iq2xxs_fit = grid_codes(grids->iq2xxs, 256, 8, &iq2xxs_codes[0][0], iq2xxs_levels) && small_levels(iq2xxs_levels);
    iq2xs_fit = grid_codes(grids->iq2xs, 512, 8, &iq2xs_codes[0][0], iq2xs_levels) && small_levels(iq2xs_levels);
    iq2s_fit = grid_codes(grids->iq2s, 1024, 8, &iq2s_codes[0][0], iq2s_levels) && small_levels(iq2s_levels);
    for (int e = 0; e < 1024; e++) iq2s_words[e] = iq2s_codes[0][e] | (uint32_t)iq2s_codes[1][e] << 8;
    signed_levels(iq2xxs_levels, iq2xxs_signed_levels);
    signed_levels(iq2xs_levels, iq2xs_signed_levels);
    signed_levels(iq2s_levels, iq2s_signed_levels);
    for (int k = 0; k < 64; k++) {
        word_pack[k] = (uint8_t)(4 * (k % 32) + k / 32);
        for (int h = 0; h < 2; h++) iq2s_high_shifts[h][k] = (uint8_t)(k % 4 == 1 ? 32 * h + 2 * (k / 4) : 0);
    }
    iq3xxs_fit = grid_codes(grids->iq3xxs, 256, 4, &iq3xxs_codes[0][0], iq3xxs_levels);
    iq3s_fit = grid_codes(grids->iq3s, 512, 4, &iq3s_codes[0][0], iq3s_levels);
    iq1_set_grid(grids->iq1s);
    memcpy(ksigns_table, grids->ksigns, 128);
    for (int k = 0; k < 64; k++) {
        entry_order[k] = (uint8_t)((k >= 32 ? 64 : 0) + 8 * ((k % 32) / 4) + k % 4);
        even_bytes[0][k] = (uint8_t)((k >= 32 ? 64 : 0) + 2 * (k % 32));
        even_bytes[1][k] = (uint8_t)(even_bytes[0][k] + 1);
        plane_order[k] = (uint8_t)(8 * (k % 8) + k / 8);
    }
    for (int q = 0; q < 8; q++) /* bytes 0, 2 of lane 2q: byte 2q % 8's nibbles; bytes 4, 6: 2q + 1's */
        half_fields[q] = ((16 * q - 1) & 63) | (int64_t)(16 * q % 64 + 3) << 16 | (int64_t)(16 * q % 64 + 7) << 32 |
                         (int64_t)(16 * q % 64 + 11) << 48;
    for (int stage = 0, s = 1; s < 8; stage++, s *= 2) /* 2 x 2 blocks of s qwords swapped */
        for (int p = 0; p < 8; p++) {
            transpose_low[stage][p] = p & s ? 8 + p - s : p;
            transpose_high[stage][p] = p & s ? 8 + p : p + s;
        }
}

/* A pair of blocks decoded: 64 bytes k = 0..63 for the values 8k..8k + 7 (k < 32: the first block):
 * the code bytes of their grid entries (per type), their sign bytes (bit j: value 8k + j negative),
 * the 16 sub-blocks' scales as int32 lanes (IQ2_XS, IQ2_S: 16-bit ones); the d are read by pair_d */
typedef struct {
    __m512i codes[4], signs, scales;
} Pair;

/* the bytes 8q + l (l = 0..3) of two 8-sub-block vectors a (entries 0..31) and b (32..63), entry order */
AVX512 __m512i entry_bytes(__m512i a, __m512i b) {
    return _mm512_permutex2var_epi8(a, _mm512_load_si512(entry_order), b);
}

/* 64 bytes of a 128-entry table at the indices' low 7 bits: a two-table byte permute whose first table (the
 * one it overwrites) is loaded into its destination each time and whose second the compiler may hold in a
 * register, for IQ2_S's two 1024-entry lookups (32 registers of tables: more than are left). Left to itself
 * the compiler keeps some first tables in registers, copies them before each permute and spills the rest
 * into permutes that read both tables from memory: on AMD Zen 4 IQ2_S's kernel took 1.09x the time so (in
 * cache, one thread); the smaller grids' tables fit in registers, and their lookups stay as they are */
AVX512 __m512i lookup128(const uint8_t *table, __m512i index) {
    __m512i got;
    __asm__("vmovdqa64 %[first], %[got]\n\tvpermt2b %[second], %[index], %[got]"
            : [got] "=&v"(got)
            : [first] "m"(*(const __m512i *)table), [second] "v"(_mm512_load_si512(table + 64)), [index] "v"(index));
    return got;
}

/* 64 bytes of a table of 256 << `high_bits` entries at the indices whose low 8 bits are `low` and whose
 * bit 8 + b is high[b]: a two-table byte permute each 128 entries, blended on bit 7, then on each high bit */
AVX512 __m512i lookup_grid(const uint8_t *table, __m512i low, const __mmask64 *high, const int high_bits) {
    const __mmask64 bit7 = _mm512_movepi8_mask(low);
    __m512i part[4];
    _Pragma("GCC unroll 4") for (int q = 0; q < 1 << high_bits; q++) {
        const uint8_t *t = table + 256 * q;
        part[q] = high_bits == 2 ? _mm512_mask_blend_epi8(bit7, lookup128(t, low), lookup128(t + 128, low))
                                 : _mm512_mask_blend_epi8(bit7, _mm512_permutex2var_epi8(_mm512_load_si512(t), low, _mm512_load_si512(t + 64)),
                                                          _mm512_permutex2var_epi8(_mm512_load_si512(t + 128), low, _mm512_load_si512(t + 192)));
    }
    _Pragma("GCC unroll 2") for (int b = 0; b < high_bits; b++) /* unrolled: part[] stays in registers */
        _Pragma("GCC unroll 2") for (int q = 0; q < 1 << high_bits; q += 2 << b) part[q] = _mm512_mask_blend_epi8(high[b], part[q], part[q + (1 << b)]);
    return part[0];
}

AVX512 __m512i lookup256(const uint8_t *table, __m512i index) { return lookup_grid(table, index, NULL, 0); }

AVX512 __m512i lookup512(const uint8_t *table, __m512i low, __mmask64 high) { return lookup_grid(table, low, &high, 1); }

/* 7-bit sign indices (bit 7 ignored) as ggml's ksigns_iq2xs bytes: 7 sign bits, their parity on top */
AVX512 __m512i ksigns(__m512i sevens) {
    return _mm512_permutex2var_epi8(_mm512_load_si512(ksigns_table), sevens, _mm512_load_si512(ksigns_table + 64));
}

AVX512 __m512i odd_scales(__m512i fours) { return _mm512_add_epi32(_mm512_slli_epi32(fours, 1), _mm512_set1_epi32(1)); }

AVX512 uint64_t u64_at(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

AVX512 uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* A pair's second block: the next block of its row or the last block of the next row (two rows' last
 * blocks of an odd count) where `two`, else none (its bytes read as zeros; `second` any readable address) */
AVX512 __m512i second_64(const uint8_t *second, const int two, int at) {
    return _mm512_maskz_loadu_epi8(two ? ~0ULL : 0, second + at);
}

AVX512 __m256i second_32(const uint8_t *second, const int two, int at) { return _mm256_maskz_loadu_epi8(two ? ~0U : 0, second + at); }

AVX512 uint64_t second_u64(const uint8_t *second, const int two, int at) { return two ? u64_at(second + at) : 0; }

/* IQ2_XXS: each sub-block's 8 bytes: 4 grid indices, four 7-bit sign fields (bits 32 + 7l), the scale
 * (bits 60..63); an entry is 8 values, codes[h] its bytes 4h..4h + 3 */
AVX512 Pair iq2_xxs_pair(const uint8_t *x, const uint8_t *second, const int two) {
    const __m512i a = _mm512_loadu_si512(x + 2), b = second_64(second, two, 2);
    const __m512i fields = _mm512_set1_epi64(0x352E2720352E2720LL); /* bit offsets 32, 39, 46, 53 twice */
    const __m512i sevens = entry_bytes(_mm512_multishift_epi64_epi8(fields, a), _mm512_multishift_epi64_epi8(fields, b));
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i ls = _mm512_permutex2var_epi32(_mm512_srli_epi64(a, 60), even, _mm512_srli_epi64(b, 60));
    const __m512i index = entry_bytes(a, b);
    return (Pair){{lookup256(iq2xxs_codes[0], index), lookup256(iq2xxs_codes[1], index)},
                  ksigns(sevens),
                  odd_scales(ls)};
}

/* IQ2 plane j's values: code position j % 4 of codes[j / 4] (the last from the byte's top bits) */
AVX512 __m512i iq2_plane(const Pair *pair, int j, const uint8_t (*levels)[64]) {
    const __m512i table = _mm512_load_si512(levels[j % 4 == 3 ? 0 : j % 4]);
    const __m512i bits = j % 4 == 3 ? _mm512_srli_epi16(pair->codes[j / 4], 6) : pair->codes[j / 4];
    return _mm512_permutexvar_epi8(bits, table);
}

AVX512 __m512i iq2_xxs_plane(const Pair *pair, int j) { return iq2_plane(pair, j, iq2xxs_levels); }
AVX512 __m512i iq2_xs_plane(const Pair *pair, int j) { return iq2_plane(pair, j, iq2xs_levels); }
AVX512 __m512i iq2_s_plane(const Pair *pair, int j) { return iq2_plane(pair, j, iq2s_levels); }
AVX512 __m512i iq2_s_permuted_plane(const Pair *pair, int j) { return iq2_s_plane(pair, j); }

/* IQ2_XS and IQ2_S scales: a byte a sub-block, the low nibble for its first 16 values, the high one for
 * the rest; `first` the first block's 8 bytes, `second` the second's: as 16-bit lanes, lane w the odd
 * scale of values 16w..16w + 15 (entries 2w, 2w + 1) of the pair */
AVX512 __m512i half_scales(uint64_t first, uint64_t second) {
    /* qwords 0-3: the first block's 8 bytes, 4-7 the second's; 32-bit lane b (byte b % 8 of its block):
     * bits 8 (b % 8) - 1.. to its low 16 bits, 8 (b % 8) + 3.. to its high ones (the nibbles doubled) */
    const __m512i bytes = _mm512_mask_set1_epi64(_mm512_set1_epi64((long long)first), 0xF0, (long long)second);
    return _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(_mm512_load_si512(half_fields), bytes), _mm512_set1_epi32(0x001E001E),
                                     _mm512_set1_epi32(0x00010001), 0xEA); /* & 0x1E001E | 0x10001 */
}

/* the two code vectors of a pair's 64 entries (16 a vector of 32-bit grid indices) by four 16-entry
 * gathers of their code words, the words' two bytes packed by two VPERMI2B: IQ2_S's on Intel, in place of
 * two 1024-entry permute lookups (16 two-table permutes and 14 blends a pair), which bounded its kernel
 * there (IQ2_XS's 512 entries: its two lookups ran 1.08x as fast as the gathers, Intel Xeon, in cache);
 * on AMD Zen 4 the lookups ran 1.6-1.8x as fast as the gathers (grid_gathers) */
AVX512 void gathered_codes(const uint32_t *words, const __m512i index[4], __m512i codes[2]) {
    __m512i got[4];
    for (int q = 0; q < 4; q++) got[q] = _mm512_i32gather_epi32(index[q], (const void *)words, 4);
    const __m512i pack = _mm512_load_si512(word_pack);
    const __m512i front = _mm512_permutex2var_epi8(got[0], pack, got[1]);
    const __m512i back = _mm512_permutex2var_epi8(got[2], pack, got[3]);
    codes[0] = _mm512_shuffle_i64x2(front, back, 0x44);
    codes[1] = _mm512_shuffle_i64x2(front, back, 0xEE);
}

/* IQ2_XS: a 16-bit word an entry: a 9-bit grid index, a 7-bit sign index; 8 scale bytes */
AVX512 Pair iq2_xs_pair(const uint8_t *x, const uint8_t *second, const int two) {
    const __m512i a = _mm512_loadu_si512(x + 2), b = second_64(second, two, 2);
    const __m512i low = _mm512_permutex2var_epi8(a, _mm512_load_si512(even_bytes[0]), b);
    const __m512i high = _mm512_permutex2var_epi8(a, _mm512_load_si512(even_bytes[1]), b);
    const __mmask64 bit8 = _mm512_test_epi8_mask(high, _mm512_set1_epi8(1));
    Pair pair = {{lookup512(iq2xs_codes[0], low, bit8), lookup512(iq2xs_codes[1], low, bit8)},
                 ksigns(_mm512_srli_epi16(high, 1)), /* bits 1..7 of each byte (ksigns reads 7 bits) */
                 _mm512_setzero_si512()};
    pair.scales = half_scales(u64_at(x + 66), second_u64(second, two, 66));
    return pair;
}

/* IQ2_S: 32 low index bytes, 32 sign bytes (one an entry), 8 bytes of index bits 8-9 (bits 2e, 2e + 1 of
 * the pair's entry order), 8 scale bytes; its pair from its two code vectors */
AVX512 Pair iq2_s_pair_of(const uint8_t *x, const uint8_t *second, const int two, const __m512i codes[2]) {
    const __m256i first = _mm256_loadu_si256((const __m256i *)(x + 34)); /* bytes 32..63: the second block's */
    const __m512i signs = _mm512_inserti64x4(_mm512_castsi256_si512(first), second_32(second, two, 34), 1);
    return (Pair){{codes[0], codes[1]}, signs, half_scales(u64_at(x + 74), second_u64(second, two, 74))};
}

/* ... its codes gathered (the grid lookups where gathers are fast: Intel) */
AVX512 Pair iq2_s_pair(const uint8_t *x, const uint8_t *second, const int two) {
    __m512i index[4], codes[2];
    for (int q = 0; q < 4; q++) { /* entries 16 q..: the low bytes | bits 8 and 9 of their indices << 8 */
        const uint8_t *block = q < 2 ? x : second;
        index[q] = _mm512_setzero_si512();
        if (q < 2 || two) {
            const __m512i low = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 2 + 16 * (q % 2))));
            const __m512i high = _mm512_multishift_epi64_epi8(_mm512_load_si512(iq2s_high_shifts[q % 2]),
                                                              _mm512_set1_epi64((long long)u64_at(block + 66)));
            index[q] = _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi32(0x300), 0xF8); /* a | (b & c) */
        }
    }
    gathered_codes(iq2s_words, index, codes);
    return iq2_s_pair_of(x, second, two, codes);
}

/* ... its codes by byte permutes (where gathers are slow: AMD Zen 4 takes about a cycle an element) */
AVX512 Pair iq2_s_permuted_pair(const uint8_t *x, const uint8_t *second, const int two) {
    const __m512i low = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x + 2))), second_32(second, two, 2), 1);
    const uint64_t high0 = u64_at(x + 66), high1 = second_u64(second, two, 66), evens = 0x5555555555555555ULL;
    const __mmask64 high[2] = {_pext_u64(high0, evens) | _pext_u64(high1, evens) << 32,
                               _pext_u64(high0, evens << 1) | _pext_u64(high1, evens << 1) << 32};
    const __m512i codes[2] = {lookup_grid(iq2s_codes[0], low, high, 2), lookup_grid(iq2s_codes[1], low, high, 2)};
    return iq2_s_pair_of(x, second, two, codes);
}

/* IQ3_XXS: 64 grid indices (an entry: 4 values), then each sub-block's 32-bit word of four 7-bit sign
 * fields (bits 7l) and the scale (bits 28..31); values 8k..8k + 3 are entry 2k, 8k + 4.. entry 2k + 1:
 * codes[0], codes[1] (entry 2k's bytes 0-1, 2-3), codes[2], codes[3] (entry 2k + 1's) */
AVX512 Pair iq3_xxs_pair(const uint8_t *x, const uint8_t *second, const int two) {
    const __m512i a = _mm512_loadu_si512(x + 2), b = second_64(second, two, 2);
    const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x + 66))), second_32(second, two, 66), 1);
    const __m512i fields = _mm512_set1_epi64(0x352E2720150E0700LL); /* bit offsets 0, 7, 14, 21 of each word */
    const __m512i even = _mm512_permutex2var_epi8(a, _mm512_load_si512(even_bytes[0]), b);
    const __m512i odd = _mm512_permutex2var_epi8(a, _mm512_load_si512(even_bytes[1]), b);
    return (Pair){{lookup256(iq3xxs_codes[0], even), lookup256(iq3xxs_codes[1], even), lookup256(iq3xxs_codes[0], odd),
                   lookup256(iq3xxs_codes[1], odd)},
                  ksigns(_mm512_multishift_epi64_epi8(fields, words)),
                  odd_scales(_mm512_srli_epi32(words, 28))};
}

/* IQ3 plane j's values: byte j % 4 of entry 2k + j / 4: code position j % 2 of codes[2 (j / 4) + j % 4 / 2] */
AVX512 __m512i iq3_plane(const Pair *pair, int j, const uint8_t (*levels)[64]) {
    return _mm512_permutexvar_epi8(pair->codes[2 * (j / 4) + j % 4 / 2], _mm512_load_si512(levels[j % 2]));
}

AVX512 __m512i iq3_xxs_plane(const Pair *pair, int j) { return iq3_plane(pair, j, iq3xxs_levels); }

/* IQ3_S: 64 index bytes (low 8 bits), 8 bytes of their bit 8 (bit e % 8 of byte e / 8: 128 bits in entry
 * order over the pair, even entries' at even bits), 32 sign bytes (byte k: values 8k..8k + 7), a nibble
 * of scale a sub-block; entries as IQ3_XXS's */
AVX512 Pair iq3_s_pair(const uint8_t *x, const uint8_t *second, const int two) {
    const __m512i a = _mm512_loadu_si512(x + 2), b = second_64(second, two, 2);
    const __m512i even = _mm512_permutex2var_epi8(a, _mm512_load_si512(even_bytes[0]), b);
    const __m512i odd = _mm512_permutex2var_epi8(a, _mm512_load_si512(even_bytes[1]), b);
    const uint64_t high0 = u64_at(x + 66), high1 = second_u64(second, two, 66), evens = 0x5555555555555555ULL;
    const __mmask64 high_even = _pext_u64(high0, evens) | _pext_u64(high1, evens) << 32;
    const __mmask64 high_odd = _pext_u64(high0, evens << 1) | _pext_u64(high1, evens << 1) << 32;
    const __m512i signs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x + 74))), second_32(second, two, 74), 1);
    const __m512i nibbles = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32((int)u32_at(x + 106)),
                                                    _mm512_set1_epi32(two ? (int)u32_at(second + 106) : 0));
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i ls = _mm512_and_si512(_mm512_srlv_epi32(nibbles, shifts), _mm512_set1_epi32(15));
    return (Pair){{lookup512(iq3s_codes[0], even, high_even), lookup512(iq3s_codes[1], even, high_even),
                   lookup512(iq3s_codes[0], odd, high_odd), lookup512(iq3s_codes[1], odd, high_odd)},
                  signs,
                  odd_scales(ls)};
}

AVX512 __m512i iq3_s_plane(const Pair *pair, int j) { return iq3_plane(pair, j, iq3s_levels); }

/* hsum8 of the sum of the two halves */
AVX512 float hsum16(__m512 v) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

/* two Q8_K blocks' codes (second NULL: zeros) as byte planes, 512 bytes: plane j at planes + 64 j, byte
 * k = code 8k + j of the pair */
AVX512 void x_pair_planes(const BlockQ8K *first, const BlockQ8K *second, int8_t *planes) {
    const __m512i by_plane = _mm512_load_si512(plane_order);
    __m512i v[8];
    for (int i = 0; i < 8; i++) {
        const BlockQ8K *block = i < 4 ? first : second;
        const __m512i codes = block != NULL ? _mm512_loadu_si512(block->qs + 64 * (i % 4)) : _mm512_setzero_si512();
        v[i] = _mm512_permutexvar_epi8(by_plane, codes); /* qword j: plane j of entries 8i..8i + 7 */
    }
    for (int stage = 0, s = 1; s < 8; stage++, s *= 2) { /* transpose the 8 x 8 qwords: plane j = qword j of each v[i] */
        const __m512i lo = _mm512_load_si512(transpose_low[stage]), hi = _mm512_load_si512(transpose_high[stage]);
        for (int i = 0; i < 8; i++)
            if (!(i & s)) {
                const __m512i a = v[i], b = v[i + s];
                v[i] = _mm512_permutex2var_epi64(a, lo, b);
                v[i + s] = _mm512_permutex2var_epi64(a, hi, b);
            }
    }
    for (int j = 0; j < 8; j++) _mm512_store_si512(planes + 64 * j, v[j]);
}

/* x's codes (`blocks` Q8_K blocks) as byte planes, pair g at planes + 512 g (a last odd block's pair padded
 * with zeros); an odd count adds its last block twice (two weight rows' last blocks as one pair) */
AVX512 void x_planes(const BlockQ8K *y, int64_t blocks, int8_t *planes) {
    for (int64_t g = 0; g < (blocks + 1) / 2; g++) x_pair_planes(y + 2 * g, 2 * g + 1 < blocks ? y + 2 * g + 1 : NULL, planes + 512 * g);
    if (blocks % 2) x_pair_planes(y + blocks - 1, y + blocks - 1, planes + 512 * ((blocks + 1) / 2));
}

/* how a type's lanes are summed: one scale a sub-block; one a half (HALVES) */
#define WHOLE 0
#define HALVES 1

/* HALVES: scaled in the planes' loop (`second`) */
AVX512 __m512i scaled_lanes(const Pair *pair, __m512i first, __m512i second, const int kind) {
    if (kind == HALVES) return second;
    return _mm512_mullo_epi32(_mm512_add_epi32(first, second), pair->scales);
}

/* the d of blocks x and (where `two`) second, their F16s converted together: lanes 0, 1 */
AVX512 __m128 pair_d(const uint8_t *x, const uint8_t *second, const int two) {
    const uint32_t halves = (uint32_t)x[0] | (uint32_t)x[1] << 8 | (two ? (uint32_t)second[0] << 16 | (uint32_t)second[1] << 24 : 0);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)halves));
}

/* A pair's float step for n input rows: lane t of scaled[r] (sub-block t's exact scaled sum) times d_w * d_y of
 * its block into acc[r], or (`split`: two weight rows' last blocks) lanes 0-7 into lanes 0-7 of acc[r] and
 * lanes 8-15 into lanes 0-7 of acc[n + r], each lane's FMA as where its block is the first of a pair (acc's
 * lanes 8-15 stay as they are: a block alone adds 0 x 0 there) */
AVX512 void pair_into(const __m512i *scaled, const uint8_t *first, const uint8_t *second, const int two, int64_t i0, int64_t i1,
                      const int split, const BlockQ8K *const *y, __m512 *acc, const int n) {
    const __m128 dw = pair_d(first, second, two);
    for (int r = 0; r < n; r++) {
        const __m128 dy = _mm_setr_ps(y[r][i0].d, two ? y[r][i1].d : 0.0f, 0.0f, 0.0f);
        const __m512 d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                               _mm512_castps128_ps512(_mm_mul_ps(dw, dy)));
        const __m512 lanes = _mm512_cvtepi32_ps(scaled[r]);
        if (!split)
            acc[r] = _mm512_fmadd_ps(lanes, d, acc[r]);
        else {
            acc[r] = _mm512_mask3_fmadd_ps(lanes, d, acc[r], 0x00FF);
            acc[n + r] = _mm512_mask3_fmadd_ps(_mm512_shuffle_f32x4(lanes, lanes, 0x4E), _mm512_shuffle_f32x4(d, d, 0x4E), acc[n + r],
                                               0x00FF);
        }
    }
}

/* A pair of weight blocks (first, second, two: NAME##_pair's) against n input rows: their planes at xs[r] + at,
 * their blocks y[r][i0], y[r][i1] (where `two`), into acc (pair_into) */
#define PAIR_DOT(NAME, BYTES, KIND, AHEAD)                                                                  \
    AVX512 void NAME##_pair_dot(const uint8_t *first, const uint8_t *second, const int two, int64_t at, int64_t i0, \
                                int64_t i1, const int split, const int8_t *const *xs, const BlockQ8K *const *y, __m512 *acc, \
                                const int n) {                                                           \
        const Pair pair = NAME##_pair(first, second, two);                                                 \
        __m512i sumi[2][RUN_ROWS]; /* HALVES: an even plane's 16-bit sums, scaled sums; else even and odd planes */ \
        for (int r = 0; r < n; r++) sumi[0][r] = sumi[1][r] = _mm512_setzero_si512();                    \
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                                            \
            const __m512i w = NAME##_plane(&pair, j);                                                    \
            const __mmask64 negative = _mm512_test_epi8_mask(pair.signs, _mm512_set1_epi8((char)(1 << j))); \
            for (int r = 0; r < n; r++) {                                                                \
                const __m512i codes = _mm512_load_si512(xs[r] + at + 64 * j);                            \
                const __m512i signed_codes =                                                             \
                    _mm512_mask_sub_epi8(codes, negative, _mm512_setzero_si512(), codes); \
                if ((KIND) == HALVES) { /* 16-bit lane w: values 16w.. (two entries) of two planes */  \
                    const __m512i sums = _mm512_maddubs_epi16(w, signed_codes);                          \
                    sumi[j & 1][r] = j & 1 ? _mm512_dpwssd_epi32(sumi[1][r], _mm512_add_epi16(sumi[0][r], sums), pair.scales) \
                                           : sums;                                                       \
                } else                                                                                   \
                    sumi[j & 1][r] = _mm512_dpbusd_epi32(sumi[j & 1][r], w, signed_codes);               \
            }                                                                                            \
        }                                                                                                \
        __m512i scaled[RUN_ROWS];                                                                        \
        for (int r = 0; r < n; r++) scaled[r] = scaled_lanes(&pair, sumi[0][r], sumi[1][r], KIND);       \
        pair_into(scaled, first, second, two, i0, i1, split, y, acc, n);                                  \
    }                                                                                                    \
    PAIRS(NAME##_pairs, NAME##_pair_dot, BYTES, 512, 0, AHEAD)

/* NAME: every pair of `wide` rows `stride` bytes apart, by DOT (X_PAIR bytes of x a pair; wide 2: an odd
 * count's last blocks one pair), the rows one after another or (IN_TURN) their pairs in turn: two
 * independent chains of work (IQ2_S's signed levels: 0.96x the time in cache; the planes' kernels of IQ2_XS
 * and IQ3_S took 1.09-1.12x at 768 inputs so) */
#define PAIRS(NAME, DOT, BYTES, X_PAIR, IN_TURN, AHEAD)                                                       \
    AVX512 void NAME(const uint8_t *row, int64_t stride, const int wide, int64_t blocks, const int8_t *const *xs, \
                     const BlockQ8K *const *y, __m512 *acc, const int n) {                               \
        if (IN_TURN)                                                                                     \
            for (int64_t g = 0; g < blocks / 2; g++)                                                     \
                for (int w = 0; w < wide; w++) {                                                         \
                    const uint8_t *x = row + w * stride + 2 * g * (BYTES);                               \
                    prefetch_soon(x, 2 * (BYTES), wide, AHEAD); /* a pair's lines, not a row's at once */     \
                    DOT(x, x + (BYTES), 1, (X_PAIR) * g, 2 * g, 2 * g + 1, 0, xs, y, acc + w * n, n);    \
                }                                                                                        \
        else                                                                                             \
            for (int w = 0; w < wide; w++) {                                                             \
                const uint8_t *x = row + w * stride;                                                     \
                for (int64_t g = 0; g < blocks / 2; g++) {                                               \
                    prefetch_soon(x + 2 * g * (BYTES), 2 * (BYTES), 1, AHEAD);                               \
                    DOT(x + 2 * g * (BYTES), x + (2 * g + 1) * (BYTES), 1, (X_PAIR) * g, 2 * g, 2 * g + 1, 0, xs, y, acc + w * n, n); \
                }                                                                                        \
            }                                                                                            \
        const int64_t last = blocks - 1, alone = (X_PAIR) * (blocks / 2), shared = (X_PAIR) * ((blocks + 1) / 2); \
        if (blocks % 2 && wide == 2)                                                                     \
            DOT(row + last * (BYTES), row + stride + last * (BYTES), 1, shared, last, last, 1, xs, y, acc, n); \
        else if (blocks % 2)                                                                             \
            DOT(row + last * (BYTES), row, 0, alone, last, 0, 0, xs, y, acc, n);                         \
    }

PAIR_DOT(iq2_xxs, 66, WHOLE, GRID_PREFETCH_BYTES)
PAIR_DOT(iq2_xs, 74, HALVES, GRID_PREFETCH_BYTES)
PAIR_DOT(iq2_s, 82, HALVES, IQ2_S_PREFETCH_BYTES)
PAIR_DOT(iq2_s_permuted, 82, HALVES, IQ2_S_PREFETCH_BYTES)
PAIR_DOT(iq3_xxs, 98, WHOLE, GRID_PREFETCH_BYTES)
PAIR_DOT(iq3_s, 110, WHOLE, GRID_PREFETCH_BYTES)

AVX512 int64_t plane_bytes(int64_t blocks) { return 512 * ((blocks + 1) / 2 + blocks % 2); }

/* The IQ2 types against fewer than RUN_ROWS input rows: signed levels. Such a row's planes hold |x| (at most 128, unsigned),
 * and after each pair's 512 bytes x's sign bits in the weights' sign layout (byte k, bit j: value 8k + j), so a
 * pair's sign bytes XOR those are the signs of the products. Two planes share an index byte: their codes in
 * bits 0-3 (plane 2i's in bits 0-1), their product signs in bits 4, 5, from which two 64-entry byte permutes
 * (signed_levels) give each plane's levels, signed; VPMADDUBSW multiplies |x| by them, the same exact
 * 16-bit sums as the planes' kernel, and VPDPWSSD by each 16 values' scale (IQ2_XXS: its sub-block's in both
 * halves of a lane) gives each sub-block's exact scaled sum. The four index bytes take 10 operations a pair
 * where the planes' kernel takes 8 sign tests, 8 masked negates and 2 shifts; with RUN_ROWS input rows that
 * kernel shares its tests and level permutes between the rows, and is the faster one. */
AVX512 void x_signed_pair(const BlockQ8K *first, const BlockQ8K *second, int8_t *planes) {
    x_pair_planes(first, second, planes);
    __m512i signs = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        const __m512i plane = _mm512_load_si512(planes + 64 * j);
        signs = _mm512_or_si512(signs, _mm512_maskz_mov_epi8(_mm512_movepi8_mask(plane), _mm512_set1_epi8((char)(1 << j))));
        _mm512_store_si512(planes + 64 * j, _mm512_abs_epi8(plane));
    }
    _mm512_store_si512(planes + 512, signs);
}

/* x's codes (`blocks` Q8_K blocks) so, pair g at planes + 576 g, an odd count as x_planes */
AVX512 void x_signed_planes(const BlockQ8K *y, int64_t blocks, int8_t *planes) {
    for (int64_t g = 0; g < (blocks + 1) / 2; g++) x_signed_pair(y + 2 * g, 2 * g + 1 < blocks ? y + 2 * g + 1 : NULL, planes + 576 * g);
    if (blocks % 2) x_signed_pair(y + blocks - 1, y + blocks - 1, planes + 576 * ((blocks + 1) / 2));
}

AVX512 int64_t signed_plane_bytes(int64_t blocks) { return 576 * ((blocks + 1) / 2 + blocks % 2); }

/* bits 0-3 of `codes`, bits 4-7 of `signs` */
AVX512 __m512i code_sign_index(__m512i codes, __m512i signs) { return _mm512_ternarylogic_epi32(codes, signs, _mm512_set1_epi8(0x0F), 0xE4); }

#define SIGNED_PAIR_DOT(NAME, BYTES, LEVELS, KIND, AHEAD)                                                     \
    AVX512 void NAME##_signed_pair_dot(const uint8_t *first, const uint8_t *second, const int two, int64_t at, int64_t i0, \
                                       int64_t i1, const int split, const int8_t *const *xs, const BlockQ8K *const *y, \
                                       __m512 *acc, const int n) {                                       \
        const Pair pair = NAME##_pair(first, second, two);                                               \
        const __m512i low_plane = _mm512_load_si512(LEVELS[0]), high_plane = _mm512_load_si512(LEVELS[1]); \
        const __m512i scales = (KIND) == HALVES ? pair.scales : _mm512_or_si512(pair.scales, _mm512_slli_epi32(pair.scales, 16)); \
        __m512i scaled[RUN_ROWS];                                                                        \
        for (int r = 0; r < n; r++) {                                                                    \
            const int8_t *planes = xs[r] + at;                                                           \
            const __m512i s = _mm512_xor_si512(pair.signs, _mm512_load_si512(planes + 512));             \
            const __m512i index[4] = {code_sign_index(pair.codes[0], _mm512_slli_epi16(s, 4)),            \
                                      code_sign_index(_mm512_srli_epi16(pair.codes[0], 4), _mm512_slli_epi16(s, 2)), \
                                      code_sign_index(pair.codes[1], s),                                 \
                                      code_sign_index(_mm512_srli_epi16(pair.codes[1], 4), _mm512_srli_epi16(s, 2))}; \
            scaled[r] = _mm512_setzero_si512();                                                          \
            _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++) {                                        \
                const __m512i even = _mm512_maddubs_epi16(_mm512_load_si512(planes + 128 * h), _mm512_permutexvar_epi8(index[h], low_plane)); \
                const __m512i odd = _mm512_maddubs_epi16(_mm512_load_si512(planes + 128 * h + 64), _mm512_permutexvar_epi8(index[h], high_plane)); \
                scaled[r] = _mm512_dpwssd_epi32(scaled[r], _mm512_add_epi16(even, odd), scales);         \
            }                                                                                            \
        }                                                                                                \
        pair_into(scaled, first, second, two, i0, i1, split, y, acc, n);                                 \
    }                                                                                                    \
    PAIRS(NAME##_signed_pairs, NAME##_signed_pair_dot, BYTES, 576, 1, AHEAD)

/* A row kernel: the input rows of matrix b RUN_ROWS at a time, each batch's activations put in the
 * kernel's order once (PREPARE, or ONE_PREPARE for fewer than RUN_ROWS rows: X_BYTES(blocks) bytes a row,
 * enough for either), then every weight row first..last - 1 against them; fewer than RUN_ROWS input rows take
 * them one at a time (ONE_PAIRS), against WIDE weight rows at once (`wide` rows `stride` bytes apart, into
 * acc[w n + r]). PAIRS (the pair kernels): with an odd block count (one block: 256 inputs, an expert's down
 * projection) weight rows go two at a time, their last blocks one pair (alone, a row's last block leaves
 * half of its pair's work on zeros); each row's lanes keep their own sums, the same bits as the row alone.
 * Two rows at once are row m and row m + half of first..last - 1 (half: half their count; an odd count's
 * last row alone): two streams from RAM that the hardware prefetchers follow, each row after row (from RAM
 * on AMD Zen 4, one thread, 1.05-1.15x as fast as rows m and m + 1 for IQ2_S, 1.01-1.05x for IQ1_S and IQ1_M) */
#define PREPARED_ROWS(ID, NAME, FACTOR, PREPARE, ONE_PREPARE, ONE_PAIRS, X_BYTES, WIDE, PAIRS)                 \
    AVX512_TARGET static void NAME##_rows_avx512(const Product *pr, int64_t b, int64_t first, int64_t last) { \
        const int64_t blocks = pr->in_features / 256, x_bytes = X_BYTES(blocks);                               \
        int8_t *buffer = aligned_alloc(64, (size_t)(RUN_ROWS * x_bytes));                                \
        if (buffer == NULL) { /* no memory for the activations: ggml's AVX2 kernel (a few ulp apart) */  \
            iq_q8_kernel_avx2(ID)(pr, b, first, last);                                                   \
            return;                                                                                      \
        }                                                                                                \
        for (int64_t p = pr->starts[b]; p < pr->starts[b + 1]; p += RUN_ROWS) {                          \
            const int n = pr->starts[b + 1] - p < RUN_ROWS ? (int)(pr->starts[b + 1] - p) : RUN_ROWS;    \
            const int8_t *xs[RUN_ROWS];                                                                  \
            const BlockQ8K *y[RUN_ROWS];                                                                 \
            for (int r = 0; r < n; r++) {                                                                \
                y[r] = pr->q8 + pr->rows[p + r] * blocks;                                                \
                if (n == RUN_ROWS)                                                                       \
                    PREPARE(y[r], blocks, buffer + r * x_bytes);                                         \
                else                                                                                     \
                    ONE_PREPARE(y[r], blocks, buffer + r * x_bytes);                                     \
                xs[r] = buffer + r * x_bytes;                                                            \
            }                                                                                            \
            /* two weight rows at once: row m and row m + half (two streams from RAM, each a row after row) */ \
            const int two_rows = (n < RUN_ROWS && (WIDE) == 2) || ((PAIRS) && blocks % 2);               \
            const int64_t half = two_rows ? (last - first) / 2 : 0, stride = half * pr->row_bytes;        \
            for (int64_t m = first; m < last; m = m + 1 == first + half ? first + 2 * half : m + 1) {     \
                const int wide = m < first + half ? 2 : 1;                                               \
                const int k = n == RUN_ROWS ? RUN_ROWS : 1; /* input rows a call (a constant to the pairs) */ \
                const uint8_t *row = (const uint8_t *)(uintptr_t)pr->addresses[b] + m * pr->row_bytes;   \
                for (int r = 0; r < n; r += k) {                                                         \
                    __m512 acc[2 * RUN_ROWS];                                                            \
                    for (int a = 0; a < 2 * RUN_ROWS; a++) acc[a] = _mm512_setzero_ps();                 \
                    if ((PAIRS) && k == RUN_ROWS && wide == 2) /* constants: acc stays in registers */    \
                        NAME##_pairs(row, stride, 2, blocks, xs, y, acc, RUN_ROWS);                      \
                    else if (k == RUN_ROWS)                                                              \
                        NAME##_pairs(row, stride, 1, blocks, xs, y, acc, RUN_ROWS);                      \
                    else if (wide == 2)                                                                  \
                        ONE_PAIRS(row, stride, 2, blocks, xs + r, y + r, acc, 1);                        \
                    else                                                                                 \
                        ONE_PAIRS(row, stride, 1, blocks, xs + r, y + r, acc, 1);                        \
                    for (int w = 0; w < wide; w++)                                                       \
                        for (int a = 0; a < k; a++)                                                      \
                            pr->out[(p + r + a) * pr->out_stride + m + w * half] = (FACTOR) * hsum16(acc[w * k + a]); \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        free(buffer);                                                                                    \
    }
#define PLANES_ROWS(ID, NAME, FACTOR) PREPARED_ROWS(ID, NAME, FACTOR, x_planes, x_planes, NAME##_pairs, plane_bytes, 1, 1)
/* the IQ2 types: fewer than RUN_ROWS input rows take the signed levels */
#define SIGNED_ROWS(ID, NAME, BYTES, LEVELS, KIND, AHEAD)                                                     \
    SIGNED_PAIR_DOT(NAME, BYTES, LEVELS, KIND, AHEAD)                                                         \
    PREPARED_ROWS(ID, NAME, 0.125f, x_planes, x_signed_planes, NAME##_signed_pairs, signed_plane_bytes, 2, 1)

SIGNED_ROWS(16, iq2_xxs, 66, iq2xxs_signed_levels, WHOLE, GRID_PREFETCH_BYTES)
SIGNED_ROWS(17, iq2_xs, 74, iq2xs_signed_levels, HALVES, GRID_PREFETCH_BYTES)
SIGNED_ROWS(22, iq2_s, 82, iq2s_signed_levels, HALVES, IQ2_S_PREFETCH_BYTES)
SIGNED_ROWS(22, iq2_s_permuted, 82, iq2s_signed_levels, HALVES, IQ2_S_PREFETCH_BYTES)
PLANES_ROWS(18, iq3_xxs, 0.25f)
PLANES_ROWS(21, iq3_s, 1.0f)

/* IQ1_S and IQ1_M: the grid gathered. Each grid entry (8 values -1, 0, 1) is a dword of 4-bit codes, value
 * + 1 (0, 1, 2): byte i holds value i in its low nibble, value i + 4 in its high one; a 2048-entry copy
 * follows with 4 added to each code (IQ1_S: a block's entries 16..31 take it; IQ1_M: the second 16 values
 * of each sub-block). One VPGATHERDD fetches 16 entries (128 values, half a block) from that 16 KiB in
 * L1, two a block; a byte shuffle of the low nibbles and one of the high ones look up each code's weight
 * 8 s code, at most 240 (s the odd scale of its sub-block (IQ1_S) or 16 values (IQ1_M); a table a 128-bit
 * lane of 4 entries, codes 0-2 and 4-6 of two scales), and VPDPBUSD multiplies them with the activations,
 * put in the same order once per call (`iq1_x`). The delta (+-1/8 of s) and the codes' offset of 1 leave
 * s (8 - delta sign) times x's negated sums of 32 (IQ1_S) or 8 (IQ1_M) values, by VPDPWSSD: a block's 16
 * int32 lanes hold 8 times its exact sum; d_w * d_y times them added by FMA into 16 float lanes, block
 * after block; at the end hsum16 times 0.125. Loads bound it, the gathers' 32 elements a block among
 * them: on Intel Xeon (Emerald Rapids) the two gathers alone take about 11.6 TSC ticks (2.1 GHz) a
 * block from L1, each further 64-byte load beside them 0.3-0.7 tick, 16 more ALU uops beside them about
 * 1. So a block's indices are made during the preceding block (its gathers never wait on them), fewer
 * than RUN_ROWS input rows take two weight rows at once (`wide`: an input row's block, 4 code vectors and
 * its sums, loaded once for both), and IQ1_M's scale words and delta signs come by broadcast loads, its
 * factors 7 or 9 times s by a VPMULLW (one sums vector). The other ways of reading 32 grid entries cost
 * as much or more there: qword gathers of 8-byte entries (the same per element), partial gathers beside
 * broadcast loads blended into vectors (a load and a blend an entry), entries copied through memory by
 * scalar loads (store forwarding stalls). On AMD Zen 4 the gathers take two thirds of its time (about a
 * cycle an element); scalar loads and 2048-entry byte-permute lookups measured no more than 8% faster
 * there (docs/kernels-iquants.md). */
static uint32_t iq1_nibbles[2 * 2048] __attribute__((aligned(64)));
static int iq1_fit;
/* Both gathers' indices of a block at once, per type (0: IQ1_S, 1: IQ1_M): a byte permute of the block
 * puts in qword q the low index bytes of entries 2q, 16 + 2q, 2q + 1, 17 + 2q and the bytes of their
 * high 3 bits (IQ1_S: the qh words of sub-blocks q / 2, 4 + q / 2; IQ1_M: qh bytes q, 8 + q); a
 * multishift takes each entry's 8 + 3 bits to a 16-bit word, so int32 lane k holds entry k's index (low
 * word, the first gather) and entry 16 + k's (high word, the second); bit 11 of a word picks the grid's
 * copy (IQ1_S: entries 16..31; IQ1_M: the second half of a sub-block, entries 4t + 2, 4t + 3). */
static uint8_t iq1_pick[2][64] __attribute__((aligned(64))), iq1_index_shifts[2][64] __attribute__((aligned(64)));
static uint16_t iq1_copy[2][32] __attribute__((aligned(64)));
/* the bit offsets of the scale fields a byte shuffle's table takes (code 1: 16 k + 8, k's 3 bits to bits
 * 4-6; code 2: 32 k + 16, to bits 5-7; codes 5, 6 the same of the copy's): IQ1_S's one table of a block,
 * lane l: sub-blocks l, 4 + l, from the permuted qword 2l; IQ1_M's table of gather h, lane l: the halves
 * (16 values) 8h + 2l, 8h + 2l + 1, from the 4 scale words */
static uint8_t iq1s_scale_shifts[64] __attribute__((aligned(64))), iq1m_scale_shifts[2][64] __attribute__((aligned(64)));
static uint8_t iq1_scale_mask[64] __attribute__((aligned(64))), iq1_scale_or[64] __attribute__((aligned(64)));
/* IQ1_S: s (8 - delta sign) by the 4 bits k | sign << 3 (bits 4, 5 ignored; its table vector holds those
 * of sub-blocks l, 4 + l at bytes 8, 10 of lane l, beside the codes' bytes); IQ1_M: the bit offsets of
 * half-sub-block j % 16's scale field, less 1, at word j */
static uint8_t iq1s_delta_factor[64] __attribute__((aligned(64)));
static uint8_t iq1m_scale_words[64] __attribute__((aligned(64)));

/* the high index bits' offset of entry e in its permuted qword */
static int iq1_high_at(int type, int e) {
    return type == 0 ? (e < 16 ? 32 : 48) + 3 * (e % 4) : (e < 16 ? 32 : 40) + 4 * (e % 2);
}

static void iq1_set_grid(const int8_t *grid) {
    iq1_fit = 1;
    for (int e = 0; e < 2048; e++) {
        uint32_t word = 0;
        for (int j = 0; j < 8; j++) {
            const int code = grid[8 * e + j] + 1;
            iq1_fit &= code >= 0 && code <= 2;
            word |= (uint32_t)(code & 3) << (8 * (j % 4) + 4 * (j / 4));
        }
        iq1_nibbles[e] = word;
        iq1_nibbles[2048 + e] = word | 0x44444444u;
    }
    for (int q = 0; q < 8; q++) {
        const int d = 2 * q, entries[4] = {d, 16 + d, d + 1, 17 + d};
        const uint8_t picks[2][8] = {{(uint8_t)(2 + d), (uint8_t)(18 + d), (uint8_t)(3 + d), (uint8_t)(19 + d), (uint8_t)(34 + 2 * (q / 2)),
                                      (uint8_t)(35 + 2 * (q / 2)), (uint8_t)(42 + 2 * (q / 2)), (uint8_t)(43 + 2 * (q / 2))},
                                     {(uint8_t)d, (uint8_t)(16 + d), (uint8_t)(d + 1), (uint8_t)(17 + d), (uint8_t)(32 + q),
                                      (uint8_t)(40 + q), 0, 0}};
        for (int type = 0; type < 2; type++) {
            memcpy(&iq1_pick[type][8 * q], picks[type], 8);
            for (int w = 0; w < 4; w++) {
                iq1_index_shifts[type][8 * q + 2 * w] = (uint8_t)(8 * w);
                iq1_index_shifts[type][8 * q + 2 * w + 1] = (uint8_t)iq1_high_at(type, entries[w]);
                iq1_copy[type][4 * q + w] = (type == 0 ? entries[w] >= 16 : entries[w] % 4 >= 2) ? 0x800 : 0;
            }
        }
    }
    for (int i = 0; i < 64; i++) {
        const int lane = i / 16, c = i % 16, down = c % 4 == 1 ? 4 : 5;
        iq1s_scale_shifts[i] = (uint8_t)(c == 8 ? 44 : c == 10 ? 60 : ((c / 4 % 2 ? 60 : 44) - down) & 63);
        for (int h = 0; h < 2; h++) {
            const int half = 8 * h + 2 * lane + c / 4 % 2;
            iq1m_scale_shifts[h][i] = (uint8_t)((16 * (half / 4) + 3 * (half % 4) - down) & 63);
        }
        iq1_scale_mask[i] = c == 8 || c == 10 ? 0xFF : c % 4 == 1 ? 0x70 : c % 4 == 2 ? 0xE0 : 0;
        iq1_scale_or[i] = c % 4 == 1 ? 8 : c % 4 == 2 ? 16 : 0;
        const int half = (i / 2) % 16;
        iq1m_scale_words[i] = (uint8_t)((16 * (half / 4) + 3 * (half % 4) - 1) & 63);
    }
    for (int i = 0; i < 64; i++) iq1s_delta_factor[i] = (uint8_t)((2 * (i & 7) + 1) * (7 + 2 * ((i >> 3) & 1)));
}

/* a Q8_K block's codes in the gathers' order, and its sums the deltas take */
typedef struct {
    int8_t low[2][64], high[2][64]; /* gather h: values 8e + i (low), 8e + 4 + i (high) at byte 4 (e - 16h) + i */
    int16_t sums[32]; /* IQ1_S: -(sum of sub-block t) at sums[j], j = 8 (t % 4) + 4 + t / 4 (its table
                         vector's order), d at words 0, 1; IQ1_M: -(sum of entry e), e = 2j (j < 16),
                         2 (j - 16) + 1 */
} __attribute__((aligned(64))) Iq1X;

AVX512 int64_t iq1_x_bytes(int64_t blocks) { return blocks * (int64_t)sizeof(Iq1X); }

AVX512 void iq1_codes(const BlockQ8K *y, Iq1X *out) {
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (int h = 0; h < 2; h++) {
        const __m512i a = _mm512_loadu_si512(y->qs + 128 * h), b = _mm512_loadu_si512(y->qs + 128 * h + 64);
        _mm512_store_si512(out->low[h], _mm512_permutex2var_epi32(a, evens, b));
        _mm512_store_si512(out->high[h], _mm512_permutex2var_epi32(a, odds, b));
    }
}

AVX512 void iq1_s_x(const BlockQ8K *y, int64_t blocks, int8_t *buffer) {
    Iq1X *out = (Iq1X *)(void *)buffer;
    for (int64_t i = 0; i < blocks; i++) {
        iq1_codes(y + i, out + i);
        memset(out[i].sums, 0, sizeof out[i].sums);
        for (int t = 0; t < 8; t++)
            out[i].sums[8 * (t % 4) + 4 + t / 4] = (int16_t)(-(y[i].bsums[2 * t] + y[i].bsums[2 * t + 1]));
        memcpy(out[i].sums, &y[i].d, sizeof y[i].d);
    }
}

AVX512 void iq1_m_x(const BlockQ8K *y, int64_t blocks, int8_t *buffer) {
    Iq1X *out = (Iq1X *)(void *)buffer;
    for (int64_t i = 0; i < blocks; i++) {
        iq1_codes(y + i, out + i);
        for (int j = 0; j < 32; j++) {
            const int e = j < 16 ? 2 * j : 2 * (j - 16) + 1;
            int sum = 0;
            for (int v = 0; v < 8; v++) sum += y[i].qs[8 * e + v];
            out[i].sums[j] = (int16_t)-sum;
        }
    }
}

/* a type's constants for a row: loaded once into registers (an empty asm hides where they came from, or
 * gcc takes each from memory again every block, and loads bound this kernel beside the gathers' 32) */
typedef struct {
    __m512i pick, index_shifts, copy, low_bits, scale_shifts[2], mask, or, words;
    __m512i factors;
} Iq1Constants;

AVX512 Iq1Constants iq1_constants(const int type) {
    Iq1Constants c = {_mm512_load_si512(iq1_pick[type]),
                      _mm512_load_si512(iq1_index_shifts[type]),
                      _mm512_load_si512(iq1_copy[type]),
                      _mm512_set1_epi16(0x7FF),
                      {_mm512_load_si512(type ? iq1m_scale_shifts[0] : iq1s_scale_shifts), _mm512_load_si512(iq1m_scale_shifts[1])},
                      _mm512_load_si512(iq1_scale_mask),
                      _mm512_load_si512(iq1_scale_or),
                      _mm512_load_si512(iq1m_scale_words),
                      _mm512_load_si512(iq1s_delta_factor)};
    __asm__("" : "+v"(c.pick), "+v"(c.index_shifts), "+v"(c.copy), "+v"(c.low_bits), "+v"(c.scale_shifts[0]),
            "+v"(c.scale_shifts[1]), "+v"(c.mask), "+v"(c.or), "+v"(c.words), "+v"(c.factors));
    return c;
}

/* a block's address, its bytes (zero past them where a 64-byte load would leave its row: `whole` says it
 * stays in it), permuted, and its grid indices: made a block ahead, so its gathers never wait on them */
typedef struct {
    const uint8_t *x;
    __m512i raw, picked, words;
} Iq1Ahead;

/* its 32 grid indices from its permuted bytes: 16-bit words, entry k (low) and 16 + k (high) in int32 lane
 * k, bit 11 the copy */
AVX512 __m512i iq1_words(__m512i picked, const Iq1Constants *c) {
    return _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(c->index_shifts, picked), c->low_bits, c->copy, 0xEA);
}

AVX512 Iq1Ahead iq1_ahead(const uint8_t *x, const int bytes, const int whole, const Iq1Constants *c) {
    Iq1Ahead a;
    a.x = x;
    a.raw = whole ? _mm512_loadu_si512(x) : _mm512_maskz_loadu_epi8((1ULL << bytes) - 1, x);
    a.picked = _mm512_permutexvar_epi8(c->pick, a.raw);
    a.words = iq1_words(a.picked, c);
    return a;
}

/* IQ1_M's 4 scale words (bytes 48..55) in every qword (loads broadcast: cheaper here than permutes of raw) */
AVX512 __m512i iq1m_scale_qwords(const uint8_t *x) { return _mm512_set1_epi64((long long)u64_at(x + 48)); }

/* the byte-shuffle tables of an IQ1_S (TYPE 0) or IQ1_M (1) block for gather h: 8 s code at code c of each
 * lane (IQ1_S: one for both) */
AVX512 void iq1_tables(const Iq1Ahead *a, const int type, const Iq1Constants *c, __m512i tables[2]) {
    const __m512i source = type ? iq1m_scale_qwords(a->x) : a->picked;
    for (int h = 0; h < 2; h++)
        tables[h] = type == 0 && h == 1 ? tables[0]
                                        : _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(c->scale_shifts[h], source),
                                                                    c->mask, c->or, 0xEA);
}

/* its weights 8 s code: gather h's (entries 16h..16h + 15) values 8e + i (w[2h]) and 8e + 4 + i (w[2h + 1])
 * at byte 4 (e - 16h) + i */
AVX512 void iq1_weights(__m512i words, const __m512i tables[2], __m512i w[4]) {
    const __m512i index[2] = {_mm512_and_si512(words, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(words, 16)};
    for (int h = 0; h < 2; h++) {
        const __m512i nibbles = _mm512_i32gather_epi32(index[h], (const void *)iq1_nibbles, 4);
        w[2 * h] = _mm512_shuffle_epi8(tables[h], nibbles);
        w[2 * h + 1] = _mm512_shuffle_epi8(tables[h], _mm512_srli_epi16(nibbles, 4));
    }
}

/* an input row's block i: its codes in the gathers' order, its sums the deltas take, its d */
typedef struct {
    __m512i codes[4], sums;
    float dy;
} Iq1Input;

AVX512 Iq1Input iq1_input(const int8_t *xs, const BlockQ8K *y, int64_t i, const int type) {
    const Iq1X *X = (const Iq1X *)(const void *)xs + i;
    Iq1Input in;
    for (int h = 0; h < 4; h++) in.codes[h] = _mm512_load_si512(h % 2 ? X->high[h / 2] : X->low[h / 2]);
    in.sums = _mm512_load_si512(X->sums);
    in.dy = type ? y[i].d : _mm_cvtss_f32(_mm_castsi128_ps(_mm512_castsi512_si128(in.sums)));
    return in;
}

/* the deltas' factors of a block, by x's negated sums: IQ1_S's s (8 - delta sign) of its 8 sub-blocks (words
 * 8 (t % 4) + 4 + t / 4), from its table vector; IQ1_M's s (8 - delta sign) of each entry, 0, 2, .., 30,
 * then 1, 3, .., 31 (the sign bit 3 of its nibble of qh, bytes 32..47) */
AVX512 __m512i iq1_delta_factors(const Iq1Ahead *a, const __m512i table, const int type, const Iq1Constants *c) {
    if (type == 0) return _mm512_maskz_permutexvar_epi8(0x0500050005000500ULL, table, c->factors);
    const __m512i fields = _mm512_multishift_epi64_epi8(c->words, iq1m_scale_qwords(a->x));
    const __m512i scales = _mm512_ternarylogic_epi32(fields, _mm512_set1_epi16(0x000E), _mm512_set1_epi16(1), 0xEA);
    const __m256i sign_bits = _mm256_set_m128i(_mm_set1_epi8((char)0x80), _mm_set1_epi8(0x08));
    const __mmask32 nine = _mm256_test_epi8_mask(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(a->x + 32))), sign_bits);
    return _mm512_mullo_epi16(scales, _mm512_mask_blend_epi16(nine, _mm512_set1_epi16(7), _mm512_set1_epi16(9)));
}

/* one block i of a weight row against n input rows into their float lanes (`in`: their blocks, loaded for
 * several weight rows; NULL: loaded here from xs, y): a block's 16 int32 lanes hold 8 times its exact sum
 * (each block's from zero), times d_w * d_y added by FMA */
AVX512 void iq1_block(const Iq1Ahead *a, const int type, const Iq1Constants *c, const Iq1Input *in, const int8_t *const *xs,
                      const BlockQ8K *const *y, int64_t i, __m512 *acc, const int n) {
    __m512i tables[2], w[4];
    iq1_tables(a, type, c, tables);
    const __m512i factors = iq1_delta_factors(a, tables[0], type, c);
    iq1_weights(a->words, tables, w);
    /* d: IQ1_S's first 2 bytes, IQ1_M's the top nibbles of its 4 scale words */
    const float d = type == 0 ? _mm_cvtss_f32(_mm_cvtph_ps(_mm512_castsi512_si128(a->raw)))
                              : _cvtsh_ss((unsigned short)_pext_u64(u64_at(a->x + 48),
                                                                    0xF000F000F000F000ULL));
    for (int r = 0; r < n; r++) {
        const Iq1Input x = in ? in[r] : iq1_input(xs[r], y[r], i, type);
        __m512i sumi = _mm512_dpwssd_epi32(_mm512_setzero_si512(), factors, x.sums);
        for (int h = 0; h < 4; h++) sumi = _mm512_dpbusd_epi32(sumi, w[h], x.codes[h]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(d * x.dy), acc[r]);
    }
}

/* every block of `wide` IQ1_S (TYPE 0) or IQ1_M (1) weight rows (`stride` bytes apart) against n input rows
 * into their float lanes (out[w n + r]; wide n at most RUN_ROWS): block i of each row in turn, each input
 * row's block loaded once for them (the loads bound this kernel beside the gathers' 32 a block) */
AVX512 void iq1_dot(const uint8_t *row, int64_t stride, const int wide, int64_t blocks, const int type, const int bytes,
                    const int8_t *const *xs, const BlockQ8K *const *y, __m512 *out, const int n) {
    if (blocks < 1) return;
    const Iq1Constants c = iq1_constants(type);
    __m512 acc[RUN_ROWS]; /* in registers: no store in the loop */
    for (int a = 0; a < wide * n; a++) acc[a] = out[a];
    Iq1Ahead next[RUN_ROWS];
    for (int w = 0; w < wide; w++) next[w] = iq1_ahead(row + w * stride, bytes, blocks * bytes >= 64, &c);
    for (int64_t i = 0; i < blocks; i++) {
        Iq1Input in[RUN_ROWS];
        for (int r = 0; r < n && wide > 1; r++) in[r] = iq1_input(xs[r], y[r], i, type);
        for (int w = 0; w < wide; w++) {
            const Iq1Ahead now = next[w];
            const uint8_t *x = row + w * stride + i * bytes;
            if (i + 1 < blocks) {
                prefetch_soon(x + bytes, 128, wide, GRID_PREFETCH_BYTES); /* two lines a block: more reads in flight from RAM */
                next[w] = iq1_ahead(x + bytes, bytes, (blocks - i - 1) * bytes >= 64, &c);
            }
            iq1_block(&now, type, &c, wide > 1 ? in : NULL, xs, y, i, acc + w * n, n);
        }
    }
    for (int a = 0; a < wide * n; a++) out[a] = acc[a];
}

AVX512 void iq1_s_pairs(const uint8_t *row, int64_t stride, const int wide, int64_t blocks, const int8_t *const *xs,
                        const BlockQ8K *const *y, __m512 *acc, const int n) {
    iq1_dot(row, stride, wide, blocks, 0, 50, xs, y, acc, n);
}

AVX512 void iq1_m_pairs(const uint8_t *row, int64_t stride, const int wide, int64_t blocks, const int8_t *const *xs,
                        const BlockQ8K *const *y, __m512 *acc, const int n) {
    iq1_dot(row, stride, wide, blocks, 1, 56, xs, y, acc, n);
}

PREPARED_ROWS(19, iq1_s, 0.125f, iq1_s_x, iq1_s_x, iq1_s_pairs, iq1_x_bytes, 2, 0)
PREPARED_ROWS(29, iq1_m, 0.125f, iq1_m_x, iq1_m_x, iq1_m_pairs, iq1_x_bytes, 2, 0)

/* whether IQ2_S's grid lookups gather (VPGATHERDD, 64 elements a pair of blocks) or take byte permutes (two
 * 1024-entry lookups): whichever decodes 16 pairs of blocks (fixed pseudo-random bytes) in fewer TSC ticks,
 * best of 9 alternated runs each, measured once (about 20 microseconds). Intel Xeon's gathers beat the
 * permutes; AMD Zen 4 takes about a cycle a gathered element, and its permutes decode a pair in 0.4-0.5 of
 * the gathers' ticks. */
AVX512_TARGET static int gathers_measured_faster(void) {
    static uint8_t blocks[32 * 82] __attribute__((aligned(64)));
    uint32_t state = 1;
    for (int i = 0; i < (int)sizeof blocks; i++) {
        state = state * 1664525u + 1013904223u;
        blocks[i] = (uint8_t)(state >> 24);
    }
    uint64_t best[2] = {UINT64_MAX, UINT64_MAX};
    __m512i sink = _mm512_setzero_si512();
    for (int trial = 0; trial < 9; trial++)
        for (int way = 0; way < 2; way++) { /* 1: gathers */
            const uint64_t start = __rdtsc();
            for (int g = 0; g < 16; g++) {
                const uint8_t *x = blocks + 2 * g * 82;
                const Pair pair = way ? iq2_s_pair(x, x + 82, 1) : iq2_s_permuted_pair(x, x + 82, 1);
                sink = _mm512_ternarylogic_epi32(sink, pair.codes[0], pair.codes[1], 0x96);
            }
            const uint64_t ticks = __rdtsc() - start;
            best[way] = ticks < best[way] ? ticks : best[way];
        }
    __asm__ volatile("" : : "v"(sink)); /* the decoded codes are used */
    return best[1] < best[0];
}

/* K3STREAM_GRID_LOOKUP=gather or =permute takes either way on any AVX-512 machine (the same bits), else
 * the measured one */
static int grid_gathers(void) {
    static int measured = -1;
    return measured_choice("K3STREAM_GRID_LOOKUP", "gather", "permute", &measured, gathers_measured_faster);
}

RowKernel iq_avx512_kernel(int ggml_type) {
    if (!HAVE_AVX512()) return NULL;
    switch (ggml_type) {
        case 16: return iq2xxs_fit ? iq2_xxs_rows_avx512 : NULL;
        case 17: return iq2xs_fit ? iq2_xs_rows_avx512 : NULL;
        case 22: return !iq2s_fit ? NULL : grid_gathers() ? iq2_s_rows_avx512 : iq2_s_permuted_rows_avx512;
        case 18: return iq3xxs_fit ? iq3_xxs_rows_avx512 : NULL;
        case 21: return iq3s_fit ? iq3_s_rows_avx512 : NULL;
        case 19: return iq1_fit ? iq1_s_rows_avx512 : NULL;
        case 29: return iq1_fit ? iq1_m_rows_avx512 : NULL;
        default: return NULL;
    }
}
#else
void iq_avx512_set_grids(const IqGrids *grids) { (void)grids; }
RowKernel iq_avx512_kernel(int ggml_type) {
    (void)ggml_type;
    return NULL;
}
#endif
