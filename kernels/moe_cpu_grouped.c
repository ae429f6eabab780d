/* The routed-expert step of T tokens on the CPU in one call, straight from a slot pool's bundle
 * bytes (kernels/moe_cpu_grouped.py builds and loads this file and checks the arguments).
 *
 * Shape legend: T = tokens, A = entries per token, D = hidden, I = expert width.
 *
 * One OpenMP parallel region per call, its phases split by barriers: x laid out as the rows read
 * it; gate_up over (token, entry, block of rows of I), h = silu(gate) * up; down over (token,
 * entry, block of rows of D) (each expert's rows in turn: interleaving the experts' short rows
 * starves the hardware prefetcher); then each output element sums the token's experts in the
 * order of its entries (the caller sorts them by ascending expert id), in fp32, into `out`:
 * out[t, d] += w[t, a] * y[t, a, d], as combine_experts accumulates them. Every element of every
 * phase is computed by one thread with the same code whatever the thread count, so results are
 * bit-identical run to run and for any thread count.
 *
 * Weights are decoded exactly, activations and sums are fp32 (multiply-adds fused where the
 * target has FMA: -ffp-contract=fast, fixed for a build):
 * int4: symmetric q in [-7, 7], two's complement nibbles, column 2j the low nibble of byte j, per
 *       group of 32 columns an e4m3 code (decoded by the caller's 256-entry table) times the
 *       projection's power-of-two global scale: y = sum_g scale_g * sum_{c in g} q_c * x_c.
 * int8: q int8 per column, one fp32 scale per row: y = scale * sum_c q_c * x_c.
 * No intrinsics: GNU C vectors of 16 lanes (gcc, clang; one AVX-512 register, four NEON ones).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ROWS 32 /* rows of one work item; D and I are multiples of it (the caller checks) */
#define NR 4    /* rows computed together: independent sums, the activations loaded once */

/* 16 lanes as GNU C vectors (gcc, clang; any target) for the fp32-activation rows: gcc's
 * auto-vectorizer picks 128-bit vectors for their mixed int8 / fp32 loops, half the speed */
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

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

/* the 32 columns of 16 bytes of one int4 row against fp32 activations (e: even columns, o: odd) */
static inline f32x16 q4_chunk(const uint8_t *w, f32x16 e, f32x16 o) {
    int32_t t[16]; /* a loop gcc turns into one sign-extending load (its vector convert: scalar) */
    for (int k = 0; k < 16; k++) t[k] = (int8_t)w[k];
    i32x16 v;
    memcpy(&v, t, sizeof v);
    const i32x16 lo = (v << 28) >> 28, hi = v >> 4; /* columns 2j, 2j + 1 */
    return __builtin_convertvector(lo, f32x16) * e + __builtin_convertvector(hi, f32x16) * o;
}

/* NR int4 rows (as dot_q4) against fp32 activations deinterleaved: xe[j], xo[j] = x[2j], x[2j + 1] */
static void dot_q4(const uint8_t *restrict w, int64_t ws, const uint8_t *restrict codes, int64_t cs,
                    const float *restrict lut, float gscale, const float *restrict xe, const float *restrict xo,
                    int64_t C, float *restrict y) {
    f32x16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t g = 0; g < C / 32; g++) {
        const int64_t j = 16 * g;
        for (int r = NR; r < 2 * NR && g % 4 == 0; r++) __builtin_prefetch(w + r * ws + j); /* next rows */
        const f32x16 e = load_f32(xe + j), o = load_f32(xo + j);
        a0 += q4_chunk(w + j, e, o) * (lut[codes[g]] * gscale);
        a1 += q4_chunk(w + ws + j, e, o) * (lut[codes[cs + g]] * gscale);
        a2 += q4_chunk(w + 2 * ws + j, e, o) * (lut[codes[2 * cs + g]] * gscale);
        a3 += q4_chunk(w + 3 * ws + j, e, o) * (lut[codes[3 * cs + g]] * gscale);
    }
    y[0] = lane_sum(a0), y[1] = lane_sum(a1), y[2] = lane_sum(a2), y[3] = lane_sum(a3);
}

/* NR int8 rows (`ws` bytes apart, fp32 scales at `scales`) against x fp32 -> y[NR] */
static void dot_q8(const int8_t *restrict w, int64_t ws, const uint8_t *scales, const float *restrict x,
                   int64_t C, float *restrict y) {
    f32x16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t j = 0; j < C; j += 16) {
        if (j % 64 == 0) /* the next rows' line: lockstep streams outrun the hardware prefetcher */
            for (int r = NR; r < 2 * NR; r++) __builtin_prefetch(w + r * ws + j);
        const f32x16 xv = load_f32(x + j);
        a0 += load_i8(w + j) * xv;
        a1 += load_i8(w + ws + j) * xv;
        a2 += load_i8(w + 2 * ws + j) * xv;
        a3 += load_i8(w + 3 * ws + j) * xv;
    }
    float sc[NR];
    memcpy(sc, scales, sizeof sc);
    y[0] = sc[0] * lane_sum(a0), y[1] = sc[1] * lane_sum(a1);
    y[2] = sc[2] * lane_sum(a2), y[3] = sc[3] * lane_sum(a3);
}

typedef struct {
    const uint8_t *pool;
    int64_t block_bytes;
    const float *gscales;       /* [S, 2] (int4) */
    const float *lut;           /* [256] e4m3 values (int4) */
    int quant;                  /* 4 or 8 */
    int64_t w_off[2], s_off[2]; /* byte offsets of gate_up / down weight and scales in a block */
} Experts;

/* rows r..r + NR - 1 of projection p (0 gate_up, 1 down) of slot `slot`, C columns, against the
 * fp32 activations v (int4: deinterleaved, v[j] and v[C/2 + j] the columns of byte j) -> y[NR] */
static void rows_dot(const Experts *e, int64_t slot, int p, int64_t r, int64_t C, const float *v, float *y) {
    const uint8_t *block = e->pool + slot * e->block_bytes;
    const uint8_t *w = block + e->w_off[p] + r * (e->quant == 4 ? C / 2 : C);
    if (e->quant == 4)
        dot_q4(w, C / 2, block + e->s_off[p] + r * (C / 32), C / 32, e->lut, e->gscales[slot * 2 + p], v,
               v + C / 2, C, y);
    else
        dot_q8((const int8_t *)w, C, block + e->s_off[p] + r * 4, v, C, y);
}

/* where activation c of C goes: int4 rows read them deinterleaved */
static inline int64_t spot(int quant, int64_t c, int64_t C) {
    return quant == 4 ? c % 2 * (C / 2) + c / 2 : c;
}

/* bytes of scratch per token: x fp32 [D] (as the rows read it), h fp32 [A, I], y fp32 [A, D] */
int64_t edgerun_moe_grouped_scratch(int64_t A, int64_t D, int64_t I) {
    return 4 * (D + A * I + A * D);
}

/* x fp32 [T, D]; slots, weights [T, A] (first count[t] entries used, in summation order);
 * out fp32 [T, D] (added into); scratch: T * edgerun_moe_grouped_scratch(A, D, I) bytes.
 * offsets: gate_up weight, gate_up scales, down weight, down scales in a block. Returns 0. */
int edgerun_moe_grouped(const float *x, const uint8_t *pool, int64_t block_bytes, const int64_t *slots,
                        const float *weights, const int64_t *count, const float *gscales, const float *lut,
                        int64_t T, int64_t A, int64_t D, int64_t I, int quant, const int64_t *offsets,
                        float *out, uint8_t *scratch, int threads) {
    const Experts e = {pool, block_bytes, gscales, lut, quant, {offsets[0], offsets[2]}, {offsets[1], offsets[3]}};
    const int64_t per = edgerun_moe_grouped_scratch(A, D, I), ub = I / ROWS, db = D / ROWS;
#define X(t) ((float *)(scratch + (t) * per))
#define H(t, a) ((float *)(scratch + (t) * per) + D + (a) * I)
#define Y(t, a) ((float *)(scratch + (t) * per) + D + A * I + (a) * D)
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = 0; c < D; c++) X(t)[spot(quant, c, D)] = x[t * D + c];
        /* gate_up: h[t, a, i] = silu(gate row i . x) * (up row I + i . x) */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * A * ub; item++) {
            const int64_t t = item / (A * ub), a = item / ub % A, r0 = item % ub * ROWS;
            if (a >= count[t]) continue;
            for (int64_t i = r0; i < r0 + ROWS; i += NR) {
                float gate[NR], up[NR];
                rows_dot(&e, slots[t * A + a], 0, i, D, X(t), gate);
                rows_dot(&e, slots[t * A + a], 0, I + i, D, X(t), up);
                for (int r = 0; r < NR; r++) H(t, a)[spot(quant, i + r, I)] = gate[r] / (1.0f + expf(-gate[r])) * up[r];
            }
        }
        /* down: y[t, a, d] */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * A * db; item++) {
            const int64_t t = item / (A * db), a = item / db % A, r0 = item % db * ROWS;
            if (a >= count[t]) continue;
            for (int64_t d = r0; d < r0 + ROWS; d += NR)
                rows_dot(&e, slots[t * A + a], 1, d, I, H(t, a), Y(t, a) + d);
        }
        /* the weighted sum of each token's experts, in entry order */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * db; item++) {
            const int64_t t = item / db, r0 = item % db * ROWS;
            for (int64_t a = 0; a < count[t]; a++)
                for (int64_t d = r0; d < r0 + ROWS; d++) out[t * D + d] += weights[t * A + a] * Y(t, a)[d];
        }
    }
    return 0;
}
