/* actdb._native: the full scan's inner loops and the ingest's hook, compiled.

   split_rows(x, y, h, norm, mean, gain, bias, d, centered, eps, portable, threads): a norm
   input's rows turned into their stored fields (float16 direction, norm, mean) and checked
   against the module's output, the GIL released, on the calling thread or shared with a pool
   of POSIX threads (below, "The hook's rows shared among threads").

   f16_dots_crc(x, v, out, rows, crcs): f16_dots with each chunk's CRC-32C checked in the same
   pass (where DOTS_CRC; _native_crc.c).

   read_chunks(paths, buf, nbytes, crc, check[, crcs]): the chunk files of a run read into their
   places in one buffer and their CRC-32C checked (and handed back, for the digests recorded for
   their places), with the GIL released for the whole run (below).

   f16_dots(x, v, out): out[i] = sum_j float(x[i, j]) * v[j] for a C-contiguous float16 matrix
   x [n, d], a float32 vector v [d] and a float32 vector out [n], in one pass over x (the
   float16 values converted in registers, never written out as float32), with the GIL
   released.

   Each row is reduced on its own, in an order fixed by d alone: 32 float32 partial sums
   (lane k takes the elements j = k mod 32 of the row's first d - d mod 32, each step one fused
   multiply-add), added pairwise (16 + 16, 8 + 8, 4 + 4, 2 + 2, 1 + 1), then the remaining
   d mod 32 products added in order with fused multiply-adds. A row's value therefore never
   depends on the rows computed with it (docs/ENGINE.md, "A row's value does not depend on its
   neighbours"), and the portable C path computes exactly the AVX2 path's operations, so both
   give the same bits (tests/unit/test_native.py checks it).

   Python 3.11's C API, no NumPy headers: arguments are buffers. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <sys/uio.h>
#include <unistd.h>
#include <stdint.h>
#include <string.h>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <signal.h>
#define ACTDB_POOL 1 /* the hook's rows shared among threads (below) */
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ACTDB_X86 1
#include <immintrin.h>
#endif

/* IEEE binary16 -> binary32, exact for every value (subnormals, infinities, NaN payloads). */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        /* subnormal: normalise the mantissa */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while ((man & 0x400u) == 0);
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float finish(float *acc, const uint16_t *row, const float *v, Py_ssize_t body,
                    Py_ssize_t d) {
    for (int w = 16; w >= 1; w /= 2) {
        for (int k = 0; k < w; k++) {
            acc[k] = acc[k] + acc[k + w];
        }
    }
    float s = acc[0];
    for (Py_ssize_t j = body; j < d; j++) {
        s = fmaf(half_to_float(row[j]), v[j], s);
    }
    return s;
}

static void dots_portable(const uint16_t *x, const float *v, float *out, Py_ssize_t n,
                          Py_ssize_t d) {
    Py_ssize_t body = d - d % 32;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint16_t *row = x + i * d;
        float acc[32] = {0};
        for (Py_ssize_t j = 0; j < body; j += 32) {
            for (int k = 0; k < 32; k++) {
                acc[k] = fmaf(half_to_float(row[j + k]), v[j + k], acc[k]);
            }
        }
        out[i] = finish(acc, row, v, body, d);
    }
}

#ifdef ACTDB_X86
/* 32 values of a row from J on: dots_avx2's step, and dots_crc_avx512's (_native_crc.c), so
   that both give the same bits. */
#define DOTS_STEP(J)                                                                        \
    do {                                                                                    \
        a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + (J)))), \
                             _mm256_loadu_ps(v + (J)), a0);                                 \
        a1 = _mm256_fmadd_ps(                                                               \
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + (J) + 8))),            \
            _mm256_loadu_ps(v + (J) + 8), a1);                                              \
        a2 = _mm256_fmadd_ps(                                                               \
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + (J) + 16))),           \
            _mm256_loadu_ps(v + (J) + 16), a2);                                             \
        a3 = _mm256_fmadd_ps(                                                               \
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + (J) + 24))),           \
            _mm256_loadu_ps(v + (J) + 24), a3);                                             \
    } while (0)

/* A row's four accumulators reduced as `finish` reduces them, then its values from body on. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline float finish256(__m256 a0, __m256 a1, __m256 a2, __m256 a3, const uint16_t *row,
                              const float *v, Py_ssize_t body, Py_ssize_t d) {
    float acc[32];
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
    _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3);
    return finish(acc, row, v, body, d);
}

__attribute__((target("avx2,fma,f16c")))
static void dots_avx2(const uint16_t *x, const float *v, float *out, Py_ssize_t n,
                      Py_ssize_t d) {
    Py_ssize_t body = d - d % 32;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint16_t *row = x + i * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (Py_ssize_t j = 0; j < body; j += 32) {
            DOTS_STEP(j);
        }
        out[i] = finish256(a0, a1, a2, a3, row, v, body, d);
    }
}
#endif


#include "_native_crc.c" /* crc32c: the CRC-32C on the fastest path this CPU has */


/* -- reading a run of chunk files -----------------------------------------------------------

   read_chunks(paths, buf, nbytes, crc, check[, crcs]) -> list: file i's first `nbytes` bytes
   into buf[i * nbytes:], then up to 5 more bytes (its 4-byte CRC-32C when `crc`, and one byte
   that shows a file too long); with `crcs` (a writable buffer of a uint32 a file), file i's
   stored CRC-32C into crcs[i], for the caller to compare with the digest recorded for the
   chunk's place (store/digests.py). For each file in order, the number of bytes it held (None:
   no such file) or, when its size is right and `check` holds and its CRC-32C differs from the
   stored one, -1; the list stops at the first file that is missing, of the wrong size or fails
   its checksum, as the Python reader stops there (chunks.py). Any other error opening or
   reading a file is an OSError naming it. The GIL is released for the whole run: one call where
   a run of 16 chunks took about 150 Python steps. */

static PyObject *py_read_chunks(PyObject *self, PyObject *args) {
    PyObject *list;
    Py_buffer buf;
    Py_ssize_t nbytes;
    int crc, check;
    PyObject *crcs_obj = Py_None;
    Py_buffer crcs = {0};
    if (!PyArg_ParseTuple(args, "O!w*npp|O", &PyList_Type, &list, &buf, &nbytes, &crc,
                          &check, &crcs_obj)) {
        return NULL;
    }
    if (crcs_obj != Py_None) {
        if (PyObject_GetBuffer(crcs_obj, &crcs, PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&buf);
            return NULL;
        }
    }
    PyObject *result = NULL;
    /* a tuple of its own: the list may change while the GIL is released, the tuple keeps
       every path alive */
    PyObject *paths = PyList_AsTuple(list);
    const char **names = NULL;
    long long *got = NULL;
    int *errs = NULL;
    if (paths == NULL) {
        PyBuffer_Release(&buf);
        if (crcs.obj != NULL) {
            PyBuffer_Release(&crcs);
        }
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(paths);
    uint32_t *stored_out = crcs.obj != NULL ? (uint32_t *)crcs.buf : NULL;
    if (stored_out != NULL && (!crc || crcs.len < count * (Py_ssize_t)sizeof(uint32_t))) {
        PyErr_SetString(PyExc_ValueError,
                        "read_chunks: crcs needs 4 bytes a chunk, and chunks with a CRC-32C");
        goto done;
    }
    /* by division: count * nbytes may overflow */
    if (nbytes <= 0 || (count > 0 && nbytes > buf.len / count)) {
        PyErr_SetString(PyExc_ValueError, "read_chunks: the buffer is smaller than the run");
        goto done;
    }
    long long expected = (long long)nbytes + (crc ? 4 : 0);
    names = PyMem_Calloc((size_t)count + 1, sizeof *names);
    got = PyMem_Calloc((size_t)count + 1, sizeof *got);
    errs = PyMem_Calloc((size_t)count + 1, sizeof *errs);
    if (names == NULL || got == NULL || errs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *p = PyTuple_GET_ITEM(paths, i);
        if (!PyBytes_Check(p)) {
            PyErr_SetString(PyExc_TypeError, "read_chunks: paths must be bytes");
            goto done;
        }
        names[i] = PyBytes_AS_STRING(p);
        if ((Py_ssize_t)strlen(names[i]) != PyBytes_GET_SIZE(p)) {
            PyErr_SetString(PyExc_ValueError, "read_chunks: a path holds a NUL byte");
            goto done;
        }
    }
    Py_ssize_t failed = -1, stop = count;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned char tail[5];
        unsigned char *data = (unsigned char *)buf.buf + i * nbytes;
        int fd;
        do {
            fd = open(names[i], O_RDONLY | O_CLOEXEC);
        } while (fd < 0 && errno == EINTR);
        if (fd < 0) {
            if (errno == ENOENT) {
                got[i] = -2; /* missing */
                stop = i + 1;
                break;
            }
            errs[i] = errno;
            failed = i;
            break;
        }
        struct iovec iov[2] = {{data, (size_t)nbytes}, {tail, sizeof tail}};
        long long total = 0;
        ssize_t r = 0;
        /* preadv may return fewer bytes than asked for (signals): read on until end of file */
        for (;;) {
            long long want = (long long)nbytes + (long long)sizeof tail;
            if (total >= want) {
                break;
            }
            if (total < nbytes) {
                iov[0].iov_base = data + total;
                iov[0].iov_len = (size_t)(nbytes - total);
                iov[1].iov_base = tail;
                iov[1].iov_len = sizeof tail;
                r = preadv(fd, iov, 2, (off_t)total);
            } else {
                r = pread(fd, tail + (total - nbytes), (size_t)(want - total), (off_t)total);
            }
            if (r < 0 && errno == EINTR) {
                continue;
            }
            if (r <= 0) {
                break;
            }
            total += r;
        }
        int saved = errno;
        close(fd);
        if (r < 0) {
            errs[i] = saved;
            failed = i;
            break;
        }
        got[i] = total;
        if (total != expected) {
            stop = i + 1;
            break;
        }
        if (crc && (check || stored_out != NULL)) {
            uint32_t stored = (uint32_t)tail[0] | (uint32_t)tail[1] << 8 |
                              (uint32_t)tail[2] << 16 | (uint32_t)tail[3] << 24;
            if (stored_out != NULL) {
                stored_out[i] = stored;
            }
            if (check && crc32c_of(data, (size_t)nbytes) != stored) {
                got[i] = -1;
                stop = i + 1;
                break;
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (failed >= 0) {
        PyObject *name = PyUnicode_DecodeFSDefault(names[failed]);
        if (name != NULL) {
            errno = errs[failed];
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
            Py_DECREF(name);
        }
        goto done;
    }
    result = PyList_New(stop);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < stop; i++) {
        PyObject *v = got[i] == -2 ? Py_NewRef(Py_None) : PyLong_FromLongLong(got[i]);
        if (v == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, v);
    }
done:
    PyMem_Free(names);
    PyMem_Free(got);
    PyMem_Free(errs);
    Py_DECREF(paths);
    PyBuffer_Release(&buf);
    if (crcs.obj != NULL) {
        PyBuffer_Release(&crcs);
    }
    return result;
}

typedef void (*dots_fn)(const uint16_t *, const float *, float *, Py_ssize_t, Py_ssize_t);

static dots_fn chosen = dots_portable;
static const char *chosen_name = "portable";

static int check(Py_buffer *b, Py_ssize_t itemsize, const char *what) {
    if (!PyBuffer_IsContiguous(b, 'C')) {
        PyErr_Format(PyExc_ValueError, "f16_dots: %s is not C-contiguous", what);
        return -1;
    }
    if (b->itemsize != itemsize || b->len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "f16_dots: %s has items of %zd bytes, not %zd", what,
                     b->itemsize, itemsize);
        return -1;
    }
    return 0;
}

static PyObject *f16_dots(PyObject *self, PyObject *args) {
    Py_buffer x, v, out;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "y*y*w*|p", &x, &v, &out, &portable)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (check(&x, 2, "x") || check(&v, 4, "v") || check(&out, 4, "out")) {
        goto done;
    }
    Py_ssize_t d = v.len / 4, n = out.len / 4;
    /* by division: n * d may overflow */
    if (d == 0 || x.len / 2 % d != 0 || x.len / 2 / d != n) {
        PyErr_Format(PyExc_ValueError, "f16_dots: x holds %zd values, not %zd rows of %zd",
                     x.len / 2, n, d);
        goto done;
    }
    dots_fn fn = portable ? dots_portable : chosen;
    Py_BEGIN_ALLOW_THREADS
    fn((const uint16_t *)x.buf, (const float *)v.buf, (float *)out.buf, n, d);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&v);
    PyBuffer_Release(&out);
    return result;
}

/* f16_dots_crc(x, v, out, rows, crcs) -> int: f16_dots's products (the AVX2 path's bits)
   with each chunk of `rows` rows checked against its CRC-32C, crcs[c] (uint32), in the same
   pass (dots_crc_avx512 in _native_crc.c); the first chunk that fails, or -1; the GIL
   released. Where DOTS_CRC (AVX2, FMA, F16C and the AVX-512 CRC path), for d a multiple of 64
   and whole chunks. */
static int dots_crc_ok(void) {
#ifdef ACTDB_X86
    return chosen == dots_avx2 && crc_best == CRC_AVX512;
#else
    return 0;
#endif
}

static PyObject *f16_dots_crc(PyObject *self, PyObject *args) {
    Py_buffer x, v, out, crcs;
    Py_ssize_t rows;
    if (!PyArg_ParseTuple(args, "y*y*w*ny*", &x, &v, &out, &rows, &crcs)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (check(&x, 2, "x") || check(&v, 4, "v") || check(&out, 4, "out") ||
        check(&crcs, 4, "crcs")) {
        goto done;
    }
    Py_ssize_t d = v.len / 4, n = out.len / 4;
    if (d == 0 || x.len / 2 % d != 0 || x.len / 2 / d != n) {
        PyErr_Format(PyExc_ValueError, "f16_dots_crc: x holds %zd values, not %zd rows of %zd",
                     x.len / 2, n, d);
        goto done;
    }
    if (!dots_crc_ok()) {
        PyErr_SetString(PyExc_RuntimeError, "f16_dots_crc: not on this CPU (DOTS_CRC)");
        goto done;
    }
    if (d % 64 != 0 || rows <= 0 || n % rows != 0 || crcs.len / 4 != n / rows) {
        PyErr_Format(PyExc_ValueError,
                     "f16_dots_crc: %zd rows of %zd values in chunks of %zd rows, with %zd "
                     "CRCs (d a multiple of 64, whole chunks, a CRC a chunk)",
                     n, d, rows, crcs.len / 4);
        goto done;
    }
    Py_ssize_t bad = -1;
#ifdef ACTDB_X86
    Py_BEGIN_ALLOW_THREADS
    bad = dots_crc_avx512((const uint16_t *)x.buf, (const float *)v.buf, (float *)out.buf, n, d,
                          rows, (const uint32_t *)crcs.buf);
    Py_END_ALLOW_THREADS
#endif
    result = PyLong_FromSsize_t(bad);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&v);
    PyBuffer_Release(&out);
    PyBuffer_Release(&crcs);
    return result;
}

/* -- The ingest's hook: a norm input's rows turned into the stored fields, and checked -------

   split_rows(x, y, h, norm, mean, gain, bias, d, centered, eps, portable=False, threads=1) ->
   worst: for each row of x (float32 [n, d], the norm module's input) its norm ||x|| and mean
   (sums in float64, stored as float32), its direction x / norm (a float32 division) rounded to
   float16 (to nearest, ties to even) into h (zeros where the norm is 0 or NaN, as norms.split
   gives); then the module's output rebuilt from what is stored (v = float(h) * norm in float32, the
   site's formula w = v - mean(v) if centred, y' = gain * w / sqrt(mean(w^2) + eps) + bias, in
   float64) and compared with its real output y: the worst ||y' - y|| / (||y|| + 1e-6) over
   the rows (NaN if any is). gain and bias are float32 [d] or empty (ones, zeros). Three passes
   over memory (x, y, h) where torch's ops made about twenty, the GIL released; with threads > 1
   the rows are shared among threads (split_shared, below). */

/* binary32 -> binary16, to nearest, ties to even: what F16C's vcvtps2ph and NumPy give. */
static uint16_t float_to_half(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t absb = bits & 0x7fffffffu;
    if (absb >= 0x7f800000u) { /* inf or NaN (quiet, payload's top bits kept) */
        return sign | 0x7c00u | (absb > 0x7f800000u ? (uint16_t)(0x200u | ((absb >> 13) & 0x3ffu)) : 0);
    }
    if (absb >= 0x477ff000u) { /* rounds to 65536 or more: infinity */
        return sign | 0x7c00u;
    }
    if (absb >= 0x38800000u) { /* normal in binary16 */
        uint32_t mant = absb & 0x7fffffu;
        uint32_t exp = (absb >> 23) - 112u;
        uint32_t half = (exp << 10) | (mant >> 13);
        uint32_t rest = mant & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) {
            half += 1u; /* a carry into the exponent is right */
        }
        return sign | (uint16_t)half;
    }
    if (absb < 0x33000000u) { /* below half the smallest subnormal: zero */
        return sign;
    }
    /* subnormal in binary16: the value in units of 2^-24, rounded to nearest even */
    uint32_t e = absb >> 23;
    uint32_t mant = (absb & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 2^-24 units: mant * 2^(e - 150) / 2^-24 = mant >> (126 - e) */
    uint32_t half = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1u);
    uint32_t mid = 1u << (shift - 1u);
    if (rest > mid || (rest == mid && (half & 1u))) {
        half += 1u;
    }
    return sign | (uint16_t)half;
}

typedef struct {
    const float *gain, *bias;
    int centered;
    double eps;
    Py_ssize_t d;
} SplitSite;

/* The portable path makes exactly the AVX2 path's operations, so both store the same bits:
   each float64 sum over a row's first d - d mod 8 elements in 8 lanes (lane k takes the
   elements j = k mod 8; squares by fused multiply-add), the lanes added as split_avx2's
   registers are ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the last d mod 8
   elements one after another without fusing (ISO C: no contraction). */
static double lanes_total(const double *l) {
    double c0 = l[0] + l[4], c1 = l[1] + l[5], c2 = l[2] + l[6], c3 = l[3] + l[7];
    return (c0 + c2) + (c1 + c3);
}

/* The last d mod 8 elements of each sum, one after another: shared by both paths. */
static void tail_norm(const float *xr, Py_ssize_t body, Py_ssize_t d, double *sum, double *ss) {
    for (Py_ssize_t j = body; j < d; j++) {
        *sum += (double)xr[j];
        *ss += (double)xr[j] * (double)xr[j];
    }
}

static double tail_mean(const uint16_t *hr, float nrm, Py_ssize_t body, Py_ssize_t d,
                        double m) {
    for (Py_ssize_t j = body; j < d; j++) {
        m += (double)(half_to_float(hr[j]) * nrm);
    }
    return m;
}

static double tail_squares(const uint16_t *hr, float nrm, double m, Py_ssize_t body,
                           Py_ssize_t d, double ws) {
    for (Py_ssize_t j = body; j < d; j++) {
        double w = (double)(half_to_float(hr[j]) * nrm) - m;
        ws += w * w;
    }
    return ws;
}

/* The row's relative error once its last elements are added; the worst so far kept, NaN
   for good once a row is NaN. */
static double row_worst(const SplitSite *s, const uint16_t *hr, const float *yr, float nrm,
                        double m, double r, Py_ssize_t body, double e2, double yy,
                        double worst) {
    for (Py_ssize_t j = body; j < s->d; j++) {
        double yh = ((double)(half_to_float(hr[j]) * nrm) - m) * r;
        if (s->gain) yh *= (double)s->gain[j];
        if (s->bias) yh += (double)s->bias[j];
        double diff = yh - (double)yr[j];
        e2 += diff * diff;
        yy += (double)yr[j] * (double)yr[j];
    }
    double err = sqrt(e2) / (sqrt(yy) + 1e-6);
    return isnan(err) || err > worst ? err : worst;
}

static double split_portable(const SplitSite *s, const float *x, const float *y, uint16_t *h,
                             float *norm, float *mean, Py_ssize_t n) {
    Py_ssize_t d = s->d, body = d - d % 8;
    double worst = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const float *xr = x + i * d, *yr = y + i * d;
        uint16_t *hr = h + i * d;
        double a[8] = {0}, q[8] = {0};
        for (Py_ssize_t j = 0; j < body; j += 8) {
            for (int k = 0; k < 8; k++) {
                double v = (double)xr[j + k];
                a[k] = a[k] + v;
                q[k] = fma(v, v, q[k]);
            }
        }
        double sum = lanes_total(a), ss = lanes_total(q);
        tail_norm(xr, body, d, &sum, &ss);
        float nrm = (float)sqrt(ss);
        norm[i] = nrm;
        mean[i] = (float)(sum / (double)d);
        for (Py_ssize_t j = 0; j < d; j++) {
            hr[j] = nrm > 0.0f ? float_to_half(xr[j] / nrm) : 0;
        }
        double m = 0.0;
        if (s->centered) {
            double l[8] = {0};
            for (Py_ssize_t j = 0; j < body; j += 8) {
                for (int k = 0; k < 8; k++) {
                    l[k] = l[k] + (double)(half_to_float(hr[j + k]) * nrm);
                }
            }
            m = tail_mean(hr, nrm, body, d, lanes_total(l)) / (double)d;
        }
        double l[8] = {0};
        for (Py_ssize_t j = 0; j < body; j += 8) {
            for (int k = 0; k < 8; k++) {
                double w = (double)(half_to_float(hr[j + k]) * nrm) - m;
                l[k] = fma(w, w, l[k]);
            }
        }
        double ws = tail_squares(hr, nrm, m, body, d, lanes_total(l));
        double r = 1.0 / sqrt(ws / (double)d + s->eps);
        double e[8] = {0}, yl[8] = {0};
        for (Py_ssize_t j = 0; j < body; j += 8) {
            for (int k = 0; k < 8; k++) {
                double yh = ((double)(half_to_float(hr[j + k]) * nrm) - m) * r;
                if (s->gain) yh = yh * (double)s->gain[j + k];
                yh = yh + (s->bias ? (double)s->bias[j + k] : 0.0);
                double yv = (double)yr[j + k], diff = yh - yv;
                e[k] = fma(diff, diff, e[k]);
                yl[k] = fma(yv, yv, yl[k]);
            }
        }
        worst = row_worst(s, hr, yr, nrm, m, r, body, lanes_total(e), lanes_total(yl), worst);
    }
    return worst;
}

#ifdef ACTDB_X86
__attribute__((target("avx2,fma,f16c")))
static inline double hsum_pd(__m256d v) {
    __m128d lo = _mm256_castpd256_pd128(v), hi = _mm256_extractf128_pd(v, 1);
    lo = _mm_add_pd(lo, hi);
    return _mm_cvtsd_f64(_mm_add_sd(lo, _mm_unpackhi_pd(lo, lo)));
}

__attribute__((target("avx2,fma,f16c")))
static double split_avx2(const SplitSite *s, const float *x, const float *y, uint16_t *h,
                         float *norm, float *mean, Py_ssize_t n) {
    Py_ssize_t d = s->d, body = d - d % 8;
    double worst = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const float *xr = x + i * d, *yr = y + i * d;
        uint16_t *hr = h + i * d;
        __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
        __m256d q0 = _mm256_setzero_pd(), q1 = _mm256_setzero_pd();
        for (Py_ssize_t j = 0; j < body; j += 8) {
            __m256 v = _mm256_loadu_ps(xr + j);
            __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
            s0 = _mm256_add_pd(s0, a);
            s1 = _mm256_add_pd(s1, b);
            q0 = _mm256_fmadd_pd(a, a, q0);
            q1 = _mm256_fmadd_pd(b, b, q1);
        }
        double sum = hsum_pd(_mm256_add_pd(s0, s1)), ss = hsum_pd(_mm256_add_pd(q0, q1));
        tail_norm(xr, body, d, &sum, &ss);
        float nrm = (float)sqrt(ss);
        norm[i] = nrm;
        mean[i] = (float)(sum / (double)d);
        if (nrm > 0.0f) {
            __m256 nv = _mm256_set1_ps(nrm);
            for (Py_ssize_t j = 0; j < body; j += 8) {
                __m256 q = _mm256_div_ps(_mm256_loadu_ps(xr + j), nv);
                _mm_storeu_si128((__m128i *)(hr + j),
                                 _mm256_cvtps_ph(q, _MM_FROUND_TO_NEAREST_INT));
            }
            for (Py_ssize_t j = body; j < d; j++) {
                hr[j] = float_to_half(xr[j] / nrm);
            }
        } else {
            memset(hr, 0, (size_t)d * sizeof *hr);
        }
        /* the rebuilt vector v = float(h) * norm, in float32 */
        __m256 nv = _mm256_set1_ps(nrm);
        double m = 0.0;
        if (s->centered) {
            __m256d m0 = _mm256_setzero_pd(), m1 = _mm256_setzero_pd();
            for (Py_ssize_t j = 0; j < body; j += 8) {
                __m256 v = _mm256_mul_ps(
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hr + j))), nv);
                m0 = _mm256_add_pd(m0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
                m1 = _mm256_add_pd(m1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
            }
            m = tail_mean(hr, nrm, body, d, hsum_pd(_mm256_add_pd(m0, m1))) / (double)d;
        }
        __m256d mv = _mm256_set1_pd(m);
        __m256d w0 = _mm256_setzero_pd(), w1 = _mm256_setzero_pd();
        for (Py_ssize_t j = 0; j < body; j += 8) {
            __m256 v = _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hr + j))), nv);
            __m256d a = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), mv);
            __m256d b = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), mv);
            w0 = _mm256_fmadd_pd(a, a, w0);
            w1 = _mm256_fmadd_pd(b, b, w1);
        }
        double ws = tail_squares(hr, nrm, m, body, d, hsum_pd(_mm256_add_pd(w0, w1)));
        double r = 1.0 / sqrt(ws / (double)d + s->eps);
        __m256d rv = _mm256_set1_pd(r);
        __m256d e0 = _mm256_setzero_pd(), e1 = _mm256_setzero_pd();
        __m256d y0 = _mm256_setzero_pd(), y1 = _mm256_setzero_pd();
        for (Py_ssize_t j = 0; j < body; j += 8) {
            __m256 v = _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hr + j))), nv);
            __m256 yv = _mm256_loadu_ps(yr + j);
            __m256 gv = s->gain ? _mm256_loadu_ps(s->gain + j) : _mm256_set1_ps(1.0f);
            __m256 bv = s->bias ? _mm256_loadu_ps(s->bias + j) : _mm256_setzero_ps();
            __m256d a = _mm256_mul_pd(
                _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), mv), rv);
            __m256d b = _mm256_mul_pd(
                _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), mv), rv);
            a = s->gain ? _mm256_mul_pd(a, _mm256_cvtps_pd(_mm256_castps256_ps128(gv))) : a;
            b = s->gain ? _mm256_mul_pd(b, _mm256_cvtps_pd(_mm256_extractf128_ps(gv, 1))) : b;
            a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm256_castps256_ps128(bv)));
            b = _mm256_add_pd(b, _mm256_cvtps_pd(_mm256_extractf128_ps(bv, 1)));
            __m256d ya = _mm256_cvtps_pd(_mm256_castps256_ps128(yv));
            __m256d yb = _mm256_cvtps_pd(_mm256_extractf128_ps(yv, 1));
            __m256d da = _mm256_sub_pd(a, ya), db = _mm256_sub_pd(b, yb);
            e0 = _mm256_fmadd_pd(da, da, e0);
            e1 = _mm256_fmadd_pd(db, db, e1);
            y0 = _mm256_fmadd_pd(ya, ya, y0);
            y1 = _mm256_fmadd_pd(yb, yb, y1);
        }
        worst = row_worst(s, hr, yr, nrm, m, r, body, hsum_pd(_mm256_add_pd(e0, e1)),
                          hsum_pd(_mm256_add_pd(y0, y1)), worst);
    }
    return worst;
}
#endif

typedef double (*split_fn)(const SplitSite *, const float *, const float *, uint16_t *, float *,
                           float *, Py_ssize_t);
static split_fn split_chosen = split_portable;

/* -- The hook's rows shared among threads of our own ----------------------------------------

   The rows of one call are cut into contiguous runs, one a thread: the calling thread takes
   the first and the pool's workers the others. A row's fields do not depend on the others, so
   the bits are the one-thread path's, and the worst error is combined with row_worst's rule
   (NaN sticks). The workers are plain POSIX threads, started on first use and kept for the
   process, sleeping on a condition variable between calls (starting threads for every call
   would cost more than a small batch's rows). One call uses the pool at a time: a caller that
   finds it busy runs its rows on its own thread, as do calls asking for one thread. A forked
   child starts with no workers (they do not survive fork) and makes its own on first use. */
#ifdef ACTDB_POOL
#define SPLIT_MAX_THREADS 64

typedef struct {
    split_fn fn;
    const SplitSite *site;
    const float *x, *y;
    uint16_t *h;
    float *norm, *mean;
    Py_ssize_t n;
    int of; /* the threads sharing the rows, the caller included */
    double worst[SPLIT_MAX_THREADS];
} SplitJob;

/* The k-th of job->of contiguous runs, so the runs cover every row once. */
static void split_part(SplitJob *job, int k) {
    Py_ssize_t d = job->site->d;
    Py_ssize_t lo = job->n * k / job->of, hi = job->n * (k + 1) / job->of;
    job->worst[k] = job->fn(job->site, job->x + lo * d, job->y + lo * d, job->h + lo * d,
                            job->norm + lo, job->mean + lo, hi - lo);
}

static struct {
    pthread_mutex_t owner; /* held by the one call using the pool */
    pthread_mutex_t lock;  /* guards the fields below */
    pthread_cond_t start, done;
    int workers;           /* started, numbered 1 .. workers */
    unsigned long round;   /* bumped for each job, so a worker sees each one once */
    unsigned long born[SPLIT_MAX_THREADS]; /* the round when each worker was started */
    SplitJob *job;
    int pending;           /* workers of this job not finished */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, {0}, NULL, 0};
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void *split_worker(void *arg) {
    int k = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    unsigned long seen = pool.born[k]; /* a job posted before it first ran is still its own */
    for (;;) {
        while (pool.round == seen) {
            pthread_cond_wait(&pool.start, &pool.lock);
        }
        seen = pool.round;
        SplitJob *job = pool.job;
        if (k >= job->of) {
            continue; /* a job for fewer threads than the pool holds */
        }
        pthread_mutex_unlock(&pool.lock);
        split_part(job, k);
        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0) {
            pthread_cond_signal(&pool.done);
        }
    }
    return NULL;
}

/* The child of a fork has only the forking thread: it forgets the parent's workers and any
   call that held the pool, and starts its own workers when it first needs them. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.owner, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.start, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = 0;
    pool.round = 0;
    pool.job = NULL;
    pool.pending = 0;
}

static void pool_register_fork(void) {
    pthread_atfork(NULL, NULL, pool_after_fork);
}

/* Workers up to `want` (under pool.owner); returns how many there are. They block every
   signal, so signals keep going to the threads Python runs. */
static int pool_grow(int want) {
    pthread_once(&pool_once, pool_register_fork);
    if (pool.workers >= want) {
        return pool.workers;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (pool.workers < want) {
        pthread_t tid;
        pthread_mutex_lock(&pool.lock);
        int k = pool.workers + 1;
        pool.born[k] = pool.round;
        int failed = pthread_create(&tid, &attr, split_worker, (void *)(intptr_t)k);
        if (!failed) {
            pool.workers = k;
        }
        pthread_mutex_unlock(&pool.lock);
        if (failed) {
            break; /* fewer threads than asked: the rows still all run */
        }
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return pool.workers;
}
#endif

/* The rows on `threads` threads (the caller and the pool's workers), called with the GIL
   released; one thread when the pool is busy with another call, or for a few rows. */
static double split_shared(split_fn fn, const SplitSite *site, const float *x, const float *y,
                           uint16_t *h, float *norm, float *mean, Py_ssize_t n, int threads) {
#ifdef ACTDB_POOL
    if (threads > 1 && n >= 2 * (Py_ssize_t)threads && pthread_mutex_trylock(&pool.owner) == 0) {
        int of = 1 + pool_grow((threads < SPLIT_MAX_THREADS ? threads : SPLIT_MAX_THREADS) - 1);
        SplitJob job = {fn, site, x, y, h, norm, mean, n, of, {0}};
        pthread_mutex_lock(&pool.lock);
        pool.job = &job;
        pool.pending = of - 1;
        pool.round++;
        pthread_cond_broadcast(&pool.start);
        pthread_mutex_unlock(&pool.lock);
        split_part(&job, 0);
        pthread_mutex_lock(&pool.lock);
        while (pool.pending > 0) {
            pthread_cond_wait(&pool.done, &pool.lock);
        }
        pool.job = NULL;
        pthread_mutex_unlock(&pool.lock);
        pthread_mutex_unlock(&pool.owner);
        double worst = 0.0;
        for (int k = 0; k < of; k++) {
            worst = isnan(job.worst[k]) || job.worst[k] > worst ? job.worst[k] : worst;
        }
        return worst;
    }
#else
    (void)threads;
#endif
    return fn(site, x, y, h, norm, mean, n);
}

static PyObject *split_rows(PyObject *self, PyObject *args) {
    Py_buffer x, y, h, nrm, mean, gain, bias;
    Py_ssize_t d;
    int centered, portable = 0, threads = 1;
    double eps;
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*y*y*npd|pi", &x, &y, &h, &nrm, &mean, &gain, &bias,
                          &d, &centered, &eps, &portable, &threads)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer *all[] = {&x, &y, &h, &nrm, &mean, &gain, &bias};
    const char *names[] = {"x", "y", "h", "norm", "mean", "gain", "bias"};
    const Py_ssize_t items[] = {4, 4, 2, 4, 4, 4, 4};
    for (int k = 0; k < 7; k++) {
        if (!PyBuffer_IsContiguous(all[k], 'C') || all[k]->len % items[k] != 0) {
            PyErr_Format(PyExc_ValueError, "split_rows: %s is not a C-contiguous buffer of "
                         "%zd-byte items", names[k], items[k]);
            goto done;
        }
    }
    Py_ssize_t n = nrm.len / 4;
    if (d <= 0 || x.len / 4 % d != 0 || x.len / 4 / d != n || y.len != x.len ||
        h.len / 2 != x.len / 4 || mean.len != nrm.len ||
        (gain.len != 0 && gain.len / 4 != d) || (bias.len != 0 && bias.len / 4 != d)) {
        PyErr_Format(PyExc_ValueError, "split_rows: sizes disagree (x %zd values, y %zd, h %zd, "
                     "norm %zd, mean %zd, gain %zd, bias %zd, d %zd)", x.len / 4, y.len / 4,
                     h.len / 2, n, mean.len / 4, gain.len / 4, bias.len / 4, d);
        goto done;
    }
    SplitSite site = {gain.len ? (const float *)gain.buf : NULL,
                      bias.len ? (const float *)bias.buf : NULL, centered, eps, d};
    split_fn fn = portable ? split_portable : split_chosen;
    double worst;
    Py_BEGIN_ALLOW_THREADS
    worst = split_shared(fn, &site, (const float *)x.buf, (const float *)y.buf,
                         (uint16_t *)h.buf, (float *)nrm.buf, (float *)mean.buf, n, threads);
    Py_END_ALLOW_THREADS
    result = PyFloat_FromDouble(worst);
done:
    for (int k = 0; k < 7; k++) {
        PyBuffer_Release(all[k]);
    }
    return result;
}

static PyObject *split_pool(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
#ifdef ACTDB_POOL
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

/* -- vec handles: SipHash-2-4 over each handle's fields word ---------------------------------

   A query's `vec` handle is a 128-bit value: its fields (row, stream, view) in the high 64 bits
   and, in the low 64, SipHash-2-4 (Aumasson and Bernstein) of those fields as 8 little-endian
   bytes under the connection's 128-bit key (actdb/query/handles.py). Handles are made for every
   row a query reads and checked in every tensor function call, so both loops are here, with
   the GIL released; handles.py holds the same function in NumPy for a build without this
   module, and the tests check that the two agree with a byte-wise reference.

   handles_seal(key, fields, out): out[2i] = mac(fields[i]), out[2i + 1] = fields[i] (uint64).
   handles_open(key, words, fields) -> int: fields[i] = words[2i + 1] for each pair whose mac
   matches; the index of the first pair whose mac does not match, or -1. */

#define SIP_ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIP_ROUND                                                                              \
    do {                                                                                       \
        v0 += v1; v1 = SIP_ROTL(v1, 13); v1 ^= v0; v0 = SIP_ROTL(v0, 32);                      \
        v2 += v3; v3 = SIP_ROTL(v3, 16); v3 ^= v2;                                             \
        v0 += v3; v3 = SIP_ROTL(v3, 21); v3 ^= v0;                                             \
        v2 += v1; v1 = SIP_ROTL(v1, 17); v1 ^= v2; v2 = SIP_ROTL(v2, 32);                      \
    } while (0)

static inline uint64_t sip_word(uint64_t k0, uint64_t k1, uint64_t m) {
    uint64_t v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    const uint64_t b = (uint64_t)8 << 56; /* the message's length, 8 bytes, in the last block */
    v3 ^= m;
    SIP_ROUND; SIP_ROUND;
    v0 ^= m;
    v3 ^= b;
    SIP_ROUND; SIP_ROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIP_ROUND; SIP_ROUND; SIP_ROUND; SIP_ROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

static int sip_key(Py_buffer *key, uint64_t *k0, uint64_t *k1) {
    if (key->len != 16) {
        PyErr_SetString(PyExc_ValueError, "a handle key is 16 bytes");
        return -1;
    }
    memcpy(k0, key->buf, 8); /* little-endian machines only, as the float16 kernels */
    memcpy(k1, (const char *)key->buf + 8, 8);
    return 0;
}

static PyObject *handles_seal(PyObject *self, PyObject *args) {
    Py_buffer key, fields, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*", &key, &fields, &out)) {
        return NULL;
    }
    uint64_t k0, k1;
    PyObject *ret = NULL;
    Py_ssize_t n = fields.len / 8;
    if (sip_key(&key, &k0, &k1) == 0) {
        if (fields.len % 8 || out.len != 2 * fields.len) {
            PyErr_SetString(PyExc_ValueError, "handles_seal: out must hold 2 words a field");
        } else {
            const uint64_t *f = (const uint64_t *)fields.buf;
            uint64_t *o = (uint64_t *)out.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < n; i++) {
                uint64_t m;
                memcpy(&m, f + i, 8);
                o[2 * i] = sip_word(k0, k1, m);
                o[2 * i + 1] = m;
            }
            Py_END_ALLOW_THREADS
            ret = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&fields);
    PyBuffer_Release(&out);
    return ret;
}

static PyObject *handles_open(PyObject *self, PyObject *args) {
    Py_buffer key, words, fields;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*", &key, &words, &fields)) {
        return NULL;
    }
    uint64_t k0, k1;
    PyObject *ret = NULL;
    Py_ssize_t n = fields.len / 8, bad = -1;
    if (sip_key(&key, &k0, &k1) == 0) {
        if (fields.len % 8 || words.len != 2 * fields.len) {
            PyErr_SetString(PyExc_ValueError, "handles_open: words must hold 2 a field");
        } else {
            const unsigned char *w = (const unsigned char *)words.buf;
            uint64_t *f = (uint64_t *)fields.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < n; i++) {
                uint64_t mac, m;
                memcpy(&mac, w + 16 * i, 8);
                memcpy(&m, w + 16 * i + 8, 8);
                if (sip_word(k0, k1, m) != mac) {
                    bad = i;
                    break;
                }
                f[i] = m;
            }
            Py_END_ALLOW_THREADS
            ret = PyLong_FromSsize_t(bad);
        }
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&words);
    PyBuffer_Release(&fields);
    return ret;
}

#include "_native_vocab.c" /* vocab_scan: the vocabulary-wide lens functions' product */
#include "_native_rank.c"  /* rank_scan: token_rank's candidate pass in 16-bit integers */

static PyMethodDef methods[] = {
#ifdef ACTDB_VOCAB
    {"vocab_scan", vocab_scan, METH_VARARGS,
     "vocab_scan(a, b, nt, V, n, mode, threads, c, e, t0, above, band_n, band, m, s0, s1, s2, "
     "cross): rows against a vocabulary in bfloat16 (AVX-512 BF16), each 4 x 64 tile reduced in "
     "registers: mode 0 counts and lists tokens against a threshold band, modes 1-3 sum exp() "
     "for a log-sum-exp (and its moments, or a pair's cross term); see _native_vocab.c."},
    {"vocab_top", vocab_top, METH_VARARGS,
     "vocab_top(a, b, V, n, k, cap, threads, e, cand, cand_v, cand_n): the candidates for each row's k "
     "largest bfloat16 logits, for an exact rescore; see _native_vocab.c."},
    {"rank_scan", rank_scan, METH_VARARGS,
     "rank_scan(a, b, sw, nt, dt, bias, V, n, d, chunk, threads, xf, wf, tid, sx, ex, ey, c, "
     "above, band_n): token ranks from exact 16-bit integer products (AVX-512 VNNI) and a "
     "float64 band; see _native_rank.c."},
    {"rank_pack", rank_pack, METH_VARARGS,
     "rank_pack(w, out, sw, nt, dt, d, chunk) -> the largest sum p^2 of a run: a vocabulary as "
     "16-bit integers in rank_scan's panels, with each token's scale, norm and residual norm; "
     "see _native_rank.c."},
    {"vocab_pack", vocab_pack, METH_VARARGS,
     "vocab_pack(w, bias, out, nt, d) -> (max N, finite): a vocabulary split into bfloat16 "
     "pairs and laid out in vocab_scan's panels, with each token's norm; see _native_vocab.c."},
#endif
    {"split_pool", split_pool, METH_NOARGS,
     "split_pool() -> bool: whether split_rows(..., threads > 1) can share the rows among "
     "threads (a POSIX build); without it they run on the calling thread."},
    {"split_rows", split_rows, METH_VARARGS,
     "split_rows(x, y, h, norm, mean, gain, bias, d, centered, eps, portable=False, threads=1) "
     "-> worst: a norm input's rows (float32 [n, d]) to their float16 directions, norms and "
     "means, and the worst relative error of the output rebuilt from them against y; the GIL "
     "released, the rows shared among `threads` threads when threads > 1."},
    {"f16_dots", f16_dots, METH_VARARGS,
     "f16_dots(x, v, out, portable=False): out[i] = sum_j x[i, j] * v[j], x float16 [n, d] "
     "C-contiguous, v float32 [d], out float32 [n]; each row reduced on its own in a fixed "
     "order; the GIL released. portable=True runs the plain C path (tests)."},
    {"f16_dots_crc", f16_dots_crc, METH_VARARGS,
     "f16_dots_crc(x, v, out, rows, crcs) -> int: f16_dots's products with each chunk of "
     "`rows` rows checked against its CRC-32C crcs[c] in the same pass; the first chunk that "
     "fails, or -1; the GIL released. Where DOTS_CRC, for d a multiple of 64."},
    {"crc32c", py_crc32c, METH_VARARGS,
     "crc32c(data, path=None): the CRC-32C of a buffer's bytes, the GIL released; on the "
     "fastest path this CPU has (CRC_PATH), or on `path`, one of CRC_PATHS (tests)."},
    {"read_chunks", py_read_chunks, METH_VARARGS,
     "read_chunks(paths, buf, nbytes, crc, check[, crcs]): a run of chunk files read into `buf`, "
     "their sizes (None: missing; -1: right size, wrong CRC-32C) in a list."},
    {"handles_seal", handles_seal, METH_VARARGS,
     "handles_seal(key, fields, out): out[2i] = SipHash-2-4(key, fields[i]), out[2i + 1] = "
     "fields[i] (uint64 buffers), the GIL released."},
    {"handles_open", handles_open, METH_VARARGS,
     "handles_open(key, words, fields) -> int: fields[i] = words[2i + 1] where words[2i] is its "
     "SipHash-2-4; the first index where it is not, or -1; the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "actdb's compiled scan kernel (see _native.c).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
#ifdef ACTDB_X86
    __builtin_cpu_init();
    /* all three checked: a virtual machine may hide F16C while showing AVX2 and FMA */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        chosen = dots_avx2;
        chosen_name = "avx2";
        split_chosen = split_avx2;
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddStringConstant(m, "PATH", chosen_name) < 0 ||
                      crc_add_constants(m) < 0 ||
                      PyModule_AddObject(m, "DOTS_CRC", PyBool_FromLong(dots_crc_ok())) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
