/* token_rank's candidate pass in 16-bit integers (AVX-512 VNNI): rows against a whole
   vocabulary, each (row, token) value an exact integer dot product, reduced in registers.
   Included by _native.c after _native_vocab.c (vs_dot64, vs_check); the bound that makes the
   rank exact is derived in actdb/query/vocab_rank.py, the only caller.

   rank_pack(w, out, sw, nt, dt, d, chunk) -> (the largest sum of p^2 over a run): the
   vocabulary w float32 [V][d] as 16-bit integers p_t,i = rint(w_t,i / sw_t) (|p| <= 32767),
   sw_t = max(max_i |w_t,i| / 32767, max over runs of ||w_t,run|| / 46000, 2^-60) rounded up
   to float32 (a run: `chunk` pairs, 2 chunk values), in panels of 16 tokens [P][k2][16] of
   int16 pairs (k2 = ceil(d / 2), P = 4 ceil(V / 64), zeros past V and d); nt[t] = ||w_t|| and
   dt[t] = ||w_t - sw_t p_t|| (the residual, each term exact in float64), both times 1 + 2^-40
   and rounded up to float32. One pass, the GIL released.

   rank_scan(a, b, sw, nt, dt, bias, V, n, d, chunk, threads, xf, wf, tid, sx, ex, ey, c,
   above, band_n): a holds n rows (a multiple of 4) of k2 int16 pairs [n][k2] (the rows' q =
   x / sx rounded, |q| <= 32767, each run's sum q^2 times rank_pack's largest below 2^62, so
   that no int32 sum of a run overflows). Each run's sum of q_i p_t,i is exact (VPDPWSSD,
   int32), the runs' sums added in float32 (F_t); a_t = F_t (sx_r sw_t) (+ bias_t) in
   float32. c[r] (written here) is row r's token's logit x . w + b in float64 (vs_dot64, as
   the band's are computed); a token is above row r when a_t > c + W and in its band when not
   above and not a_t < c - W (NaN: in the band), W = ex[r] nt[t] + ey[r] dt[t] + 2^-120 +
   2^-20 (|a_t| + |c[r]|); a band token's logit is computed as c[r] was and counted when
   larger. above[k][r] counts the tokens found larger, band_n[k][r] the band's; the
   vocabulary's panels are shared among `threads` POSIX threads in contiguous runs. */

#ifdef ACTDB_VOCAB
typedef struct {
    const uint32_t *a, *b;
    const float *sw, *nt, *dt, *bias, *sx, *ex, *ey, *xf, *wf;
    const double *c;
    Py_ssize_t n, k2, V, d, g_lo, g_hi, chunk;
    int64_t *above, *band_n;
} RankJob;

/* a run's ||q||, ||p||: at most 46000 + sqrt(2 chunk) / 2, their product below 2^31 */
#define RK_NORM 46000.0
#define RK_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* The 4 x 64 tile of rows a (k2 pairs each) against the 4 panels from b: acc[4 row + panel],
   the float32 sums of exact int32 sums over runs of `chunk` pairs. */
RK_TARGET static void rk_tile(const uint32_t *a, const uint32_t *b, Py_ssize_t k2,
                              Py_ssize_t chunk, __m512 acc[16]) {
    const uint32_t *a0 = a, *a1 = a + k2, *a2 = a + 2 * k2, *a3 = a + 3 * k2;
    const uint32_t *b0 = b, *b1 = b + 16 * k2, *b2 = b + 32 * k2, *b3 = b + 48 * k2;
    for (int i = 0; i < 16; i++) {
        acc[i] = _mm512_setzero_ps();
    }
    for (Py_ssize_t k0 = 0; k0 < k2; k0 += chunk) {
        Py_ssize_t k1 = k0 + chunk < k2 ? k0 + chunk : k2;
        __m512i c00 = _mm512_setzero_si512(), c01 = c00, c02 = c00, c03 = c00;
        __m512i c10 = c00, c11 = c00, c12 = c00, c13 = c00, c20 = c00, c21 = c00, c22 = c00;
        __m512i c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;
        for (Py_ssize_t kk = k0; kk < k1; kk++) {
            __m512i w0 = _mm512_loadu_si512(b0 + 16 * kk), w1 = _mm512_loadu_si512(b1 + 16 * kk);
            __m512i w2 = _mm512_loadu_si512(b2 + 16 * kk), w3 = _mm512_loadu_si512(b3 + 16 * kk);
            __m512i x = _mm512_set1_epi32((int)a0[kk]);
            c00 = _mm512_dpwssd_epi32(c00, x, w0);
            c01 = _mm512_dpwssd_epi32(c01, x, w1);
            c02 = _mm512_dpwssd_epi32(c02, x, w2);
            c03 = _mm512_dpwssd_epi32(c03, x, w3);
            x = _mm512_set1_epi32((int)a1[kk]);
            c10 = _mm512_dpwssd_epi32(c10, x, w0);
            c11 = _mm512_dpwssd_epi32(c11, x, w1);
            c12 = _mm512_dpwssd_epi32(c12, x, w2);
            c13 = _mm512_dpwssd_epi32(c13, x, w3);
            x = _mm512_set1_epi32((int)a2[kk]);
            c20 = _mm512_dpwssd_epi32(c20, x, w0);
            c21 = _mm512_dpwssd_epi32(c21, x, w1);
            c22 = _mm512_dpwssd_epi32(c22, x, w2);
            c23 = _mm512_dpwssd_epi32(c23, x, w3);
            x = _mm512_set1_epi32((int)a3[kk]);
            c30 = _mm512_dpwssd_epi32(c30, x, w0);
            c31 = _mm512_dpwssd_epi32(c31, x, w1);
            c32 = _mm512_dpwssd_epi32(c32, x, w2);
            c33 = _mm512_dpwssd_epi32(c33, x, w3);
        }
        __m512i c[16] = {c00, c01, c02, c03, c10, c11, c12, c13,
                         c20, c21, c22, c23, c30, c31, c32, c33};
        for (int i = 0; i < 16; i++) {
            acc[i] = _mm512_add_ps(acc[i], _mm512_cvtepi32_ps(c[i]));
        }
    }
}

RK_TARGET static double rk_logit64(const RankJob *j, Py_ssize_t r, Py_ssize_t t) {
    double v = vs_dot64(j->xf + r * j->d, j->wf + t * j->d, j->d);
    return j->bias != NULL ? v + (double)j->bias[t] : v;
}

/* Row r's tokens tok0.. (its four panels' exact sums q) above its band counted, those in it
   computed in float64 as c was. */
RK_TARGET static void rk_rank(RankJob *j, Py_ssize_t r, Py_ssize_t tok0, const __m512 *q,
                              const __mmask16 *valid) {
    double c = j->c[r];
    float cf = (float)c;
    __m512 ex = _mm512_set1_ps(j->ex[r]), ey = _mm512_set1_ps(j->ey[r]);
    __m512 sx = _mm512_set1_ps(j->sx[r]), slack = _mm512_set1_ps(0x1p-20f);
    __m512 base = _mm512_set1_ps(0x1p-120f + 0x1p-20f * fabsf(cf)), cv = _mm512_set1_ps(cf);
    int64_t above = 0;
    for (int p = 0; p < 4; p++) {
        if (!valid[p]) {
            continue;
        }
        const Py_ssize_t t = tok0 + 16 * p;
        __m512 s = _mm512_mul_ps(sx, _mm512_maskz_loadu_ps(valid[p], j->sw + t));
        __m512 v = _mm512_mul_ps(q[p], s);
        if (j->bias != NULL) {
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid[p], j->bias + t));
        }
        __m512 w = _mm512_fmadd_ps(ex, _mm512_maskz_loadu_ps(valid[p], j->nt + t),
                                   _mm512_fmadd_ps(ey, _mm512_maskz_loadu_ps(valid[p], j->dt + t),
                                                   _mm512_fmadd_ps(slack, _mm512_abs_ps(v),
                                                                   base)));
        __mmask16 up = _mm512_mask_cmp_ps_mask(valid[p], v, _mm512_add_ps(cv, w), _CMP_GT_OQ);
        __mmask16 in = _mm512_mask_cmp_ps_mask(valid[p] & (__mmask16)~up, v,
                                               _mm512_sub_ps(cv, w), _CMP_NLT_UQ);
        above += __builtin_popcount((unsigned)up);
        while (in) {
            int bit = __builtin_ctz((unsigned)in);
            in &= (__mmask16)(in - 1);
            j->band_n[r]++;
            above += rk_logit64(j, r, t + bit) > c;
        }
    }
    j->above[r] += above;
}

RK_TARGET static void rk_run(RankJob *j) {
    __m512 acc[16];
    __mmask16 valid[4];
    for (Py_ssize_t g = j->g_lo; g < j->g_hi; g++) {
        Py_ssize_t tok0 = 64 * g;
        vs_valid(j->V, tok0, valid); /* _native_vocab.c */
        const uint32_t *b = j->b + 4 * g * 16 * j->k2;
        for (Py_ssize_t r = 0; r < j->n; r += 4) {
            rk_tile(j->a + r * j->k2, b, j->k2, j->chunk, acc);
            for (int i = 0; i < 4; i++) {
                rk_rank(j, r + i, tok0, acc + 4 * i, valid);
            }
        }
    }
}

static void *rk_thread(void *arg) {
    rk_run((RankJob *)arg);
    return NULL;
}

static PyObject *rank_scan(PyObject *self, PyObject *args) {
    Py_buffer a, b, sw, nt, dt, bias, xf, wf, tid, sx, ex, ey, c, above, band_n;
    Py_ssize_t V, n, d, chunk;
    int threads;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*nnnniy*y*y*y*y*y*w*w*w*", &a, &b, &sw, &nt, &dt,
                          &bias, &V, &n, &d, &chunk, &threads, &xf, &wf, &tid, &sx, &ex, &ey, &c,
                          &above, &band_n)) {
        return NULL;
    }
    Py_buffer *all[] = {&a, &b, &sw, &nt, &dt, &bias, &xf, &wf, &tid, &sx, &ex, &ey, &c,
                        &above, &band_n};
    PyObject *result = NULL;
    RankJob *jobs = NULL;
    int T = threads < 1 ? 1 : threads > VS_MAX_THREADS ? VS_MAX_THREADS : threads;
    Py_ssize_t k2 = (d + 1) / 2, P = 4 * ((V + 63) / 64);
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512vnni"))) {
        PyErr_SetString(PyExc_RuntimeError, "rank_scan: this CPU has no AVX-512 VNNI");
        goto done;
    }
    if (n <= 0 || n % 4 != 0 || threads != T || d <= 0 || V < 1 || chunk < 1) {
        PyErr_Format(PyExc_ValueError, "rank_scan: n %zd (a positive multiple of 4), d %zd, "
                     "V %zd, chunk %zd or threads %d out of range", n, d, V, chunk, threads);
        goto done;
    }
    if (vs_check(&a, 4, n * k2, "a") || vs_check(&b, 4, P * 16 * k2, "b") ||
        vs_check(&sw, 4, V, "sw") || vs_check(&nt, 4, V, "nt") || vs_check(&dt, 4, V, "dt") ||
        (bias.len != 0 && vs_check(&bias, 4, V, "bias")) || vs_check(&xf, 4, n * d, "xf") ||
        vs_check(&wf, 4, V * d, "wf") || vs_check(&tid, 8, n, "tid") ||
        vs_check(&sx, 4, n, "sx") || vs_check(&ex, 4, n, "ex") || vs_check(&ey, 4, n, "ey") ||
        vs_check(&c, 8, n, "c") || vs_check(&above, 8, T * n, "above") ||
        vs_check(&band_n, 8, T * n, "band_n")) {
        goto done;
    }
    if (vs_tokens_in_range(&tid, n, V, "rank_scan")) { /* _native_vocab.c */
        goto done;
    }
    jobs = calloc((size_t)T, sizeof *jobs);
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t groups = P / 4;
    for (int k = 0; k < T; k++) {
        RankJob *j = jobs + k;
        j->a = (const uint32_t *)a.buf, j->b = (const uint32_t *)b.buf;
        j->sw = (const float *)sw.buf, j->nt = (const float *)nt.buf;
        j->dt = (const float *)dt.buf, j->bias = bias.len ? (const float *)bias.buf : NULL;
        j->sx = (const float *)sx.buf, j->ex = (const float *)ex.buf;
        j->ey = (const float *)ey.buf, j->xf = (const float *)xf.buf;
        j->wf = (const float *)wf.buf, j->c = (const double *)c.buf;
        j->n = n, j->k2 = k2, j->V = V, j->d = d, j->chunk = chunk;
        j->g_lo = groups * k / T, j->g_hi = groups * (k + 1) / T;
        j->above = (int64_t *)above.buf + k * n;
        j->band_n = (int64_t *)band_n.buf + k * n;
        memset(j->above, 0, (size_t)n * 8);
        memset(j->band_n, 0, (size_t)n * 8);
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n; r++) { /* the targets' logits, as the band's are computed */
        ((double *)c.buf)[r] = rk_logit64(jobs, r, ((const int64_t *)tid.buf)[r]);
    }
    run_jobs(rk_thread, jobs, sizeof *jobs, T); /* _native_vocab.c */
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    free(jobs);
    for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) {
        PyBuffer_Release(all[k]);
    }
    return result;
}

/* float64 -> float32, rounded up (a bound stays a bound). */
static float rk_up(double v) {
    float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

static PyObject *rank_pack(PyObject *self, PyObject *args) {
    Py_buffer w, out, sw, nt, dt;
    Py_ssize_t d, chunk;
    if (!PyArg_ParseTuple(args, "y*w*w*w*w*nn", &w, &out, &sw, &nt, &dt, &d, &chunk)) {
        return NULL;
    }
    PyObject *result = NULL;
    int16_t *row = NULL;
    Py_ssize_t V = d > 0 ? w.len / 4 / d : 0, k2 = (d + 1) / 2, P = 4 * ((V + 63) / 64);
    if (d <= 0 || V < 1 || chunk < 1 || vs_check(&w, 4, V * d, "w") || vs_check(&out, 4, P * 16 * k2, "out") ||
        vs_check(&sw, 4, V, "sw") || vs_check(&nt, 4, V, "nt") || vs_check(&dt, 4, V, "dt")) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "rank_pack: width %zd out of range", d);
        }
        goto done;
    }
    row = malloc((size_t)(2 * k2) * sizeof *row);
    if (row == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const float *wf = (const float *)w.buf;
    uint32_t *o = (uint32_t *)out.buf;
    int64_t p2max = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < 16 * P; t++) {
        memset(row, 0, (size_t)(2 * k2) * sizeof *row);
        if (t < V) {
            const float *y = wf + t * d;
            double ss = 0.0, m = 0.0, cmax = 0.0, cs = 0.0;
            for (Py_ssize_t i = 0; i < d; i++) {
                double v = (double)y[i] * (double)y[i];
                ss += v;
                cs += v;
                if ((i + 1) % (2 * chunk) == 0 || i + 1 == d) { /* a run's end */
                    cmax = cs > cmax ? cs : cmax;
                    cs = 0.0;
                }
                m = fabs((double)y[i]) > m ? fabs((double)y[i]) : m;
            }
            double norm = sqrt(ss) * (1 + 0x1p-40), cn = sqrt(cmax) * (1 + 0x1p-40);
            double want = m / 32767.0 > cn / RK_NORM ? m / 32767.0 : cn / RK_NORM;
            float s = rk_up(want > 0x1p-60 ? want : 0x1p-60);
            double rs = 0.0;
            int64_t p2 = 0;
            for (Py_ssize_t i = 0; i < d; i++) {
                float q = rintf(y[i] / s);
                q = q > 32767.0f ? 32767.0f : q < -32767.0f ? -32767.0f : q;
                double res = (double)y[i] - (double)s * (double)q; /* exact */
                rs += res * res;
                row[i] = (int16_t)q;
                p2 += (int64_t)q * (int64_t)q;
                if ((i + 1) % (2 * chunk) == 0 || i + 1 == d) { /* the run's sum of p^2 */
                    p2max = p2 > p2max ? p2 : p2max;
                    p2 = 0;
                }
            }
            ((float *)sw.buf)[t] = s;
            ((float *)nt.buf)[t] = rk_up(norm);
            ((float *)dt.buf)[t] = rk_up(sqrt(rs) * (1 + 0x1p-40));
        }
        uint32_t *panel = o + (t / 16) * k2 * 16 + t % 16;
        for (Py_ssize_t kk = 0; kk < k2; kk++) {
            panel[kk * 16] = (uint32_t)(uint16_t)row[2 * kk] |
                             ((uint32_t)(uint16_t)row[2 * kk + 1] << 16);
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong((long long)p2max);
done:
    free(row);
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    PyBuffer_Release(&sw);
    PyBuffer_Release(&nt);
    PyBuffer_Release(&dt);
    return result;
}
#endif
