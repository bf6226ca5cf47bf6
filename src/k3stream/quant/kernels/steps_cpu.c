/* Per-token steps of the model in C, for the CPU (k3stream.quant.kernels.cpu calls them through
 * the extension's functions in ggml_cpu.c):
 *
 * - k3_kda_recurrent: the KDA recurrence after the projections, token by token (k3stream.model.kda.KDA's
 *   decode, and its prefill on the CPU). For each of B sequences, each of its tokens and each head: the
 *   causal conv of the projected q/k/v (history updated in place), SiLU, l2-normalised q and k, the
 *   per-channel decay gate, the delta rule on the state S [V, K] (in place), then the output's RMS norm
 *   and sigmoid gate.
 * - k3_residual_mix: the attention-residual mix (k3stream.model.attn_res.residual_mix).
 * - k3_rms_norm, k3_situ and k3_route: the RMS norm (k3stream.model.layers.rms_norm), Kimi-K3's
 *   activation (k3stream.quant.kernels.situ) and the MoE's sigmoid router (k3stream.model.moe.Routing).
 * - k3_add and k3_combine: the residual stream's sums and the MoE's weighted sum of its experts' outputs.
 * - k3_mla_attend: MLA's decode attention of one query per head over its latent cache (k3_mla_attend_rows:
 *   a prefill's queries, each as a decode step at its position computes it); k3_sigmoid_gate
 *   its output gate; k3_copy the copies between a decode token's buffers (rows with strides of their own).
 *
 * The same operations as the torch code they replace (which stays the reference and the GPU path),
 * so a step costs one call instead of tens of small tensor operations.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#else /* a compiler without OpenMP (Apple's clang): setup.py builds the kernels for one thread */
#define omp_get_thread_num() 0
#endif

#define SOFTPLUS_THRESHOLD 20.0f
#define LANES 16
#if K3_X86_SIMD
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
/* the MLA attention's clones: AVX-512 registers take its Floats16 whole (the same lane-wise operations,
 * so the same bits as the other clones) */
#define CLONES_WIDE __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#define CLONES_WIDE
#endif

/* exp, tanh and sigmoid from arithmetic alone (Cephes' single-precision polynomials, within 2 ulp of
 * libm), so the loops over them vectorize: libm's scalar tanhf made a step's activation slower than
 * torch's. */
INLINE float as_float(int32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

INLINE float exp_poly(float x) {
    x = x < -87.3f ? -87.3f : x > 88.7f ? 88.7f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return (p * r * r + r + 1.0f) * as_float(((int32_t)n + 127) << 23);
}

INLINE float sigmoidf(float x) { return 1.0f / (1.0f + exp_poly(-x)); }

/* ggml's CPU arithmetic (its x86 build with AVX2 and FMA), for the steps the default arithmetic
 * (match_ggml) computes in its order */

#define GGML_LANES 32

/* ggml_vec_dot_f32's reduction of its 32 running sums (lanes 8a + b of its accumulators a = 0..3) */
INLINE float ggml_lanes_sum(const float *lanes) {
    float x[8];
    for (int b = 0; b < 8; b++) x[b] = (lanes[b] + lanes[16 + b]) + (lanes[8 + b] + lanes[24 + b]);
    const float t0 = x[0] + x[4], t1 = x[1] + x[5], t2 = x[2] + x[6], t3 = x[3] + x[7];
    return (t0 + t1) + (t2 + t3);
}

/* ggml_vec_dot_f32 of a and b, n values */
INLINE float ggml_dot_f32(const float *a, const float *b, int64_t n) {
    float lanes[GGML_LANES] = {0};
    const int64_t whole = n & ~(int64_t)(GGML_LANES - 1);
    for (int64_t i = 0; i < whole; i += GGML_LANES)
        for (int l = 0; l < GGML_LANES; l++) lanes[l] = fmaf(a[i + l], b[i + l], lanes[l]);
    float sum = ggml_lanes_sum(lanes);
    for (int64_t i = whole; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* ggml_v_expf (AVX2) of one value: exp within 1.5 ulp, 0 below about -104, the same bits lane by lane */
INLINE float ggml_expf(float x) {
    const float shift = 0x1.8p23f, z = fmaf(x, 0x1.715476p+0f, shift), n = z - shift;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    uint32_t z_bits;
    memcpy(&z_bits, &z, sizeof z_bits);
    const uint32_t e = z_bits << 23;
    const float k = as_float((int32_t)(e + 0x3f800000u)), u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                         0x1.ffffecp-1f * b);
    if (!(fabsf(n) > 126.0f)) return fmaf(j, k, k);
    const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
    const float s1 = as_float((int32_t)(g + 0x7f000000u)), s2 = as_float((int32_t)(e - g));
    return fabsf(n) > 192.0f ? s1 * s1 : fmaf(s2, j, s2) * s1;
}

/* ggml_vec_soft_max_f32 of (values - their largest), in place, then each times (float)(1 / sum) (ggml's
 * soft_max), n a multiple of 8: exp by ggml_v_expf 8 values at a time, their sum pairwise in float into
 * a double */
INLINE void ggml_soft_max(float *values, int64_t n) {
    float most = -INFINITY;
    for (int64_t i = 0; i < n; i++) most = values[i] > most ? values[i] : most;
    double total = 0.0;
    for (int64_t i = 0; i < n; i += 8) {
        float *group = values + i;
        for (int b = 0; b < 8; b++) group[b] = ggml_expf(group[b] - most);
        const float x0 = group[0] + group[4], x1 = group[1] + group[5], x2 = group[2] + group[6],
                    x3 = group[3] + group[7];
        total += (double)((x0 + x2) + (x1 + x3));
    }
    const float inverse = (float)(1.0 / total);
    for (int64_t i = 0; i < n; i++) values[i] *= inverse;
}

/* The conv's input at `position` of a step's rows: negative positions are the history's rows (the
 * taps - 1 inputs before the step) */
INLINE const float *conv_input(const float *rows, const float *history, int64_t taps, int64_t width,
                               int64_t position) {
    return position < 0 ? history + (position + taps - 1) * width : rows + position * width;
}

/* Channels c0..c1 - 1 of the short causal conv over `tokens` rows: mixed[t][c] = sum_i input(t - taps
 * + 1 + i)[c] * w[i][c], oldest tap first (w by tap: [taps, width], so the loops run along the channels
 * and vectorize); then those channels of the history become the last taps - 1 inputs. Channel ranges
 * are independent, so threads may take them. */
INLINE void causal_conv_rows(const float *rows, float *history, const float *w, int64_t taps, int64_t width,
                             int64_t tokens, float *mixed, int64_t c0, int64_t c1) {
    for (int64_t t = 0; t < tokens; t++) {
        float *out = mixed + t * width;
        const float *oldest = conv_input(rows, history, taps, width, t - taps + 1);
        for (int64_t c = c0; c < c1; c++) out[c] = oldest[c] * w[c];
        for (int64_t i = 1; i < taps; i++) {
            const float *in = conv_input(rows, history, taps, width, t - taps + 1 + i), *wi = w + i * width;
            for (int64_t c = c0; c < c1; c++) out[c] += in[c] * wi[c];
        }
    }
    for (int64_t i = 0; i < taps - 1; i++) /* a history row moves down (i < tokens + i): never overwritten first */
        memmove(history + i * width + c0, conv_input(rows, history, taps, width, tokens - taps + 1 + i) + c0,
                sizeof(float) * (size_t)(c1 - c0));
}

/* Eight floats as one value (GCC's vector extension: AVX registers in the x86-64-v3 clone, SSE pairs in
 * the default one; the same lane-wise IEEE operations, so the same bits): the delta rule's loops and
 * sums in a fixed order the compiler cannot reorder or leave scalar */
typedef float Floats8 __attribute__((vector_size(32)));
/* they pass only between always-inline functions, never across the call ABI GCC warns about for the
 * default (SSE) clone */
#pragma GCC diagnostic ignored "-Wpsabi"
INLINE Floats8 load8(const float *p) {
    Floats8 v;
    memcpy(&v, p, sizeof v);
    return v;
}
INLINE void store8(float *p, Floats8 v) { memcpy(p, &v, sizeof v); }

typedef float Floats4 __attribute__((vector_size(16)));

/* the sum of eight partial sums as a tree: lanes i and i + 4, then i and i + 2, then the two (as
 * vectors: three adds deep, where a running sum of sixteen was a third of a prefill's KDA step) */
INLINE float tree_sum(Floats8 v) {
    const Floats4 quad = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    const Floats4 pair = quad + __builtin_shufflevector(quad, quad, 2, 3, 2, 3);
    return pair[0] + pair[1];
}

/* tree_sum of eight vectors at once, lane r the sum of v[r], by the same adds */
INLINE Floats8 tree_sums(const Floats8 *v) {
    Floats8 quads[4], pairs[2];
    for (int r = 0; r < 4; r++) /* [quad of v[r] | quad of v[r + 4]] */
        quads[r] = __builtin_shufflevector(v[r], v[r + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(v[r], v[r + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int r = 0; r < 2; r++) /* [pairs of rows 2r, 2r + 1 | of rows 2r + 4, 2r + 5] */
        pairs[r] = __builtin_shufflevector(quads[2 * r], quads[2 * r + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(quads[2 * r], quads[2 * r + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(pairs[0], pairs[1], 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(pairs[0], pairs[1], 1, 3, 9, 11, 5, 7, 13, 15);
}

/* sum_i a[i] b[i] in LANES interleaved partial sums, added as a tree */
INLINE float dot(const float *a, const float *b, int64_t n) {
    Floats8 low = {0}, high = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        low += load8(a + i) * load8(b + i);
        high += load8(a + i + 8) * load8(b + i + 8);
    }
    float sum = tree_sum(low + high);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

INLINE void silu_l2(float *v, int64_t n, float eps, int normalize) {
    for (int64_t i = 0; i < n; i++) v[i] = v[i] * sigmoidf(v[i]);
    if (!normalize) return;
    const float inverse = 1.0f / sqrtf(dot(v, v, n) + eps);
    for (int64_t i = 0; i < n; i++) v[i] *= inverse;
}

/* The decay of one head's key channels in log space: lower_bound * sigmoid(a f) or -a softplus(f)
 * (a loop per form, so the bounded one vectorizes) */
INLINE void decay(const float *f, const float *bias, float a, int has_bound, float bound, int64_t n,
                  float *out) {
    if (has_bound) {
        for (int64_t i = 0; i < n; i++) out[i] = exp_poly(bound * sigmoidf(a * (f[i] + bias[i])));
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const float value = f[i] + bias[i];
        const float softplus = value > SOFTPLUS_THRESHOLD ? value : log1pf(exp_poly(value));
        out[i] = exp_poly(-a * softplus);
    }
}

/* Each of `rows` (1..4) state rows `stride` apart: row = row * scale + add[r] * along (scale or along
 * NULL: that term left out) over n values (a multiple of LANES), and row . with in LANES interleaved
 * partial sums, into parts[r] as lanes i + (i + 8): one pass over state rows for a step of the delta
 * rule and the dot that follows it. scale, along and with are loaded once for the rows (one row at a time
 * loaded them for each, three loads per two state values: the loads the step waited on) */
INLINE void update_partials(float *row, int64_t stride, const int rows, const float *scale, const float *add,
                            const float *along, const float *with, int64_t n, Floats8 *parts) {
    Floats8 low[4] = {{0}}, high[4] = {{0}};
    for (int64_t i = 0; i < n; i += LANES) {
        const Floats8 with_low = load8(with + i), with_high = load8(with + i + 8);
        const Floats8 scale_low = scale != NULL ? load8(scale + i) : with_low;
        const Floats8 scale_high = scale != NULL ? load8(scale + i + 8) : with_high;
        const Floats8 along_low = along != NULL ? load8(along + i) : with_low;
        const Floats8 along_high = along != NULL ? load8(along + i + 8) : with_high;
        for (int r = 0; r < rows; r++) {
            float *at = row + r * stride + i;
            Floats8 a = load8(at), b = load8(at + 8);
            if (scale != NULL) a *= scale_low, b *= scale_high;
            if (along != NULL) a += add[r] * along_low, b += add[r] * along_high;
            store8(at, a);
            store8(at + 8, b);
            low[r] += a * with_low;
            high[r] += b * with_high;
        }
    }
    for (int r = 0; r < rows; r++) parts[r] = low[r] + high[r];
}

/* update_partials of one row over any n, summed (the values past the last whole LANES one by one) */
INLINE float update_dot(float *row, const float *scale, float add, const float *along, const float *with,
                        int64_t n) {
    const int64_t whole = n - n % LANES;
    Floats8 parts;
    update_partials(row, 0, 1, scale, &add, along, with, whole, &parts);
    float sum = tree_sum(parts);
    for (int64_t i = whole; i < n; i++) {
        float value = scale != NULL ? row[i] * scale[i] : row[i];
        if (along != NULL) value += add * along[i];
        row[i] = value;
        sum += value * with[i];
    }
    return sum;
}

/* Asks for the `count` floats at `at` in the cache, to be written (a prefetch never faults: past the
 * end of the states it asks for nothing) */
INLINE void prefetch_to_write(const float *at, int64_t count) {
    for (int64_t i = 0; i < count; i += 64 / (int64_t)sizeof(float)) __builtin_prefetch(at + i, 1, 3);
}

/* S *= exp(g); S += (beta (v - S k)) k^T; o = S q, two passes per state row. Rows of a multiple of
 * LANES go eight at a time (each pass of eight rows, then their eight sums at once: the same adds, no
 * chain of one row's sum, delta and second pass to wait on), four rows of a pass together (a prefill's
 * KDA 1.2x faster than one at a time), the next eight rows asked for while these compute: at 128
 * values a row they are the next 4 KiB page, where the hardware prefetchers stop (a decode's state
 * comes from RAM, evicted by the layers' weights) */
INLINE void delta_rule(float *s, const float *q, const float *k, const float *v, const float *factor, float beta,
                       int64_t dim, float *o) {
    if (dim % LANES != 0) {
        for (int64_t row = 0; row < dim; row++) {
            float *sr = s + row * dim;
            const float delta = (v[row] - update_dot(sr, factor, 0.0f, NULL, k, dim)) * beta;
            o[row] = update_dot(sr, NULL, delta, k, q, dim);
        }
        return;
    }
    for (int64_t row = 0; row < dim; row += 8) {
        prefetch_to_write(s + (row + 8) * dim, 8 * dim);
        Floats8 parts[8];
        for (int r = 0; r < 8; r += 4) update_partials(s + (row + r) * dim, dim, 4, factor, NULL, NULL, k, dim, parts + r);
        float deltas[8];
        store8(deltas, (load8(v + row) - tree_sums(parts)) * beta);
        for (int r = 0; r < 8; r += 4) update_partials(s + (row + r) * dim, dim, 4, NULL, deltas + r, k, q, dim, parts + r);
        store8(o + row, tree_sums(parts));
    }
}

/* One head of one sequence's KDA step after the conv (`mixed` its conved q|k|v); `scratch`: 2 dim floats */
INLINE void kda_head(float *mixed, const float *f, const float *dt_bias, const float *ssm_a, int has_bound,
                     float bound, float beta_logit, float *state, const float *g_logits, const float *o_norm,
                     int64_t h, int64_t inner, int64_t dim, float eps, float scale, float *scratch, float *y) {
    float *q = mixed + h * dim, *k = mixed + inner + h * dim, *v = mixed + 2 * inner + h * dim;
    float *factor = scratch, *o = scratch + dim;
    silu_l2(q, dim, eps, 1);
    silu_l2(k, dim, eps, 1);
    silu_l2(v, dim, eps, 0);
    for (int64_t i = 0; i < dim; i++) q[i] *= scale;
    decay(f + h * dim, dt_bias + h * dim, -ssm_a[h], has_bound, bound, dim, factor);
    delta_rule(state + h * dim * dim, q, k, v, factor, sigmoidf(beta_logit), dim, o);
    const float inverse = 1.0f / sqrtf(dot(o, o, dim) / (float)dim + eps);
    const float *gate = g_logits + h * dim;
    for (int64_t i = 0; i < dim; i++) y[i] = o[i] * inverse * o_norm[i] * sigmoidf(gate[i]);
}

/* `tokens` steps in order of one head of one sequence: rows t of mixed [tokens, 3D], f and g_logits
 * [tokens, D], b_logits [tokens, H] and out [tokens, D] */
INLINE void kda_head_steps(float *mixed, const float *f, const float *dt_bias, const float *ssm_a, int has_bound,
                           float bound, const float *b_logits, float *state, const float *g_logits,
                           const float *o_norm, int64_t h, int64_t heads, int64_t dim, int64_t tokens, float eps,
                           float scale, float *scratch, float *out) {
    const int64_t inner = heads * dim;
    for (int64_t t = 0; t < tokens; t++)
        kda_head(mixed + 3 * inner * t, f + inner * t, dt_bias, ssm_a, has_bound, bound, b_logits[heads * t + h],
                 state, g_logits + inner * t, o_norm, h, inner, dim, eps, scale, scratch, out + inner * t + h * dim);
}

/* Heads run on up to `threads` threads when a call's steps come to KDA_PARALLEL_MIN state values or
 * more (Kimi-K3's 64 heads of 128 in decode, a prefill's tokens; each head on one thread, all its steps
 * in order, the same operations as on one: the same bits; heads and conv chunks taken one at a time as
 * threads come free, so a thread whose core a pack reader takes leaves its share to the other); else no
 * OpenMP region at all. One decode step of 8 heads of 128 on this machine's two vCPUs ran slower on two
 * (0.9 against 0.7 ms a mid token): its compute-bound work barely gains from the second one. */
#define KDA_PARALLEL_MIN (1 << 20)
/* A prefill's call (tokens > 1) keeps each head's state in its thread's cache for all its tokens: it
 * takes the threads from this much (a 644-token prefill of 4 heads of 16 took 0.9 ms a layer on one) */
#define KDA_PREFILL_PARALLEL_MIN (1 << 16)
#define CONV_CHUNK 512 /* channels a thread takes of a prefill's conv */

/* The KDA recurrence after the projections, token by token, for B sequences of `tokens` rows each
 * (decode: one each; prefill: one sequence): its conv, the heads' steps, their output norm and gate.
 * Returns 0, or -2 without memory. proj [B tokens, 3D] (q, k, v; D = heads * dim; sequence b's rows
 * b tokens .. (b + 1) tokens - 1, oldest first); histories[b] [taps - 1, 3D]; conv_w [taps, 3D];
 * f [B tokens, D] (before dt_bias); ssm_a [H] (-exp(A_log)); b_logits [B tokens, H];
 * states[b] [H, dim, dim]; g_logits [B tokens, D]; o_norm [dim]; out [B tokens, D]. */
CLONES int k3_kda_recurrent(const float *proj, float *const *histories, const float *conv_w, int64_t taps,
                            const float *f, const float *dt_bias, const float *ssm_a, int has_bound, float bound,
                            const float *b_logits, float *const *states, const float *g_logits, const float *o_norm,
                            int64_t batch, int64_t tokens, int64_t heads, int64_t dim, float eps, float scale,
                            float *out, int threads) {
    const int64_t inner = heads * dim, width = 3 * inner;
    const int64_t least = tokens > 1 ? KDA_PREFILL_PARALLEL_MIN : KDA_PARALLEL_MIN;
    const int teams = threads > 1 && tokens * heads * dim * dim >= least ? (threads < heads ? threads : (int)heads) : 1;
    float *mixed = malloc(sizeof(float) * (size_t)(tokens * width + 2 * dim * teams));
    if (mixed == NULL) return -2;
    float *scratch = mixed + tokens * width;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t first = b * tokens;
        const int64_t chunks = teams > 1 ? (width + CONV_CHUNK - 1) / CONV_CHUNK : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(teams) if (chunks > 1)
        for (int64_t chunk = 0; chunk < chunks; chunk++) {
            const int64_t c0 = chunk * CONV_CHUNK, c1 = chunks == 1 || c0 + CONV_CHUNK > width ? width : c0 + CONV_CHUNK;
            causal_conv_rows(proj + first * width, histories[b], conv_w, taps, width, tokens, mixed, c0, c1);
        }
        const float *fb = f + first * inner, *gb = g_logits + first * inner, *beta = b_logits + first * heads;
        float *yb = out + first * inner;
        if (teams == 1) {
            for (int64_t h = 0; h < heads; h++)
                kda_head_steps(mixed, fb, dt_bias, ssm_a, has_bound, bound, beta, states[b], gb, o_norm, h, heads,
                               dim, tokens, eps, scale, scratch, yb);
        } else {
#pragma omp parallel num_threads(teams)
            {
                float *own = scratch + 2 * dim * omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
                for (int64_t h = 0; h < heads; h++)
                    kda_head_steps(mixed, fb, dt_bias, ssm_a, has_bound, bound, beta, states[b], gb, o_norm, h,
                                   heads, dim, tokens, eps, scale, own, yb);
            }
        }
    }
    free(mixed);
    return 0;
}

/* out[r] = sum_i softmax_i(score . rms(rows_i[r])) rows_i[r] over the `count` rows (bank then current)
 * of each of `n` positions; rows[i] [n, width]. The scores and the softmax are summed in double: a
 * score is a long sum that can reach the thousands, and the softmax amplifies its rounding. Returns 0,
 * or -2 without memory. */
/* position r of k3_residual_mix; weights: `count` doubles of scratch */
INLINE void mix_position(const float *const *rows, int64_t count, int64_t r, int64_t width, const float *score,
                         float eps, double *weights, float *out) {
    double largest = -INFINITY, total = 0.0;
    for (int64_t i = 0; i < count; i++) {
        const float *x = rows[i] + r * width;
        double squares_part[LANES] = {0}, scored_part[LANES] = {0}, squares = 0.0, scored = 0.0;
        int64_t e = 0;
        for (; e + LANES <= width; e += LANES)
            for (int j = 0; j < LANES; j++) {
                squares_part[j] += (double)x[e + j] * x[e + j];
                scored_part[j] += (double)x[e + j] * score[e + j];
            }
        for (int j = 0; j < LANES; j++) squares += squares_part[j], scored += scored_part[j];
        for (; e < width; e++) squares += (double)x[e] * x[e], scored += (double)x[e] * score[e];
        weights[i] = scored / sqrt(squares / (double)width + eps);
        largest = weights[i] > largest ? weights[i] : largest;
    }
    for (int64_t i = 0; i < count; i++) total += weights[i] = exp(weights[i] - largest);
    float *y = out + r * width;
    for (int64_t e = 0; e < width; e++) y[e] = 0.0f;
    for (int64_t i = 0; i < count; i++) {
        const float *x = rows[i] + r * width, w = (float)(weights[i] / total);
        for (int64_t e = 0; e < width; e++) y[e] += w * x[e];
    }
}

/* Mixes of two positions or more and at least this many values (a prefill's) take the threads,
 * positions split between them */
#define MIX_PARALLEL_MIN (1 << 15)

CLONES int k3_residual_mix(const float *const *rows, int64_t count, int64_t n, int64_t width, const float *score,
                           float eps, float *out, int threads) {
    const int teams = threads > 1 && n > 1 && count * n * width >= MIX_PARALLEL_MIN ? threads : 1;
    double *weights = malloc(sizeof(double) * (size_t)(count * teams));
    if (weights == NULL) return -2;
    if (teams == 1) {
        for (int64_t r = 0; r < n; r++) mix_position(rows, count, r, width, score, eps, weights, out);
    } else {
#pragma omp parallel for schedule(static) num_threads(teams)
        for (int64_t r = 0; r < n; r++)
            mix_position(rows, count, r, width, score, eps, weights + count * omp_get_thread_num(), out);
    }
    free(weights);
    return 0;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight (weight NULL: no scaling), n rows of width, in ggml's
 * order (its rms_norm then its mul): the squares summed in double one by one, the mean rounded to float,
 * each value times 1 / sqrtf(mean + eps), then times its weight */
CLONES void k3_rms_norm(const float *x, int64_t n, int64_t width, const float *weight, float eps, float *out) {
    for (int64_t r = 0; r < n; r++) {
        const float *row = x + r * width;
        double squares = 0.0;
        for (int64_t e = 0; e < width; e++) squares += (double)(row[e] * row[e]);
        const float mean = (float)(squares / (double)width), inverse = 1.0f / sqrtf(mean + eps);
        float *y = out + r * width;
        for (int64_t e = 0; e < width; e++) y[e] = weight == NULL ? row[e] * inverse : row[e] * inverse * weight[e];
    }
}

INLINE float tanh_poly(float x) {
    const float a = fabsf(x), x2 = x * x;
    float p = -5.70498872745e-3f;
    p = p * x2 + 2.06390887954e-2f;
    p = p * x2 - 5.37397155531e-2f;
    p = p * x2 + 1.33314422036e-1f;
    p = p * x2 - 3.33332819422e-1f;
    const float small = x + x * x2 * p, large = 1.0f - 2.0f / (exp_poly(2.0f * a) + 1.0f);
    return a < 0.625f ? small : copysignf(large, x);
}

/* out = beta tanh(gate / beta) sigmoid(gate) * (linear_beta > 0 ? linear_beta tanh(up / linear_beta) : up);
 * out may be gate or up */
CLONES void k3_situ(const float *gate, const float *up, int64_t count, float beta, float linear_beta, float *out) {
    if (linear_beta > 0)
        for (int64_t i = 0; i < count; i++)
            out[i] = beta * tanh_poly(gate[i] / beta) / (1.0f + exp_poly(-gate[i])) *
                     (linear_beta * tanh_poly(up[i] / linear_beta));
    else
        for (int64_t i = 0; i < count; i++)
            out[i] = beta * tanh_poly(gate[i] / beta) / (1.0f + exp_poly(-gate[i])) * up[i];
}

/* The sigmoid router of n rows: probs = sigmoid(logits); the k experts with the largest probs + bias
 * (descending; of equal ones the lower index first) into chosen [n, k], their probs into weights
 * [n, k], divided by their sum (ggml's: in double, rounded to float) clamped below at min_sum when
 * `normalize`, then times scale (the torch code's operations in its order). k <= experts. */
CLONES void k3_route(const float *logits, const float *bias, int64_t n, int64_t experts, int64_t k, int normalize,
                     float min_sum, float scale, float *probs, int64_t *chosen, float *weights) {
    for (int64_t r = 0; r < n; r++) {
        const float *row = logits + r * experts;
        int64_t *ids = chosen + r * k, count = 0;
        float *w = weights + r * k;
        for (int64_t e = 0; e < experts; e++) probs[e] = 1.0f / (1.0f + expf(-row[e]));
        for (int64_t e = 0; e < experts; e++) { /* insertion into the sorted top k so far */
            const float value = probs[e] + bias[e];
            int64_t at = count < k ? count : k;
            while (at > 0 && value > probs[ids[at - 1]] + bias[ids[at - 1]]) at--;
            if (at == k) continue;
            for (int64_t j = (count < k ? count : k - 1); j > at; j--) ids[j] = ids[j - 1];
            ids[at] = e;
            count += count < k;
        }
        double total = 0.0; /* in double, in choice order, then rounded: ggml's sum_rows */
        for (int64_t j = 0; j < k; j++) total += w[j] = probs[ids[j]];
        float sum = (float)total;
        sum = sum < min_sum ? min_sum : sum;
        for (int64_t j = 0; j < k; j++) w[j] = (normalize ? w[j] / sum : w[j]) * scale;
    }
}

/* out = a + b over n values (the residual stream's sums) */
CLONES void k3_add(const float *a, const float *b, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

/* out = values * sigmoid(logits) over n values (MLA's output gate) */
CLONES void k3_sigmoid_gate(const float *values, const float *logits, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = values[i] * sigmoidf(logits[i]);
}

/* dst[r, :cols] = src[r, :cols] for `rows` rows, each side with its own row stride (in floats) */
void k3_copy(const float *src, int64_t src_stride, float *dst, int64_t dst_stride, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) memcpy(dst + r * dst_stride, src + r * src_stride, sizeof(float) * (size_t)cols);
}

/* The MoE's weighted sum of each row's k expert outputs: out[r] = sum_j weights[r, j] pairs[r k + j] (rows
 * of width), each product rounded, then summed from zero in j order */
CLONES void k3_combine(const float *pairs, const float *weights, int64_t n, int64_t k, int64_t width, float *out) {
    for (int64_t r = 0; r < n; r++) {
        float *y = out + r * width;
        for (int64_t e = 0; e < width; e++) y[e] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const float *x = pairs + (r * k + j) * width, w = weights[r * k + j];
            for (int64_t e = 0; e < width; e++) y[e] += x[e] * w;
        }
    }
}

/* Cache rows an attention pass takes at a time: every head's work on a block is done while it sits in
 * the core's L2 (a long cache is read once from memory per pass, not once per head) */
#define ATTEND_BLOCK 64

/* Sixteen floats as one value: dot's two partial-sum vectors (low, high) side by side, so dot's bits */
typedef float Floats16 __attribute__((vector_size(64)));
INLINE Floats16 load16(const float *p) {
    Floats16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
INLINE void store16(float *p, Floats16 v) { memcpy(p, &v, sizeof v); }

/* `dot(queries[j], rows[r], n)` for HEADS_AT_ONCE queries (`query_stride` apart) and four rows (`stride`
 * apart) at once, each pair with its own partial sums in dot's order (so dot's bits): a load of a query
 * serves four rows and a load of a row serves the queries. out[j * out_stride + r]. */
#define HEADS_AT_ONCE 4
INLINE void dot_tile(const float *queries, int64_t query_stride, int heads, const float *rows, int64_t stride,
                     int64_t n, float *out, int64_t out_stride) {
    Floats16 sums[HEADS_AT_ONCE][4] = {{{0}}};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        Floats16 row[4];
        for (int r = 0; r < 4; r++) row[r] = load16(rows + r * stride + i);
        for (int j = 0; j < heads; j++) {
            const Floats16 q = load16(queries + j * query_stride + i);
            for (int r = 0; r < 4; r++) sums[j][r] += q * row[r];
        }
    }
    for (int j = 0; j < heads; j++)
        for (int r = 0; r < 4; r++) {
            const Floats16 v = sums[j][r];
            const Floats8 low = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
            const Floats8 high = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
            float sum = tree_sum(low + high);
            for (int64_t k = i; k < n; k++) sum += queries[j * query_stride + k] * rows[r * stride + k];
            out[j * out_stride + r] = sum;
        }
}

/* Scores of `heads` heads (a constant where inlined) over cache rows t0..t1 - 1: p[j * length + t] =
 * (q_j . row_t) * scale, four rows a tile (`dot` for the last rows) */
INLINE void score_heads(const float *q, const float *cache, int64_t length, int64_t t0, int64_t t1, int heads,
                        int64_t width, float scale, float *p) {
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) {
        dot_tile(q, width, heads, cache + t * width, width, width, p + t, length);
        for (int j = 0; j < heads; j++)
            for (int r = 0; r < 4; r++) p[j * length + t + r] *= scale;
    }
    for (; t < t1; t++)
        for (int j = 0; j < heads; j++) p[j * length + t] = dot(q + j * width, cache + t * width, width) * scale;
}

/* out[h, e] += sum over rows t0..t1 - 1 of weights[h * length + t] * row_t[e] for `heads` heads (a
 * constant where it is inlined, so the sums stay in registers), e < kv: each (h, e) summed in t order
 * (one product rounded, then added), 2 LANES values of e at a time */
INLINE void weigh_heads(const float *w, const float *cache, int64_t length, int64_t t0, int64_t t1, int heads,
                        int64_t width, int64_t kv, float *y) {
    int64_t e = 0;
    for (; e + 2 * LANES <= kv; e += 2 * LANES) {
        Floats16 sums[HEADS_AT_ONCE][2];
        for (int j = 0; j < heads; j++)
            for (int k = 0; k < 2; k++) sums[j][k] = load16(y + j * kv + e + LANES * k);
        for (int64_t t = t0; t < t1; t++) {
            const Floats16 low = load16(cache + t * width + e), high = load16(cache + t * width + e + LANES);
            for (int j = 0; j < heads; j++) {
                sums[j][0] += w[j * length + t] * low;
                sums[j][1] += w[j * length + t] * high;
            }
        }
        for (int j = 0; j < heads; j++)
            for (int k = 0; k < 2; k++) store16(y + j * kv + e + LANES * k, sums[j][k]);
    }
    for (; e < kv; e++)
        for (int j = 0; j < heads; j++)
            for (int64_t t = t0; t < t1; t++) y[j * kv + e] += w[j * length + t] * cache[t * width + e];
}

/* `score_heads` (scores into probs) or, with `weigh`, `weigh_heads` (rows weighted by probs into out) for
 * the `heads` heads from h */
INLINE void heads_pass(int weigh, const float *query, const float *cache, int64_t length, int64_t t0, int64_t t1,
                       int64_t h, int heads, int64_t width, int64_t kv, float scale, float *probs, float *out) {
    if (weigh)
        weigh_heads(probs + h * length, cache, length, t0, t1, heads, width, kv, out + h * kv);
    else
        score_heads(query + h * width, cache, length, t0, t1, heads, width, scale, probs + h * length);
}

/* One pass (`heads_pass`) over cache rows t0..t1 - 1 for heads first..last - 1: HEADS_AT_ONCE heads at a
 * time (a constant there, so a tile's sums stay in registers), then one at a time */
INLINE void block_pass(int weigh, const float *query, const float *cache, int64_t length, int64_t t0, int64_t t1,
                       int64_t first, int64_t last, int64_t width, int64_t kv, float scale, float *probs, float *out) {
    int64_t h = first;
    for (; h + HEADS_AT_ONCE <= last; h += HEADS_AT_ONCE)
        heads_pass(weigh, query, cache, length, t0, t1, h, HEADS_AT_ONCE, width, kv, scale, probs, out);
    for (; h < last; h++) heads_pass(weigh, query, cache, length, t0, t1, h, 1, width, kv, scale, probs, out);
}

/* Rows of the latent cache one attention part takes: its scores, then its weighted rows, while the part
 * sits in the core's L2, so a long cache is read once from memory. Each part's softmax is its own (its
 * largest score, its sum, its weighted rows), merged in part order (`merge_parts`): a query's bits do not
 * depend on how many threads take its parts. */
#define ATTEND_PART 256

/* A softmax weight exp(d) of a score d below the largest: 0 where d < -64 (exp(d) < 1.6e-28, nothing at
 * float precision beside the largest's 1), not exp_poly's smallest normal, whose products with the rows
 * are subnormal floats that cost a hundred cycles each (a trained model's scores span hundreds) */
INLINE float softmax_weight(float d) { return d < -64.0f ? 0.0f : exp_poly(d); }

/* Floats of the scratch one attention of `heads` heads over `length` rows takes on one thread: the
 * scores of a part, and each part's weighted rows, largest score and sum per head */
INLINE int64_t part_scratch(int64_t length, int64_t heads, int64_t kv) {
    return heads * ATTEND_PART + (length + ATTEND_PART - 1) / ATTEND_PART * heads * (kv + 2);
}

/* Heads first..last - 1 of one query [heads, width] over cache rows t0..t1 - 1 (at most ATTEND_PART): for
 * each head's q the scores s_t = (q . cache[t]) * scale, ATTEND_BLOCK rows at a time for all these heads,
 * then m = max s, e_t = exp(s_t - m), sum = sum_t e_t (in t order) and y = sum_t e_t cache[t, :kv] (the
 * first kv values of each row, in t order). `probs`: heads x ATTEND_PART floats; `part`: this part's
 * [heads x kv] weighted rows, then [heads] largest scores, then [heads] sums. A head's sums are its own:
 * the same whatever heads, parts or queries are computed beside it. */
INLINE void attend_part(const float *query, const float *cache, int64_t t0, int64_t t1, int64_t first, int64_t last,
                        int64_t heads, int64_t width, int64_t kv, float scale, float *probs, float *part) {
    const float *rows = cache + t0 * width;
    const int64_t n = t1 - t0;
    float *largest = part + heads * kv, *sums = largest + heads;
    for (int64_t t = 0; t < n; t += ATTEND_BLOCK)
        block_pass(0, query, rows, ATTEND_PART, t, t + ATTEND_BLOCK < n ? t + ATTEND_BLOCK : n, first, last, width, kv,
                   scale, probs, part);
    for (int64_t h = first; h < last; h++) {
        float *p = probs + h * ATTEND_PART, most = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < n; t++) most = p[t] > most ? p[t] : most;
        for (int64_t t = 0; t < n; t++) p[t] = softmax_weight(p[t] - most);
        for (int64_t t = 0; t < n; t++) total += p[t];
        largest[h] = most;
        sums[h] = total;
        for (int64_t e = 0; e < kv; e++) part[h * kv + e] = 0.0f;
    }
    for (int64_t t = 0; t < n; t += ATTEND_BLOCK)
        block_pass(1, query, rows, ATTEND_PART, t, t + ATTEND_BLOCK < n ? t + ATTEND_BLOCK : n, first, last, width, kv,
                   scale, probs, part);
}

/* The softmax of `count` parts (`attend_part`'s, heads x (kv + 2) floats each) merged for heads first..last
 * - 1, in part order: with m the largest of the parts' largest scores and w_p = exp(m_p - m),
 * out[h] = (sum_p w_p y_p) / (sum_p w_p sum_p) */
INLINE void merge_parts(const float *parts, int64_t count, int64_t first, int64_t last, int64_t heads, int64_t kv,
                        float *out) {
    const int64_t size = heads * (kv + 2);
    for (int64_t h = first; h < last; h++) {
        float most = -INFINITY, total = 0.0f;
        for (int64_t p = 0; p < count; p++) {
            const float m = parts[p * size + heads * kv + h];
            most = m > most ? m : most;
        }
        float *y = out + h * kv;
        for (int64_t e = 0; e < kv; e++) y[e] = 0.0f;
        for (int64_t p = 0; p < count; p++) {
            const float *part = parts + p * size;
            const float w = softmax_weight(part[heads * kv + h] - most);
            total += w * part[heads * kv + heads + h];
            for (int64_t e = 0; e < kv; e++) y[e] += w * part[h * kv + e];
        }
        for (int64_t e = 0; e < kv; e++) y[e] /= total;
    }
}

/* One query [heads, width] over the first `length` rows of a latent cache [width each] on one thread:
 * out[h] = softmax((q_h . cache^T) * scale) @ cache[:, :kv], part by part (`attend_part`, `merge_parts`).
 * `scratch`: part_scratch(length, heads, kv) floats. */
INLINE void attend_query(const float *query, const float *cache, int64_t length, int64_t heads, int64_t width,
                         int64_t kv, float scale, float *scratch, float *out) {
    float *parts = scratch + heads * ATTEND_PART;
    const int64_t count = (length + ATTEND_PART - 1) / ATTEND_PART;
    for (int64_t p = 0; p < count; p++) {
        const int64_t t1 = (p + 1) * ATTEND_PART < length ? (p + 1) * ATTEND_PART : length;
        attend_part(query, cache, p * ATTEND_PART, t1, 0, heads, heads, width, kv, scale, scratch,
                    parts + p * heads * (kv + 2));
    }
    merge_parts(parts, count, 0, heads, heads, kv, out);
}

/* Floats of scratch `k3_mla_attend` (threads: its thread count) or `k3_mla_attend_rows` (length: offset +
 * n) takes */
int64_t k3_mla_scratch(int64_t length, int64_t heads, int64_t kv, int threads) {
    return (threads < 1 ? 1 : threads) * part_scratch(length, heads, kv);
}

/* One query per head over a latent cache (MLA's absorbed decode attention,
 * k3stream.model.mla.MLA._attend_one), `attend_query`'s bits: when the work is large, its parts (and,
 * with fewer parts than threads, runs of heads) on up to `threads` threads, taken as they come free,
 * then their merge.
 * `scratch`: k3_mla_scratch(length, heads, kv, threads) floats. */
CLONES_WIDE void k3_mla_attend(const float *query, const float *cache, int64_t length, int64_t heads, int64_t width,
                          int64_t kv, float scale, float *scratch, float *out, int threads) {
    const double work = (double)heads * (double)length * (double)(width + kv);
    const int teams = threads > 1 && work >= (1 << 20) ? threads : 1;
    if (teams == 1) {
        attend_query(query, cache, length, heads, width, kv, scale, scratch, out);
        return;
    }
    const int64_t count = (length + ATTEND_PART - 1) / ATTEND_PART;
    const int64_t runs = count >= teams ? 1 : (teams < heads ? teams : heads);
    float *parts = scratch + (int64_t)teams * heads * ATTEND_PART;
#pragma omp parallel for schedule(dynamic, 1) num_threads(teams)
    for (int64_t task = 0; task < count * runs; task++) {
        const int64_t p = task / runs, run = task % runs;
        const int64_t t1 = (p + 1) * ATTEND_PART < length ? (p + 1) * ATTEND_PART : length;
        attend_part(query, cache, p * ATTEND_PART, t1, heads * run / runs, heads * (run + 1) / runs, heads, width,
                    kv, scale, scratch + (int64_t)omp_get_thread_num() * heads * ATTEND_PART,
                    parts + p * heads * (kv + 2));
    }
    merge_parts(parts, count, 0, heads, heads, kv, out);
}

/* A prefill's queries [n, heads, width] at positions offset..offset + n - 1, each over the cache rows up
 * to its own (offset + i + 1 rows): out [n, heads, kv], each query's heads as k3_mla_attend computes
 * them for a decode step at that position, bit for bit (`attend_query`), whatever queries come with it.
 * Queries on up to `threads` threads (one query alone: its parts, as k3_mla_attend splits them); `scratch`:
 * k3_mla_scratch(offset + n, heads, kv, threads) floats. */
CLONES_WIDE void k3_mla_attend_rows(const float *queries, const float *cache, int64_t offset, int64_t n, int64_t heads,
                               int64_t width, int64_t kv, float scale, float *scratch, float *out, int threads) {
    if (n == 1) { /* a last-only prefill's query: its parts on the threads, as its decode step's */
        k3_mla_attend(queries, cache, offset + 1, heads, width, kv, scale, scratch, out, threads);
        return;
    }
    const double work = (double)n * (double)heads * (double)(offset + n) * (double)(width + kv);
    const int teams = threads > 1 && work >= (1 << 20) ? threads : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(teams) if (teams > 1)
    for (int64_t i = n - 1; i >= 0; i--) { /* the longest first: dynamic scheduling evens the rest */
        float *own = scratch + (int64_t)omp_get_thread_num() * part_scratch(offset + n, heads, kv);
        attend_query(queries + i * heads * width, cache, offset + i + 1, heads, width, kv, scale, own,
                     out + i * heads * kv);
    }
}

/* MLA's attention in the float order of ggml's CPU backend (llama.cpp's attention without flash attention
 * on an F32 cache, its x86 build with AVX2 and FMA), the default arithmetic's (match_ggml):
 * - each score is ggml_vec_dot_f32 of the query and the cache row: 32 running sums (four 8-float
 *   accumulators, one fused multiply-add per value) over the first multiple of 32 values, summed pairwise
 *   (`ggml_lanes_sum`), then the remaining values added one at a time, unfused, in float;
 * - the softmax of the scores times the scale: exp by ggml_v_expf of (score - largest) 8 values at a
 *   time, their sum 8 at a time (pairwise in float) into a double, each weight times (float)(1 / sum);
 * - each context value is ggml_vec_dot_f32 of the weights and the cache column over llama.cpp's padded
 *   cache length (a multiple of 256: zero weights past the last row, so no remaining values). */

/* Floats of scratch one ggml-order attention over `length` rows takes on one thread */
INLINE int64_t ggml_attend_scratch(int64_t length, int64_t kv) {
    return (length + 7) / 8 * 8 + (GGML_LANES + 1) * kv;
}

/* Head h of one query [heads, width] over the first `length` cache rows in ggml's order into out[h]
 * ([kv]); `scratch`: ggml_attend_scratch(length, kv) floats */
INLINE void ggml_attend_head(const float *query, const float *cache, int64_t length, int64_t h, int64_t width,
                             int64_t kv, float scale, float *scratch, float *out) {
    const int64_t padded = (length + 7) / 8 * 8; /* llama.cpp's masked rows past the cache: weight 0 */
    float *weights = scratch, *lanes = scratch + padded;
    for (int64_t t = 0; t < length; t++) weights[t] = ggml_dot_f32(query + h * width, cache + t * width, width) * scale;
    for (int64_t t = length; t < padded; t++) weights[t] = -INFINITY;
    ggml_soft_max(weights, padded);
    /* the running sums of lanes past the cache's rows stay 0: they read one zero row */
    const int64_t used = length < GGML_LANES ? length : GGML_LANES;
    memset(lanes, 0, sizeof(float) * (size_t)(used * kv));
    memset(lanes + GGML_LANES * kv, 0, sizeof(float) * (size_t)kv);
    for (int64_t t = 0; t < length; t++) {
        float *lane = lanes + (t & (GGML_LANES - 1)) * kv;
        const float *row = cache + t * width, w = weights[t];
        for (int64_t e = 0; e < kv; e++) lane[e] = fmaf(row[e], w, lane[e]);
    }
    const float *sums[GGML_LANES];
    for (int l = 0; l < GGML_LANES; l++) sums[l] = lanes + (l < used ? l : GGML_LANES) * kv;
    for (int64_t e0 = 0; e0 < kv; e0 += 64) { /* `ggml_lanes_sum` of 64 columns at once */
        const int64_t n = kv - e0 < 64 ? kv - e0 : 64;
        float x[8][64];
        for (int b = 0; b < 8; b++)
            for (int64_t e = 0; e < n; e++)
                x[b][e] = (sums[b][e0 + e] + sums[16 + b][e0 + e]) + (sums[8 + b][e0 + e] + sums[24 + b][e0 + e]);
        for (int64_t e = 0; e < n; e++)
            out[h * kv + e0 + e] = ((x[0][e] + x[4][e]) + (x[1][e] + x[5][e])) + ((x[2][e] + x[6][e]) + (x[3][e] + x[7][e]));
    }
}

/* Floats of scratch `k3_mla_attend_ggml` or `k3_mla_attend_rows_ggml` (length: offset + n) takes */
int64_t k3_mla_ggml_scratch(int64_t length, int64_t kv, int threads) {
    return (threads < 1 ? 1 : threads) * ggml_attend_scratch(length, kv);
}

/* `k3_mla_attend` in ggml's order: one query [heads, width] over the first `length` cache rows -> out
 * [heads, kv], heads on up to `threads` threads when the work is large (each head's bits its own) */
CLONES_WIDE void k3_mla_attend_ggml(const float *query, const float *cache, int64_t length, int64_t heads,
                                    int64_t width, int64_t kv, float scale, float *scratch, float *out, int threads) {
    const double work = (double)heads * (double)length * (double)(width + kv);
    const int teams = threads > 1 && heads > 1 && work >= (1 << 20) ? threads : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(teams) if (teams > 1)
    for (int64_t h = 0; h < heads; h++)
        ggml_attend_head(query, cache, length, h, width, kv, scale,
                         scratch + (int64_t)omp_get_thread_num() * ggml_attend_scratch(length, kv), out);
}

/* `k3_mla_attend_rows` in ggml's order: queries [n, heads, width] at positions offset.., each over the
 * cache rows up to its own -> out [n, heads, kv], each as `k3_mla_attend_ggml` computes it */
CLONES_WIDE void k3_mla_attend_rows_ggml(const float *queries, const float *cache, int64_t offset, int64_t n,
                                         int64_t heads, int64_t width, int64_t kv, float scale, float *scratch,
                                         float *out, int threads) {
    const double work = (double)n * (double)heads * (double)(offset + n) * (double)(width + kv);
    const int teams = threads > 1 && work >= (1 << 20) ? threads : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(teams) if (teams > 1)
    for (int64_t task = n * heads - 1; task >= 0; task--) { /* the longest first */
        const int64_t i = task / heads, h = task % heads;
        ggml_attend_head(queries + i * heads * width, cache, offset + i + 1, h, width, kv, scale,
                         scratch + (int64_t)omp_get_thread_num() * ggml_attend_scratch(offset + n, kv),
                         out + i * heads * kv);
    }
}
