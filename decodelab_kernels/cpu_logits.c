/* What the sampler reads from a row of logits on x86 CPUs with AVX2 and FMA, in two passes over the row instead of
   PyTorch's ~8 (log_softmax, topk, and the entropy's exp, mask, product and sum, each over a 49k vocabulary):
   the log-sum-exp, the entropy of the softmax, and the n largest logits. Rows are independent: each is computed by
   one thread, the same bits in any batch; a batch with enough of them splits them between threads (OpenMP,
   PyTorch's libgomp, loaded first; `parallel_min`). Built and loaded by decodelab_kernels/cpu_logits.py. */
#include <immintrin.h>
#include "cpu_simd.h"
#include <math.h>
#include <stdint.h>

/* below this many logits in a batch its rows run on the calling thread. One 49k row takes ~23 us (AMD Zen 5, 2
   threads): with the other thread spinning (OpenMP's default wait) 2 rows take 26 us instead of 42, 128 rows 1.5 ms
   instead of 2.9. With OMP_WAIT_POLICY=PASSIVE (play's default where the engine takes every core) waking it is a
   futex, and a core the browser may hold: there only batches of 8 such rows split (not timed; the attention
   kernel's parallel_min reasons the same way) */
static int64_t parallel_min(void) {
    static int64_t v = 0;  /* (a race here writes the same value) */
    if (!v) v = omp_passive() ? (int64_t)6 << 16 : (int64_t)1 << 16;  /* 8 or 2 rows of 49152 */
    return v;
}

/* insert (v, id) into the descending list vals/ids of length n (v beats its last entry) */
static void insert(float* vals, int64_t* ids, int64_t n, float v, int64_t id) {
    int64_t i = n - 1;
    while (i > 0 && vals[i - 1] < v) {  /* equal values keep the earlier (lower) id first */
        vals[i] = vals[i - 1];
        ids[i] = ids[i - 1];
        i--;
    }
    vals[i] = v;
    ids[i] = id;
}

/* For each of the S rows of x [S, V] (row stride ldx, finite or -inf values, at least one finite):
   lse[s] = log(sum(exp(x))), ent[s] = -sum(p * log p) over p = softmax(x) (0 log 0 = 0), and, with n > 0, the n
   largest values in descending order: top_ids[s, :n] and top_lp[s, :n] = x - lse (log-probabilities). */
void dl_logit_stats(const float* x, int64_t ldx, int64_t S, int64_t V, float* lse, float* ent, int64_t n,
                    int64_t* top_ids, float* top_lp) {
    #pragma omp parallel for schedule(static) if (S > 1 && S * V >= parallel_min())
    for (int64_t s = 0; s < S; s++) {
        const float* xr = x + s * ldx;
        float* vals = top_lp + s * n;
        int64_t* ids = top_ids + s * n;
        for (int64_t i = 0; i < n; i++) { vals[i] = -INFINITY; ids[i] = -1; }
        /* pass 1: the max, and the top n (a value enters only when it beats the n-th best so far) */
        __m256 mx = _mm256_set1_ps(-INFINITY);
        float thr = -INFINITY;
        int64_t v = 0;
        for (; v + 8 <= V; v += 8) {
            __m256 xv = _mm256_loadu_ps(xr + v);
            mx = _mm256_max_ps(mx, xv);
            if (n) {
                int bits = _mm256_movemask_ps(_mm256_cmp_ps(xv, _mm256_set1_ps(thr), _CMP_GT_OQ));
                while (bits) {
                    int b = __builtin_ctz(bits);
                    bits &= bits - 1;
                    if (xr[v + b] > vals[n - 1]) {
                        insert(vals, ids, n, xr[v + b], v + b);
                        thr = vals[n - 1];
                    }
                }
            }
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float m = _mm_cvtss_f32(h);
        for (int64_t t = v; t < V; t++) {
            if (xr[t] > m) m = xr[t];
            if (n && xr[t] > vals[n - 1]) insert(vals, ids, n, xr[t], t);
        }
        /* pass 2: Z = sum e, e = exp(x - m); sum e * (x - m) for the entropy, log Z - sum(e (x - m)) / Z */
        __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.0f);
        __m256 z = _mm256_setzero_ps(), zd = _mm256_setzero_ps();
        for (v = 0; v + 8 <= V; v += 8) {
            __m256 d = _mm256_sub_ps(_mm256_loadu_ps(xr + v), mv);
            __m256 keep = _mm256_cmp_ps(d, lo, _CMP_GT_OQ);  /* below e^-87 a term adds nothing (and -inf: 0) */
            __m256 e = _mm256_and_ps(exp8(d), keep);
            z = _mm256_add_ps(z, e);
            zd = _mm256_fmadd_ps(e, _mm256_and_ps(d, keep), zd);
        }
        float zs = hsum(z), zds = hsum(zd);
        for (int64_t t = v; t < V; t++) {
            float d = xr[t] - m;
            if (d > -87.0f) {
                float e = expf(d);
                zs += e;
                zds += e * d;
            }
        }
        /* fewer than n finite values: the rest of the list from the -inf ones, lowest ids first (as ids, not -1) */
        int64_t filled = 0;
        while (filled < n && ids[filled] >= 0) filled++;
        for (int64_t t = 0; t < V && filled < n; t++)
            if (!(xr[t] > -INFINITY)) ids[filled++] = t;
        float logz = logf(zs);
        lse[s] = m + logz;
        ent[s] = logz - zds / zs;
        for (int64_t i = 0; i < n; i++) vals[i] -= lse[s];
    }
}
