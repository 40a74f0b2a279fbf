/* The vocabulary scan: rows against a whole vocabulary in bfloat16, reduced in registers.
   Included by _native.c (one compiled module); the bounds that make it exact are derived in
   actdb/query/vocab_scan.py, which is the only caller.

   vocab_scan(a, b, nt, V, n, d, mode, threads, xf, wf, bias, tid, e, t0, c, above, band_n, m,
   s0, s1, s2, cross): a holds n rows (n a multiple of 4) of K bfloat16 values as uint32 pairs
   [n][K/2]; b the vocabulary's V rows of K bfloat16 values packed in panels of 16 tokens,
   [P][K/2][16] uint32 pairs (P a multiple of 4; tokens past V are zeros). Each (row, token)
   value is the float32 sum of the K products a[r][i] * b[t][i], each exact in float32, added
   in the order of i, a pair at a time (VDPBF16PS, which flushes subnormal inputs and results
   to zero), in one accumulator per (row, token). The [n, V] values are never written out;
   each 4-row x 64-token tile of them is reduced while in registers:

   mode 0 (rank): xf float32 [n][d] and wf float32 [V][d] (and bias float32 [V], or empty) are
   the rows and the vocabulary themselves, tid int64 [n] each row's token. c[r] (written here)
   is the token's logit x . w + b in float64 (vs_dot64: each product exact, the sum in a fixed
   order). With e, t0 float32 [n] and nt float32 [V], a token t is above row r when its value
   v > c + W and in its band when not above and not v < c - W (NaN: in the band), W = e[r] *
   nt[t] + t0[r] + 2^-21 (|v| + |c[r]|); a band token's logit is computed as c[r] was and
   counted when larger. above[k][r] counts the tokens found larger, band_n[k][r] the band's.
   mode 1 (log-sum-exp): m[k][r] the largest value, s0[k][r] = sum_t exp(v_t - m) (float64
   sums of a float32 exp whose relative error is below 2^-20; values below m - 87.3 count as
   exp(-87.3));
   mode 2: also s1 = sum_t exp(v_t - m) (v_t - m) and s2 = sum_t exp(v_t - m) (v_t - m)^2;
   mode 3 (pairs): rows 2i and 2i + 1 are a pair (v, target); as mode 1, and for the target
   row cross[k][2i + 1] = sum_t exp(v_target,t - m_target) (v_target,t - v_v,t) and
   s1[k][2i + 1] the same sum of |v_target,t - v_v,t|.

   The vocabulary's panels are shared among `threads` POSIX threads in contiguous runs; thread
   k writes only the k-th slice of each output ([threads][n]), and the
   caller combines them. The GIL is released. */

#if defined(ACTDB_X86) && defined(ACTDB_POOL)
#define ACTDB_VOCAB 1
#define VS_MAX_THREADS 64

typedef struct {
    const uint32_t *a, *b;
    const float *nt, *e, *t0, *xf, *wf, *bias;
    const double *c;
    Py_ssize_t n, k2, V, groups, d;
    int mode;
    int64_t *above, *band_n;
    float *m;
    double *s0, *s1, *s2, *cross;
    Py_ssize_t g_lo, g_hi;
    double *lanes; /* scratch: 8 float64 lanes per row for s0, s1, s2, cross */
    /* vocab_top: a's pairs per row (ka) meet b's pairs from kb0 on */
    Py_ssize_t ka, kb0, k, cap;
    float *top;     /* scratch [n][k]: each row's k best values so far, ascending */
    int32_t *cand;  /* [n][cap] */
    float *cand_v;  /* [n][cap]: their values */
    int64_t *cand_n;
} VocabJob;

#define VS_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

/* The 4 x 64 tile of rows a0..a3 (`ka` pairs each, `count` of them used) against the 4 panels
   from b (each `k2` pairs, b already at the first pair used): acc[4 * row + panel]. */
VS_TARGET static void vs_tile(const uint32_t *a, Py_ssize_t ka, Py_ssize_t count,
                              const uint32_t *b, Py_ssize_t k2, __m512 acc[16]) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
    __m512 c10 = c00, c11 = c00, c12 = c00, c13 = c00, c20 = c00, c21 = c00, c22 = c00;
    __m512 c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;
    const uint32_t *a0 = a, *a1 = a + ka, *a2 = a + 2 * ka, *a3 = a + 3 * ka;
    const uint32_t *b0 = b, *b1 = b + 16 * k2, *b2 = b + 32 * k2, *b3 = b + 48 * k2;
    for (Py_ssize_t kk = 0; kk < count; kk++) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + 16 * kk);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + 16 * kk);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(b2 + 16 * kk);
        __m512bh w3 = (__m512bh)_mm512_loadu_si512(b3 + 16 * kk);
        __m512bh x = (__m512bh)_mm512_set1_epi32((int)a0[kk]);
        c00 = _mm512_dpbf16_ps(c00, x, w0);
        c01 = _mm512_dpbf16_ps(c01, x, w1);
        c02 = _mm512_dpbf16_ps(c02, x, w2);
        c03 = _mm512_dpbf16_ps(c03, x, w3);
        x = (__m512bh)_mm512_set1_epi32((int)a1[kk]);
        c10 = _mm512_dpbf16_ps(c10, x, w0);
        c11 = _mm512_dpbf16_ps(c11, x, w1);
        c12 = _mm512_dpbf16_ps(c12, x, w2);
        c13 = _mm512_dpbf16_ps(c13, x, w3);
        x = (__m512bh)_mm512_set1_epi32((int)a2[kk]);
        c20 = _mm512_dpbf16_ps(c20, x, w0);
        c21 = _mm512_dpbf16_ps(c21, x, w1);
        c22 = _mm512_dpbf16_ps(c22, x, w2);
        c23 = _mm512_dpbf16_ps(c23, x, w3);
        x = (__m512bh)_mm512_set1_epi32((int)a3[kk]);
        c30 = _mm512_dpbf16_ps(c30, x, w0);
        c31 = _mm512_dpbf16_ps(c31, x, w1);
        c32 = _mm512_dpbf16_ps(c32, x, w2);
        c33 = _mm512_dpbf16_ps(c33, x, w3);
    }
    acc[0] = c00, acc[1] = c01, acc[2] = c02, acc[3] = c03;
    acc[4] = c10, acc[5] = c11, acc[6] = c12, acc[7] = c13;
    acc[8] = c20, acc[9] = c21, acc[10] = c22, acc[11] = c23;
    acc[12] = c30, acc[13] = c31, acc[14] = c32, acc[15] = c33;
}

/* exp(y) for y <= 0 in float32: y clamped at -87.3, y = n ln2 + f (Cody-Waite), a degree-7
   Taylor polynomial in |f| <= ln2 / 2 (remainder below 2^-27), scaled by 2^n. Its relative
   error, measured over a dense grid by tests/unit/test_vocab_scan.py, is below 2^-21. */
VS_TARGET static inline __m512 vs_exp(__m512 y) {
    y = _mm512_max_ps(y, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), y);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* x . w + b in float64 for float32 x, w [d] (each product exact): 8-lane sums in an order that
   depends on d alone, so equal rows give equal values. */
VS_TARGET static double vs_dot64(const float *x, const float *w, Py_ssize_t d) {
    __m512d s0 = _mm512_setzero_pd(), s1 = s0;
    Py_ssize_t i = 0;
    for (; i + 16 <= d; i += 16) {
        __m512 xv = _mm512_loadu_ps(x + i), wv = _mm512_loadu_ps(w + i);
        s0 = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(xv)),
                             _mm512_cvtps_pd(_mm512_castps512_ps256(wv)), s0);
        s1 = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(xv, 1)),
                             _mm512_cvtps_pd(_mm512_extractf32x8_ps(wv, 1)), s1);
    }
    double t = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    for (; i < d; i++) {
        t += (double)x[i] * (double)w[i];
    }
    return t;
}

VS_TARGET static double vs_logit64(const VocabJob *j, Py_ssize_t r, Py_ssize_t t) {
    double v = vs_dot64(j->xf + r * j->d, j->wf + t * j->d, j->d);
    return j->bias != NULL ? v + (double)j->bias[t] : v;
}

/* Row r's tokens tok0.. above its band, counted, and those in it rescored in float64. */
VS_TARGET static void vs_rank(VocabJob *j, Py_ssize_t r, Py_ssize_t tok0, const __m512 *v,
                              const __mmask16 *valid) {
    double c = j->c[r];
    float cf = (float)c;
    __m512 e = _mm512_set1_ps(j->e[r]), slack = _mm512_set1_ps(0x1p-21f);
    __m512 base = _mm512_set1_ps(j->t0[r] + 0x1p-21f * fabsf(cf)), cv = _mm512_set1_ps(cf);
    int64_t above = 0;
    for (int p = 0; p < 4; p++) {
        if (!valid[p]) {
            continue;
        }
        __m512 nt = _mm512_maskz_loadu_ps(valid[p], j->nt + tok0 + 16 * p);
        __m512 w = _mm512_fmadd_ps(e, nt, _mm512_fmadd_ps(slack, _mm512_abs_ps(v[p]), base));
        __mmask16 up = _mm512_mask_cmp_ps_mask(valid[p], v[p], _mm512_add_ps(cv, w),
                                               _CMP_GT_OQ);
        __mmask16 in = _mm512_mask_cmp_ps_mask(valid[p] & (__mmask16)~up, v[p],
                                               _mm512_sub_ps(cv, w), _CMP_NLT_UQ);
        above += __builtin_popcount((unsigned)up);
        while (in) {
            int bit = __builtin_ctz((unsigned)in);
            in &= (__mmask16)(in - 1);
            j->band_n[r]++;
            above += vs_logit64(j, r, tok0 + 16 * p + bit) > c;
        }
    }
    j->above[r] += above;
}

/* Rescale row r's float64 lanes from its old largest value to `top`. */
VS_TARGET static void vs_shift(VocabJob *j, Py_ssize_t r, float top) {
    double *l = j->lanes + r * 32;
    if (j->m[r] != -INFINITY) {
        double d = (double)j->m[r] - (double)top, f = exp(d);
        __m512d s0 = _mm512_loadu_pd(l), s1 = _mm512_loadu_pd(l + 8);
        __m512d s2 = _mm512_loadu_pd(l + 16), cr = _mm512_loadu_pd(l + 24);
        __m512d dv = _mm512_set1_pd(d), fv = _mm512_set1_pd(f);
        __m512d s2n = _mm512_fmadd_pd(dv, _mm512_fmadd_pd(dv, s0, _mm512_add_pd(s1, s1)), s2);
        /* moments move with the largest value; a pair's sums of |a_t - a_v| only scale */
        __m512d s1n = j->mode == 3 ? s1 : _mm512_fmadd_pd(dv, s0, s1);
        _mm512_storeu_pd(l, _mm512_mul_pd(fv, s0));
        _mm512_storeu_pd(l + 8, _mm512_mul_pd(fv, s1n));
        _mm512_storeu_pd(l + 16, _mm512_mul_pd(fv, s2n));
        _mm512_storeu_pd(l + 24, _mm512_mul_pd(fv, cr));
    }
    j->m[r] = top;
}

/* Row r's tile values v (invalid lanes ignored) into its sums; `other`, when not NULL, the
   same tokens' values of the pair's first row (mode 3, r the target). */
VS_TARGET static void vs_lse(VocabJob *j, Py_ssize_t r, const __m512 *v, const __mmask16 *valid,
                             const __m512 *other) {
    __m512 ninf = _mm512_set1_ps(-INFINITY), top = ninf;
    for (int p = 0; p < 4; p++) {
        top = _mm512_max_ps(top, _mm512_mask_blend_ps(valid[p], ninf, v[p]));
    }
    float tmax = _mm512_reduce_max_ps(top);
    if (tmax > j->m[r] || isnan(tmax)) {
        vs_shift(j, r, tmax);
    }
    double *l = j->lanes + r * 32;
    __m512d s0 = _mm512_loadu_pd(l), s1 = _mm512_loadu_pd(l + 8);
    __m512d s2 = _mm512_loadu_pd(l + 16), cr = _mm512_loadu_pd(l + 24);
    __m512 mv = _mm512_set1_ps(j->m[r]);
    for (int p = 0; p < 4; p++) {
        if (!valid[p]) {
            continue;
        }
        __m512 y = _mm512_sub_ps(v[p], mv);
        __m512 ex = _mm512_maskz_mov_ps(valid[p], vs_exp(y));
        __m512d elo = _mm512_cvtps_pd(_mm512_castps512_ps256(ex));
        __m512d ehi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(ex, 1));
        s0 = _mm512_add_pd(s0, _mm512_add_pd(elo, ehi));
        if (j->mode == 2) {
            __m512 ym = _mm512_maskz_mov_ps(valid[p], y);
            __m512d ylo = _mm512_cvtps_pd(_mm512_castps512_ps256(ym));
            __m512d yhi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(ym, 1));
            __m512d tlo = _mm512_mul_pd(elo, ylo), thi = _mm512_mul_pd(ehi, yhi);
            s1 = _mm512_add_pd(s1, _mm512_add_pd(tlo, thi));
            s2 = _mm512_fmadd_pd(tlo, ylo, _mm512_fmadd_pd(thi, yhi, s2));
        } else if (other != NULL) {
            __m512 g = _mm512_maskz_sub_ps(valid[p], v[p], other[p]);
            __m512d glo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
            __m512d ghi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(g, 1));
            cr = _mm512_fmadd_pd(elo, glo, _mm512_fmadd_pd(ehi, ghi, cr));
            s1 = _mm512_fmadd_pd(elo, _mm512_abs_pd(glo), _mm512_fmadd_pd(ehi, _mm512_abs_pd(ghi), s1));
        }
    }
    _mm512_storeu_pd(l, s0);
    _mm512_storeu_pd(l + 8, s1);
    _mm512_storeu_pd(l + 16, s2);
    _mm512_storeu_pd(l + 24, cr);
}

/* Row r's tile into its k best values so far, then the tokens not more than W below the k-th
   of them listed as candidates (W = e[r] + 2^-21 (|v| + |k-th|)). */
VS_TARGET static void vs_top(VocabJob *j, Py_ssize_t r, Py_ssize_t tok0, const __m512 *v,
                             const __mmask16 *valid) {
    float *top = j->top + r * j->k, vals[16];
    for (int p = 0; p < 4; p++) {
        __mmask16 up = _mm512_mask_cmp_ps_mask(valid[p], v[p], _mm512_set1_ps(top[0]),
                                               _CMP_GT_OQ);
        if (!up) {
            continue;
        }
        _mm512_storeu_ps(vals, v[p]);
        while (up) {
            int bit = __builtin_ctz((unsigned)up);
            up &= (__mmask16)(up - 1);
            float val = vals[bit];
            if (val > top[0]) { /* insert, dropping the smallest */
                Py_ssize_t i = 0;
                while (i + 1 < j->k && top[i + 1] < val) {
                    top[i] = top[i + 1];
                    i++;
                }
                top[i] = val;
            }
        }
    }
    float vals2[64];
    for (int p = 0; p < 4; p++) {
        _mm512_storeu_ps(vals2 + 16 * p, v[p]);
    }
    __m512 kth = _mm512_set1_ps(top[0]), slack = _mm512_set1_ps(0x1p-21f);
    __m512 base = _mm512_set1_ps(j->e[r] + 0x1p-21f * fabsf(top[0]));
    for (int p = 0; p < 4; p++) {
        __m512 w = _mm512_fmadd_ps(slack, _mm512_abs_ps(v[p]), base);
        __mmask16 in = _mm512_mask_cmp_ps_mask(valid[p], v[p], _mm512_sub_ps(kth, w),
                                               _CMP_NLT_UQ);
        while (in) {
            int bit = __builtin_ctz((unsigned)in);
            in &= (__mmask16)(in - 1);
            int64_t c = j->cand_n[r]++;
            if (c < j->cap) {
                j->cand[r * j->cap + c] = (int32_t)(tok0 + 16 * p + bit);
                j->cand_v[r * j->cap + c] = vals2[16 * p + bit];
            }
        }
    }
}

/* The masks of the 64 tokens from tok0 on (4 panels of 16) that a V-token head has (vs_run,
   rk_run in _native_rank.c). */
static inline void vs_valid(Py_ssize_t V, Py_ssize_t tok0, __mmask16 valid[4]) {
    for (int p = 0; p < 4; p++) {
        Py_ssize_t left = V - (tok0 + 16 * p);
        valid[p] = left >= 16 ? (__mmask16)0xFFFF
                   : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    }
}

VS_TARGET static void vs_run(VocabJob *j) {
    __m512 acc[16];
    __mmask16 valid[4];
    for (Py_ssize_t g = j->g_lo; g < j->g_hi; g++) {
        Py_ssize_t tok0 = 64 * g;
        vs_valid(j->V, tok0, valid);
        const uint32_t *b = j->b + 4 * g * 16 * j->k2 + 16 * j->kb0;
        for (Py_ssize_t r = 0; r < j->n; r += 4) {
            vs_tile(j->a + r * j->ka, j->ka, j->ka, b, j->k2, acc);
            for (int i = 0; i < 4; i++) {
                if (j->mode == 4) {
                    vs_top(j, r + i, tok0, acc + 4 * i, valid);
                } else if (j->mode == 0) {
                    vs_rank(j, r + i, tok0, acc + 4 * i, valid);
                } else {
                    vs_lse(j, r + i, acc + 4 * i, valid,
                           j->mode == 3 && i % 2 == 1 ? acc + 4 * (i - 1) : NULL);
                }
            }
        }
    }
    if (j->mode != 0 && j->mode != 4) { /* the lanes to one sum per row */
        for (Py_ssize_t r = 0; r < j->n; r++) {
            double *l = j->lanes + r * 32, t[4] = {0, 0, 0, 0};
            for (int q = 0; q < 4; q++) {
                for (int k = 0; k < 8; k++) {
                    t[q] += l[8 * q + k];
                }
            }
            j->s0[r] = t[0], j->s1[r] = t[1], j->s2[r] = t[2], j->cross[r] = t[3];
        }
    }
}

static void *vs_thread(void *arg) {
    vs_run((VocabJob *)arg);
    return NULL;
}

/* Runs `work` on each of the T jobs at `jobs` (`size` bytes apart): jobs 1 .. T-1 on threads
   of their own, job 0 on this one, then any job whose thread could not start, here as well.
   Called without the GIL. */
static void run_jobs(void *(*work)(void *), void *jobs, size_t size, int T) {
    pthread_t tids[VS_MAX_THREADS];
    int started = 0;
    for (int k = 1; k < T; k++) {
        if (pthread_create(&tids[k], NULL, work, (char *)jobs + (size_t)k * size) != 0) {
            break;
        }
        started = k;
    }
    work(jobs);
    for (int k = 1; k <= started; k++) {
        pthread_join(tids[k], NULL);
    }
    for (int k = started + 1; k < T; k++) { /* threads that could not start: run them here */
        work((char *)jobs + (size_t)k * size);
    }
}

/* Whether every one of the n int64 token ids in `tid` is a row of a V-token head; a
   ValueError naming `who` where one is not. */
static int vs_tokens_in_range(const Py_buffer *tid, Py_ssize_t n, Py_ssize_t V, const char *who) {
    for (Py_ssize_t r = 0; r < n; r++) {
        int64_t t = ((const int64_t *)tid->buf)[r];
        if (t < 0 || t >= V) {
            PyErr_Format(PyExc_ValueError, "%s: token %lld out of range", who, (long long)t);
            return -1;
        }
    }
    return 0;
}

static int vs_check(Py_buffer *b, Py_ssize_t itemsize, Py_ssize_t items, const char *what) {
    if (!PyBuffer_IsContiguous(b, 'C') || b->len != items * itemsize) {
        PyErr_Format(PyExc_ValueError, "vocab_scan: %s must be a C-contiguous buffer of %zd "
                     "%zd-byte items, not %zd bytes", what, items, itemsize, b->len);
        return -1;
    }
    return 0;
}

static PyObject *vocab_scan(PyObject *self, PyObject *args) {
    Py_buffer a, b, nt, xf, wf, bias, tid, e, t0, c, above, band_n, m, s0, s1, s2, cross;
    Py_ssize_t V, n, d;
    int mode, threads;
    if (!PyArg_ParseTuple(args, "y*y*y*nnnii" "y*y*y*y*y*y*" "w*w*w*" "w*w*w*w*w*", &a, &b, &nt,
                          &V, &n, &d, &mode, &threads, &xf, &wf, &bias, &tid, &e, &t0, &c,
                          &above, &band_n, &m, &s0, &s1, &s2, &cross)) {
        return NULL;
    }
    Py_buffer *all[] = {&a, &b, &nt, &xf, &wf, &bias, &tid, &e, &t0, &c, &above, &band_n, &m,
                        &s0, &s1, &s2, &cross};
    PyObject *result = NULL;
    VocabJob *jobs = NULL;
    double *lanes = NULL;
    int T = threads < 1 ? 1 : threads > VS_MAX_THREADS ? VS_MAX_THREADS : threads;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512bf16"))) {
        PyErr_SetString(PyExc_RuntimeError, "vocab_scan: this CPU has no AVX-512 BF16");
        goto done;
    }
    if (n <= 0 || n % 4 != 0 || mode < 0 || mode > 3 || threads != T || d <= 0) {
        PyErr_Format(PyExc_ValueError, "vocab_scan: n %zd (a positive multiple of 4), d %zd, "
                     "mode %d or threads %d out of range", n, d, mode, threads);
        goto done;
    }
    Py_ssize_t k2 = a.len / 4 / n;
    Py_ssize_t P = k2 > 0 ? b.len / 4 / (16 * k2) : 0;
    if (k2 <= 0 || vs_check(&a, 4, n * k2, "a") || P % 4 != 0 || V > 16 * P || V < 0 ||
        vs_check(&b, 4, P * 16 * k2, "b")) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "vocab_scan: b holds %zd panels for %zd tokens",
                         P, V);
        }
        goto done;
    }
    Py_ssize_t rn = mode == 0 ? n : 0, ln = mode == 0 ? 0 : n;
    if (vs_check(&nt, 4, mode == 0 ? V : 0, "nt") || vs_check(&xf, 4, rn * d, "xf") ||
        vs_check(&wf, 4, mode == 0 ? V * d : 0, "wf") ||
        (bias.len != 0 && vs_check(&bias, 4, V, "bias")) || vs_check(&tid, 8, rn, "tid") ||
        vs_check(&e, 4, rn, "e") || vs_check(&t0, 4, rn, "t0") || vs_check(&c, 8, rn, "c") ||
        vs_check(&above, 8, T * rn, "above") || vs_check(&band_n, 8, T * rn, "band_n") ||
        vs_check(&m, 4, T * ln, "m") || vs_check(&s0, 8, T * ln, "s0") ||
        vs_check(&s1, 8, T * ln, "s1") || vs_check(&s2, 8, T * ln, "s2") ||
        vs_check(&cross, 8, T * ln, "cross")) {
        goto done;
    }
    if (vs_tokens_in_range(&tid, rn, V, "vocab_scan")) {
        goto done;
    }
    jobs = calloc((size_t)T, sizeof *jobs);
    lanes = mode == 0 ? NULL : calloc((size_t)(T * n * 32), sizeof *lanes);
    if (jobs == NULL || (mode != 0 && lanes == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t groups = P / 4;
    for (int k = 0; k < T; k++) {
        VocabJob *j = jobs + k;
        *j = (VocabJob){(const uint32_t *)a.buf, (const uint32_t *)b.buf, (const float *)nt.buf,
                        (const float *)e.buf, (const float *)t0.buf, (const float *)xf.buf,
                        (const float *)wf.buf, bias.len ? (const float *)bias.buf : NULL,
                        (const double *)c.buf, n, k2, V, groups, d, mode, NULL, NULL, NULL,
                        NULL, NULL, NULL, NULL, groups * k / T, groups * (k + 1) / T, NULL,
                        k2, 0, 0, 0, NULL, NULL, NULL, NULL};
        if (mode == 0) {
            j->above = (int64_t *)above.buf + k * n;
            j->band_n = (int64_t *)band_n.buf + k * n;
            memset(j->above, 0, (size_t)n * 8);
            memset(j->band_n, 0, (size_t)n * 8);
        } else {
            j->m = (float *)m.buf + k * n;
            j->s0 = (double *)s0.buf + k * n;
            j->s1 = (double *)s1.buf + k * n;
            j->s2 = (double *)s2.buf + k * n;
            j->cross = (double *)cross.buf + k * n;
            j->lanes = lanes + k * n * 32;
            for (Py_ssize_t r = 0; r < n; r++) {
                j->m[r] = -INFINITY;
            }
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rn; r++) { /* the targets' logits, as the band's are computed */
        ((double *)c.buf)[r] = vs_logit64(jobs, r, ((const int64_t *)tid.buf)[r]);
    }
    run_jobs(vs_thread, jobs, sizeof *jobs, T);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    free(jobs);
    free(lanes);
    for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) {
        PyBuffer_Release(all[k]);
    }
    return result;
}

/* vocab_top(a, b, V, n, k, cap, threads, e, cand, cand_v, cand_n): the candidates for each row's k
   largest values (mode 4): a holds n rows (a multiple of 4) of the last K' values of b's
   rows ([n][K'/2] pairs; vocab_top reads b's pairs from K/2 - K'/2 on, K from b's size and
   V); each row keeps its k largest values so far and lists, in cand[k][r][:cap], every token
   not more than e[r] + 2^-21 (|v| + |k-th|) below the k-th of them when its tile is seen
   (thresholds only rise, so a token left out is that far below the row's final k-th value
   on its thread, and so on all of them), their values in cand_v; cand_n[k][r] counts them
   all. */
static PyObject *vocab_top(PyObject *self, PyObject *args) {
    Py_buffer a, b, e, cand, cand_v, cand_n;
    Py_ssize_t V, n, k, cap;
    int threads;
    if (!PyArg_ParseTuple(args, "y*y*nnnniy*w*w*w*", &a, &b, &V, &n, &k, &cap, &threads, &e,
                          &cand, &cand_v, &cand_n)) {
        return NULL;
    }
    PyObject *result = NULL;
    VocabJob *jobs = NULL;
    float *top = NULL;
    int T = threads < 1 ? 1 : threads > VS_MAX_THREADS ? VS_MAX_THREADS : threads;
    Py_ssize_t P = 4 * ((V + 63) / 64), ka = n > 0 ? a.len / 4 / n : 0;
    Py_ssize_t k2 = P > 0 ? b.len / 4 / (16 * P) : 0;
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512f")) {
        PyErr_SetString(PyExc_RuntimeError, "vocab_top: this CPU has no AVX-512 BF16");
        goto done;
    }
    if (n <= 0 || n % 4 != 0 || k < 1 || cap < k || threads != T || V < 1 || ka <= 0 ||
        ka > k2 || vs_check(&a, 4, n * ka, "a") || vs_check(&b, 4, P * 16 * k2, "b") ||
        vs_check(&e, 4, n, "e") || vs_check(&cand, 4, T * n * cap, "cand") ||
        vs_check(&cand_v, 4, T * n * cap, "cand_v") ||
        vs_check(&cand_n, 8, T * n, "cand_n")) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "vocab_top: n %zd, k %zd, cap %zd, threads %d or "
                         "widths (%zd of %zd pairs) out of range", n, k, cap, threads, ka, k2);
        }
        goto done;
    }
    jobs = calloc((size_t)T, sizeof *jobs);
    top = malloc((size_t)(T * n * k) * sizeof *top);
    if (jobs == NULL || top == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < T * n * k; i++) {
        top[i] = -INFINITY;
    }
    Py_ssize_t groups = P / 4;
    for (int t = 0; t < T; t++) {
        VocabJob *j = jobs + t;
        memset(j, 0, sizeof *j);
        j->a = (const uint32_t *)a.buf;
        j->b = (const uint32_t *)b.buf;
        j->e = (const float *)e.buf;
        j->n = n, j->k2 = k2, j->V = V, j->groups = groups, j->mode = 4;
        j->g_lo = groups * t / T, j->g_hi = groups * (t + 1) / T;
        j->ka = ka, j->kb0 = k2 - ka, j->k = k, j->cap = cap;
        j->top = top + t * n * k;
        j->cand = (int32_t *)cand.buf + t * n * cap;
        j->cand_v = (float *)cand_v.buf + t * n * cap;
        j->cand_n = (int64_t *)cand_n.buf + t * n;
        memset(j->cand_n, 0, (size_t)n * 8);
    }
    Py_BEGIN_ALLOW_THREADS
    run_jobs(vs_thread, jobs, sizeof *jobs, T);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    free(jobs);
    free(top);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&e);
    PyBuffer_Release(&cand);
    PyBuffer_Release(&cand_v);
    PyBuffer_Release(&cand_n);
    return result;
}

/* vocab_pack(w, bias, out, nt) -> (max N, finite): the vocabulary w float32 [V][d] (and bias
   float32 [V], or empty) as vocab_scan's b: per token the K values (w_hi,i, w_lo,i) for each
   i, then w_hi, then b_hi, b_lo, b_lo2 with a bias, a zero to make K even, each bfloat16 to
   nearest (ties to even) of what is left of the value, in panels of 16 tokens [P][K/2][16]
   (P = 4 ceil(V / 64), zeros past V); nt[t] = N_t = ||(w_t, b_t)|| (sums of squares in
   float64, times 1 + 2^-40, rounded up to float32). One pass, the GIL released. */
static inline uint16_t vs_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* to nearest, ties to even (finite values) */
    return (uint16_t)(u >> 16);
}

static inline float vs_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static PyObject *vocab_pack(PyObject *self, PyObject *args) {
    Py_buffer w, bias, out, nt;
    Py_ssize_t d;
    if (!PyArg_ParseTuple(args, "y*y*w*w*n", &w, &bias, &out, &nt, &d)) {
        return NULL;
    }
    PyObject *result = NULL;
    uint16_t *row = NULL;
    Py_ssize_t V = nt.len / 4, K = 3 * d + (bias.len ? 3 : 0);
    K += K % 2;
    Py_ssize_t k2 = K / 2, P = 4 * ((V + 63) / 64);
    if (d <= 0 || vs_check(&w, 4, V * d, "w") || (bias.len && vs_check(&bias, 4, V, "bias")) ||
        vs_check(&out, 4, P * 16 * k2, "out") || vs_check(&nt, 4, V, "nt")) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "vocab_pack: width %zd out of range", d);
        }
        goto done;
    }
    row = malloc((size_t)K * sizeof *row);
    if (row == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const float *wf = (const float *)w.buf, *bf = bias.len ? (const float *)bias.buf : NULL;
    uint32_t *o = (uint32_t *)out.buf;
    float *ntf = (float *)nt.buf;
    double n_max = 0.0;
    int finite = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < 16 * P; t++) {
        memset(row, 0, (size_t)K * sizeof *row);
        if (t < V) {
            double ss = 0.0;
            for (Py_ssize_t i = 0; i < d; i++) {
                float y = wf[t * d + i];
                finite &= isfinite(y) != 0;
                uint16_t hi = vs_bf16(y);
                row[2 * i] = hi;
                row[2 * i + 1] = vs_bf16(y - vs_f32(hi));
                row[2 * d + i] = hi;
                ss += (double)y * (double)y;
            }
            if (bf != NULL) {
                float y = bf[t];
                finite &= isfinite(y) != 0;
                ss += (double)y * (double)y;
                for (int q = 0; q < 3; q++) {
                    row[3 * d + q] = vs_bf16(y);
                    y -= vs_f32(row[3 * d + q]);
                }
            }
            double n = sqrt(ss) * (1 + 0x1p-40);
            float nf = (float)n;
            ntf[t] = (double)nf < n ? nextafterf(nf, INFINITY) : nf;
            n_max = n > n_max ? n : n_max;
        }
        uint32_t *panel = o + (t / 16) * k2 * 16 + t % 16;
        for (Py_ssize_t kk = 0; kk < k2; kk++) {
            panel[kk * 16] = (uint32_t)row[2 * kk] | ((uint32_t)row[2 * kk + 1] << 16);
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(dO)", n_max, finite ? Py_True : Py_False);
done:
    free(row);
    PyBuffer_Release(&w);
    PyBuffer_Release(&bias);
    PyBuffer_Release(&out);
    PyBuffer_Release(&nt);
    return result;
}
#endif

