// AVX2 + FMA + F16C kernels. Everything here has internal linkage so nothing compiled for AVX2 can
// be merged into code that runs on older CPUs; the table at the bottom is the only export.
#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace hm {
namespace {

constexpr int kPrefetchBytes = 2048;  // software prefetch distance along the weight stream

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// MXFP4 decode for the GEMV: nibbles -> bf16 bytes of the doubled E2M1 value via two byte
// lookups, then bf16 -> fp32 by shifting/masking 16-bit halves. Exact, and it leaves the 32
// weights in the order kMxPerm below, which prep_x applies to the activations once per call.
const uint8_t kLutHi[16] = {0x00, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41,
                            0x00, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0, 0xC1, 0xC1};
const uint8_t kLutLo[16] = {0x00, 0x80, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x40,
                            0x00, 0x80, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x40};
const int kMxPerm[32] = {0, 2, 4,  6,  16, 18, 20, 22, 1, 3, 5,  7,  17, 19, 21, 23,
                         8, 10, 12, 14, 24, 26, 28, 30, 9, 11, 13, 15, 25, 27, 29, 31};

struct MxConsts {
    __m256i m0f, luth, lutl, hmask;
    MxConsts() {
        m0f = _mm256_set1_epi8(0x0f);
        luth = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kLutHi));
        lutl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kLutLo));
        hmask = _mm256_set1_epi32(int(0xffff0000u));
    }
};

inline void mx_decode_perm(const uint8_t* blk, const MxConsts& c, __m256* f) {
    // Broadcast-load + blend instead of an insert: keeps the shuffle ports for the lookups.
    __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(blk + 1)));
    __m256i nib = _mm256_and_si256(_mm256_blend_epi32(q, _mm256_srli_epi16(q, 4), 0xF0), c.m0f);
    __m256i hb = _mm256_shuffle_epi8(c.luth, nib);   // lane 0: elements 0..15, lane 1: 16..31
    __m256i lb = _mm256_shuffle_epi8(c.lutl, nib);
    __m256i wa = _mm256_unpacklo_epi8(lb, hb);       // bf16 of elements 0..7 | 16..23
    __m256i wb = _mm256_unpackhi_epi8(lb, hb);       // bf16 of elements 8..15 | 24..31
    f[0] = _mm256_castsi256_ps(_mm256_slli_epi32(wa, 16));
    f[1] = _mm256_castsi256_ps(_mm256_and_si256(wa, c.hmask));
    f[2] = _mm256_castsi256_ps(_mm256_slli_epi32(wb, 16));
    f[3] = _mm256_castsi256_ps(_mm256_and_si256(wb, c.hmask));
}

inline void q8_decode(const uint8_t* blk, __m256* f) {
    for (int i = 0; i < 4; ++i)
        f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * i))));
}

inline __m256 q8_scale(const uint8_t* blk) {
    uint16_t h;
    std::memcpy(&h, blk, 2);
    return _mm256_set1_ps(_cvtsh_ss(h));
}

void prep_x(int fmt, const float* x, float* xp, int64_t K) {
    if (fmt != kMXFP4) {
        std::memcpy(xp, x, K * sizeof(float));
        return;
    }
    for (int64_t b = 0; b < K; b += kBlockElems)
        for (int j = 0; j < kBlockElems; ++j) xp[b + j] = x[b + kMxPerm[j]];
}

// Per block: the 4 weight vectors times the 4 activation vectors, then one FMA by the block
// scale. Two accumulator sets (even/odd blocks) hide the FMA latency when NT is 1.
// One block of one row against NT activation rows. The dependency chains are kept short: the
// FP scheduler, not the ports, is what limits this loop on Zen-class cores.
//  NT == 1: two partial dot products per block, each scaled into its own accumulator (acc[0..1]).
//  NT >= 2: scale the 4 weight vectors once, then 2 accumulators per token (acc[2t], acc[2t+1]).
template <int FMT, int NT>
inline void gemv_block(const uint8_t* row, int64_t b, const float* const* xs, const MxConsts& c, __m256* acc) {
    constexpr int bb = FMT == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    const uint8_t* blk = row + b * bb;
    _mm_prefetch((const char*)blk + kPrefetchBytes, _MM_HINT_T0);
    __m256 f[4], d;
    if (FMT == kMXFP4) {
        mx_decode_perm(blk, c, f);
        d = _mm256_broadcast_ss(&g_e8m0_table[blk[0]]);
    } else {
        q8_decode(blk, f);
        d = q8_scale(blk);
    }
    if constexpr (NT == 1) {
        const float* xb = xs[0] + b * kBlockElems;
        __m256 s0 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
        __m256 s1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
        acc[0] = _mm256_fmadd_ps(s0, d, acc[0]);
        acc[1] = _mm256_fmadd_ps(s1, d, acc[1]);
    } else {
        for (int i = 0; i < 4; ++i) f[i] = _mm256_mul_ps(f[i], d);
        for (int t = 0; t < NT; ++t) {
            const float* xb = xs[t] + b * kBlockElems;
            acc[2 * t] = _mm256_fmadd_ps(f[0], _mm256_loadu_ps(xb), acc[2 * t]);
            acc[2 * t + 1] = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), acc[2 * t + 1]);
            acc[2 * t] = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), acc[2 * t]);
            acc[2 * t + 1] = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), acc[2 * t + 1]);
        }
    }
}

template <int FMT, int NT>
void gemv_t(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs,
            float* out, int64_t ldo) {
    const int64_t nb = K / kBlockElems;
    const MxConsts c;
    for (int64_t r = 0; r < n_rows; ++r) {
        const uint8_t* row = w + r * row_bytes;
        __m256 acc[2 * NT];
        for (int i = 0; i < 2 * NT; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) gemv_block<FMT, NT>(row, b, xs, c, acc);
        for (int t = 0; t < NT; ++t) out[t * ldo + r] = hsum(_mm256_add_ps(acc[2 * t], acc[2 * t + 1]));
    }
}

template <int FMT>
void gemv_fmt(const uint8_t* w, int64_t rb, int64_t n, int64_t K, const float* const* xs, int nt,
              float* out, int64_t ldo) {
    switch (nt) {
        case 1: return gemv_t<FMT, 1>(w, rb, n, K, xs, out, ldo);
        case 2: return gemv_t<FMT, 2>(w, rb, n, K, xs, out, ldo);
        case 3: return gemv_t<FMT, 3>(w, rb, n, K, xs, out, ldo);
        default: return gemv_t<FMT, 4>(w, rb, n, K, xs, out, ldo);
    }
}

void gemv(int fmt, const uint8_t* w, int64_t rb, int64_t n, int64_t K, const float* const* xs, int nt,
          float* out, int64_t ldo) {
    if (fmt == kMXFP4) gemv_fmt<kMXFP4>(w, rb, n, K, xs, nt, out, ldo);
    else gemv_fmt<kQ8_0>(w, rb, n, K, xs, nt, out, ldo);
}

void decode(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* tile) {
    const int64_t nb = K / kBlockElems;
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kMxfp4Lut2));
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            float* o = tile + r * K + b * kBlockElems;
            __m256 f[4], d;
            if (fmt == kMXFP4) {
                const uint8_t* blk = w + r * row_bytes + b * kMxfp4Bytes;
                __m128i q = _mm_loadu_si128((const __m128i*)(blk + 1));
                __m256i v = _mm256_shuffle_epi8(
                    lut, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m0f));
                __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
                f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
                f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
                f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
                f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
                d = _mm256_broadcast_ss(&g_e8m0_table[blk[0]]);
            } else {
                const uint8_t* blk = w + r * row_bytes + b * kQ8_0Bytes;
                q8_decode(blk, f);
                d = q8_scale(blk);
            }
            for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(f[i], d));
        }
    }
}

// MR x NR dot products sharing loads: MR activation rows against NR weight rows.
template <int MR, int NR>
void micro(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc) {
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 b[NR];
        for (int n = 0; n < NR; ++n) b[n] = _mm256_loadu_ps(B + n * ldb + k);
        for (int m = 0; m < MR; ++m) {
            __m256 a = _mm256_loadu_ps(A + m * lda + k);
            for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(a, b[n], acc[m][n]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) C[m * ldc + n] = hsum(acc[m][n]);
}

template <int MR>
void micro_n(int nr, const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C,
             int64_t ldc) {
    if (nr == 3) micro<MR, 3>(A, lda, B, ldb, K, C, ldc);
    else if (nr == 2) micro<MR, 2>(A, lda, B, ldb, K, C, ldc);
    else micro<MR, 1>(A, lda, B, ldb, K, C, ldc);
}

void gemm(const float* A, int64_t lda, int64_t M, const float* B, int64_t ldb, int64_t N, int64_t K,
          float* C, int64_t ldc) {
    for (int64_t n = 0; n < N; n += 3) {
        const int nr = int(N - n < 3 ? N - n : 3);
        for (int64_t m = 0; m < M; m += 3) {
            const int mr = int(M - m < 3 ? M - m : 3);
            const float *a = A + m * lda, *b = B + n * ldb;
            float* c = C + m * ldc + n;
            if (mr == 3) micro_n<3>(nr, a, lda, b, ldb, K, c, ldc);
            else if (mr == 2) micro_n<2>(nr, a, lda, b, ldb, K, c, ldc);
            else micro_n<1>(nr, a, lda, b, ldb, K, c, ldc);
        }
    }
}

}  // namespace

const KernelSet kAvx2Kernels = {"avx2", prep_x, gemv, decode, gemm};

}  // namespace hm
#pragma GCC pop_options
