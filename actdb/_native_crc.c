/* -- CRC-32C (Castagnoli), as Zarr's crc32c codec and the crc32c package compute it ----------

   Included by _native.c. Three paths, the fastest this CPU has chosen at import (crc_init):

   - "avx512": VPCLMULQDQ folding (the method of Gopal et al., "Fast CRC computation for
     generic polynomials using PCLMULQDQ", Intel, 2009) over four 512-bit accumulators, 256
     bytes a step; the 16 bytes left folded, and the buffer's last < 64 bytes, finished by the
     crc32 instruction. A full scan checks every byte it reads, and this path checks a chunk at
     several times the rate of the one below, so the check hides behind the read.
   - "sse4.2": three streams of the crc32 instruction over three consecutive blocks, joined by
     shifting the earlier streams' CRCs over the later blocks' lengths (a linear map over
     GF(2), tabulated at import). Mark Adler's method (crc32c.c, zlib licence).
   - "portable": a table a byte, for any CPU.

   tests/unit/test_native.py checks every path this CPU has against the crc32c package and a
   bitwise reference of its own.

   Folding, in the bit order of a reflected CRC (a byte's bit 0 its highest power of x): a
   64-bit little-endian word w stands for W(x) = sum_k w_k x^(63-k), and the carry-less product
   of two such words stands for W1(x) W2(x) x (one power above the product). A 16-byte lane
   whose first word is L and second H stands for L x^64 + H; moved D bits on, where the data's
   next lane lies, it is L x^(64+D) + H x^D, which modulo P is clmul(L, K(63+D)) ^
   clmul(H, K(D-1)) with K(n) the word for x^n mod P (degree < 32, so the product fits a
   lane). Congruent modulo P, the whole message keeps its CRC. The initial CRC is xored into
   the first four bytes (a CRC with initial value c is the zero-initialized CRC of the message
   whose first 32 bits are xored with c), and the folded 16 bytes are then a message of their
   own, in the place of everything before them, whose CRC the crc32 instruction finishes. */

#define CRC_POLY 0x82f63b78u        /* reflected */
#define CRC_POLY_NORMAL 0x1edc6f41u /* the same polynomial, x^31 in bit 31 */
#define CRC_LONG 8192
#define CRC_SHORT 256

static uint32_t crc_table[256];
static uint32_t crc_long[4][256], crc_short[4][256];

enum { CRC_PORTABLE = 0, CRC_SSE42 = 1, CRC_AVX512 = 2 };
static const char *const crc_names[] = {"portable", "sse4.2", "avx512"};
static int crc_best = CRC_PORTABLE; /* the fastest path this CPU has (crc_init) */

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) {
            sum ^= *mat;
        }
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) {
        square[n] = gf2_times(mat, mat[n]);
    }
}

/* The operator that appends `len` zero bytes to a CRC (len a power of two at least 1). */
static void crc_zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = CRC_POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four zero bits */
    /* odd: one zero byte's operator minus one squaring; square until len is consumed */
    do {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) {
            return;
        }
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof odd);
}

static void crc_zeros(uint32_t zeros[4][256], size_t len) {
    uint32_t op[32];
    crc_zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static uint32_t crc_shift(uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

static uint32_t crc32c_portable(const unsigned char *p, size_t len) {
    uint32_t crc = 0xffffffffu;
    while (len--) {
        crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    }
    return crc ^ 0xffffffffu;
}

#ifdef ACTDB_X86
/* The crc32 instruction over p[0:len], from the CRC register `crc0` (no final inversion). */
__attribute__((target("sse4.2")))
static uint64_t crc32c_sse42_run(uint64_t crc0, const unsigned char *next, size_t len) {
    uint64_t crc1, crc2;
    uint64_t word;
    while (len && ((uintptr_t)next & 7) != 0) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    for (size_t block = CRC_LONG; block >= CRC_SHORT; block = CRC_SHORT) {
        uint32_t (*zeros)[256] = block == CRC_LONG ? crc_long : crc_short;
        while (len >= 3 * block) {
            const unsigned char *end = next + block;
            crc1 = 0;
            crc2 = 0;
            do {
                memcpy(&word, next, 8);
                crc0 = _mm_crc32_u64(crc0, word);
                memcpy(&word, next + block, 8);
                crc1 = _mm_crc32_u64(crc1, word);
                memcpy(&word, next + 2 * block, 8);
                crc2 = _mm_crc32_u64(crc2, word);
                next += 8;
            } while (next < end);
            crc0 = crc_shift(zeros, (uint32_t)crc0) ^ crc1;
            crc0 = crc_shift(zeros, (uint32_t)crc0) ^ crc2;
            next += 2 * block;
            len -= 3 * block;
        }
        if (block == CRC_SHORT) {
            break;
        }
    }
    while (len >= 8) {
        memcpy(&word, next, 8);
        crc0 = _mm_crc32_u64(crc0, word);
        next += 8;
        len -= 8;
    }
    while (len) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    return crc0;
}

static uint32_t crc32c_sse42(const unsigned char *p, size_t len) {
    return (uint32_t)crc32c_sse42_run(0xffffffffu, p, len) ^ 0xffffffffu;
}

/* K(n) of the comment above: x^n mod P as a reflected 64-bit word (its degrees < 32 in the
   word's upper half), for the fold distances below. */
static uint64_t crc_fold_word(unsigned n) {
    uint32_t r = 1; /* x^0, x^31 in bit 31 */
    while (n--) {
        r = (r & 0x80000000u) ? (r << 1) ^ CRC_POLY_NORMAL : r << 1;
    }
    uint32_t reflected = 0;
    for (int k = 0; k < 32; k++) {
        reflected |= ((r >> k) & 1u) << (31 - k);
    }
    return (uint64_t)reflected << 32;
}

/* Per fold distance D bits, the words for a lane's first word (x^(63+D)) and second (x^(D-1)). */
/* D = 2048 (four accumulators 256 bytes on), 512 (64 bytes), 1024 (two, 128 bytes on) */
static uint64_t crc_fold[3][2];
static uint64_t crc_fold_lane[3][2]; /* a lane D = 384, 256, 128 bits before the last */

#define CRC_AVX512_TARGET "sse4.2,pclmul,avx512f,avx512dq,vpclmulqdq"
/* A block of the mixed loop: CRC_MIX_FOLD bytes folded while three crc32 streams take the
   CRC_LONG bytes each that follow them, in the proportion that has both finish together. */
#define CRC_MIX_FOLD (64 * 1024)
#define CRC_MIX_BLOCK (CRC_MIX_FOLD + 3 * CRC_LONG)

__attribute__((target(CRC_AVX512_TARGET)))
static inline __m512i crc_fold512(__m512i x, __m512i k, __m512i next) {
    /* 0x96: a ^ b ^ c */
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), next, 0x96);
}

__attribute__((target(CRC_AVX512_TARGET)))
static inline __m128i crc_fold128(__m128i x, const uint64_t k[2], __m128i next) {
    __m128i kk = _mm_set_epi64x((long long)k[1], (long long)k[0]);
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, kk, 0x00),
                                       _mm_clmulepi64_si128(x, kk, 0x11)), next);
}

__attribute__((target(CRC_AVX512_TARGET)))
static inline __m512i crc_k512(const uint64_t k[2]) {
    return _mm512_set_epi64((long long)k[1], (long long)k[0], (long long)k[1], (long long)k[0],
                            (long long)k[1], (long long)k[0], (long long)k[1], (long long)k[0]);
}

/* The first 256 bytes at p, the CRC register `crc` xored into their first 32 bits. */
__attribute__((target(CRC_AVX512_TARGET)))
static inline void crc_fold_start(__m512i x[4], uint64_t crc, const unsigned char *p) {
    x[0] = _mm512_xor_si512(_mm512_loadu_si512((const void *)p),
                            _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)(uint32_t)crc)));
    x[1] = _mm512_loadu_si512((const void *)(p + 64));
    x[2] = _mm512_loadu_si512((const void *)(p + 128));
    x[3] = _mm512_loadu_si512((const void *)(p + 192));
}

/* The four accumulators moved on by the next 256 bytes at p. */
__attribute__((target(CRC_AVX512_TARGET)))
static inline void crc_fold_step(__m512i x[4], __m512i k4, const unsigned char *p) {
    x[0] = crc_fold512(x[0], k4, _mm512_loadu_si512((const void *)p));
    x[1] = crc_fold512(x[1], k4, _mm512_loadu_si512((const void *)(p + 64)));
    x[2] = crc_fold512(x[2], k4, _mm512_loadu_si512((const void *)(p + 128)));
    x[3] = crc_fold512(x[3], k4, _mm512_loadu_si512((const void *)(p + 192)));
}

/* The accumulators, then the `len` (< 256, a multiple of 64) bytes at p, down to the CRC
   register of everything they stand for: one accumulator, one lane, then the crc32
   instruction over those 16 bytes from zero. */
__attribute__((target(CRC_AVX512_TARGET)))
static uint64_t crc_fold_end(__m512i x[4], const unsigned char *p, size_t len) {
    const __m512i k1 = crc_k512(crc_fold[1]);
    __m512i y = crc_fold512(x[0], k1, x[1]);
    y = crc_fold512(y, k1, x[2]);
    y = crc_fold512(y, k1, x[3]);
    for (; len; len -= 64, p += 64) {
        y = crc_fold512(y, k1, _mm512_loadu_si512((const void *)p));
    }
    __m128i acc = _mm512_extracti64x2_epi64(y, 3);
    acc = crc_fold128(_mm512_extracti64x2_epi64(y, 0), crc_fold_lane[0], acc);
    acc = crc_fold128(_mm512_extracti64x2_epi64(y, 1), crc_fold_lane[1], acc);
    acc = crc_fold128(_mm512_extracti64x2_epi64(y, 2), crc_fold_lane[2], acc);
    uint64_t crc = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(acc));
    return _mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(acc, 1));
}

/* One block of CRC_MIX_BLOCK bytes from the CRC register `crc`: its first CRC_MIX_FOLD
   folded by the vector unit while the crc32 instruction, on another port, takes the three
   CRC_LONG blocks after them (Adler's three streams), joined as crc32c_sse42_run joins them.
   Both at once check a chunk in cache about 1.4 times as fast as folding alone. */
__attribute__((target(CRC_AVX512_TARGET)))
static uint64_t crc_mix_block(uint64_t crc, const unsigned char *p) {
    const __m512i k4 = crc_k512(crc_fold[0]);
    const unsigned char *s = p + CRC_MIX_FOLD;
    uint64_t c0 = 0, c1 = 0, c2 = 0, w0, w1, w2;
    __m512i x[4];
    crc_fold_start(x, crc, p);
    /* per step 256 bytes folded and 4 words of each stream: CRC_MIX_FOLD / 256 steps take
       CRC_MIX_FOLD / 64 = CRC_LONG / 8 words a stream */
    for (const unsigned char *a = p + 256;; a += 256) {
        for (int w = 0; w < 4; w++, s += 8) {
            memcpy(&w0, s, 8);
            memcpy(&w1, s + CRC_LONG, 8);
            memcpy(&w2, s + 2 * CRC_LONG, 8);
            c0 = _mm_crc32_u64(c0, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
        }
        if (a == p + CRC_MIX_FOLD) {
            break;
        }
        crc_fold_step(x, k4, a);
    }
    crc = crc_fold_end(x, NULL, 0);
    crc = crc_shift(crc_long, (uint32_t)crc) ^ c0;
    crc = crc_shift(crc_long, (uint32_t)crc) ^ c1;
    return crc_shift(crc_long, (uint32_t)crc) ^ c2;
}

__attribute__((target(CRC_AVX512_TARGET)))
static uint32_t crc32c_avx512(const unsigned char *p, size_t len) {
    uint64_t crc = 0xffffffffu;
    for (; len >= CRC_MIX_BLOCK; p += CRC_MIX_BLOCK, len -= CRC_MIX_BLOCK) {
        crc = crc_mix_block(crc, p);
    }
    if (len >= 256) { /* folded, and the last < 64 bytes through the crc32 instruction */
        const __m512i k4 = crc_k512(crc_fold[0]);
        __m512i x[4];
        crc_fold_start(x, crc, p);
        size_t body = len & ~(size_t)63;
        const unsigned char *a = p + 256;
        for (; a + 256 <= p + body; a += 256) {
            crc_fold_step(x, k4, a);
        }
        crc = crc_fold_end(x, a, (size_t)(p + body - a));
        p += body;
        len -= body;
    }
    return (uint32_t)crc32c_sse42_run(crc, p, len) ^ 0xffffffffu;
}

/* -- The full scan's product and its chunks' checksums in one pass ---------------------------

   dots_crc_avx512(x, v, out, n, d, rows, stored): dots_avx2's products (its DOTS_STEP and
   finish256, _native.c: the same operations in the same order, so the same bits), while the
   same 64-byte loads, already in the core's first-level cache, are folded into each chunk's
   CRC-32C (`rows` rows a chunk) by two 512-bit accumulators, 128 bytes on from each other.
   The products wait on their multiply-adds' latency, and the folds fill the vector unit's
   idle slots: the check costs a fraction of a separate pass over the chunk. d a multiple of
   64 (whole 128-byte steps a row), n a multiple of rows. The first chunk whose CRC-32C is
   not stored[c], or -1. */

__attribute__((target("avx2,fma,f16c," CRC_AVX512_TARGET)))
static Py_ssize_t dots_crc_avx512(const uint16_t *x, const float *v, float *out, Py_ssize_t n,
                                  Py_ssize_t d, Py_ssize_t rows, const uint32_t *stored) {
    const __m512i k2 = crc_k512(crc_fold[2]);
    for (Py_ssize_t c = 0; c * rows < n; c++) {
        /* the initial CRC, all ones, into the chunk's first 32 bits, at its first step */
        __m512i y0 = _mm512_zextsi128_si512(_mm_cvtsi32_si128(-1));
        __m512i y1 = _mm512_setzero_si512();
        int started = 0;
        for (Py_ssize_t i = c * rows; i < (c + 1) * rows; i++) {
            const uint16_t *row = x + i * d;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (Py_ssize_t j = 0; j < d; j += 64) {
                __m512i b0 = _mm512_loadu_si512((const void *)(row + j));
                __m512i b1 = _mm512_loadu_si512((const void *)(row + j + 32));
                if (started) {
                    y0 = crc_fold512(y0, k2, b0);
                    y1 = crc_fold512(y1, k2, b1);
                } else {
                    y0 = _mm512_xor_si512(y0, b0);
                    y1 = b1;
                    started = 1;
                }
                DOTS_STEP(j);
                DOTS_STEP(j + 32);
            }
            out[i] = finish256(a0, a1, a2, a3, row, v, d, d);
        }
        /* y0 moved on by 64 bytes onto y1 (crc_fold_end's first step, the others zero) */
        __m512i zero = _mm512_setzero_si512();
        __m512i x4[4] = {zero, zero, y0, y1};
        if ((uint32_t)crc_fold_end(x4, NULL, 0) != ~stored[c]) {
            return c;
        }
    }
    return -1;
}
#endif

static int crc_has(int path) {
    return path >= CRC_PORTABLE && path <= crc_best;
}

static uint32_t crc32c_on(const unsigned char *p, size_t len, int path) {
#ifdef ACTDB_X86
    if (path == CRC_AVX512) {
        return crc32c_avx512(p, len);
    }
    if (path == CRC_SSE42) {
        return crc32c_sse42(p, len);
    }
#endif
    return crc32c_portable(p, len);
}

/* The CRC-32C of p[0:len] on the fastest path this CPU has. */
static uint32_t crc32c_of(const unsigned char *p, size_t len) {
    return crc32c_on(p, len, crc_best);
}

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) {
            c = c & 1 ? (c >> 1) ^ CRC_POLY : c >> 1;
        }
        crc_table[n] = c;
    }
    crc_zeros(crc_long, CRC_LONG);
    crc_zeros(crc_short, CRC_SHORT);
#ifdef ACTDB_X86
    static const unsigned distances[3] = {2048, 512, 1024}; /* bits */
    for (int i = 0; i < 3; i++) {
        crc_fold[i][0] = crc_fold_word(63 + distances[i]);
        crc_fold[i][1] = crc_fold_word(distances[i] - 1);
    }
    for (int i = 0; i < 3; i++) {
        unsigned d = 128 * (unsigned)(3 - i);
        crc_fold_lane[i][0] = crc_fold_word(63 + d);
        crc_fold_lane[i][1] = crc_fold_word(d - 1);
    }
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        crc_best = CRC_SSE42;
        /* __builtin_cpu_supports("avx512f") also asks the OS (XCR0) whether it keeps the
           512-bit registers */
        if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("avx512f") &&
            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("vpclmulqdq")) {
            crc_best = CRC_AVX512;
        }
    }
#endif
}

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer b;
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "y*|z", &b, &name)) {
        return NULL;
    }
    int path = crc_best;
    if (name != NULL) {
        path = -1;
        for (int i = CRC_PORTABLE; i <= CRC_AVX512; i++) {
            if (strcmp(name, crc_names[i]) == 0) {
                path = i;
            }
        }
        if (!crc_has(path)) {
            PyErr_Format(PyExc_ValueError, "crc32c: no path %R on this CPU (CRC_PATHS)",
                         PyTuple_GET_ITEM(args, 1));
            PyBuffer_Release(&b);
            return NULL;
        }
    }
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = crc32c_on((const unsigned char *)b.buf, (size_t)b.len, path);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(crc);
}

/* CRC_PATHS: the paths this CPU has, the fastest (CRC_PATH) last. */
static int crc_add_constants(PyObject *m) {
    PyObject *paths = PyTuple_New(crc_best + 1);
    if (paths == NULL) {
        return -1;
    }
    for (int i = 0; i <= crc_best; i++) {
        PyObject *s = PyUnicode_FromString(crc_names[i]);
        if (s == NULL) {
            Py_DECREF(paths);
            return -1;
        }
        PyTuple_SET_ITEM(paths, i, s);
    }
    if (PyModule_AddObject(m, "CRC_PATHS", paths) < 0) {
        Py_DECREF(paths);
        return -1;
    }
    return PyModule_AddStringConstant(m, "CRC_PATH", crc_names[crc_best]);
}
