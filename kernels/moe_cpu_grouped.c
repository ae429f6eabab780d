/* The routed-expert step of T tokens on the CPU in one call, straight from a slot pool's bundle
 * bytes (kernels/moe_cpu_grouped.py builds and loads this file and checks the arguments).
 *
 * Shape legend: T = tokens, A = entries per token, D = hidden, I = expert width, S = slots.
 *
 * The entries (token, expert) are first grouped by slot (a counting sort), so each expert runs
 * over all of its tokens together: a block of ROWS weight rows is read from memory once per call
 * and decoded once per tile of up to NT of its tokens (NR rows x NT tokens of independent sums in
 * registers), where a token at a time re-read every expert's rows for each token of a prompt.
 * One OpenMP parallel region per call, its phases split by barriers: x laid out as the rows read
 * it; gate_up over (expert, block of rows of I), h = silu(gate) * up; h laid out as the rows read
 * it; down over (expert, block of rows of D) (each expert's rows in turn: interleaving the
 * experts' short rows starves the hardware prefetcher); then each output element sums the
 * token's experts in the order of its entries (the caller sorts them by ascending expert id), in
 * fp32, into `out`: out[t, d] += w[t, a] * y[t, a, d], as combine_experts accumulates them.
 *
 * Bits: every (token, row) sum runs the same sequence of operations whether its tile holds 1 or
 * NT tokens (the tile only shares the weight loads and decoding; its lanes never mix), and every
 * element of every phase is computed by one thread, so results are bit-identical run to run, for
 * any thread count, and for any other tokens in the call.
 *
 * Weights are decoded exactly; sums after the integer ones are fp32 (multiply-adds fused where
 * the target has FMA: -ffp-contract=fast, fixed for a build):
 * int4: symmetric q in [-7, 7], two's complement nibbles, column 2j the low nibble of byte j, per
 *       group of 32 columns an e4m3 code times the projection's power-of-two global scale. The
 *       activations are quantized to 16 bits per group of 32 (QVec: two int8 halves), so a
 *       group's sum of q * Q is an exact integer: y = sum_g (scale_g * d_g) * isum_g. With
 *       AVX-512 VNNI: vpdpbusd on the unsigned nibbles q + 8 (minus 8 * sum Q); else plain C
 *       (gcc vectorizes the integer sums; NEON dotprod on aarch64 is not written yet). The two
 *       paths add the groups' fp32 terms in different (each fixed) orders.
 *       llama.cpp's 8-bit activations measured 1.2-1.6e-2 of the output's scale here; 16 bits
 *       measure 3-6e-5 and cost one more vpdpbusd per half.
 * int8: q int8 per column, one fp32 scale per row, fp32 activations (GNU C vectors of 16 lanes:
 *       gcc, clang; one AVX-512 register, four NEON ones): y = scale * sum_c q_c * x_c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(EDGERUN_PORTABLE)
#include <immintrin.h>
#define VNNI 1
#else
#define VNNI 0
#endif

#define ROWS 32 /* rows of one work item; D and I are multiples of it (the caller checks) */
#define NR 4    /* rows computed together: independent sums, the activations loaded once */
#define NT 4    /* tokens computed together: each weight row decoded once for all of them */
#define INLINE static inline __attribute__((always_inline))

/* 16 lanes as GNU C vectors (gcc, clang; any target) for the fp32-activation rows: gcc's
 * auto-vectorizer picks 128-bit vectors for their mixed int8 / fp32 loops, half the speed */
typedef float f32x16 __attribute__((vector_size(64)));

static inline f32x16 load_f32(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline f32x16 load_i8(const int8_t *p) {
    float t[16]; /* a loop gcc turns into one sign-extending load + convert */
    for (int k = 0; k < 16; k++) t[k] = p[k];
    return load_f32(t);
}

/* fixed-order tree over the lanes */
static float lane_sum(f32x16 acc) {
    float a[16], s8[8], s4[4];
    memcpy(a, &acc, sizeof a);
    for (int k = 0; k < 8; k++) s8[k] = a[k] + a[k + 8];
    for (int k = 0; k < 4; k++) s4[k] = s8[k] + s8[k + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* Activations of an int4 row quantized to 16 bits per group of 32 columns: Q = round(v / d),
 * d = absmax / (127 * 254) (fp32), |Q| <= 32258, split exactly as Q = 256 * q1 + q2 with q1, q2
 * int8, so a group's sum of q * Q is an exact integer from two int8 dot products (llama.cpp's Q8
 * activations have only q1: ~1% error here). Laid out as the rows read them: [k][j] for k = q1,
 * q2, j the byte (qe even columns, qo odd); per 4 bytes (a VNNI lane) cq = -8 * their sum of Q
 * (the unsigned-nibble correction, where a lane's sum starts) and dl = the group's d. */
typedef struct {
    int8_t *q1e, *q1o, *q2e, *q2o;
    int32_t *cq;
    float *dl;
} QVec;

static QVec qvec_at(float *p, int64_t C) { /* C floats of room: 2C bytes of q, C/8 + C/8 words */
    int8_t *b = (int8_t *)p;
    QVec q = {b, b + C / 2, b + C, b + 3 * C / 2, (int32_t *)(b + 2 * C), (float *)(b + 2 * C) + C / 8};
    return q;
}

static void quantize(const float *v, int64_t C, QVec q) {
    for (int64_t g = 0; g < C / 32; g++) {
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(v[32 * g + k]));
        const float d = amax / (127.0f * 254.0f), inv = amax > 0.0f ? (127.0f * 254.0f) / amax : 0.0f;
        int32_t sums[4] = {0};
        for (int k = 0; k < 32; k++) {
            const int32_t Q = (int32_t)nearbyintf(v[32 * g + k] * inv);
            const int32_t q1 = (Q + 128) >> 8; /* floor((Q + 128) / 256), |q1| <= 126: gcc's >> is arithmetic */
            const int64_t j = 16 * g + k / 2;
            (k % 2 ? q.q1o : q.q1e)[j] = (int8_t)q1;
            (k % 2 ? q.q2o : q.q2e)[j] = (int8_t)(Q - 256 * q1);
            sums[k / 8] += Q;
        }
        for (int l = 0; l < 4; l++) q.cq[4 * g + l] = -8 * sums[l], q.dl[4 * g + l] = d;
    }
}

#if VNNI
/* e4m3 codes (int32 lanes) -> fp32, exactly (a gather from the table is 2x slower); the NaN codes
 * 0x7F / 0xFF, which no bundle holds (quantize_int4 saturates at 448), read as +-480 */
static inline __m512 e4m3(__m512i c) {
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(c, 3), _mm512_set1_epi32(15));
    const __m512i m = _mm512_and_si512(c, _mm512_set1_epi32(7));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
    const __m512i normal = _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
                                           _mm512_slli_epi32(m, 20));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(1.0f / 512)); /* m x 2^-9 */
    const __m512i mag = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), normal,
                                                _mm512_castps_si512(sub));
    return _mm512_castsi512_ps(_mm512_or_si512(mag, sign));
}
#endif

/* NR int4 rows from w (rows `ws` bytes apart; codes `cs` apart, one per group of 32) against the
 * quantized activations of nt tokens x[nt] -> y[nt][NR]; inlined with nt a constant (1..NT) so
 * the sums stay in registers */
INLINE void q4_tile(const uint8_t *restrict w, int64_t ws, const uint8_t *restrict codes, int64_t cs,
                    const float *restrict lut, float gscale, const QVec *x, const int nt, int64_t C,
                    float y[NT][NR]) {
    const int64_t G = C / 32;
#if VNNI
    if (C % 128 == 0) { /* 64 bytes (4 groups, 16 lanes of 4 bytes) a step, NR rows in lockstep */
        __m512 acc[NT][NR];
        for (int t = 0; t < nt; t++)
            for (int r = 0; r < NR; r++) acc[t][r] = _mm512_setzero_ps();
        const __m512i lo4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x88);
        for (int64_t k = 0; k < G; k += 16) { /* 16 groups' scales at a time */
            const int n = G - k < 16 ? (int)(G - k) : 16;
            __m512 sv[NR];
            for (int r = 0; r < NR; r++) {
                const __m128i c = _mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), codes + r * cs + k);
                sv[r] = _mm512_mul_ps(e4m3(_mm512_cvtepu8_epi32(c)), _mm512_set1_ps(gscale));
            }
            for (int c = 0; c < n / 4; c++) {
                const int64_t j = (k + 4 * c) * 16; /* byte offset in a row */
                const __m512i pick = _mm512_set_epi32(4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 2,
                                                      4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 1, 4 * c + 1,
                                                      4 * c + 1, 4 * c + 1, 4 * c, 4 * c, 4 * c, 4 * c);
                for (int r = 0; r < NR; r++) {
                    _mm_prefetch((const char *)(w + (r + NR) * ws + j), _MM_HINT_T0); /* the next rows */
                    const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(w + r * ws + j), flip); /* q + 8 */
                    const __m512i lo = _mm512_and_si512(u, lo4);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(u, 4), lo4);
                    const __m512 ps = _mm512_permutexvar_ps(pick, sv[r]);
                    for (int t = 0; t < nt; t++) {
                        const __m512i a1 = _mm512_loadu_si512(x[t].q1e + j), b1 = _mm512_loadu_si512(x[t].q1o + j);
                        const __m512i a2 = _mm512_loadu_si512(x[t].q2e + j), b2 = _mm512_loadu_si512(x[t].q2o + j);
                        const __m512i s1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, a1), hi, b1);
                        const __m512i corr = _mm512_loadu_si512(x[t].cq + j / 4); /* -8 sum Q */
                        const __m512i s2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(corr, lo, a2), hi, b2);
                        /* sum (q + 8) Q - 8 sum Q: exact, and under 2^24, so exact in fp32 */
                        const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(s1, 8), s2);
                        const __m512 scale = _mm512_mul_ps(ps, _mm512_loadu_ps(x[t].dl + j / 4));
                        acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[t][r]);
                    }
                }
            }
        }
        for (int t = 0; t < nt; t++)
            for (int r = 0; r < NR; r++) y[t][r] = _mm512_reduce_add_ps(acc[t][r]);
        return;
    }
#endif
    for (int r = 0; r < NR; r++) {
        const uint8_t *row = w + r * ws;
        float acc[NT] = {0};
        for (int64_t g = 0; g < G; g++) {
            int32_t s[NT] = {0};
            for (int k = 0; k < 16; k++) {
                const int v = (int8_t)row[16 * g + k], j = 16 * g + k;
                const int32_t lo = (int32_t)((uint32_t)v << 28) >> 28, hi = v >> 4;
                for (int t = 0; t < nt; t++)
                    s[t] += lo * (256 * x[t].q1e[j] + x[t].q2e[j]) + hi * (256 * x[t].q1o[j] + x[t].q2o[j]);
            }
            const float wscale = lut[codes[r * cs + g]] * gscale;
            for (int t = 0; t < nt; t++) /* fmaf: fused for every nt alike, whatever gcc vectorizes */
                acc[t] = fmaf((float)s[t], wscale * x[t].dl[4 * g], acc[t]);
        }
        for (int t = 0; t < nt; t++) y[t][r] = acc[t];
    }
}

/* NR int8 rows (`ws` bytes apart, fp32 scales at `scales`) against nt tokens' fp32 x[nt] ->
 * y[nt][NR]; inlined with nt a constant, as q4_tile */
INLINE void q8_tile(const int8_t *restrict w, int64_t ws, const uint8_t *scales, const float *const *x,
                    const int nt, int64_t C, float y[NT][NR]) {
    f32x16 acc[NT][NR];
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < NR; r++) acc[t][r] = (f32x16){0};
    for (int64_t j = 0; j < C; j += 16) {
        if (j % 64 == 0) /* the next rows' line: lockstep streams outrun the hardware prefetcher */
            for (int r = NR; r < 2 * NR; r++) __builtin_prefetch(w + r * ws + j);
        f32x16 wv[NR];
        for (int r = 0; r < NR; r++) wv[r] = load_i8(w + r * ws + j);
        for (int t = 0; t < nt; t++) {
            const f32x16 xv = load_f32(x[t] + j);
            for (int r = 0; r < NR; r++) acc[t][r] += wv[r] * xv;
        }
    }
    float sc[NR];
    memcpy(sc, scales, sizeof sc);
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < NR; r++) y[t][r] = sc[r] * lane_sum(acc[t][r]);
}

typedef struct {
    const uint8_t *pool;
    const uint8_t *far;         /* slots from `split` on: its rows (NULL: none) */
    int64_t split;
    int64_t block_bytes;
    const float *gscales;       /* [S, 2] (int4) */
    const float *lut;           /* [256] e4m3 values (int4) */
    int quant;                  /* 4 or 8 */
    int64_t w_off[2], s_off[2]; /* byte offsets of gate_up / down weight and scales in a block */
} Experts;

/* one q4_tile / q8_tile call per token count, so each is compiled with nt a constant */
#define BY_COUNT(nt, call)                        \
    switch (nt) {                                 \
    case 1: call(1); break;                       \
    case 2: call(2); break;                       \
    case 3: call(3); break;                       \
    default: call(NT); break;                     \
    }

/* rows r..r + NR - 1 of projection p (0 gate_up, 1 down) of slot `slot`, C columns, against the
 * activations of nt (1..NT) tokens at v[nt]: int4 quantized (QVecs), int8 fp32 -> y[nt][NR] */
static void rows_dot(const Experts *e, int64_t slot, int p, int64_t r, int64_t C, float *const *v, int nt,
                     float y[NT][NR]) {
    const uint8_t *block =
        slot < e->split ? e->pool + slot * e->block_bytes : e->far + (slot - e->split) * e->block_bytes;
    const uint8_t *w = block + e->w_off[p] + r * (e->quant == 4 ? C / 2 : C);
    if (e->quant == 4) {
        QVec q[NT];
        for (int t = 0; t < nt; t++) q[t] = qvec_at(v[t], C);
        const uint8_t *codes = block + e->s_off[p] + r * (C / 32);
        const float gs = e->gscales[slot * 2 + p];
#define Q4(n) q4_tile(w, C / 2, codes, C / 32, e->lut, gs, q, n, C, y)
        BY_COUNT(nt, Q4)
#undef Q4
    } else {
        const int8_t *w8 = (const int8_t *)w;
        const uint8_t *scales = block + e->s_off[p] + r * 4;
#define Q8(n) q8_tile(w8, C, scales, (const float *const *)v, n, C, y)
        BY_COUNT(nt, Q8)
#undef Q8
    }
}

/* The entries (t * A + a, first count[t] of each token) in ascending slot, stably (a counting
 * sort): ent[beg[g]..beg[g + 1]) hold group g's, all of slot gslot[g]; ng groups. One malloc
 * (idx, freed by the caller); NULL if it failed. */
typedef struct {
    int64_t *idx, *ent, *beg, *gslot, ng;
} Groups;

static Groups group_by_slot(const int64_t *slots, const int64_t *count, int64_t T, int64_t A, int64_t S) {
    Groups g = {malloc(sizeof(int64_t) * (3 * (S + 1) + T * A + 1)), 0, 0, 0, 0};
    if (!g.idx) return g;
    int64_t *start = g.idx; /* [S + 1]: entries of slots below s */
    g.ent = start + S + 1, g.beg = g.ent + T * A, g.gslot = g.beg + S + 1;
    memset(start, 0, sizeof(int64_t) * (S + 1));
    for (int64_t t = 0; t < T; t++)
        for (int64_t a = 0; a < count[t]; a++) start[slots[t * A + a] + 1]++;
    for (int64_t s = 0; s < S; s++) {
        if (start[s + 1]) g.beg[g.ng] = start[s], g.gslot[g.ng++] = s;
        start[s + 1] += start[s];
    }
    g.beg[g.ng] = start[S];
    for (int64_t t = 0; t < T; t++)
        for (int64_t a = 0; a < count[t]; a++) g.ent[start[slots[t * A + a]]++] = t * A + a;
    return g;
}

/* bytes of scratch per token, in floats: x as the rows read it [D], h fp32 [A, I], h as the rows
 * read it [A, I], y fp32 [A, D] */
int64_t edgerun_moe_grouped_scratch(int64_t A, int64_t D, int64_t I) {
    return 4 * (D + 2 * A * I + A * D);
}

/* entries in the tile of group grp starting at entry b: NT, or what is left of the group */
static inline int tile_size(const Groups *g, int64_t grp, int64_t b) {
    return g->beg[grp + 1] - b < NT ? (int)(g->beg[grp + 1] - b) : NT;
}

/* x fp32 [T, D]; slots, weights [T, A] (first count[t] entries used, in summation order; slots
 * in 0..S - 1: below `split` rows of `pool`, from it rows of `far`); out fp32 [T, D] (added
 * into); scratch: T * edgerun_moe_grouped_scratch(A, D, I) bytes. offsets: gate_up weight,
 * gate_up scales, down weight, down scales in a block. Returns 0, or 1 if the grouping's memory
 * could not be allocated. */
int edgerun_moe_grouped(const float *x, const uint8_t *pool, const uint8_t *far, int64_t split,
                        int64_t block_bytes, const int64_t *slots, const float *weights, const int64_t *count,
                        const float *gscales, const float *lut, int64_t T, int64_t A, int64_t D, int64_t I,
                        int64_t S, int quant, const int64_t *offsets, float *out, uint8_t *scratch, int threads) {
    const Experts e = {pool, far, split, block_bytes, gscales, lut, quant, {offsets[0], offsets[2]}, {offsets[1], offsets[3]}};
    const int64_t per = edgerun_moe_grouped_scratch(A, D, I), ub = I / ROWS, db = D / ROWS;
    const Groups g = group_by_slot(slots, count, T, A, S);
    if (!g.idx) return 1;
#define X(t) ((float *)(scratch + (t) * per))
#define H(t, a) ((float *)(scratch + (t) * per) + D + (a) * I)
#define HQ(t, a) ((float *)(scratch + (t) * per) + D + A * I + (a) * I)
#define Y(t, a) ((float *)(scratch + (t) * per) + D + 2 * A * I + (a) * D)
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            if (quant == 4)
                quantize(x + t * D, D, qvec_at(X(t), D));
            else
                memcpy(X(t), x + t * D, D * sizeof(float));
        /* gate_up: h[t, a, i] = silu(gate row i . x) * (up row I + i . x), an expert's tokens NT at a time */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < g.ng * ub; item++) {
            const int64_t grp = item / ub, r0 = item % ub * ROWS, slot = g.gslot[grp];
            for (int64_t b = g.beg[grp]; b < g.beg[grp + 1]; b += NT) {
                const int nt = tile_size(&g, grp, b);
                float *v[NT];
                for (int k = 0; k < nt; k++) v[k] = X(g.ent[b + k] / A);
                for (int64_t i = r0; i < r0 + ROWS; i += NR) {
                    float gate[NT][NR], up[NT][NR];
                    rows_dot(&e, slot, 0, i, D, v, nt, gate);
                    rows_dot(&e, slot, 0, I + i, D, v, nt, up);
                    for (int k = 0; k < nt; k++)
                        for (int r = 0; r < NR; r++)
                            H(g.ent[b + k] / A, g.ent[b + k] % A)[i + r] =
                                gate[k][r] / (1.0f + expf(-gate[k][r])) * up[k][r];
                }
            }
        }
        /* h as the down rows read it */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * A; item++) {
            const int64_t t = item / A, a = item % A;
            if (a >= count[t]) continue;
            if (quant == 4)
                quantize(H(t, a), I, qvec_at(HQ(t, a), I));
            else
                memcpy(HQ(t, a), H(t, a), I * sizeof(float));
        }
        /* down: y[t, a, d], an expert's tokens NT at a time */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < g.ng * db; item++) {
            const int64_t grp = item / db, r0 = item % db * ROWS, slot = g.gslot[grp];
            for (int64_t b = g.beg[grp]; b < g.beg[grp + 1]; b += NT) {
                const int nt = tile_size(&g, grp, b);
                float *v[NT];
                for (int k = 0; k < nt; k++) v[k] = HQ(g.ent[b + k] / A, g.ent[b + k] % A);
                for (int64_t d = r0; d < r0 + ROWS; d += NR) {
                    float y[NT][NR];
                    rows_dot(&e, slot, 1, d, I, v, nt, y);
                    for (int k = 0; k < nt; k++)
                        memcpy(Y(g.ent[b + k] / A, g.ent[b + k] % A) + d, y[k], sizeof y[k]);
                }
            }
        }
        /* the weighted sum of each token's experts, in entry order */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * db; item++) {
            const int64_t t = item / db, r0 = item % db * ROWS;
            for (int64_t a = 0; a < count[t]; a++)
                for (int64_t d = r0; d < r0 + ROWS; d++) out[t * D + d] += weights[t * A + a] * Y(t, a)[d];
        }
    }
    free(g.idx);
    return 0;
}
