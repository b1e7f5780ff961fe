/* streamer's CPU kernels: the decoder stack of a Llama-family model over a packed step.
 *
 * A step is N new tokens of several sequences (sessions, questions, flash forks), each written
 * into its own KV cache and attending over read-only ranges of other caches plus its own
 * cache, causally. One call runs every layer for all N rows:
 *
 *   RMSNorm -> q|k|v (one weight matrix) -> rotary embedding, K/V written at the sequence's
 *   slots -> attention (split over key chunks, merged by log-sum-exp in a fixed order) ->
 *   o (added to the residual) -> RMSNorm -> gate|up (one matrix) -> SiLU(gate) * up -> down
 *   (added to the residual)
 *
 * Linear layers are weight-only quantized, as llama.cpp runs them: per block of 32 weights a
 * scale d and an offset m (fp16), codes of 4 bits (Q4_1: w = d q + m) or 8 bits (Q8_0 stored
 * as q + 128 with m = -128 d); activations are quantized per block of 32 to int8 (scale
 * amax / 127), and the dot product of a block is exact in integers:
 *     sum_j w_j x_j = d_w d_x sum_j q_j qx_j + m_w (d_x sum_j qx_j).
 *
 * Determinism: every output row is computed by the same sequence of floating-point operations
 * whatever other rows share the step, whatever the thread count and whichever thread runs it
 * (work is split over output columns, attention key chunks of a fixed size and rows; a key
 * chunk's partial softmax is merged into a row's state in one fixed order). So a token reads
 * bit for bit the same alone or batched, and a replayed session equals the original.
 *
 * Built at first use by kernels/cpu.py (gcc -O3 -march=native); AVX-512 VNNI where the CPU
 * has it (and AMX tiles for the GEMM's rows 16 at a time where it also has those), AVX2,
 * portable C elsewhere.
 *
 * State: a caller's buffers and step timings live in an sk_ctx it creates (sk_ctx_new) and
 * passes to every call. The one process-wide state is the thread pool (POOL, its workers'
 * start generations, api_lock and the fork handler): threads belong to the process, and every
 * caller shares one pool so that two engines never run twice the cores' threads; api_lock
 * makes the callers take turns on it.
 *
 * ABI: kernels/cpu.py declares these structures with ctypes; sk_abi_version and the
 * sk_sizeof_* / block-size getters below let it check, at load, that both sides agree.
 * Calls return SK_OK or one of the SK_E* codes.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SK_AVX512 1
#include <immintrin.h>
#else
#define SK_AVX512 0
#endif
#if !SK_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SK_AVX2 1 /* most laptops: 8-lane vectors, vpmaddubsw for the integer dot products */
#else
#define SK_AVX2 0
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif
#if SK_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SK_AMX 1 /* the compiler targets AMX (Sapphire Rapids and later); used when the kernel allows it */
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SK_AMX 0
#endif

/* Which code path this build has: 2 AVX-512 VNNI, 1 AVX2 (+FMA, F16C), 0 portable C. */
int sk_simd(void) { return SK_AVX512 ? 2 : (SK_AVX2 ? 1 : 0); }

#define QB 32           /* weights per quantization block */
#define CHUNK 1024      /* keys per attention chunk (fixed: a row's result never depends on the batch) */
#define SPLIT_ROWS 8    /* sequences with at most this many new rows split their own keys over tasks */
#define ROW_TILE 16     /* rows per attention task of a longer sequence */
#define MAX_THREADS 64
#define ALIGN 64

#define SK_ABI_VERSION 2 /* bump when a structure, a signature or a code below changes */
enum {
    SK_OK = 0,
    SK_ENOMEM = -1,       /* a buffer could not be allocated */
    SK_EINVAL = -2,       /* a bad argument: no rows, a width not in blocks of 32, heads not a multiple of kv heads */
    SK_EUNSUPPORTED = -3, /* a valid request beyond what the kernels take (query heads per kv head, ranges) */
    SK_EPLAN = -4,        /* an inconsistent plan: a sequence's rows or group out of range */
};

int sk_abi_version(void) { return SK_ABI_VERSION; }

/* ---- fp16 ------------------------------------------------------------------------------ */

static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        if (m == 0) { bits = s; }
        else { /* subnormal */
            e = 127 - 15 + 1;
            while (!(m & 0x400)) { m <<= 1; e--; }
            bits = s | (e << 23) | ((m & 0x3ff) << 13);
        }
    } else if (e == 31) {
        bits = s | 0x7f800000u | (m << 13);
    } else {
        bits = s | ((e + 127 - 15) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t f2h(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    int32_t e = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t m = x & 0x7fffffu;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u : 0));
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        m |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e), half = 1u << (shift - 1);
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = m >> 13, rem = m & 0x1fffu;
    uint32_t out = sign | ((uint32_t)e << 10) | r;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) out++;
    return (uint16_t)out;
#endif
}

/* ---- the thread pool ----------------------------------------------------------------------
 * Workers spin briefly for the next job (steps come back to back while a session decodes),
 * then sleep on a condition variable. Inside a job, phases are separated by a spin barrier
 * that yields the CPU when a peer is descheduled. */

typedef void (*job_fn)(void *ctx, int tid, int nth);

static struct {
    int nth;                      /* threads in a job, the caller included */
    int started;                  /* worker threads alive */
    pthread_t threads[MAX_THREADS];
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_uint generation;
    atomic_int pending;           /* workers still running the current job */
    atomic_int sleeping;
    job_fn fn;
    void *ctx;
    /* barrier */
    atomic_int arrived;
    atomic_uint phase;
} POOL = {.nth = 1, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#define SPIN_ROUNDS 20000

static unsigned start_generation[MAX_THREADS]; /* the generation a worker was created at: it runs every later job */

static void *worker_main(void *arg) {
    int tid = (int)(intptr_t)arg;
    unsigned seen = start_generation[tid];
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&POOL.generation, memory_order_acquire)) == seen) {
            if (++spins < SPIN_ROUNDS) { cpu_relax(); continue; }
            pthread_mutex_lock(&POOL.lock);
            atomic_fetch_add(&POOL.sleeping, 1);
            while ((g = atomic_load(&POOL.generation)) == seen) pthread_cond_wait(&POOL.wake, &POOL.lock);
            atomic_fetch_sub(&POOL.sleeping, 1);
            pthread_mutex_unlock(&POOL.lock);
            break;
        }
        seen = g;
        if (POOL.fn == NULL) return NULL; /* shutdown */
        if (tid < POOL.nth) POOL.fn(POOL.ctx, tid, POOL.nth);
        atomic_fetch_sub_explicit(&POOL.pending, 1, memory_order_release);
    }
}

/* One caller at a time: engines in one process share the pool and the workspace. */
static pthread_mutex_t api_lock = PTHREAD_MUTEX_INITIALIZER;

/* A forked child has none of the parent's worker threads: it starts over with none. */
static void child_after_fork(void) {
    POOL.started = 0;
    POOL.nth = 1;
    pthread_mutex_init(&POOL.lock, NULL);
    pthread_cond_init(&POOL.wake, NULL);
    pthread_mutex_init(&api_lock, NULL);
    atomic_store(&POOL.sleeping, 0);
}

static pthread_once_t fork_handler = PTHREAD_ONCE_INIT;

static void install_fork_handler(void) { pthread_atfork(NULL, NULL, child_after_fork); }

int sk_set_threads(int n) {
    pthread_once(&fork_handler, install_fork_handler);
    pthread_mutex_lock(&api_lock);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (POOL.started < n - 1) {
        int tid = POOL.started + 1;
        start_generation[tid] = atomic_load(&POOL.generation);
        if (pthread_create(&POOL.threads[POOL.started], NULL, worker_main, (void *)(intptr_t)tid) != 0) break;
        pthread_detach(POOL.threads[POOL.started]);
        POOL.started++;
    }
    POOL.nth = n <= POOL.started + 1 ? n : POOL.started + 1;
    pthread_mutex_unlock(&api_lock);
    return POOL.nth;
}

int sk_threads(void) { return POOL.nth; }

static void run_job(job_fn fn, void *ctx) {
    if (POOL.nth <= 1 || POOL.started == 0) {
        fn(ctx, 0, 1);
        return;
    }
    POOL.fn = fn;
    POOL.ctx = ctx;
    atomic_store(&POOL.arrived, 0);
    atomic_store(&POOL.pending, POOL.started);
    pthread_mutex_lock(&POOL.lock);
    atomic_fetch_add_explicit(&POOL.generation, 1, memory_order_release);
    if (atomic_load(&POOL.sleeping) > 0) pthread_cond_broadcast(&POOL.wake);
    pthread_mutex_unlock(&POOL.lock);
    fn(ctx, 0, POOL.nth);
    int spins = 0;
    while (atomic_load_explicit(&POOL.pending, memory_order_acquire) > 0) {
        if (++spins > 1000) sched_yield(); else cpu_relax();
    }
}

static void barrier(int nth) {
    if (nth <= 1) return;
    unsigned phase = atomic_load_explicit(&POOL.phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&POOL.arrived, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&POOL.arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&POOL.phase, 1, memory_order_release);
        return;
    }
    int spins = 0;
    while (atomic_load_explicit(&POOL.phase, memory_order_acquire) == phase) {
        if (++spins > 2000) sched_yield(); else cpu_relax();
    }
}

static inline void split(int total, int tid, int nth, int *lo, int *hi) {
    *lo = (int)((int64_t)total * tid / nth);
    *hi = (int)((int64_t)total * (tid + 1) / nth);
}

/* ---- quantized matrices ------------------------------------------------------------------
 * Output columns go in groups of 16 (the last group padded with zero columns), each group a
 * run of blocks of 32 inputs. In a block, the 16 columns' codes are interleaved so that 32-bit
 * lane l of a vector holds 4 consecutive codes of column l: one integer multiply-add
 * (vpdpbusd) against 4 activation codes broadcast to every lane advances all 16 columns, and
 * each column's sum stays in its own lane (no horizontal reduction; the scales multiply 16
 * columns at once). A 4-bit block is 256 bytes of codes (byte 4 l + t of chunk c, c < 4: the
 * code of column l at input 4 c + t in the low nibble, at 16 + 4 c + t in the high one), then
 * the 16 scales d and the 16 offsets m (fp16): 320 bytes, Q4_1's 5 bits a weight. An 8-bit
 * block is 512 bytes of codes (chunk c < 8: inputs 4 c .. 4 c + 3; stored q + 128), then 16
 * scales: Q8_0's 8.5 bits a weight, no offsets. */

#define COLS 16 /* columns per group */
/* Weights a tile asks the memory for ahead of the block it reads (bytes; a thread's groups lie
 * one after another, so this runs ahead through its share of the matrix). The hardware prefetcher
 * alone kept a 2-core Zen 5 at ~42 GB/s on a cold 1.1 MB matrix read by one row; 8 KB ahead made
 * it 67 GB/s (1.6x; 1.4-1.8x for 2-24 rows) and a decode step 11-24% faster (bench/decode.py).
 * A prefetch never faults, so reading ahead past the matrix's end is harmless. */
#define PREFETCH_AHEAD 8192

/* Ask for the line `ahead` bytes past p (prefetcht0; integer arithmetic: the address may lie past
 * the matrix or the cache it reads). */
static inline void prefetch_at(const void *p, int64_t ahead) {
    __builtin_prefetch((const void *)((uintptr_t)p + ahead), 0, 3);
}

/* The same into L2 only (prefetcht1): for bytes needed later than the next few microseconds. */
static inline void prefetch_l2(const void *p, int64_t ahead) {
    __builtin_prefetch((const void *)((uintptr_t)p + ahead), 0, 2);
}

/* The same, non-temporal (prefetchnta): for bytes read once, kept out of the caches' longer life. */
static inline void prefetch_nta(const void *p, int64_t ahead) {
    __builtin_prefetch((const void *)((uintptr_t)p + ahead), 0, 0);
}

/* Ask for the bytes PREFETCH_AHEAD past a block of `bb` bytes at u (the block read later); `once`:
 * the call reads these weights once (a step of a few rows), so they are asked for as non-temporal
 * (prefetchnta): they pass through L1 without displacing what the caches hold for the rest of the
 * step and the next one (a session's K/V, the activations, the Python that runs between steps).
 * A 512-context decode step 2.5% faster on a 2-core Zen 4 (in-process A/B, 9 of 10 rounds faster),
 * 4K the same. Only on AMD (weights_once_nta): on a Sapphire Rapids-class Xeon the same hint made
 * decode 1.75x slower (9.6 against 5.5 ms a token at 512, 12.0 against 7.2 at 4K), its lines
 * skipping the L2 whose streamer would have fetched ahead of them. A step of many rows passes over
 * a thread's columns once per row block and wants them kept in L2. */
static atomic_int nta_state; /* 0 not known yet, 1 AMD, -1 any other */

/* Whether a GEMM that reads its weights once asks for them non-temporal (above): on AMD only. */
static int weights_once_nta(void) {
    int st = atomic_load_explicit(&nta_state, memory_order_relaxed);
    if (st == 0) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_cpu_init();
        st = __builtin_cpu_is("amd") ? 1 : -1;
#else
        st = -1;
#endif
        atomic_store_explicit(&nta_state, st, memory_order_relaxed);
    }
    return st > 0;
}

static inline void prefetch_ahead(const uint8_t *u, int bb, int once) {
    for (int l = 0; l < bb; l += 64) {
        if (once) prefetch_nta(u + l, PREFETCH_AHEAD);
        else prefetch_at(u + l, PREFETCH_AHEAD);
    }
}

#if SK_AVX512
#define MR 12 /* GEMM micro-tile: rows (a block's unpacked weights serve them all from registers; 12 x 16
                 columns measured ~20% faster than 4 on a 2-core Zen 4) */
#else
#define MR 4
#endif

typedef struct {
    int32_t bits, n, k, pad;
    int64_t group_bytes; /* one group of 16 columns: k / 32 blocks */
    const uint8_t *data;
    const float *bias; /* [n] or NULL */
} sk_qmat;

static inline int block_bytes(int bits) { return bits == 8 ? 512 + 32 : 256 + 64; }

int sk_block_bytes(int bits) { return block_bytes(bits); }
int sk_quant_block(void) { return QB; }
int sk_matrix_cols(void) { return COLS; }

int64_t sk_group_bytes(int bits, int k) { return (int64_t)(k / QB) * block_bytes(bits); }

int64_t sk_matrix_bytes(int bits, int n, int k) { return (int64_t)((n + COLS - 1) / COLS) * sk_group_bytes(bits, k); }

/* Pack codes (uint8 [n, k]: 0..15, or q + 128 for 8 bits), scales and offsets (fp16 bits
 * [n, k/32]; offsets ignored for 8 bits) into the layout above (sk_matrix_bytes bytes). */
void sk_pack(int bits, int n, int k, const uint8_t *codes, const uint16_t *d, const uint16_t *m, uint8_t *out) {
    int nb = k / QB, groups = (n + COLS - 1) / COLS, bb = block_bytes(bits);
    memset(out, 0, (size_t)sk_matrix_bytes(bits, n, k));
    for (int g = 0; g < groups; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *u = out + ((int64_t)g * nb + b) * bb;
            int cb = bits == 8 ? 512 : 256;
            for (int l = 0; l < COLS && g * COLS + l < n; l++) {
                int col = g * COLS + l;
                const uint8_t *c = codes + (int64_t)col * k + b * QB;
                for (int j = 0; j < QB; j++) {
                    if (bits == 8) {
                        u[(j / 4) * 64 + l * 4 + j % 4] = c[j];
                    } else {
                        int chunk = (j % 16) / 4, t = j % 4;
                        u[chunk * 64 + l * 4 + t] |= (uint8_t)((c[j] & 15) << (j < 16 ? 0 : 4));
                    }
                }
                memcpy(u + cb + 2 * l, d + (int64_t)col * nb + b, 2);
                if (bits == 4) memcpy(u + cb + 32 + 2 * l, m + (int64_t)col * nb + b, 2);
            }
        }
}

/* Activations quantized per block of 32: codes (scale d = amax / 127), and per block
 * s = d * sum(codes) (what a 4-bit block's offset multiplies) and c = -128 * sum(codes) (an
 * 8-bit weight is stored as q + 128: an integer sum started at c removes the 128). */
typedef struct {
    int k;
    int8_t *q;
    float *d, *s;
    int32_t *c;
} act_t;

static inline int8_t *act_q(const act_t *a, int r) { return a->q + (int64_t)r * a->k; }
static inline float *act_d(const act_t *a, int r) { return a->d + (int64_t)r * (a->k / QB); }
static inline float *act_s(const act_t *a, int r) { return a->s + (int64_t)r * (a->k / QB); }
static inline int32_t *act_c(const act_t *a, int r) { return a->c + (int64_t)r * (a->k / QB); }

static inline size_t round_up(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

static size_t act_bytes(int k, int rows) {
    size_t nb = (size_t)rows * (k / QB);
    return round_up((size_t)rows * k) + 3 * round_up(nb * 4);
}

/* Lay an activation buffer for `rows` rows of width k out at `base` (act_bytes(k, rows) bytes). */
static void act_place(act_t *a, int k, int rows, char *base) {
    size_t nb = (size_t)rows * (k / QB), off = 0;
    a->k = k;
    a->q = (int8_t *)(base + off); off += round_up((size_t)rows * k);
    a->d = (float *)(base + off); off += round_up(nb * 4);
    a->s = (float *)(base + off); off += round_up(nb * 4);
    a->c = (int32_t *)(base + off);
}

/* ---- reductions across lanes ---------------------------------------------------------------- */

#if SK_AVX512
/* The sums of four vectors, one per lane of the result. */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m256 y0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    __m256 y1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    __m256 y2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
    __m256 y3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(y0, y1), _mm256_hadd_ps(y2, y3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

enum { R16_ADD, R16_MAX, R16_ADD_EPI32 };

static inline __m512 r16_op(__m512 a, __m512 b, const int op) {
    if (op == R16_MAX) return _mm512_max_ps(a, b);
    if (op == R16_ADD_EPI32) return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    return _mm512_add_ps(a, b);
}

/* reduce4 for 16 vectors at once: lane i of the result is the sum of x[i], pairing the lanes
 * exactly as reduce4 does (y_l = v_l + v_(l+8), then adjacent pairs, twice, then the halves), so
 * every sum is bit for bit reduce4's; 45 operations for 16 sums where reduce4 takes ~19 for 4.
 * `op`: the sums (R16_ADD), or the same tree with a max of floats or a sum of int32 lanes. */
static inline __m512 reduce16_op(const __m512 *x, const int op) {
    static const int order[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15}; /* lane of A_k below */
    __m512 y[8], z[4], w[2];
    for (int m = 0; m < 8; m++) {
        __m512 a = x[order[2 * m]], b = x[order[2 * m + 1]];
        y[m] = r16_op(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE), op);
    }
    for (int m = 0; m < 4; m++)
        z[m] = r16_op(_mm512_shuffle_ps(y[2 * m], y[2 * m + 1], 0x88), _mm512_shuffle_ps(y[2 * m], y[2 * m + 1], 0xDD), op);
    for (int m = 0; m < 2; m++)
        w[m] = r16_op(_mm512_shuffle_ps(z[2 * m], z[2 * m + 1], 0x88), _mm512_shuffle_ps(z[2 * m], z[2 * m + 1], 0xDD), op);
    return r16_op(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD), op);
}

static inline __m512 reduce16(const __m512 *x) { return reduce16_op(x, R16_ADD); }

/* The sum of a vector's 16 lanes in reduce4's order: with y_i = v_i + v_(i+8),
 * ((y0 + y1) + (y2 + y3)) + ((y4 + y5) + (y6 + y7)). */
static inline float sum16(__m512 v) {
    __m512 z = _mm512_setzero_ps();
    return _mm_cvtss_f32(reduce4(v, z, z, z));
}

/* quantize_row's blocks 16 at a time, a block in each lane where one block alone reduces across
 * its own lanes: the largest magnitudes and the codes' sums by reduce16_op's tree (a max of
 * numbers and an integer sum: the same in any order; with a NaN input the maximum may differ
 * from a block alone's, a row's own either way), one division for 16 inverse scales and one for
 * 16 scales, so every code and scale of finite inputs is a block alone's. On a Sapphire
 * Rapids-class Xeon a row of 576 inputs ~130 -> ~70 ns, of 1,536 ~350 -> ~170 (a 512-token
 * ingest 1.014x, in-process A/B). */
static inline void quantize16(const float *x, int8_t *q, float *d, float *s, int32_t *c) {
    __m512 m[16], sums[16];
    for (int i = 0; i < 16; i++)
        m[i] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i * QB)), _mm512_abs_ps(_mm512_loadu_ps(x + i * QB + 16)));
    __m512 amax = reduce16_op(m, R16_MAX);
    __mmask16 positive = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    float id[16];
    _mm512_storeu_ps(id, _mm512_maskz_div_ps(positive, _mm512_set1_ps(127.0f), amax));
    for (int i = 0; i < 16; i++) {
        __m512 vid = _mm512_set1_ps(id[i]);
        __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i * QB), vid));
        __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i * QB + 16), vid));
        _mm_storeu_si128((__m128i *)(q + i * QB), _mm512_cvtsepi32_epi8(ql));
        _mm_storeu_si128((__m128i *)(q + i * QB + 16), _mm512_cvtsepi32_epi8(qh));
        sums[i] = _mm512_castsi512_ps(_mm512_add_epi32(ql, qh));
    }
    __m512i sum = _mm512_castps_si512(reduce16_op(sums, R16_ADD_EPI32));
    __m512 scale = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
    _mm512_storeu_ps(d, scale);
    _mm512_storeu_ps(s, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(sum)));
    _mm512_storeu_si512((void *)c, _mm512_mullo_epi32(_mm512_set1_epi32(-128), sum));
}
#endif

static void quantize_row(const float *x, const act_t *a, int r) {
    int k = a->k, nb = k / QB, b = 0;
    int8_t *q = act_q(a, r);
    float *d = act_d(a, r), *s = act_s(a, r);
    int32_t *c = act_c(a, r);
#if SK_AVX512
    for (; b + 16 <= nb; b += 16) quantize16(x + b * QB, q + b * QB, d + b, s + b, c + b);
#endif
    for (; b < nb; b++) {
        const float *xb = x + b * QB;
        int8_t *qb = q + b * QB;
        int sum = 0;
#if SK_AVX512
        __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512 vid = _mm512_set1_ps(id);
        __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vid)), qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vid));
        _mm_storeu_si128((__m128i *)qb, _mm512_cvtsepi32_epi8(ql));
        _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtsepi32_epi8(qh));
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
#elif SK_AVX2
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4];
        __m256 m = _mm256_setzero_ps();
        for (int u = 0; u < 4; u++) {
            v[u] = _mm256_loadu_ps(xb + 8 * u);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[u]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256 vid = _mm256_set1_ps(id);
        for (int u = 0; u < 4; u++) {
            int32_t q8[8];
            _mm256_storeu_si256((__m256i *)q8, _mm256_cvtps_epi32(_mm256_mul_ps(v[u], vid)));
            for (int e = 0; e < 8; e++) {
                qb[8 * u + e] = (int8_t)q8[e];
                sum += q8[e];
            }
        }
#else
        float amax = 0.0f;
        for (int j = 0; j < QB; j++) {
            float v = fabsf(xb[j]);
            amax = v > amax ? v : amax;
        }
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < QB; j++) {
            int v = (int)nearbyintf(xb[j] * id);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            qb[j] = (int8_t)v;
            sum += v;
        }
#endif
        d[b] = amax / 127.0f;
        s[b] = d[b] * (float)sum;
        c[b] = -128 * sum;
    }
}

/* ---- the quantized GEMM: y[r, n] (+)= sum_k w[n, k] x[r, k] (+ bias) ------------------------
 * A micro-tile is up to MR rows x one group of 16 columns; each (row, column) accumulates in
 * its own lane by the same operations whatever the tile, so results never depend on M. Per
 * block: an exact integer sum over its 32 inputs, then acc += float(sum) * (d_w d_x)
 * (+ m_w s_x for 4 bits). */

static inline void store_cols(float *out, const float *v, const float *bias, int ncols, int accumulate) {
    for (int j = 0; j < ncols; j++) {
        float x = v[j] + (bias ? bias[j] : 0.0f);
        out[j] = accumulate ? out[j] + x : x;
    }
}

#if SK_AVX512
/* store_cols for a whole group: the same two additions a column, 16 at once. */
static inline void store_group(float *out, __m512 v, const float *bias, int ncols, int accumulate) {
    if (ncols < COLS) {
        float t[COLS];
        _mm512_storeu_ps(t, v);
        store_cols(out, t, bias, ncols, accumulate);
        return;
    }
    __m512 x = _mm512_add_ps(v, bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps());
    _mm512_storeu_ps(out, accumulate ? _mm512_add_ps(_mm512_loadu_ps(out), x) : x);
}

static inline __attribute__((always_inline)) void tile(const sk_qmat *W, int g, const act_t *X, int r0, const int rc,
                                                       float *y, int64_t ldy, int accumulate, int once) {
    const int nb = W->k / QB, bits = W->bits, bb = block_bytes(bits), cb = bits == 8 ? 512 : 256;
    const uint8_t *base = W->data + (int64_t)g * W->group_bytes;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512 acc[MR];
    for (int i = 0; i < rc; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *u = base + (int64_t)b * bb;
        prefetch_ahead(u, bb, once);
        __m512i w[8];
        if (bits == 8) {
            for (int c = 0; c < 8; c++) w[c] = _mm512_loadu_si512((const void *)(u + 64 * c));
        } else {
            for (int c = 0; c < 4; c++) {
                __m512i raw = _mm512_loadu_si512((const void *)(u + 64 * c));
                w[c] = _mm512_and_si512(raw, nib);
                w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
            }
        }
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + cb)));
        __m512 mw = bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(u + cb + 32))) : dw;
        for (int i = 0; i < rc; i++) {
            const int32_t *xq = (const int32_t *)(act_q(X, r0 + i) + b * QB);
            /* two chains of 4 multiply-adds (half the latency of one of 8); integer sums are exact
             * in any order, so this is the same sum */
            __m512i s0 = bits == 8 ? _mm512_set1_epi32(act_c(X, r0 + i)[b]) : _mm512_setzero_si512();
            __m512i s1 = _mm512_setzero_si512();
            for (int c = 0; c < 8; c += 2) {
                s0 = _mm512_dpbusd_epi32(s0, w[c], _mm512_set1_epi32(xq[c]));
                s1 = _mm512_dpbusd_epi32(s1, w[c + 1], _mm512_set1_epi32(xq[c + 1]));
            }
            __m512i sum = _mm512_add_epi32(s0, s1);
            __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(act_d(X, r0 + i)[b])),
                                       acc[i]);
            if (bits == 4) a = _mm512_fmadd_ps(mw, _mm512_set1_ps(act_s(X, r0 + i)[b]), a);
            acc[i] = a;
        }
    }
    int ncols = W->n - g * COLS < COLS ? W->n - g * COLS : COLS;
    const float *bias = W->bias ? W->bias + g * COLS : NULL;
    for (int i = 0; i < rc; i++) store_group(y + (int64_t)(r0 + i) * ldy + g * COLS, acc[i], bias, ncols, accumulate);
}
#elif SK_AVX2
static inline __attribute__((always_inline)) void tile(const sk_qmat *W, int g, const act_t *X, int r0, const int rc,
                                                       float *y, int64_t ldy, int accumulate, int once) {
    const int nb = W->k / QB, bits = W->bits, bb = block_bytes(bits), cb = bits == 8 ? 512 : 256;
    const uint8_t *base = W->data + (int64_t)g * W->group_bytes;
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[MR][2];
    for (int i = 0; i < rc; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *u = base + (int64_t)b * bb;
        prefetch_ahead(u, bb, once);
        for (int h = 0; h < 2; h++) { /* columns 8h .. 8h + 7: bytes 32h .. 32h + 31 of each 64-byte chunk */
            __m256i w[8];
            if (bits == 8) { /* stored q + 128: the signed code, for the sign trick below */
                for (int c = 0; c < 8; c++)
                    w[c] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(u + 64 * c + 32 * h)), flip);
            } else {
                for (int c = 0; c < 4; c++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(u + 64 * c + 32 * h));
                    w[c] = _mm256_and_si256(raw, nib);
                    w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
                }
            }
            __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + cb + 16 * h)));
            __m256 mw = bits == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(u + cb + 32 + 16 * h))) : dw;
            for (int i = 0; i < rc; i++) {
                const int32_t *xq = (const int32_t *)(act_q(X, r0 + i) + b * QB);
                __m256i sum;
                if (bits == 4) { /* 8 x (15 * 127 * 2) fits in 16 bits: one widening at the end */
                    __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xq[0]));
                    for (int c = 1; c < 8; c++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(xq[c])));
                    sum = _mm256_madd_epi16(s16, ones);
                } else { /* |q| * (x signed as q): no saturation (127 * 127 * 2 < 32768) */
                    sum = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c++) {
                        __m256i xv = _mm256_set1_epi32(xq[c]);
                        __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w[c]), _mm256_sign_epi8(xv, w[c]));
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
                    }
                }
                __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(act_d(X, r0 + i)[b])),
                                           acc[i][h]);
                if (bits == 4) a = _mm256_fmadd_ps(mw, _mm256_set1_ps(act_s(X, r0 + i)[b]), a);
                acc[i][h] = a;
            }
        }
    }
    int ncols = W->n - g * COLS < COLS ? W->n - g * COLS : COLS;
    const float *bias = W->bias ? W->bias + g * COLS : NULL;
    for (int i = 0; i < rc; i++) {
        float v[COLS];
        _mm256_storeu_ps(v, acc[i][0]);
        _mm256_storeu_ps(v + 8, acc[i][1]);
        store_cols(y + (int64_t)(r0 + i) * ldy + g * COLS, v, bias, ncols, accumulate);
    }
}
#else
static inline void tile(const sk_qmat *W, int g, const act_t *X, int r0, const int rc, float *y, int64_t ldy,
                        int accumulate, int once) {
    (void)once;
    const int nb = W->k / QB, bits = W->bits, bb = block_bytes(bits), cb = bits == 8 ? 512 : 256;
    const uint8_t *base = W->data + (int64_t)g * W->group_bytes;
    int ncols = W->n - g * COLS < COLS ? W->n - g * COLS : COLS;
    const float *bias = W->bias ? W->bias + g * COLS : NULL;
    for (int i = 0; i < rc; i++) {
        const int8_t *xq = act_q(X, r0 + i);
        float acc[COLS] = {0};
        for (int b = 0; b < nb; b++) {
            const uint8_t *u = base + (int64_t)b * bb;
            for (int l = 0; l < COLS; l++) {
                int sum = bits == 8 ? act_c(X, r0 + i)[b] : 0;
                for (int j = 0; j < QB; j++) {
                    int code;
                    if (bits == 8) code = u[(j / 4) * 64 + l * 4 + j % 4];
                    else code = (u[((j % 16) / 4) * 64 + l * 4 + j % 4] >> (j < 16 ? 0 : 4)) & 15;
                    sum += code * xq[b * QB + j];
                }
                uint16_t dh, mh;
                memcpy(&dh, u + cb + 2 * l, 2);
                acc[l] += (float)sum * (h2f(dh) * act_d(X, r0 + i)[b]);
                if (bits == 4) {
                    memcpy(&mh, u + cb + 32 + 2 * l, 2);
                    acc[l] += h2f(mh) * act_s(X, r0 + i)[b];
                }
            }
        }
        store_cols(y + (int64_t)(r0 + i) * ldy + g * COLS, acc, bias, ncols, accumulate);
    }
}
#endif

/* Every row count gets its own copy of `tile` with a constant bound (registers, unrolled). */
static void tile_any(const sk_qmat *W, int g, const act_t *X, int r0, int rc, float *y, int64_t ldy, int accumulate,
                     int once) {
    switch (rc) {
    case 1: tile(W, g, X, r0, 1, y, ldy, accumulate, once); return;
    case 2: tile(W, g, X, r0, 2, y, ldy, accumulate, once); return;
    case 3: tile(W, g, X, r0, 3, y, ldy, accumulate, once); return;
#if MR >= 8
    case 4: tile(W, g, X, r0, 4, y, ldy, accumulate, once); return;
    case 5: tile(W, g, X, r0, 5, y, ldy, accumulate, once); return;
    case 6: tile(W, g, X, r0, 6, y, ldy, accumulate, once); return;
    case 7: tile(W, g, X, r0, 7, y, ldy, accumulate, once); return;
    case 8: tile(W, g, X, r0, 8, y, ldy, accumulate, once); return;
    case 9: tile(W, g, X, r0, 9, y, ldy, accumulate, once); return;
    case 10: tile(W, g, X, r0, 10, y, ldy, accumulate, once); return;
    case 11: tile(W, g, X, r0, 11, y, ldy, accumulate, once); return;
    default: tile(W, g, X, r0, 12, y, ldy, accumulate, once); return;
#else
    default: tile(W, g, X, r0, 4, y, ldy, accumulate, once); return;
#endif
    }
}

/* ---- AMX: the same GEMM, 16 rows at a time, on the tile unit --------------------------------
 * Where the CPU has AMX (and the kernel lets this process use it), whole tiles of 16 rows run
 * their integer block sums as tile multiply-adds: per block of 32 inputs, one tdpbsud of the 16
 * rows' activation codes (signed) by the group's 16 columns (unsigned codes, the layout above is
 * already the tile unit's: 4 consecutive inputs of a column in each 32-bit lane) gives the 16 x 16
 * exact sums at once, where the vector path spends 8 vpdpbusd a row. The float epilogue is the
 * vector path's, operation for operation (acc = fma(float(sum), d_w d_x, acc), then + m_w s_x),
 * so a row's result is bit for bit the vector path's: the rows a step leaves over (fewer than 16)
 * and a decode's one row take the vector path and agree with rows run here. A thread's groups go
 * in chunks of up to AMX_CHUNK_BYTES of codes (4-bit codes unpacked to bytes into a thread's
 * scratch once per call), each chunk passing over the rows in blocks of AMX_ROW_BLOCK.
 * Blocks go in runs of AMX_RUN: the run's sums are stored (1 KB each, still in L1), then their
 * epilogues run. On a 2-core Sapphire Rapids-class Xeon (one thread, a 16 x 16 x 32 block): the
 * vector path ~55-60 ns, this one ~37-45 ns (the tile unit's multiply ~5 ns, loads and store ~5 ns,
 * the epilogue's 64 vector operations ~14 ns; in every order tried the tile unit and the vector
 * epilogue did not overlap, so the epilogue is the bound). The model's matrices 1.4-1.6x, ingest
 * 1.36x at 512 tokens (bench/decode.py prints both paths). */
#if SK_AMX
#define AMX_ROWS 16
#define AMX_ROW_BLOCK 32 /* rows kept hot (their codes in L1) while a chunk's groups pass: ingest 5-7% faster than
                            128 in the engine (16: 2-5% slower; 48: the same) */
#define AMX_CHUNK_BYTES (512 << 10) /* a chunk's codes, kept in L2 while the row blocks pass: each 4-bit group
                                       unpacked once a call, not once a row block (512-token ingest +8-10%,
                                       4K +3% on a 2-core Sapphire Rapids-class Xeon, in-process A/B; 128 and
                                       256 KB a little less, 1 MB the same) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_enabled = 1; /* sk_set_amx: 0 runs every row on the vector path (to compare; same results) */
static atomic_int amx_state; /* 0 not asked yet, 1 granted, -1 refused by the kernel */

/* Whether this process may use the tile unit (asked of the kernel once; the grant is the
 * process's, its threads included). */
static int amx_allowed(void) {
    int st = atomic_load_explicit(&amx_state, memory_order_acquire);
    if (st == 0) {
        st = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        atomic_store_explicit(&amx_state, st, memory_order_release);
    }
    return st > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* Tiles 0, 1: 16 x 16 int32 sums; 2, 3: 16 rows x 32 activation codes; 4, 5: one block of a
 * group's codes (8 rows of 4 inputs x 16 columns). */
static void amx_configure(void) {
    amx_config_t cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) { cfg.rows[t] = AMX_ROWS; cfg.colsb[t] = 64; }
    for (int t = 2; t < 4; t++) { cfg.rows[t] = AMX_ROWS; cfg.colsb[t] = QB; }
    for (int t = 4; t < 6; t++) { cfg.rows[t] = QB / 4; cfg.colsb[t] = 64; }
    /* not _tile_loadconfig: GCC's names 8 bytes of the config as read, so it may drop the stores
     * to the rest (a harness built with -O3 faulted at the ldtilecfg); this names all 64 */
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

/* Tile loads and stores stated exactly (the compiler's own macros clobber all memory at a store,
 * which keeps a tile's 16 accumulators in memory): a load reads what was written before the tile
 * loop began (the unpacked codes, the activations: amx_groups puts a compiler barrier between);
 * a store writes the one 1 KB buffer it names. */
typedef struct { int32_t v[AMX_ROWS * 16]; } amx_sums_t;
#define AMX_LOAD(t, base, stride) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"((long)(stride)))
#define AMX_STORE(t, out) \
    __asm__ volatile("tilestored %%tmm" #t ", (%1,%2,1)" : "=m"(*(out)) : "r"((out)->v), "r"(64L))

static void *grow(void **buf, size_t *cap, size_t need);
static __thread uint8_t *amx_scratch;
static __thread size_t amx_scratch_cap;
#define AMX_RUN 8 /* blocks whose sums are stored before their epilogues run (2-16 measured alike) */

/* One group's 4-bit codes as bytes, block after block (512 bytes each), at dst (a thread's
 * scratch, grown by amx_groups). */
static void amx_unpack(const sk_qmat *W, int g, uint8_t *dst) {
    const int nb = W->k / QB, bb = block_bytes(4);
    const uint8_t *base = W->data + (int64_t)g * W->group_bytes;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *u = base + (int64_t)b * bb;
        uint8_t *o = dst + (size_t)b * 512;
        prefetch_ahead(u, bb, 0);
        for (int c = 0; c < 4; c++) {
            __m512i raw = _mm512_loadu_si512((const void *)(u + 64 * c));
            _mm512_store_si512((void *)(o + 64 * c), _mm512_and_si512(raw, nib));
            _mm512_store_si512((void *)(o + 256 + 64 * c), _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib));
        }
    }
}

/* Block b's epilogue for the 16 rows from r0: the tile's sums (at sums) into acc. */
static inline __attribute__((always_inline)) void amx_epilogue(const int bits, const int nb, const uint8_t *scales,
                                                               const act_t *X, int r0, int b,
                                                               const int32_t *sums, __m512 *acc) {
    __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
    __m512 mw = bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32))) : dw;
    const float *d = act_d(X, r0) + b, *s = act_s(X, r0) + b;
    const int32_t *c = act_c(X, r0) + b;
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; i++) {
        __m512i sum = _mm512_load_si512((const void *)(sums + 16 * i));
        if (bits == 8) sum = _mm512_add_epi32(_mm512_set1_epi32(c[(int64_t)i * nb]), sum);
        __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(d[(int64_t)i * nb])),
                                   acc[i]);
        if (bits == 4) a = _mm512_fmadd_ps(mw, _mm512_set1_ps(s[(int64_t)i * nb]), a);
        acc[i] = a;
    }
}

/* Rows r0 .. r0 + 15 x group g; codes: the group's blocks as bytes, `step` bytes apart. */
static inline __attribute__((always_inline)) void amx_tile(const int bits, const sk_qmat *W, int g,
                                                           const uint8_t *codes, const act_t *X, int r0,
                                                           float *y, int64_t ldy, int accumulate) {
    const int nb = W->k / QB, bb = block_bytes(bits), cb = bits == 8 ? 512 : 256;
    const int64_t step = bits == 4 ? 512 : bb; /* bytes from one block's codes to the next's */
    const uint8_t *scales = W->data + (int64_t)g * W->group_bytes + cb;
    const int8_t *xq = act_q(X, r0);
    const int64_t ldx = X->k;
    __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; i++) acc[i] = _mm512_setzero_ps();
#define AMX_ISSUE(b, C, A, B)                                        \
    do {                                                             \
        _tile_zero(C);                                               \
        AMX_LOAD(A, xq + (int64_t)(b) * QB, ldx);                    \
        AMX_LOAD(B, codes + (int64_t)(b) * step, 64);                \
        _tile_dpbsud(C, A, B);                                       \
    } while (0)
    /* a run's sums first (the tile unit), then its epilogues in block order (the vector units) */
    amx_sums_t all[AMX_RUN] __attribute__((aligned(64)));
    for (int b0 = 0; b0 < nb; b0 += AMX_RUN) {
        int b1 = b0 + AMX_RUN < nb ? b0 + AMX_RUN : nb, b = b0;
        for (; b + 1 < b1; b += 2) {
            AMX_ISSUE(b, 0, 2, 4);
            AMX_ISSUE(b + 1, 1, 3, 5);
            AMX_STORE(0, &all[b - b0]);
            AMX_STORE(1, &all[b + 1 - b0]);
        }
        if (b < b1) {
            AMX_ISSUE(b, 0, 2, 4);
            AMX_STORE(0, &all[b - b0]);
        }
        for (b = b0; b < b1; b++) amx_epilogue(bits, nb, scales + (int64_t)b * bb, X, r0, b, all[b - b0].v, acc);
    }
#undef AMX_ISSUE
    int ncols = W->n - g * COLS < COLS ? W->n - g * COLS : COLS;
    const float *bias = W->bias ? W->bias + g * COLS : NULL;
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; i++) store_group(y + (int64_t)(r0 + i) * ldy + g * COLS, acc[i], bias, ncols, accumulate);
}

/* Rows 0 .. rows - 1 (a multiple of 16) x groups g0 .. g1 - 1 on the tile unit; returns the rows
 * it ran (0: the vector path runs them all: AMX off, refused, or no scratch). */
static int amx_groups(const sk_qmat *W, int g0, int g1, const act_t *X, int rows, float *y, int64_t ldy,
                      int accumulate) {
    rows -= rows % AMX_ROWS;
    if (rows == 0 || !amx_enabled || !amx_allowed()) return 0;
    const size_t gbytes = (size_t)(W->k / QB) * 512; /* a group's codes as bytes */
    int chunk = (int)(AMX_CHUNK_BYTES / gbytes);     /* groups a chunk */
    chunk = chunk < 1 ? 1 : chunk;
    if (W->bits == 4 && !grow((void **)&amx_scratch, &amx_scratch_cap, gbytes * chunk)) return 0;
    amx_configure();
    for (int gc = g0; gc < g1; gc += chunk) {
        int ge = gc + chunk < g1 ? gc + chunk : g1;
        if (W->bits == 4)
            for (int g = gc; g < ge; g++) amx_unpack(W, g, amx_scratch + (size_t)(g - gc) * gbytes);
        __asm__ volatile("" ::: "memory"); /* the codes are in memory before the tile loads read them */
        for (int rb = 0; rb < rows; rb += AMX_ROW_BLOCK) {
            int re = rb + AMX_ROW_BLOCK < rows ? rb + AMX_ROW_BLOCK : rows;
            for (int g = gc; g < ge; g++)
                for (int r = rb; r < re; r += AMX_ROWS) {
                    if (W->bits == 4) amx_tile(4, W, g, amx_scratch + (size_t)(g - gc) * gbytes, X, r, y, ldy, accumulate);
                    else amx_tile(8, W, g, W->data + (int64_t)g * W->group_bytes, X, r, y, ldy, accumulate);
                }
        }
    }
    _tile_release();
    return rows;
}
#endif

/* 1 where full tiles of 16 rows run on AMX, 0 where every row takes the vector path (no AMX in
 * this build or CPU, the kernel refused it, or sk_set_amx(0)). */
int sk_amx(void) {
#if SK_AMX
    return amx_enabled && amx_allowed();
#else
    return 0;
#endif
}

/* Turn the AMX path on or off (results are the same either way); returns sk_amx(). */
int sk_set_amx(int on) {
#if SK_AMX
    pthread_mutex_lock(&api_lock); /* not in the middle of a call */
    amx_enabled = on != 0;
    pthread_mutex_unlock(&api_lock);
#else
    (void)on;
#endif
    return sk_amx();
}

#define ROW_BLOCK (64 / MR * MR) /* rows kept hot while a thread's columns pass over them (whole tiles) */

static void gemm_groups(const sk_qmat *W, int g0, int g1, const act_t *X, int rows, float *y, int64_t ldy,
                        int accumulate) {
    int first = 0; /* rows before it ran on the tile unit */
#if SK_AMX
    first = amx_groups(W, g0, g1, X, rows, y, ldy, accumulate);
#endif
    /* one pass over the columns: the weights are read once (non-temporal where that helps) */
    int once = rows - first <= ROW_BLOCK && weights_once_nta();
    for (int rb = first; rb < rows; rb += ROW_BLOCK) {
        int re = rb + ROW_BLOCK < rows ? rb + ROW_BLOCK : rows;
        for (int g = g0; g < g1; g++)
            for (int r = rb; r < re; r += MR) tile_any(W, g, X, r, re - r < MR ? re - r : MR, y, ldy, accumulate, once);
    }
}

static void gemm_part(const sk_qmat *W, const act_t *X, int rows, float *y, int64_t ldy, int accumulate, int tid,
                      int nth) {
    int groups = (W->n + COLS - 1) / COLS, lo, hi; /* whole groups of columns, split evenly */
    split(groups, tid, nth, &lo, &hi);
    if (lo < hi) gemm_groups(W, lo, hi, X, rows, y, ldy, accumulate);
}

/* ---- buffers -------------------------------------------------------------------------------- */

static void *grow(void **buf, size_t *cap, size_t need) {
    if (need > *cap) {
        free(*buf);
        size_t size = round_up(need);
        *buf = aligned_alloc(ALIGN, size);
        *cap = *buf ? size : 0;
    }
    return *buf;
}

static int act_alloc(act_t *a, int k, int rows, void **buf, size_t *cap) {
    char *base = grow(buf, cap, act_bytes(k, rows));
    if (!base) return SK_ENOMEM;
    act_place(a, k, rows, base);
    return 0;
}

/* Where a step's time goes (sk_profile): seconds per thread and part, summed over steps. */
enum { T_NORM, T_QKV, T_ROPE, T_ATTN_A, T_ATTN_B, T_O, T_GATE_UP, T_DOWN, T_WAIT, T_HEAD, T_PARTS };

/* A caller's state: the buffers its calls reuse (grown, never shrunk) and its step timings. */
typedef struct sk_ctx {
    void *ws_buf;       /* sk_forward's workspace */
    size_t ws_cap;
    void *linear_buf;   /* sk_linear's activations */
    size_t linear_cap;
    int profiling;
    double profile[MAX_THREADS][T_PARTS];
} sk_ctx;

sk_ctx *sk_ctx_new(void) { return calloc(1, sizeof(sk_ctx)); }

void sk_ctx_free(sk_ctx *c) {
    if (!c) return;
    free(c->ws_buf);
    free(c->linear_buf);
    free(c);
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Add the time since *mark to part `part` of thread `tid`; with `wait`, then wait at the
 * barrier and count that as waiting. */
static inline void lap(sk_ctx *c, int tid, int part, double *mark, int nth, int wait) {
    if (c->profiling) {
        double t = now_s();
        c->profile[tid][part] += t - *mark;
        *mark = t;
    }
    if (wait) {
        barrier(nth);
        if (c->profiling) {
            double t = now_s();
            c->profile[tid][T_WAIT] += t - *mark;
            *mark = t;
        }
    }
}

/* Start (1) or stop (0) timing; `out` (if not NULL) gets [MAX_THREADS][T_PARTS] seconds so far,
 * then the counters reset. Returns the number of parts. */
int sk_profile(sk_ctx *c, int enable, double *out) {
    pthread_mutex_lock(&api_lock); /* not while a call of this context's is running */
    if (out) memcpy(out, c->profile, sizeof(c->profile));
    memset(c->profile, 0, sizeof(c->profile));
    c->profiling = enable;
    pthread_mutex_unlock(&api_lock);
    return T_PARTS;
}

/* Rows of sk_profile's output (threads the pool may have). */
int sk_max_threads(void) { return MAX_THREADS; }

/* A standalone linear layer (the output head, a layer the HF model runs): y = x W^T (+ b). */
typedef struct {
    sk_ctx *c;
    const sk_qmat *W;
    const float *x;
    int rows;
    int64_t ldx, ldy;
    float *y;
    act_t act;
} linear_job;

static void linear_run(void *ctx, int tid, int nth) {
    linear_job *j = ctx;
    int lo, hi;
    double mark = j->c->profiling ? now_s() : 0.0;
    split(j->rows, tid, nth, &lo, &hi);
    for (int r = lo; r < hi; r++) quantize_row(j->x + r * j->ldx, &j->act, r);
    barrier(nth);
    gemm_part(j->W, &j->act, j->rows, j->y, j->ldy, 0, tid, nth);
    lap(j->c, tid, T_HEAD, &mark, nth, 0);
}

int sk_linear(sk_ctx *c, const sk_qmat *W, const float *x, int rows, int64_t ldx, float *y, int64_t ldy) {
    if (rows <= 0 || W->k <= 0 || W->k % QB || (W->bits != 4 && W->bits != 8)) return SK_EINVAL;
    linear_job j = {.c = c, .W = W, .x = x, .rows = rows, .ldx = ldx, .ldy = ldy, .y = y};
    pthread_mutex_lock(&api_lock);
    int rc = act_alloc(&j.act, W->k, rows, &c->linear_buf, &c->linear_cap);
    if (rc == 0) run_job(linear_run, &j);
    pthread_mutex_unlock(&api_lock);
    return rc;
}

/* ---- vector helpers ---------------------------------------------------------------------- */

#if SK_AVX512
/* exp for x <= 0 (softmax): 2^n * p(r), r in [-ln2/2, ln2/2], degree-6 polynomial (~1 ulp). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3981999507e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

#if SK_AVX2
/* exp512's polynomial on 8 lanes; 2^n through the exponent bits (n >= -126 after the clamp). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.3981999507e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum256(__m256 v) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

static inline float exp_scalar(float x) {
#if SK_AVX512
    return _mm512_cvtss_f32(exp512(_mm512_set1_ps(x)));
#elif SK_AVX2
    return _mm256_cvtss_f32(exp256(_mm256_set1_ps(x)));
#else
    return expf(x);
#endif
}

static inline void rmsnorm_scaled(const float *x, const float *w, int n, float eps, float ss, float *out) {
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

static void rmsnorm(const float *x, const float *w, int n, float eps, float *out) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    rmsnorm_scaled(x, w, n, eps, ss, out);
}

/* rmsnorm of rows lo .. hi - 1 (x and out `ld` floats apart). A row's sum of squares is one
 * chain of dependent additions (4 cycles each: ~0.7 us for 576 inputs), so with AVX-512 16 rows
 * run it together, a row in each lane, in the same order and with the same roundings as a row
 * alone (a multiply, then an add: contraction is off): every row gets rmsnorm's bits. */
static void rmsnorm_rows(const float *x, const float *w, int n, float eps, float *out, int64_t ld, int lo, int hi) {
    int r = lo;
#if SK_AVX512
    if ((int64_t)15 * ld <= INT32_MAX) { /* the lanes' offsets are 32-bit */
        const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)ld));
        for (; r + 16 <= hi; r += 16) {
            const float *x0 = x + (int64_t)r * ld;
            __m512 ss = _mm512_setzero_ps();
            for (int i = 0; i < n; i++) {
                __m512 v = _mm512_i32gather_ps(at, x0 + i, 4);
                ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
            }
            float s[16];
            _mm512_storeu_ps(s, ss);
            for (int j = 0; j < 16; j++) rmsnorm_scaled(x0 + j * ld, w, n, eps, s[j], out + (int64_t)(r + j) * ld);
        }
    }
#endif
    for (; r < hi; r++) rmsnorm(x + (int64_t)r * ld, w, n, eps, out + (int64_t)r * ld);
}

/* ---- attention --------------------------------------------------------------------------- */

/* A key/value range of a cache: addresses of layer 0, kv head 0, the range's first slot. */
typedef struct {
    uint64_t k, v;
    int64_t layer_stride, head_stride; /* elements */
    int32_t len, pad;
} sk_range;

typedef struct {
    int32_t row0, n;    /* its rows in the packed step */
    int32_t start;      /* own keys cached before its new ones */
    int32_t group;      /* its read-only ranges: an index into groups, or -1 */
    sk_range own;       /* its own cache; the new K/V go to own slots start .. start + n - 1 */
} sk_seq;

typedef struct {
    int32_t range0, nranges;
} sk_group;

typedef struct {
    int32_t nseqs, ngroups;
    const sk_seq *seqs;
    const sk_group *groups;
    const sk_range *ranges;
    const float *cos, *sin; /* [rows, head_dim] */
} sk_plan;

/* Merge a partial (m2, l2, a2) into a running state (m, l, acc): the one operation that
 * combines key chunks, always applied in the same order for a row. */
static inline void merge_into(float *m, float *l, float *acc, float m2, float l2, const float *a2, int dim) {
    if (l2 == 0.0f) return;
    if (*l == 0.0f) {
        *m = m2;
        *l = l2;
        memcpy(acc, a2, (size_t)dim * 4);
        return;
    }
    float mx = m2 > *m ? m2 : *m;
    float c1 = exp_scalar(*m - mx), c2 = exp_scalar(m2 - mx);
    *l = *l * c1 + l2 * c2;
    *m = mx;
#if SK_AVX512
    if ((dim & 15) == 0) {
        __m512 v1 = _mm512_set1_ps(c1), v2 = _mm512_set1_ps(c2);
        for (int d = 0; d < dim; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(a2 + d), v2,
                                                      _mm512_mul_ps(_mm512_loadu_ps(acc + d), v1)));
        return;
    }
#endif
    for (int d = 0; d < dim; d++) acc[d] = acc[d] * c1 + a2[d] * c2;
}

/* Load `count` keys (or values) of one head, fp16 or fp32, as fp32 rows. */
static void load_rows(const void *src, int fp16, int64_t first, int count, int dim, float *out) {
    if (!fp16) {
        memcpy(out, (const float *)src + first * dim, (size_t)count * dim * 4);
        return;
    }
    const uint16_t *h = (const uint16_t *)src + first * dim;
    int64_t total = (int64_t)count * dim, i = 0;
#if SK_AVX512
    for (; i + 16 <= total; i += 16) _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif SK_AVX2
    for (; i + 8 <= total; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < total; i++) out[i] = h2f(h[i]);
}

/* Scores of `nq` query vectors against `count` keys (rows of `kf`), into s[q * CHUNK + j]. */
static void scores(const float *const *qs, int nq, const float *kf, int count, int dim, float *s) {
#if SK_AVX512
    if (dim == 64) {
        for (int q = 0; q < nq; q++) {
            const float *qv = qs[q];
            __m512 q0 = _mm512_loadu_ps(qv), q1 = _mm512_loadu_ps(qv + 16), q2 = _mm512_loadu_ps(qv + 32),
                   q3 = _mm512_loadu_ps(qv + 48);
            float *sq = s + q * CHUNK;
            int j = 0;
            for (; j + 4 <= count; j += 4) {
                __m512 t[4];
                for (int u = 0; u < 4; u++) {
                    const float *kv = kf + (int64_t)(j + u) * 64;
                    __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(kv));
                    a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kv + 16), a);
                    a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kv + 32), a);
                    t[u] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kv + 48), a);
                }
                for (int u = 0; u < 4; u++) sq[j + u] = _mm512_reduce_add_ps(t[u]);
            }
            for (; j < count; j++) {
                const float *kv = kf + (int64_t)j * 64;
                __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(kv));
                a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kv + 16), a);
                a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kv + 32), a);
                a = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kv + 48), a);
                sq[j] = _mm512_reduce_add_ps(a);
            }
        }
        return;
    }
    if ((dim & 15) == 0) {
        for (int q = 0; q < nq; q++)
            for (int j = 0; j < count; j++) {
                const float *kv = kf + (int64_t)j * dim;
                __m512 a = _mm512_setzero_ps();
                for (int d = 0; d < dim; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qs[q] + d), _mm512_loadu_ps(kv + d), a);
                s[q * CHUNK + j] = _mm512_reduce_add_ps(a);
            }
        return;
    }
#elif SK_AVX2
    if ((dim & 7) == 0) {
        for (int q = 0; q < nq; q++)
            for (int j = 0; j < count; j++) {
                const float *kv = kf + (int64_t)j * dim;
                __m256 a = _mm256_setzero_ps();
                for (int d = 0; d < dim; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qs[q] + d), _mm256_loadu_ps(kv + d), a);
                s[q * CHUNK + j] = hsum256(a);
            }
        return;
    }
#endif
    for (int q = 0; q < nq; q++)
        for (int j = 0; j < count; j++) {
            const float *kv = kf + (int64_t)j * dim;
            float a = 0.0f;
            for (int d = 0; d < dim; d++) a += qs[q][d] * kv[d];
            s[q * CHUNK + j] = a;
        }
}

/* Softmax pieces of one query over its first `visible` scores of a chunk; acc = sum p v. */
static void chunk_softmax(float *sq, int visible, const float *vf, int dim, float *m_out, float *l_out, float *acc) {
    float mx = -INFINITY;
    for (int j = 0; j < visible; j++) mx = sq[j] > mx ? sq[j] : mx;
    float l = 0.0f;
    int j = 0;
#if SK_AVX512
    __m512 vm = _mm512_set1_ps(mx), vl = _mm512_setzero_ps();
    for (; j + 16 <= visible; j += 16) {
        __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(sq + j), vm));
        _mm512_storeu_ps(sq + j, p);
        vl = _mm512_add_ps(vl, p);
    }
    if (j < visible) {
        __mmask16 mk = (__mmask16)((1u << (visible - j)) - 1);
        __m512 p = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sq + j), vm)));
        _mm512_mask_storeu_ps(sq + j, mk, p);
        vl = _mm512_add_ps(vl, p);
        j = visible;
    }
    l = _mm512_reduce_add_ps(vl);
    if ((dim & 15) == 0 && dim <= 256) {
        __m512 a[16];
        int nv = dim / 16;
        for (int u = 0; u < nv; u++) a[u] = _mm512_setzero_ps();
        for (int t = 0; t < visible; t++) {
            __m512 p = _mm512_set1_ps(sq[t]);
            const float *vv = vf + (int64_t)t * dim;
            for (int u = 0; u < nv; u++) a[u] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vv + 16 * u), a[u]);
        }
        for (int u = 0; u < nv; u++) _mm512_storeu_ps(acc + 16 * u, a[u]);
        *m_out = mx;
        *l_out = l;
        return;
    }
#elif SK_AVX2
    __m256 vm = _mm256_set1_ps(mx), vl = _mm256_setzero_ps();
    for (; j < visible; j += 8) { /* a tail goes through the same lanes, zero-padded */
        float buf[8] = {0};
        int n = visible - j < 8 ? visible - j : 8;
        memcpy(buf, sq + j, (size_t)n * 4);
        __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(buf), vm));
        _mm256_storeu_ps(buf, p);
        for (int e = n; e < 8; e++) buf[e] = 0.0f;
        memcpy(sq + j, buf, (size_t)n * 4);
        vl = _mm256_add_ps(vl, _mm256_loadu_ps(buf));
    }
    l = hsum256(vl);
    if ((dim & 7) == 0 && dim <= 256) {
        __m256 a[32];
        int nv = dim / 8;
        for (int u = 0; u < nv; u++) a[u] = _mm256_setzero_ps();
        for (int t = 0; t < visible; t++) {
            __m256 p = _mm256_set1_ps(sq[t]);
            const float *vv = vf + (int64_t)t * dim;
            for (int u = 0; u < nv; u++) a[u] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vv + 8 * u), a[u]);
        }
        for (int u = 0; u < nv; u++) _mm256_storeu_ps(acc + 8 * u, a[u]);
        *m_out = mx;
        *l_out = l;
        return;
    }
#else
    for (; j < visible; j++) {
        sq[j] = expf(sq[j] - mx);
        l += sq[j];
    }
#endif
    for (int d = 0; d < dim; d++) acc[d] = 0.0f;
    for (int t = 0; t < visible; t++)
        for (int d = 0; d < dim; d++) acc[d] += sq[t] * vf[(int64_t)t * dim + d];
    *m_out = mx;
    *l_out = l;
}

/* ---- the model -------------------------------------------------------------------------- */

typedef struct {
    sk_qmat qkv, o, gate_up, down;
    const float *in_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;     /* [head_dim] per-head norms (Qwen3), or NULL */
} sk_layer;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, inter, kv_fp16, pad;
    float eps, scale;
    const sk_layer *layer;
    const float *final_norm;
} sk_model;

/* Attention. A row's keys are one sequence: its group's read-only ranges in order, then its
 * own cache (causal). That sequence is cut into chunks of CHUNK keys by position in it alone,
 * whatever ranges the keys lie in, so a row gets the same chunks, hence the same partials and
 * the same result, however its keys are split into ranges: a flash fork over a session, a
 * question written past the session's length, a stateless run over the concatenation.
 * Kind A work (partials, stored): a chunk that lies wholly in a group's read-only ranges, for
 * some of the group's rows; or a chunk of a short sequence (all its rows). Kind B (final, per
 * kv head): rows of one sequence merge their partials in chunk order, computing the chunks of
 * a longer sequence on the way, and write their output. */
enum { A_GROUP = 0, A_SEQ = 1 };

typedef struct {
    int32_t kind, idx, chunk, head, first, count;
} task_t;

/* A run of keys (and their values) of one layer and kv head, contiguous in a cache. */
typedef struct {
    const char *k, *v;
    int count;
} seg_t;

#define MAX_SEGS 17 /* a chunk's runs: at most every range of a group, and the own cache */

#define GROUP_ROWS 32 /* rows of a group per kind-A task */
#define MAX_Q 1024   /* query vectors per attention task, at most (GROUP_ROWS x heads per kv head) */

typedef struct {
    sk_ctx *c;
    const sk_model *M;
    const sk_plan *plan;
    int rows, nth_max, qmax;
    float *h, *out;
    float *norm, *qkv, *attn, *gu;
    act_t act_h, act_a, act_i;
    float *parts;            /* [slot total][heads][dim + 2]: m, l, acc */
    int32_t *row_slot0, *row_seq;
    int32_t *group_rows, *group_row0, *group_nrows;
    int32_t *group_len;        /* keys in a group's read-only ranges */
    task_t *tasks_a, *tasks_b;
    int ntasks_a, ntasks_b;
    atomic_int *next;          /* per layer: kind A and kind B counters */
    float *scratch;
    size_t scratch_floats;
} fwd_t;

static inline int chunks_of(int len) { return len <= 0 ? 0 : (len + CHUNK - 1) / CHUNK; }
static inline int is_split(const sk_seq *s) { return s->n <= SPLIT_ROWS; }

/* Keys before a sequence's own cache (its group's ranges), and chunks wholly within them. */
static inline int seq_before(const fwd_t *F, const sk_seq *s) { return s->group >= 0 ? F->group_len[s->group] : 0; }
static inline int seq_shared(const fwd_t *F, const sk_seq *s) { return s->group >= 0 ? F->group_len[s->group] / CHUNK : 0; }

/* Partials a row stores: its group's shared chunks, and every chunk if its sequence is split. */
static inline int seq_slots(const fwd_t *F, const sk_seq *s) {
    return is_split(s) ? chunks_of(seq_before(F, s) + s->start + s->n) : seq_shared(F, s);
}

static inline float *part_at(const fwd_t *F, int row, int slot, int head) {
    const sk_model *M = F->M;
    return F->parts + (((int64_t)F->row_slot0[row] + slot) * M->heads + head) * (M->head_dim + 2);
}

static inline const char *range_base(const sk_range *r, int layer, int head, int fp16, int value) {
    int64_t off = (int64_t)layer * r->layer_stride + (int64_t)head * r->head_stride;
    return (const char *)(uintptr_t)(value ? r->v : r->k) + off * (fp16 ? 2 : 4);
}

static inline int qkv_width(const sk_model *M) { return (M->heads + 2 * M->kv_heads) * M->head_dim; }

static inline float *q_vec(const fwd_t *F, int row, int head) {
    return F->qkv + (int64_t)row * qkv_width(F->M) + (int64_t)head * F->M->head_dim;
}

/* Keys [c0, c0 + CHUNK) of the sequence made of ranges[0..nranges) then `own` (own_len keys;
 * own may be NULL), for one layer and kv head, as runs; returns how many keys. */
static int chunk_segments(const fwd_t *F, const sk_range *ranges, int nranges, const sk_range *own, int own_len,
                          int layer, int head, int c0, seg_t *seg, int *nseg) {
    const sk_model *M = F->M;
    int at = 0, got = 0, n = 0, end = c0 + CHUNK, esz = M->kv_fp16 ? 2 : 4;
    for (int r = 0; r <= nranges && at < end; r++) {
        const sk_range *rg = r < nranges ? &ranges[r] : own;
        if (!rg) break;
        int len = r < nranges ? rg->len : own_len;
        int lo = c0 > at ? c0 : at, hi = end < at + len ? end : at + len;
        if (lo < hi && n < MAX_SEGS) {
            int64_t skip = (int64_t)(lo - at) * M->head_dim * esz;
            seg[n++] = (seg_t){range_base(rg, layer, head, M->kv_fp16, 0) + skip,
                               range_base(rg, layer, head, M->kv_fp16, 1) + skip, hi - lo};
            got += hi - lo;
        }
        at += len;
    }
    *nseg = n;
    return got;
}

typedef struct {
    float *kf, *vf, *s, *tmp, *state;
    const float **qs;
    int *lim;
    float **dst;
} scratch_t;

static scratch_t scratch_for(const fwd_t *F, int tid) {
    int dim = F->M->head_dim, q = F->qmax;
    float *base = F->scratch + (size_t)tid * F->scratch_floats;
    scratch_t t;
    t.kf = base;
    t.vf = t.kf + CHUNK * dim;
    t.s = t.vf + CHUNK * dim;
    t.tmp = t.s + (size_t)q * CHUNK;
    t.state = t.tmp + (size_t)q * (dim + 2);
    t.qs = (const float **)(t.state + (size_t)q * (dim + 2));
    t.lim = (int *)(t.qs + q);
    t.dst = (float **)(t.lim + q + (q & 1));
    return t;
}

/* Keys of the chunk at [c0, c0 + count) each query sees (vis[q]: below its lim), and the most any sees. */
static inline int visible_keys(const scratch_t *t, int nq, int c0, int count, int *vis) {
    int most = 0;
    for (int q = 0; q < nq; q++) {
        int v = t->lim[q] - c0;
        vis[q] = v < 0 ? 0 : (v > count ? count : v);
        most = vis[q] > most ? vis[q] : most;
    }
    return most;
}

/* The SIMD attention asks for its keys and values ahead of use. On a 2-core Zen 2 (AVX2) a
 * decode step's attention ran at ~6 GB/s a thread, latency-bound (one core streams ~16 GB/s):
 * keys 16 KB ahead, values 4 KB ahead while the scores run and 8 KB ahead in the first value
 * pass took a 4K decode step from 12.2 to 11.1 ms (bench/decode.py, in-process A/B) and the
 * attention alone 1.6x on one thread. On a 2-core Sapphire Rapids-class Xeon (AVX-512), keys 16 KB
 * and values 8 KB ahead: 4K decode 10.9 -> 9.7 ms, 512 5.3 -> 4.7 (in-process A/B, medians of 4),
 * ingest unchanged (on a Zen 5 the same gave no consistent gain). Results unchanged. There the
 * AVX-512 scores pass also asks for the values of the keys it scores into L2 (prefetcht1; read by
 * the value pass a chunk later): both streams in flight at once, the value pass from L2. 4K decode
 * 8.3 -> 7.6 ms (in-process A/B, every round faster), the attention alone (two threads, 30 layers
 * of 4K fp16 K/V, the L3 swept before each run) 4.4 -> 3.8 ms; ingest unchanged. */
#define ATT_K_AHEAD (16 << 10)
#define ATT_V_AHEAD (8 << 10)

/* Ask for both lines of a 64-dim fp16 row `ahead` bytes past p. */
static inline void prefetch_row(const uint16_t *p, int64_t ahead) {
    prefetch_at(p, ahead);
    prefetch_at(p + 32, ahead);
}

#if SK_AVX512
/* chunk_parts for head_dim 64 and an fp16 cache: keys and values are read once, straight from
 * the cache; each converted key serves every query; scores are reduced four keys at a time, four
 * queries together (reduce16: 4 x 4 sums in ~45 operations where four reduce4 take ~80; ingest
 * +7% / +12% at 512 / 4K on a 2-core Sapphire Rapids-class Xeon, in-process A/B), the queries a
 * group leaves over (a decode row's 3) one at a time by reduce4: the same sums either way. */
#define PV_GROUP 6
/* acc[q] = sum_j p[q][j] v_j over the chunk's first `most` values of one head (fp16 rows of
 * 64, in runs), key by key in order, into dst[q] + 2. */
static inline __attribute__((always_inline)) void pv(const float *p, float *const *dst, const int gn,
                                                     const seg_t *seg, int nseg, int most) {
    __m512 acc[PV_GROUP][4];
    for (int q = 0; q < gn; q++)
        for (int c = 0; c < 4; c++) acc[q][c] = _mm512_setzero_ps();
    for (int r = 0, j0 = 0; r < nseg && j0 < most; j0 += seg[r].count, r++) {
        const uint16_t *V = (const uint16_t *)seg[r].v;
        int n = most - j0 < seg[r].count ? most - j0 : seg[r].count;
        for (int j = 0; j < n; j++) {
            prefetch_row(V + (int64_t)j * 64, ATT_V_AHEAD);
            __m512 v[4];
            for (int c = 0; c < 4; c++) v[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(V + (int64_t)j * 64 + 16 * c)));
            for (int q = 0; q < gn; q++) {
                __m512 pj = _mm512_set1_ps(p[(size_t)q * CHUNK + j0 + j]);
                for (int c = 0; c < 4; c++) acc[q][c] = _mm512_fmadd_ps(pj, v[c], acc[q][c]);
            }
        }
    }
    for (int q = 0; q < gn; q++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(dst[q] + 2 + 16 * c, acc[q][c]);
}

static void pv_any(const float *p, float *const *dst, int gn, const seg_t *seg, int nseg, int most) {
    switch (gn) { /* a copy per group size: the accumulators stay in registers */
    case 1: pv(p, dst, 1, seg, nseg, most); break;
    case 2: pv(p, dst, 2, seg, nseg, most); break;
    case 3: pv(p, dst, 3, seg, nseg, most); break;
    case 4: pv(p, dst, 4, seg, nseg, most); break;
    case 5: pv(p, dst, 5, seg, nseg, most); break;
    default: pv(p, dst, 6, seg, nseg, most); break;
    }
}

/* A 64-dim query times a converted key, lane by lane over its four 16-lane quarters (one chain:
 * mul, then three FMAs): what reduce4 and reduce16 sum into a score. */
static inline __m512 lane_products(const float *qv, const __m512 *k) {
    __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qv), k[0]);
    x = _mm512_fmadd_ps(_mm512_loadu_ps(qv + 16), k[1], x);
    x = _mm512_fmadd_ps(_mm512_loadu_ps(qv + 32), k[2], x);
    return _mm512_fmadd_ps(_mm512_loadu_ps(qv + 48), k[3], x);
}

static void chunk_parts_h64(scratch_t *t, int nq, const seg_t *seg, int nseg, int c0, int count) {
    int vis[MAX_Q], most = visible_keys(t, nq, c0, count, vis);
    float *s = t->s;
    for (int r = 0, j0 = 0; r < nseg && j0 < most; j0 += seg[r].count, r++) { /* scores, four keys at a time */
        const uint16_t *K = (const uint16_t *)seg[r].k;
        int n = most - j0 < seg[r].count ? most - j0 : seg[r].count;
        for (int j = 0; j < n; j += 4) {
            for (int u = 0; u < 4; u++) prefetch_row(K + (int64_t)(j + u) * 64, ATT_K_AHEAD);
            for (int l = 0; l < 4 * 128; l += 64) prefetch_l2(seg[r].v, (int64_t)j * 128 + l); /* these keys' values */
            __m512 k[4][4];
            for (int u = 0; u < 4; u++)
                for (int p = 0; p < 4; p++)
                    k[u][p] = j + u < n ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(K + (int64_t)(j + u) * 64 + 16 * p)))
                                        : _mm512_setzero_ps();
            __mmask8 keep = n - j >= 4 ? 0xF : (__mmask8)((1u << (n - j)) - 1); /* the keys that exist */
            int q = 0;
            for (; q + 4 <= nq; q += 4) { /* four queries x four keys, reduced together */
                __m512 a[16];
                for (int e = 0; e < 4; e++) {
                    const float *qv = t->qs[q + e];
                    for (int u = 0; u < 4; u++) a[4 * e + u] = lane_products(qv, k[u]);
                }
                __m512 r = reduce16(a);
                float *row = s + (size_t)q * CHUNK + j0 + j;
                _mm_mask_storeu_ps(row, keep, _mm512_castps512_ps128(r));
                _mm_mask_storeu_ps(row + CHUNK, keep, _mm512_extractf32x4_ps(r, 1));
                _mm_mask_storeu_ps(row + 2 * CHUNK, keep, _mm512_extractf32x4_ps(r, 2));
                _mm_mask_storeu_ps(row + 3 * CHUNK, keep, _mm512_extractf32x4_ps(r, 3));
            }
            for (; q < nq; q++) {
                const float *qv = t->qs[q];
                __m512 a[4];
                for (int u = 0; u < 4; u++) a[u] = lane_products(qv, k[u]);
                _mm_mask_storeu_ps(s + (size_t)q * CHUNK + j0 + j, keep, reduce4(a[0], a[1], a[2], a[3]));
            }
        }
    }
    for (int q = 0; q < nq; q++) { /* softmax pieces; scores past a query's last visible key become 0 */
        float *sq = s + (size_t)q * CHUNK, *d = t->dst[q];
        if (vis[q] == 0) {
            d[0] = -INFINITY;
            d[1] = 0.0f;
            for (int j = 0; j < most; j++) sq[j] = 0.0f;
            continue;
        }
        __m512 vm = _mm512_set1_ps(-INFINITY);
        int j = 0;
        for (; j + 16 <= vis[q]; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sq + j));
        __mmask16 tail = (__mmask16)((1u << (vis[q] - j)) - 1);
        vm = _mm512_mask_max_ps(vm, tail, vm, _mm512_maskz_loadu_ps(tail, sq + j));
        float mx = _mm512_reduce_max_ps(vm);
        __m512 m = _mm512_set1_ps(mx), l = _mm512_setzero_ps();
        for (j = 0; j < most; j += 16) {
            int left = vis[q] - j;
            __mmask16 mk = left >= 16 ? 0xFFFF : (left <= 0 ? 0 : (__mmask16)((1u << left) - 1));
            __mmask16 room = most - j >= 16 ? 0xFFFF : (__mmask16)((1u << (most - j)) - 1);
            __m512 p = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sq + j), m)));
            _mm512_mask_storeu_ps(sq + j, room, p);
            l = _mm512_add_ps(l, p);
        }
        d[0] = mx;
        d[1] = sum16(l);
    }
    for (int g = 0; g < nq; g += PV_GROUP) { /* acc = sum_j p_j v_j, each value converted once per group */
        int gn = nq - g < PV_GROUP ? nq - g : PV_GROUP;
        pv_any(s + (size_t)g * CHUNK, t->dst + g, gn, seg, nseg, most);
    }
}
#endif

#if SK_AVX2
#define ATT_V_AHEAD_SCORES (4 << 10)

/* chunk_parts for head_dim 64 and an fp16 cache on 8-lane vectors: keys are converted four at a
 * time into a buffer in L1 that serves every query (the generic path converted the whole chunk's
 * keys and values to fp32, 512 KB, and reduced each score alone); values are read once per two
 * queries and half a head, whose accumulators stay in registers. A query's scores, softmax and
 * sum are the same operations whatever the other queries of the task. */
static inline __m128 reduce4_256(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* acc[q] = sum_j p[q][j] v_j over the chunk's first `most` values, dims 32h .. 32h + 31 (fp16
 * rows of 64, in runs), key by key in order, into dst[q] + 2 + 32h; the `first` pass over the
 * values asks for them ahead. */
static inline __attribute__((always_inline)) void pv_half(const float *p, float *const *dst, const int gn,
                                                          const seg_t *seg, int nseg, int most, int h, int first) {
    __m256 acc[2][4];
    for (int q = 0; q < gn; q++)
        for (int c = 0; c < 4; c++) acc[q][c] = _mm256_setzero_ps();
    for (int r = 0, j0 = 0; r < nseg && j0 < most; j0 += seg[r].count, r++) {
        const uint16_t *V = (const uint16_t *)seg[r].v + 32 * h;
        int n = most - j0 < seg[r].count ? most - j0 : seg[r].count;
        for (int j = 0; j < n; j++) {
            if (first) prefetch_at(V + (int64_t)j * 64, ATT_V_AHEAD);
            __m256 v[4];
            for (int c = 0; c < 4; c++) v[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(V + (int64_t)j * 64 + 8 * c)));
            for (int q = 0; q < gn; q++) {
                __m256 pj = _mm256_set1_ps(p[(size_t)q * CHUNK + j0 + j]);
                for (int c = 0; c < 4; c++) acc[q][c] = _mm256_fmadd_ps(pj, v[c], acc[q][c]);
            }
        }
    }
    for (int q = 0; q < gn; q++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(dst[q] + 2 + 32 * h + 8 * c, acc[q][c]);
}

static void chunk_parts_h64(scratch_t *t, int nq, const seg_t *seg, int nseg, int c0, int count) {
    int vis[MAX_Q], most = visible_keys(t, nq, c0, count, vis);
    float *s = t->s;
    float kb[4][64] __attribute__((aligned(32)));
    for (int r = 0, j0 = 0; r < nseg && j0 < most; j0 += seg[r].count, r++) { /* scores, four keys at a time */
        const uint16_t *K = (const uint16_t *)seg[r].k;
        int n = most - j0 < seg[r].count ? most - j0 : seg[r].count;
        const uint16_t *V = (const uint16_t *)seg[r].v;
        for (int j = 0; j < n; j += 4) {
            for (int u = 0; u < 4; u++) { /* a line of each key (the adjacent line comes with it) */
                prefetch_at(K + (int64_t)(j + u) * 64, ATT_K_AHEAD);
                prefetch_at(V + (int64_t)(j + u) * 64, ATT_V_AHEAD_SCORES);
            }
            for (int u = 0; u < 4; u++)
                for (int c = 0; c < 8; c++)
                    _mm256_store_ps(kb[u] + 8 * c, j + u < n ? _mm256_cvtph_ps(_mm_loadu_si128(
                                                                   (const __m128i *)(K + (int64_t)(j + u) * 64 + 8 * c)))
                                                             : _mm256_setzero_ps());
            for (int q = 0; q < nq; q++) {
                const float *qv = t->qs[q];
                __m256 a[4];
                for (int u = 0; u < 4; u++) {
                    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qv), _mm256_load_ps(kb[u]));
                    for (int c = 1; c < 8; c++) x = _mm256_fmadd_ps(_mm256_loadu_ps(qv + 8 * c), _mm256_load_ps(kb[u] + 8 * c), x);
                    a[u] = x;
                }
                float four[4];
                _mm_storeu_ps(four, reduce4_256(a[0], a[1], a[2], a[3]));
                for (int u = 0; u < 4 && j + u < n; u++) s[(size_t)q * CHUNK + j0 + j + u] = four[u];
            }
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int q = 0; q < nq; q++) { /* softmax pieces; scores past a query's last visible key become 0 */
        float *sq = s + (size_t)q * CHUNK, *d = t->dst[q];
        if (vis[q] == 0) {
            d[0] = -INFINITY;
            d[1] = 0.0f;
            for (int j = 0; j < most; j++) sq[j] = 0.0f;
            continue;
        }
        __m256 vm = _mm256_set1_ps(-INFINITY);
        int j = 0;
        for (; j + 8 <= vis[q]; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sq + j));
        float lanes[8], mx = -INFINITY;
        _mm256_storeu_ps(lanes, vm);
        for (int e = 0; e < 8; e++) mx = lanes[e] > mx ? lanes[e] : mx;
        for (; j < vis[q]; j++) mx = sq[j] > mx ? sq[j] : mx;
        __m256 m = _mm256_set1_ps(mx), l = _mm256_setzero_ps();
        const __m256i limit = _mm256_set1_epi32(vis[q]);
        for (j = 0; j < most; j += 8) { /* most <= CHUNK: a row's 8 lanes stay inside its CHUNK scores */
            __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, _mm256_add_epi32(lane, _mm256_set1_epi32(j))));
            __m256 p = _mm256_and_ps(keep, exp256(_mm256_sub_ps(_mm256_and_ps(keep, _mm256_loadu_ps(sq + j)), m)));
            _mm256_storeu_ps(sq + j, p);
            l = _mm256_add_ps(l, p);
        }
        d[0] = mx;
        d[1] = hsum256(l);
    }
    for (int g = 0; g < nq; g += 2) { /* acc = sum_j p_j v_j, each value converted once per two queries */
        int gn = nq - g < 2 ? nq - g : 2;
        for (int h = 0; h < 2; h++) {
            if (gn == 2) pv_half(s + (size_t)g * CHUNK, t->dst + g, 2, seg, nseg, most, h, g == 0 && h == 0);
            else pv_half(s + (size_t)g * CHUNK, t->dst + g, 1, seg, nseg, most, h, g == 0 && h == 0);
        }
    }
}
#endif

/* Partials of `nq` query vectors over the chunk of keys at [c0, c0 + count) of their sequence
 * (in runs); query q sees the keys below lim[q]. */
static void chunk_parts(const fwd_t *F, scratch_t *t, int nq, const seg_t *seg, int nseg, int c0, int count) {
    const sk_model *M = F->M;
    int dim = M->head_dim;
#if SK_AVX512 || SK_AVX2
    if (dim == 64 && M->kv_fp16) {
        chunk_parts_h64(t, nq, seg, nseg, c0, count);
        return;
    }
#endif
    for (int r = 0, j0 = 0; r < nseg; j0 += seg[r].count, r++) {
        load_rows(seg[r].k, M->kv_fp16, 0, seg[r].count, dim, t->kf + (size_t)j0 * dim);
        load_rows(seg[r].v, M->kv_fp16, 0, seg[r].count, dim, t->vf + (size_t)j0 * dim);
    }
    scores(t->qs, nq, t->kf, count, dim, t->s);
    for (int q = 0; q < nq; q++) {
        int visible = t->lim[q] - c0;
        visible = visible > count ? count : visible;
        float *d = t->dst[q];
        if (visible <= 0) {
            d[0] = -INFINITY;
            d[1] = 0.0f;
            continue;
        }
        chunk_softmax(t->s + (size_t)q * CHUNK, visible, t->vf, dim, &d[0], &d[1], d + 2);
    }
}

/* The chunk `c` of a sequence's keys (group ranges, then own) for one layer and kv head. */
static int seq_chunk(const fwd_t *F, const sk_seq *s, int layer, int head, int c, seg_t *seg, int *nseg) {
    const sk_plan *P = F->plan;
    const sk_group *g = s->group >= 0 ? &P->groups[s->group] : NULL;
    return chunk_segments(F, g ? &P->ranges[g->range0] : NULL, g ? g->nranges : 0, &s->own, s->start + s->n, layer,
                          head, c * CHUNK, seg, nseg);
}

static void run_a(const fwd_t *F, const task_t *k, int layer, scratch_t *t) {
    const sk_model *M = F->M;
    const sk_plan *P = F->plan;
    int G = M->heads / M->kv_heads, nq = 0, nseg, count;
    seg_t seg[MAX_SEGS];
    if (k->kind == A_GROUP) { /* a chunk wholly inside the group's ranges: every key visible */
        const sk_group *g = &P->groups[k->idx];
        count = chunk_segments(F, &P->ranges[g->range0], g->nranges, NULL, 0, layer, k->head, k->chunk * CHUNK, seg,
                               &nseg);
        for (int i = k->first; i < k->first + k->count; i++) {
            int row = F->group_rows[F->group_row0[k->idx] + i];
            for (int e = 0; e < G; e++) {
                int head = k->head * G + e;
                t->qs[nq] = q_vec(F, row, head);
                t->lim[nq] = F->group_len[k->idx];
                t->dst[nq++] = part_at(F, row, k->chunk, head);
            }
        }
    } else {
        const sk_seq *s = &P->seqs[k->idx];
        count = seq_chunk(F, s, layer, k->head, k->chunk, seg, &nseg);
        for (int i = 0; i < s->n; i++) {
            int row = s->row0 + i;
            for (int e = 0; e < G; e++) {
                int head = k->head * G + e;
                t->qs[nq] = q_vec(F, row, head);
                t->lim[nq] = seq_before(F, s) + s->start + i + 1;
                t->dst[nq++] = part_at(F, row, k->chunk, head);
            }
        }
    }
    chunk_parts(F, t, nq, seg, nseg, k->chunk * CHUNK, count);
}

static void run_b(const fwd_t *F, const task_t *k, int layer, scratch_t *t) {
    const sk_model *M = F->M;
    const sk_seq *s = &F->plan->seqs[k->idx];
    int G = M->heads / M->kv_heads, dim = M->head_dim, nq = k->count * G, stride = dim + 2;
    int stored = seq_slots(F, s), before = seq_before(F, s);
    for (int q = 0; q < nq; q++) {
        float *st = t->state + (size_t)q * stride;
        st[0] = -INFINITY;
        st[1] = 0.0f;
        int row = s->row0 + k->first + q / G, head = k->head * G + q % G;
        for (int c = 0; c < stored; c++) {
            const float *p = part_at(F, row, c, head);
            merge_into(&st[0], &st[1], st + 2, p[0], p[1], p + 2, dim);
        }
    }
    if (!is_split(s)) { /* the chunks after the shared ones, for this tile's rows */
        int last = before + s->start + k->first + k->count; /* keys the tile's last row sees */
        for (int q = 0; q < nq; q++) {
            int i = k->first + q / G;
            t->qs[q] = q_vec(F, s->row0 + i, k->head * G + q % G);
            t->lim[q] = before + s->start + i + 1;
            t->dst[q] = t->tmp + (size_t)q * stride;
        }
        for (int c = stored; c < chunks_of(last); c++) {
            seg_t seg[MAX_SEGS];
            int nseg, count = seq_chunk(F, s, layer, k->head, c, seg, &nseg);
            chunk_parts(F, t, nq, seg, nseg, c * CHUNK, count);
            for (int q = 0; q < nq; q++) {
                float *st = t->state + (size_t)q * stride, *p = t->dst[q];
                merge_into(&st[0], &st[1], st + 2, p[0], p[1], p + 2, dim);
            }
        }
    }
    for (int q = 0; q < nq; q++) {
        const float *st = t->state + (size_t)q * stride;
        int row = s->row0 + k->first + q / G, head = k->head * G + q % G;
        float *o = F->attn + (int64_t)row * M->heads * dim + (int64_t)head * dim;
        float inv = st[1] > 0.0f ? 1.0f / st[1] : 0.0f;
        for (int d = 0; d < dim; d++) o[d] = st[2 + d] * inv;
    }
}

/* Rotary embedding (rotate-half, as Llama and Qwen), in place on one head vector. */
static void rope(float *x, const float *cos, const float *sin, int dim) {
    int half = dim / 2;
    for (int d = 0; d < half; d++) {
        float a = x[d], b = x[d + half];
        x[d] = a * cos[d] - b * sin[d];
        x[d + half] = b * cos[d + half] + a * sin[d + half];
    }
}

static void store_kv(void *dst, int fp16, const float *src, int dim) {
    if (!fp16) {
        memcpy(dst, src, (size_t)dim * 4);
        return;
    }
    uint16_t *h = dst;
    int d = 0;
#if SK_AVX512
    for (; d + 16 <= dim; d += 16)
        _mm256_storeu_si256((__m256i *)(h + d), _mm512_cvtps_ph(_mm512_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif SK_AVX2
    for (; d + 8 <= dim; d += 8)
        _mm_storeu_si128((__m128i *)(h + d), _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; d < dim; d++) h[d] = f2h(src[d]);
}

/* New rows' queries (norm, rotated, scaled) and keys (norm, rotated) and values, the keys and
 * values written into each sequence's own cache at their slots. */
static void prepare_row(const fwd_t *F, int layer, int row) {
    const sk_model *M = F->M;
    const sk_layer *L = &M->layer[layer];
    const sk_plan *P = F->plan;
    const sk_seq *s = &P->seqs[F->row_seq[row]];
    int dim = M->head_dim, slot = s->start + (row - s->row0);
    float *base = F->qkv + (int64_t)row * qkv_width(M);
    const float *cos = P->cos + (int64_t)row * dim, *sin = P->sin + (int64_t)row * dim;
    for (int hd = 0; hd < M->heads + M->kv_heads; hd++) {
        float *x = base + (int64_t)hd * dim;
        int is_q = hd < M->heads;
        const float *nw = is_q ? L->q_norm : L->k_norm;
        if (nw) rmsnorm(x, nw, dim, M->eps, x);
        rope(x, cos, sin, dim);
        if (is_q)
            for (int d = 0; d < dim; d++) x[d] *= M->scale;
    }
    int esz = M->kv_fp16 ? 2 : 4;
    for (int hd = 0; hd < M->kv_heads; hd++) {
        int64_t off = ((int64_t)layer * s->own.layer_stride + (int64_t)hd * s->own.head_stride + (int64_t)slot * dim) * esz;
        store_kv((char *)(uintptr_t)s->own.k + off, M->kv_fp16, base + (int64_t)(M->heads + hd) * dim, dim);
        store_kv((char *)(uintptr_t)s->own.v + off, M->kv_fp16, base + (int64_t)(M->heads + M->kv_heads + hd) * dim, dim);
    }
}

/* g[i] = silu(g[i]) * u[i] */
static void silu_mul(float *g, const float *u, int n) {
    int i = 0;
#if SK_AVX512
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
#elif SK_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) g[i] = g[i] / (1.0f + exp_scalar(-g[i])) * u[i];
}

static void forward_job(void *ctx, int tid, int nth) {
    fwd_t *F = ctx;
    const sk_model *M = F->M;
    int N = F->rows, lo, hi, hidden = M->hidden, inter = M->inter;
    split(N, tid, nth, &lo, &hi);
    scratch_t t = scratch_for(F, tid);
    sk_ctx *c = F->c;
    double mark = c->profiling ? now_s() : 0.0;
    for (int layer = 0; layer < M->layers; layer++) {
        const sk_layer *L = &M->layer[layer];
        rmsnorm_rows(F->h, L->in_norm, hidden, M->eps, F->norm, hidden, lo, hi);
        for (int r = lo; r < hi; r++) quantize_row(F->norm + (int64_t)r * hidden, &F->act_h, r);
        lap(c, tid, T_NORM, &mark, nth, 1);
        gemm_part(&L->qkv, &F->act_h, N, F->qkv, qkv_width(M), 0, tid, nth);
        lap(c, tid, T_QKV, &mark, nth, 1);
        for (int r = lo; r < hi; r++) prepare_row(F, layer, r);
        lap(c, tid, T_ROPE, &mark, nth, 1);
        atomic_int *next = F->next + 2 * layer;
        for (int i; (i = atomic_fetch_add(&next[0], 1)) < F->ntasks_a;) run_a(F, &F->tasks_a[i], layer, &t);
        lap(c, tid, T_ATTN_A, &mark, nth, 1);
        for (int i; (i = atomic_fetch_add(&next[1], 1)) < F->ntasks_b;) run_b(F, &F->tasks_b[i], layer, &t);
        lap(c, tid, T_ATTN_B, &mark, nth, 1);
        for (int r = lo; r < hi; r++) quantize_row(F->attn + (int64_t)r * M->heads * M->head_dim, &F->act_a, r);
        lap(c, tid, T_NORM, &mark, nth, 1);
        gemm_part(&L->o, &F->act_a, N, F->h, hidden, 1, tid, nth);
        lap(c, tid, T_O, &mark, nth, 1);
        rmsnorm_rows(F->h, L->post_norm, hidden, M->eps, F->norm, hidden, lo, hi);
        for (int r = lo; r < hi; r++) quantize_row(F->norm + (int64_t)r * hidden, &F->act_h, r);
        lap(c, tid, T_NORM, &mark, nth, 1);
        gemm_part(&L->gate_up, &F->act_h, N, F->gu, 2 * inter, 0, tid, nth);
        lap(c, tid, T_GATE_UP, &mark, nth, 1);
        for (int r = lo; r < hi; r++) {
            float *g = F->gu + (int64_t)r * 2 * inter, *u = g + inter;
            silu_mul(g, u, inter);
            quantize_row(g, &F->act_i, r);
        }
        lap(c, tid, T_NORM, &mark, nth, 1);
        gemm_part(&L->down, &F->act_i, N, F->h, hidden, 1, tid, nth);
        lap(c, tid, T_DOWN, &mark, nth, 1);
    }
    if (F->out)
        rmsnorm_rows(F->h, M->final_norm, hidden, M->eps, F->out, hidden, lo, hi);
    lap(c, tid, T_NORM, &mark, nth, 0);
}

/* ---- the step's plan: slots, tasks, workspace --------------------------------------------- */

#define CARVE(ptr, type, count)                                                                                  \
    do {                                                                                                         \
        ptr = (type *)(base + off);                                                                              \
        off += ((size_t)(count) * sizeof(type) + ALIGN - 1) / ALIGN * ALIGN;                                     \
    } while (0)

/* The most rows of one kv head an attention task holds queries for. */
static inline int task_rows(void) {
    int most = GROUP_ROWS > ROW_TILE ? GROUP_ROWS : ROW_TILE;
    return most > SPLIT_ROWS ? most : SPLIT_ROWS;
}

/* Run every layer for `rows` packed rows. h: [rows, hidden] (updated in place: the residual
 * stream); out: [rows, hidden] the final-normed hidden states (or NULL). Returns 0, or a
 * negative number when memory runs out or the plan is inconsistent. */
static int forward_locked(sk_ctx *c, const sk_model *M, const sk_plan *P, int rows, float *h, float *out);

int sk_forward(sk_ctx *c, const sk_model *M, const sk_plan *P, int rows, float *h, float *out) {
    pthread_mutex_lock(&api_lock);
    int rc = forward_locked(c, M, P, rows, h, out);
    pthread_mutex_unlock(&api_lock);
    return rc;
}

static int forward_locked(sk_ctx *c, const sk_model *M, const sk_plan *P, int rows, float *h, float *out) {
    if (rows <= 0 || M->kv_heads <= 0 || M->heads <= 0 || M->heads % M->kv_heads) return SK_EINVAL;
    int G = M->heads / M->kv_heads, dim = M->head_dim, nth = POOL.nth;
    int qmax = G * task_rows();
    if (qmax > MAX_Q) return SK_EUNSUPPORTED; /* more query heads per kv head than a task's arrays hold */
    for (int g = 0; g < P->ngroups; g++) {
        if (P->groups[g].nranges < 0) return SK_EPLAN;
        if (P->groups[g].nranges >= MAX_SEGS) return SK_EUNSUPPORTED; /* more ranges than a chunk's runs hold */
    }
    fwd_t F = {.c = c, .M = M, .plan = P, .rows = rows, .h = h, .out = out, .qmax = qmax};
    int32_t group_len[P->ngroups + 1], group_members[P->ngroups + 1];
    F.group_len = group_len;
    for (int g = 0; g < P->ngroups; g++) {
        group_len[g] = group_members[g] = 0;
        for (int r = 0; r < P->groups[g].nranges; r++) group_len[g] += P->ranges[P->groups[g].range0 + r].len;
    }
    /* sizes: partial slots, tasks */
    int64_t slot_total = 0;
    int na = 0, nb = 0;
    for (int s = 0; s < P->nseqs; s++) {
        const sk_seq *q = &P->seqs[s];
        if (q->row0 < 0 || q->n <= 0 || q->row0 + q->n > rows || q->group >= P->ngroups) return SK_EPLAN;
        if (q->group >= 0) group_members[q->group] += q->n;
        slot_total += (int64_t)q->n * seq_slots(&F, q);
        if (is_split(q)) na += (chunks_of(seq_before(&F, q) + q->start + q->n) - seq_shared(&F, q)) * M->kv_heads;
        nb += M->kv_heads * ((q->n + ROW_TILE - 1) / ROW_TILE);
    }
    for (int g = 0; g < P->ngroups; g++)
        na += group_len[g] / CHUNK * M->kv_heads * ((group_members[g] + GROUP_ROWS - 1) / GROUP_ROWS);

    int wq = (M->heads + 2 * M->kv_heads) * dim, wa = M->heads * dim;
    size_t sf = 2 * CHUNK * dim + (size_t)qmax * CHUNK + 2 * (size_t)qmax * (dim + 2) + 5 * (size_t)qmax + 16;
    F.scratch_floats = (sf + 15) / 16 * 16;
    int act_k[3] = {M->hidden, wa, M->inter};
    size_t need = 0;
    need += (size_t)rows * M->hidden * 4 + (size_t)rows * wq * 4 + (size_t)rows * wa * 4 + (size_t)rows * 2 * M->inter * 4;
    for (int i = 0; i < 3; i++) need += act_bytes(act_k[i], rows) + ALIGN;
    need += (size_t)slot_total * M->heads * (dim + 2) * 4;
    need += (size_t)rows * 12 + (size_t)(P->ngroups + 1) * 8;
    need += (size_t)(na + nb + 2) * sizeof(task_t) + (size_t)M->layers * 2 * sizeof(atomic_int);
    need += (size_t)nth * F.scratch_floats * 4 + 32 * ALIGN;
    char *base = grow(&c->ws_buf, &c->ws_cap, need);
    if (!base) return SK_ENOMEM;
    size_t off = 0;
    CARVE(F.norm, float, (size_t)rows * M->hidden);
    CARVE(F.qkv, float, (size_t)rows * wq);
    CARVE(F.attn, float, (size_t)rows * wa);
    CARVE(F.gu, float, (size_t)rows * 2 * M->inter);
    act_t *acts[3] = {&F.act_h, &F.act_a, &F.act_i};
    for (int i = 0; i < 3; i++) {
        act_place(acts[i], act_k[i], rows, base + off);
        off += round_up(act_bytes(act_k[i], rows));
    }
    CARVE(F.parts, float, (size_t)slot_total * M->heads * (dim + 2));
    CARVE(F.row_slot0, int32_t, rows);
    CARVE(F.row_seq, int32_t, rows);
    CARVE(F.group_rows, int32_t, rows);
    CARVE(F.group_row0, int32_t, P->ngroups + 1);
    CARVE(F.group_nrows, int32_t, P->ngroups + 1);
    CARVE(F.tasks_a, task_t, na + 1);
    CARVE(F.tasks_b, task_t, nb + 1);
    CARVE(F.next, atomic_int, (size_t)M->layers * 2);
    CARVE(F.scratch, float, (size_t)nth * F.scratch_floats);

    /* rows -> sequences and partial slots; groups' rows */
    int64_t slot = 0;
    for (int s = 0; s < P->nseqs; s++) {
        const sk_seq *q = &P->seqs[s];
        for (int i = 0; i < q->n; i++) {
            F.row_seq[q->row0 + i] = s;
            F.row_slot0[q->row0 + i] = (int32_t)slot;
            slot += seq_slots(&F, q);
        }
    }
    int filled = 0;
    for (int g = 0; g < P->ngroups; g++) {
        F.group_row0[g] = filled;
        for (int s = 0; s < P->nseqs; s++)
            if (P->seqs[s].group == g)
                for (int i = 0; i < P->seqs[s].n; i++) F.group_rows[filled++] = P->seqs[s].row0 + i;
        F.group_nrows[g] = filled - F.group_row0[g];
    }
    /* tasks */
    int ia = 0, ib = 0;
    for (int g = 0; g < P->ngroups; g++)
        for (int c = 0; c < group_len[g] / CHUNK; c++)
            for (int hd = 0; hd < M->kv_heads; hd++)
                for (int first = 0; first < F.group_nrows[g]; first += GROUP_ROWS) {
                    int cnt = F.group_nrows[g] - first < GROUP_ROWS ? F.group_nrows[g] - first : GROUP_ROWS;
                    F.tasks_a[ia++] = (task_t){A_GROUP, g, c, hd, first, cnt};
                }
    for (int s = 0; s < P->nseqs; s++) {
        const sk_seq *q = &P->seqs[s];
        if (is_split(q))
            for (int c = seq_shared(&F, q); c < chunks_of(seq_before(&F, q) + q->start + q->n); c++)
                for (int hd = 0; hd < M->kv_heads; hd++) F.tasks_a[ia++] = (task_t){A_SEQ, s, c, hd, 0, q->n};
        for (int first = 0; first < q->n; first += ROW_TILE)
            for (int hd = 0; hd < M->kv_heads; hd++) {
                int cnt = q->n - first < ROW_TILE ? q->n - first : ROW_TILE;
                F.tasks_b[ib++] = (task_t){0, s, 0, hd, first, cnt};
            }
    }
    F.ntasks_a = ia;
    F.ntasks_b = ib;
    for (int i = 0; i < M->layers * 2; i++) atomic_init(&F.next[i], 0);
    run_job(forward_job, &F);
    return SK_OK;
}

/* ---- the ABI: what kernels/cpu.py checks its ctypes declarations against at load ----------- */

int64_t sk_sizeof_qmat(void) { return (int64_t)sizeof(sk_qmat); }
int64_t sk_sizeof_layer(void) { return (int64_t)sizeof(sk_layer); }
int64_t sk_sizeof_model(void) { return (int64_t)sizeof(sk_model); }
int64_t sk_sizeof_range(void) { return (int64_t)sizeof(sk_range); }
int64_t sk_sizeof_seq(void) { return (int64_t)sizeof(sk_seq); }
int64_t sk_sizeof_group(void) { return (int64_t)sizeof(sk_group); }
int64_t sk_sizeof_plan(void) { return (int64_t)sizeof(sk_plan); }

/* Read-only ranges a sequence may read (a chunk's runs hold them and the own cache). */
int sk_max_ranges(void) { return MAX_SEGS - 1; }

/* Query heads per kv head the attention tasks hold. */
int sk_max_group(void) { return MAX_Q / task_rows(); }
