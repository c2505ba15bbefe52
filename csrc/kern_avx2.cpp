// AVX2 + FMA + F16C kernels. Everything here has internal linkage so nothing compiled for AVX2 can
// be merged into code that runs on older CPUs; the table at the bottom is the only export.
#include "common.h"

#include <type_traits>
#include <vector>

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
template <int FMT, int NT, bool kPrefetch = true>
inline void gemv_block(const uint8_t* row, int64_t b, const float* const* xs, const MxConsts& c, __m256* acc) {
    constexpr int bb = FMT == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    const uint8_t* blk = row + b * bb;
    if (kPrefetch) _mm_prefetch((const char*)blk + kPrefetchBytes, _MM_HINT_T0);
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
    } else if constexpr (NT <= 4) {
        for (int i = 0; i < 4; ++i) f[i] = _mm256_mul_ps(f[i], d);
        for (int t = 0; t < NT; ++t) {
            const float* xb = xs[t] + b * kBlockElems;
            acc[2 * t] = _mm256_fmadd_ps(f[0], _mm256_loadu_ps(xb), acc[2 * t]);
            acc[2 * t + 1] = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), acc[2 * t + 1]);
            acc[2 * t] = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), acc[2 * t]);
            acc[2 * t + 1] = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), acc[2 * t + 1]);
        }
    } else {  // 5..8 tokens: one accumulator each (registers), enough independent chains anyway
        for (int i = 0; i < 4; ++i) f[i] = _mm256_mul_ps(f[i], d);
        for (int t = 0; t < NT; ++t) {
            const float* xb = xs[t] + b * kBlockElems;
            for (int i = 0; i < 4; ++i) acc[t] = _mm256_fmadd_ps(f[i], _mm256_loadu_ps(xb + 8 * i), acc[t]);
        }
    }
}

// Several tokens: the rows are walked in K chunks whose activation slices (NT x kc floats, 8 KB)
// stay in L1 while a group of rows passes over them (unchunked, every row re-read all NT
// activation rows from L2; larger slices get evicted by the weight stream and the accumulators).
// A group's rows (<= kGemvGroupRows, contiguous) are prefetched into L2 during the first chunk.
constexpr int64_t kGemvChunkFloats = 2048;  // NT * kc
constexpr int64_t kGemvGroupRows = 24;
constexpr int64_t kGemvWholeBytes = 24 << 10;
// A chunked GEMV pulls row r + 2 of its group into L2 while chunk 0 of row r is computed.
inline void prefetch_row_l2(const uint8_t* row, int64_t row_bytes) {
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char*)row + o, _MM_HINT_T1);
}  // activations this small stay in L1 unchunked (1-2 tokens)

template <int FMT, int NT>
void gemv_t(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs,
            float* out, int64_t ldo) {
    const int64_t nb = K / kBlockElems;
    const MxConsts c;
    constexpr int n_acc = NT <= 4 ? 2 * NT : NT;
    constexpr int64_t kcb = kGemvChunkFloats / (NT * kBlockElems);  // blocks per K chunk
    if (NT * K * 4 <= kGemvWholeBytes || nb <= kcb) {
        for (int64_t r = 0; r < n_rows; ++r) {
            const uint8_t* row = w + r * row_bytes;
            __m256 acc[n_acc];
            for (int i = 0; i < n_acc; ++i) acc[i] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) gemv_block<FMT, NT>(row, b, xs, c, acc);
            for (int t = 0; t < NT; ++t)
                out[t * ldo + r] = hsum(NT <= 4 ? _mm256_add_ps(acc[2 * t], acc[2 * t + 1]) : acc[t]);
        }
        return;
    }
    alignas(32) float keep[kGemvGroupRows][n_acc][8];
    for (int64_t r0 = 0; r0 < n_rows; r0 += kGemvGroupRows) {
        const int64_t nr = n_rows - r0 < kGemvGroupRows ? n_rows - r0 : kGemvGroupRows;
        const uint8_t* g = w + r0 * row_bytes;
        for (int64_t b0 = 0; b0 < nb; b0 += kcb) {
            const int64_t b1 = nb - b0 < kcb ? nb : b0 + kcb;
            for (int64_t r = 0; r < nr; ++r) {
                const uint8_t* row = g + r * row_bytes;
                if (b0 == 0 && r + 2 < nr) prefetch_row_l2(row + 2 * row_bytes, row_bytes);
                __m256 acc[n_acc];
                for (int i = 0; i < n_acc; ++i) acc[i] = b0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(keep[r][i]);
                for (int64_t b = b0; b < b1; ++b) gemv_block<FMT, NT, false>(row, b, xs, c, acc);
                if (b1 < nb) {
                    for (int i = 0; i < n_acc; ++i) _mm256_store_ps(keep[r][i], acc[i]);
                } else {
                    for (int t = 0; t < NT; ++t)
                        out[t * ldo + r0 + r] = hsum(NT <= 4 ? _mm256_add_ps(acc[2 * t], acc[2 * t + 1]) : acc[t]);
                }
            }
        }
    }
}

#include "gemv_dispatch.inc"

struct DecodeConsts {
    __m256i m0f, lut;
    DecodeConsts() {
        m0f = _mm256_set1_epi8(0x0f);
        lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kMxfp4Lut2));
    }
};

// One block's 32 weights as float32 in natural order (bit-exact).
template <int FMT>
inline void decode_block(const uint8_t* blk, const DecodeConsts& c, float* o) {
    __m256 f[4], d;
    if (FMT == kMXFP4) {
        __m128i q = _mm_loadu_si128((const __m128i*)(blk + 1));
        __m256i v = _mm256_shuffle_epi8(c.lut, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), c.m0f));
        __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
        d = _mm256_broadcast_ss(&g_e8m0_table[blk[0]]);
    } else {
        q8_decode(blk, f);
        d = q8_scale(blk);
    }
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(f[i], d));
}

void decode(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* tile) {
    const int64_t nb = K / kBlockElems;
    const DecodeConsts c;
    for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            float* o = tile + r * K + b * kBlockElems;
            if (fmt == kMXFP4) decode_block<kMXFP4>(w + r * row_bytes + b * kMxfp4Bytes, c, o);
            else decode_block<kQ8_0>(w + r * row_bytes + b * kQ8_0Bytes, c, o);
        }
}

// Activations packed in groups of 8 rows, k-major: Ap[(g*K + k)*8 + j] = A[g*8 + j][k] (zero pad).
// Then the GEMM broadcasts weights and keeps tokens in the vector lanes: per k it reads 64 bytes
// of activations and 6 scalars of weights for 12 FMAs, so it runs from L2 at close to FMA speed.
inline void transpose8(__m256* r) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

void pack_a(const float* const* rows, int64_t M, int64_t K, float* Ap) {
    for (int64_t g = 0; g * 8 < M; ++g) {
        const int n = int(M - g * 8 < 8 ? M - g * 8 : 8);
        float* dst = Ap + g * K * 8;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; ++j)
                r[j] = j < n ? _mm256_loadu_ps(rows[g * 8 + j] + k) : _mm256_setzero_ps();
            transpose8(r);
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (k + j) * 8, r[j]);
        }
    }
}

// RB weight rows x TB groups of 8 tokens over kc values of k; the accumulators live in acc
// (RB*2 vectors, packed), loaded unless `first`, so the caller can block K to keep both the
// activation slice and the weight slice in L1.
template <int RB, int TB>
void micro(const float* Ap, int64_t lda, int64_t kc, const float* B, int64_t ldb, float* tmp, bool first) {
    __m256 acc[RB][TB];
    for (int r = 0; r < RB; ++r)
        for (int t = 0; t < TB; ++t) acc[r][t] = first ? _mm256_setzero_ps() : _mm256_load_ps(tmp + (r * 2 + t) * 8);
    if constexpr (TB == 1) {
        // One token group: even and odd k accumulate separately, else the RB FMA chains (4-cycle
        // latency) and not the FMA ports would set the pace.
        __m256 odd[RB];
        for (int r = 0; r < RB; ++r) odd[r] = _mm256_setzero_ps();
        for (int64_t k = 0; k < kc; k += 2) {  // kc is even (a multiple of 8)
            const __m256 a0 = _mm256_loadu_ps(Ap + k * 8), a1 = _mm256_loadu_ps(Ap + (k + 1) * 8);
            for (int r = 0; r < RB; ++r) {
                acc[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(B + r * ldb + k), a0, acc[r][0]);
                odd[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(B + r * ldb + k + 1), a1, odd[r]);
            }
        }
        for (int r = 0; r < RB; ++r) acc[r][0] = _mm256_add_ps(acc[r][0], odd[r]);
    } else {
        for (int64_t k = 0; k < kc; ++k) {
            __m256 a[TB];
            for (int t = 0; t < TB; ++t) a[t] = _mm256_loadu_ps(Ap + (t * lda + k) * 8);
            for (int r = 0; r < RB; ++r) {
                const __m256 w = _mm256_broadcast_ss(B + r * ldb + k);
                for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_fmadd_ps(w, a[t], acc[r][t]);
            }
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int t = 0; t < TB; ++t) _mm256_store_ps(tmp + (r * 2 + t) * 8, acc[r][t]);
}

template <int TB>
void micro_rb(int rb, const float* Ap, int64_t lda, int64_t kc, const float* B, int64_t ldb, float* tmp, bool first) {
    switch (rb) {
        case 6: return micro<6, TB>(Ap, lda, kc, B, ldb, tmp, first);
        case 5: return micro<5, TB>(Ap, lda, kc, B, ldb, tmp, first);
        case 4: return micro<4, TB>(Ap, lda, kc, B, ldb, tmp, first);
        case 3: return micro<3, TB>(Ap, lda, kc, B, ldb, tmp, first);
        case 2: return micro<2, TB>(Ap, lda, kc, B, ldb, tmp, first);
        default: return micro<1, TB>(Ap, lda, kc, B, ldb, tmp, first);
    }
}

// K blocking: per block a 16-token activation slice (20 KB) and one 6-row weight slice (7.5 KB)
// stay in L1 while the token pair sweeps kGemmNc weight rows; unblocked, every 6-row panel
// re-streamed the pair's whole activation rows from L2/L3.
constexpr int64_t kGemmKc = 320;  // divides 2880; multiple of 8
constexpr int64_t kGemmNc = 48;   // weight rows (8 panels) whose accumulators a token pair keeps

void gemm(const float* Ap, int64_t M, const float* B, int64_t N, int64_t K, float* C, int64_t ldc) {
    const int64_t groups = (M + 7) / 8;
    alignas(32) float acc[kGemmNc / 6][6 * 2 * 8];
    for (int64_t g = 0; g < groups; g += 2) {
        const int tb = int(groups - g < 2 ? groups - g : 2);
        for (int64_t nc0 = 0; nc0 < N; nc0 += kGemmNc) {
            const int64_t nc = N - nc0 < kGemmNc ? N - nc0 : kGemmNc;
            for (int64_t k0 = 0; k0 < K; k0 += kGemmKc) {
                const int64_t kc = K - k0 < kGemmKc ? K - k0 : kGemmKc;
                for (int64_t n0 = nc0; n0 < nc0 + nc; n0 += 6) {
                    const int rb = int(nc0 + nc - n0 < 6 ? nc0 + nc - n0 : 6);
                    float* tmp = acc[(n0 - nc0) / 6];
                    if (tb == 2) micro_rb<2>(rb, Ap + (g * K + k0) * 8, K, kc, B + n0 * K + k0, K, tmp, k0 == 0);
                    else micro_rb<1>(rb, Ap + (g * K + k0) * 8, K, kc, B + n0 * K + k0, K, tmp, k0 == 0);
                }
            }
            for (int64_t n0 = nc0; n0 < nc0 + nc; n0 += 6) {
                const int rb = int(nc0 + nc - n0 < 6 ? nc0 + nc - n0 : 6);
                const float* tmp = acc[(n0 - nc0) / 6];
                for (int t = 0; t < tb; ++t)
                    for (int j = 0; j < 8 && (g + t) * 8 + j < M; ++j)
                        for (int r = 0; r < rb; ++r) C[((g + t) * 8 + j) * ldc + n0 + r] = tmp[(r * 2 + t) * 8 + j];
            }
        }
    }
}

// Few tokens (<= 16) straight from the quantized rows, no tile: per block the RB rows' 32
// weights are decoded into an L1 buffer and multiplied by the packed tokens (8 per vector), the
// accumulators staying in registers for the whole K. A tile would be decoded to L2 and read back
// for only a handful of tokens; here the decode is the only extra work over the FMAs.
template <int FMT, int RB, int TB>
void qmicro(const uint8_t* w, int64_t row_bytes, int64_t K, const float* Ap, float* tmp) {
    constexpr int bb = FMT == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    const int64_t nb = K / kBlockElems;
    const DecodeConsts c;
    alignas(32) float buf[RB][kBlockElems];
    __m256 acc[RB][TB], odd[RB];
    for (int r = 0; r < RB; ++r) {
        odd[r] = _mm256_setzero_ps();
        for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < RB; ++r) {
            const uint8_t* blk = w + r * row_bytes + b * bb;
            _mm_prefetch((const char*)blk + kPrefetchBytes, _MM_HINT_T0);
            decode_block<FMT>(blk, c, buf[r]);
        }
        const float* A = Ap + b * kBlockElems * 8;
        if constexpr (TB == 1) {  // even/odd k into separate chains (FMA latency, as in micro)
            for (int j = 0; j < kBlockElems; j += 2) {
                const __m256 a0 = _mm256_loadu_ps(A + j * 8), a1 = _mm256_loadu_ps(A + (j + 1) * 8);
                for (int r = 0; r < RB; ++r) {
                    acc[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(&buf[r][j]), a0, acc[r][0]);
                    odd[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&buf[r][j + 1]), a1, odd[r]);
                }
            }
        } else {
            for (int j = 0; j < kBlockElems; ++j) {
                __m256 a[TB];
                for (int t = 0; t < TB; ++t) a[t] = _mm256_loadu_ps(A + (t * K + j) * 8);
                for (int r = 0; r < RB; ++r) {
                    const __m256 wv = _mm256_broadcast_ss(&buf[r][j]);
                    for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_fmadd_ps(wv, a[t], acc[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < RB; ++r) {
        if (TB == 1) acc[r][0] = _mm256_add_ps(acc[r][0], odd[r]);
        for (int t = 0; t < TB; ++t) _mm256_store_ps(tmp + (r * 2 + t) * 8, acc[r][t]);
    }
}

template <int FMT, int TB>
void qmicro_rb(int rb, const uint8_t* w, int64_t row_bytes, int64_t K, const float* Ap, float* tmp) {
    switch (rb) {
        case 6: return qmicro<FMT, 6, TB>(w, row_bytes, K, Ap, tmp);
        case 5: return qmicro<FMT, 5, TB>(w, row_bytes, K, Ap, tmp);
        case 4: return qmicro<FMT, 4, TB>(w, row_bytes, K, Ap, tmp);
        case 3: return qmicro<FMT, 3, TB>(w, row_bytes, K, Ap, tmp);
        case 2: return qmicro<FMT, 2, TB>(w, row_bytes, K, Ap, tmp);
        default: return qmicro<FMT, 1, TB>(w, row_bytes, K, Ap, tmp);
    }
}

template <int FMT>
void qgemm_fmt(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* Ap, int64_t M, float* C,
               int64_t ldc) {
    const int64_t groups = (M + 7) / 8;
    alignas(32) float tmp[6 * 2 * 8];
    for (int64_t n0 = 0; n0 < N; n0 += 6) {
        const int rb = int(N - n0 < 6 ? N - n0 : 6);
        for (int64_t g = 0; g < groups; g += 2) {
            const int tb = int(groups - g < 2 ? groups - g : 2);
            const uint8_t* wr = w + n0 * row_bytes;
            if (tb == 2) qmicro_rb<FMT, 2>(rb, wr, row_bytes, K, Ap + g * K * 8, tmp);
            else qmicro_rb<FMT, 1>(rb, wr, row_bytes, K, Ap + g * K * 8, tmp);
            for (int t = 0; t < tb; ++t)
                for (int j = 0; j < 8 && (g + t) * 8 + j < M; ++j)
                    for (int r = 0; r < rb; ++r) C[((g + t) * 8 + j) * ldc + n0 + r] = tmp[(r * 2 + t) * 8 + j];
        }
    }
}

void qgemm(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* Ap, int64_t M,
           float* C, int64_t ldc) {
    if (fmt == kMXFP4) qgemm_fmt<kMXFP4>(w, row_bytes, N, K, Ap, M, C, ldc);
    else qgemm_fmt<kQ8_0>(w, row_bytes, N, K, Ap, M, C, ldc);
}

// ---- fast mode: int8 activations, two blocks per step (x in quantize_x_q8's pair layout).
// Weights: wa = elements 0..15 of both blocks, wb = elements 16..31. MXFP4: one pshufb each of
// LUT2 + 12 (unsigned 0..24) straight into maddubs with x, madd to 8 int32 lanes (lanes 0..3:
// block 2p, 4..7: block 2p+1), minus 12 * (lane sums of x) precomputed with x: exact.
// Q8_0: |w| (unsigned) x (x with w's sign) through maddubs (no saturation: 2*128*127 < 2^15).
// Then convert, one FMA by d_w*d_x. Float order as KernelSet::gemv_q8 defines,
// so the scalar twin matches bit for bit.
template <int FMT>
inline void load_pair(const uint8_t* blk, bool has1, const __m256i& lut, const __m256i& m0f, __m256i& wa,
                      __m256i& wb, __m256& dw) {
    constexpr int bb = FMT == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    if (FMT == kMXFP4) {
        const __m128i q0 = _mm_loadu_si128((const __m128i*)(blk + 1));
        const __m128i q1 = has1 ? _mm_loadu_si128((const __m128i*)(blk + bb + 1)) : _mm_setzero_si128();
        const __m256i q = _mm256_set_m128i(q1, q0);
        wa = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, m0f));  // lut: LUT2 + 12
        wb = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), m0f));
        const __m128 d0 = _mm_broadcast_ss(&g_e8m0_table[blk[0]]);
        const __m128 d1 = has1 ? _mm_broadcast_ss(&g_e8m0_table[blk[bb]]) : _mm_setzero_ps();
        dw = _mm256_set_m128(d1, d0);
    } else {
        const __m128i z = _mm_setzero_si128();
        wa = _mm256_set_m128i(has1 ? _mm_loadu_si128((const __m128i*)(blk + bb + 2)) : z,
                              _mm_loadu_si128((const __m128i*)(blk + 2)));
        wb = _mm256_set_m128i(has1 ? _mm_loadu_si128((const __m128i*)(blk + bb + 18)) : z,
                              _mm_loadu_si128((const __m128i*)(blk + 18)));
        uint16_t h0, h1 = 0;
        std::memcpy(&h0, blk, 2);
        if (has1) std::memcpy(&h1, blk + bb, 2);
        dw = _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(h1)), _mm_set1_ps(_cvtsh_ss(h0)));
    }
}

template <int FMT>
inline __m256 pair_dot(__m256i aa, __m256i wa, __m256i ab, __m256i wb, const int8_t* x, __m256i ones) {
    if (FMT == kMXFP4) {  // wa, wb = LUT2 + 12 in 0..24: |pair sums| <= 2*24*127, their sum < 2^15
        const __m256i pa = _mm256_maddubs_epi16(wa, _mm256_loadu_si256((const __m256i*)x));
        const __m256i pb = _mm256_maddubs_epi16(wb, _mm256_loadu_si256((const __m256i*)(x + 32)));
        const __m256i s = _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ones);
        return _mm256_cvtepi32_ps(_mm256_sub_epi32(s, _mm256_loadu_si256((const __m256i*)(x + 64))));
    }
    const __m256i pa = _mm256_maddubs_epi16(aa, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)x), wa));
    const __m256i pb = _mm256_maddubs_epi16(ab, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(x + 32)), wb));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones)));
}

template <int FMT, int NT>
void gemv_q8_t(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const int8_t* const* xq,
               const float* const* xd, float* out, int64_t ldo) {
    constexpr int bb = FMT == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    const int64_t nb = K / kBlockElems, np = q8x_pairs(K);
    const __m256i m0f = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i lut = _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kMxfp4Lut2)),
                                        _mm256_set1_epi8(12));
    // As the fp32 GEMV: with several tokens, K chunks (8 KB of int8 rows and scales) over row groups.
    const int64_t kcp = NT * np * (kQ8xPairBytes + 32) <= kGemvWholeBytes ? np
                        : kGemvChunkFloats * 4 / (NT * (kQ8xPairBytes + 32));
    alignas(32) float keep[kGemvGroupRows][NT][8];
    for (int64_t r0 = 0; r0 < n_rows; r0 += kGemvGroupRows) {
        const int64_t nr = n_rows - r0 < kGemvGroupRows ? n_rows - r0 : kGemvGroupRows;
        for (int64_t p0 = 0; p0 < np; p0 += kcp) {
            const int64_t p1 = np - p0 < kcp ? np : p0 + kcp;
            for (int64_t r = 0; r < nr; ++r) {
                const uint8_t* row = w + (r0 + r) * row_bytes;
                if (kcp < np && p0 == 0 && r + 2 < nr) prefetch_row_l2(row + 2 * row_bytes, row_bytes);
                __m256 acc[NT];
                for (int t = 0; t < NT; ++t) acc[t] = p0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(keep[r][t]);
                for (int64_t p = p0; p < p1; ++p) {
                    const uint8_t* blk = row + 2 * p * bb;
                    if (kcp == np) _mm_prefetch((const char*)blk + kPrefetchBytes, _MM_HINT_T0);
                    __m256i wa, wb;
                    __m256 dw;
                    if (2 * p + 1 < nb) load_pair<FMT>(blk, true, lut, m0f, wa, wb, dw);
                    else load_pair<FMT>(blk, false, lut, m0f, wa, wb, dw);
                    __m256i aa = wa, ab = wb;
                    if (FMT != kMXFP4) aa = _mm256_abs_epi8(wa), ab = _mm256_abs_epi8(wb);
                    for (int t = 0; t < NT; ++t) {
                        const __m256 c = pair_dot<FMT>(aa, wa, ab, wb, xq[t] + p * kQ8xPairBytes, ones);
                        acc[t] = _mm256_fmadd_ps(c, _mm256_mul_ps(dw, _mm256_loadu_ps(xd[t] + p * 8)), acc[t]);
                    }
                }
                if (p1 < np) {
                    for (int t = 0; t < NT; ++t) _mm256_store_ps(keep[r][t], acc[t]);
                } else {
                    for (int t = 0; t < NT; ++t) out[t * ldo + r0 + r] = hsum(acc[t]);
                }
            }
        }
    }
}

template <int FMT>
void gemv_q8_fmt(const uint8_t* w, int64_t rb, int64_t n, int64_t K, const int8_t* const* xq,
                 const float* const* xd, int nt, float* out, int64_t ldo) {
    switch (nt) {
        case 1: return gemv_q8_t<FMT, 1>(w, rb, n, K, xq, xd, out, ldo);
        case 2: return gemv_q8_t<FMT, 2>(w, rb, n, K, xq, xd, out, ldo);
        case 3: return gemv_q8_t<FMT, 3>(w, rb, n, K, xq, xd, out, ldo);
        case 4: return gemv_q8_t<FMT, 4>(w, rb, n, K, xq, xd, out, ldo);
        case 5: return gemv_q8_t<FMT, 5>(w, rb, n, K, xq, xd, out, ldo);
        case 6: return gemv_q8_t<FMT, 6>(w, rb, n, K, xq, xd, out, ldo);
        case 7: return gemv_q8_t<FMT, 7>(w, rb, n, K, xq, xd, out, ldo);
        default: return gemv_q8_t<FMT, 8>(w, rb, n, K, xq, xd, out, ldo);
    }
}

void gemv_q8(int fmt, const uint8_t* w, int64_t rb, int64_t n, int64_t K, const int8_t* const* xq,
             const float* const* xd, int nt, float* out, int64_t ldo) {
    if (fmt == kMXFP4) gemv_q8_fmt<kMXFP4>(w, rb, n, K, xq, xd, nt, out, ldo);
    else gemv_q8_fmt<kQ8_0>(w, rb, n, K, xq, xd, nt, out, ldo);
}

// ---- default path: int16 activations (shared with the AVX-512 set, which sums with vpdpwssd).
inline __m256i dot16_acc(__m256i acc, __m256i w, __m256i x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
inline __m256i dot16_first(__m256i w, __m256i x) { return _mm256_madd_epi16(w, x); }
#include "gemv_q16.inc"

// Loads one 32-block into v and its max |x| into amax (block_absmax's twin); false when the
// block holds a NaN or an inf: finite iff |x| <= FLT_MAX in every lane.
static inline bool load_block_absmax(const float* xb, __m256 v[4], float* amax) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 fmax = _mm256_set1_ps(3.4028234663852886e38f);
    __m256 a[4];
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        a[i] = _mm256_and_ps(v[i], absmask);
    }
    const __m256 ok = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(a[0], fmax, _CMP_LE_OQ), _mm256_cmp_ps(a[1], fmax, _CMP_LE_OQ)),
                                    _mm256_and_ps(_mm256_cmp_ps(a[2], fmax, _CMP_LE_OQ), _mm256_cmp_ps(a[3], fmax, _CMP_LE_OQ)));
    if (_mm256_movemask_ps(ok) != 0xff) return false;
    __m256 m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    *amax = _mm_cvtss_f32(m4);
    return true;
}

// quantize_x_q16's vector twin (same bits): v = x * (32767 / amax) lies within 32767.004 of
// zero and (v - hi) * 65536 within 32768, where cvtps's round-to-nearest-even equals the scalar
// magic-number rounding (clamped the same way).
void quantize_q16(const float* x, int64_t K, int16_t* q, float* d) {
    const int64_t nb = K / kBlockElems;
    std::memset(q, 0, size_t(q16x_elems(K)) * sizeof(int16_t));
    std::memset(d, 0, size_t(q16x_scales(K)) * sizeof(float));
    const __m256 lim = _mm256_set1_ps(32767.f), nlim = _mm256_set1_ps(-32767.f), s16 = _mm256_set1_ps(65536.f);
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * kBlockElems;
        int16_t* qb = q + (b / 2) * 128 + (b % 2) * 8;
        float* db = d + (b / 2) * 8 + (b % 2) * 4;
        __m256 v[4];
        float amax;
        if (!load_block_absmax(xb, v, &amax)) {
            for (int i = 0; i < 4; ++i) db[i] = __builtin_nanf("");
            continue;  // q stays 0
        }
        const float scale = amax / 32767.f;
        for (int i = 0; i < 4; ++i) db[i] = scale;
        const __m256 id = _mm256_set1_ps(amax >= kQ8TinyAmax ? 32767.f / amax : 0.f);
        __m256i hi[4], lo[4];
        for (int i = 0; i < 4; ++i) {
            const __m256 vi = _mm256_mul_ps(v[i], id);
            const __m256 h = _mm256_max_ps(_mm256_min_ps(_mm256_round_ps(vi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lim), nlim);
            const __m256 l = _mm256_mul_ps(_mm256_sub_ps(vi, h), s16);
            hi[i] = _mm256_cvtps_epi32(h);
            lo[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(_mm256_round_ps(l, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lim), nlim));
        }
        for (int h = 0; h < 2; ++h) {  // elements 16h..16h+15 -> runs 2h (0..7) and 2h+1 (8..15)
            const __m256i ph = _mm256_permute4x64_epi64(_mm256_packs_epi32(hi[2 * h], hi[2 * h + 1]), 0xD8);
            const __m256i pl = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo[2 * h], lo[2 * h + 1]), 0xD8);
            _mm_storeu_si128((__m128i*)(qb + 32 * h), _mm256_castsi256_si128(ph));
            _mm_storeu_si128((__m128i*)(qb + 32 * h + 16), _mm256_extracti128_si256(ph, 1));
            _mm_storeu_si128((__m128i*)(qb + 64 + 32 * h), _mm256_castsi256_si128(pl));
            _mm_storeu_si128((__m128i*)(qb + 64 + 32 * h + 16), _mm256_extracti128_si256(pl, 1));
        }
    }
}

// ---- fast mode, many tokens: int8 GEMM (the tile path's int8 twin).
// A panel of 8 rows is decoded once into L1 as bytes, k-quad major: wt[b*256 + q*32 + r*4 + i] =
// weight 4q+i of block b in row r, so one vector holds 4 k of 8 rows; then each token's 4 int8
// activations of that k-quad are broadcast and maddubs gives 8 rows x 2 pair sums. Rows sit in
// the lanes, so the output of a token is 8 contiguous floats. Float order as KernelSet::gemm_q8.
//  MXFP4: LUT2 + 12 (0..24, unsigned for maddubs). Four maddubs add in int16 (|sum| <= 4*2*24*127
//   < 2^15), madd to int32, minus 12 * (block sum of x): the exact LUT2 dot.
//  Q8_0: the int8 quants as they are; maddubs(|w|, sign(x, w)) = the w*x pairs (<= 2*127*127 < 2^15,
//   but two would not fit int16), madd to int32 after each.
//  MXFP4 also has a 16-row kernel (two panels): each token's broadcast k-quad feeds two maddubs.
//   Zen 3 loads at most two vectors per cycle, which bounds the 8-row kernel (a weight load per 3
//   maddubs, a broadcast per maddubs); 16 rows need fewer loads per maddubs.
constexpr int kQ8Panel = 8;
constexpr int kQ8Tokens = 3;  // tokens per micro-kernel call (3 measured fastest; 4 spills)

// Keeps v in a register at this point of the accumulation chain. Without it GCC hoisted all the
// maddubs of a k-loop ahead of their adds (reassociating the integer sums) and spilled the
// partial sums to the stack (the 16-row kernel lost ~15%).
#define HM_PIN(v) __asm__("" : "+x"(v))

template <int FMT>
void decode_panel_q8(const uint8_t* w, int64_t row_bytes, int nr, int64_t nb, uint8_t* wt, float* dwt) {
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    const __m256i lut = _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kMxfp4Lut2)),
                                        _mm256_set1_epi8(12));
    for (int64_t b = 0; b < nb; ++b) {
        __m256 v[kQ8Panel];
        for (int r = 0; r < kQ8Panel; ++r) {
            if (r >= nr) {
                v[r] = _mm256_setzero_ps();
                dwt[b * kQ8Panel + r] = 0.f;
                continue;
            }
            if constexpr (FMT == kMXFP4) {
                const uint8_t* blk = w + r * row_bytes + b * kMxfp4Bytes;
                const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(blk + 1)));
                const __m256i nib = _mm256_and_si256(_mm256_blend_epi32(q, _mm256_srli_epi16(q, 4), 0xF0), m0f);
                v[r] = _mm256_castsi256_ps(_mm256_shuffle_epi8(lut, nib));  // dword j: elements 4j..4j+3
                dwt[b * kQ8Panel + r] = g_e8m0_table[blk[0]];
            } else {
                const uint8_t* blk = w + r * row_bytes + b * kQ8_0Bytes;
                v[r] = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i*)(blk + 2)));
                uint16_t h;
                std::memcpy(&h, blk, 2);
                dwt[b * kQ8Panel + r] = _cvtsh_ss(h);
            }
        }
        transpose8(v);  // v[q]: k-quad q of the 8 rows
        for (int q = 0; q < 8; ++q) _mm256_store_ps((float*)(wt + b * 256 + q * 32), v[q]);
    }
}

// One 8-row panel (all nb blocks) times TB tokens (<= kQ8Tokens: 3 measured best; 4 spills).
// Kept out of line: inlined into gemm_q8, its accumulators were spilled to the stack.
template <int FMT, int TB>
__attribute__((noinline)) void gemm_q8_micro(const uint8_t* wt, const float* dwt, int64_t nb, const int8_t* const* xq, const float* const* xd,
                   const float* const* bs, float* const* out, int nr) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TB];
    #pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = wt + b * 256;
        const int64_t xo = (b / 2) * kQ8xPairBytes + (b % 2) * 16;
        __m256i isum[TB];
        if constexpr (FMT == kMXFP4) {
            #pragma GCC unroll 8
            for (int h = 0; h < 2; ++h) {
                __m256i p16[TB];
                #pragma GCC unroll 8
                for (int q4 = 0; q4 < 4; ++q4) {
                    const __m256i wv = _mm256_load_si256((const __m256i*)(wb + (4 * h + q4) * 32));
                    #pragma GCC unroll 8
                    for (int t = 0; t < TB; ++t) {
                        int32_t x4;
                        std::memcpy(&x4, xq[t] + xo + 32 * h + 4 * q4, 4);  // elements 16h + 4q4 .. +3
                        const __m256i p = _mm256_maddubs_epi16(wv, _mm256_set1_epi32(x4));
                        p16[t] = q4 == 0 ? p : _mm256_add_epi16(p16[t], p);
                        HM_PIN(p16[t]);
                    }
                }
                #pragma GCC unroll 8
                for (int t = 0; t < TB; ++t) {
                    const __m256i s32 = _mm256_madd_epi16(p16[t], ones);
                    isum[t] = h == 0 ? s32 : _mm256_add_epi32(isum[t], s32);
                }
            }
            #pragma GCC unroll 8
            for (int t = 0; t < TB; ++t) {
                int32_t bsum;
                std::memcpy(&bsum, bs[t] + b, sizeof(bsum));
                isum[t] = _mm256_sub_epi32(isum[t], _mm256_set1_epi32(bsum));
            }
        } else {
            #pragma GCC unroll 8
            for (int q = 0; q < 8; ++q) {
                const __m256i wv = _mm256_load_si256((const __m256i*)(wb + q * 32));
                const __m256i aw = _mm256_abs_epi8(wv);
                #pragma GCC unroll 8
                for (int t = 0; t < TB; ++t) {
                    int32_t x4;
                    std::memcpy(&x4, xq[t] + xo + 32 * (q / 4) + 4 * (q % 4), 4);  // elements 4q .. 4q+3
                    const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(x4), wv));
                    const __m256i s32 = _mm256_madd_epi16(p, ones);
                    isum[t] = q == 0 ? s32 : _mm256_add_epi32(isum[t], s32);
                    HM_PIN(isum[t]);
                }
            }
        }
        const __m256 dw = _mm256_load_ps(dwt + b * kQ8Panel);
        #pragma GCC unroll 8
        for (int t = 0; t < TB; ++t) {
            const __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(q8x_scale(xd[t], b)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), sc, acc[t]);
        }
    }
    #pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) {
        if (nr == kQ8Panel) {
            _mm256_storeu_ps(out[t], acc[t]);
        } else {
            alignas(32) float tmp[kQ8Panel];
            _mm256_store_ps(tmp, acc[t]);
            std::memcpy(out[t], tmp, size_t(nr) * sizeof(float));
        }
    }
}

// MXFP4, 16 rows (panels wt0 and wt1) times TB tokens, same sums and float order as the 8-row
// kernel (so the same bits). The float accumulators live in memory: the 4*TB int16/int32 sums and
// the two weight vectors take the registers (a load and a store per block and token).
template <int TB>
__attribute__((noinline)) void gemm_q8_micro16(const uint8_t* wt0, const uint8_t* wt1, const float* dwt0,
                                               const float* dwt1, int64_t nb, const int8_t* const* xq,
                                               const float* const* xd, const float* const* bs, float* const* out) {
    const __m256i ones = _mm256_set1_epi16(1);
    alignas(32) float acc[TB][2][kQ8Panel] = {};
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t xo = (b / 2) * kQ8xPairBytes + (b % 2) * 16;
        __m256i isum[TB][2];
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            __m256i p16[TB][2];
            #pragma GCC unroll 4
            for (int q4 = 0; q4 < 4; ++q4) {
                const __m256i w0 = _mm256_load_si256((const __m256i*)(wt0 + b * 256 + (4 * h + q4) * 32));
                const __m256i w1 = _mm256_load_si256((const __m256i*)(wt1 + b * 256 + (4 * h + q4) * 32));
                #pragma GCC unroll 4
                for (int t = 0; t < TB; ++t) {
                    int32_t x4;
                    std::memcpy(&x4, xq[t] + xo + 32 * h + 4 * q4, 4);  // elements 16h + 4q4 .. +3
                    const __m256i xv = _mm256_set1_epi32(x4);
                    const __m256i a = _mm256_maddubs_epi16(w0, xv), c = _mm256_maddubs_epi16(w1, xv);
                    p16[t][0] = q4 == 0 ? a : _mm256_add_epi16(p16[t][0], a);
                    p16[t][1] = q4 == 0 ? c : _mm256_add_epi16(p16[t][1], c);
                    HM_PIN(p16[t][0]);
                    HM_PIN(p16[t][1]);
                }
            }
            #pragma GCC unroll 4
            for (int t = 0; t < TB; ++t)
                for (int g = 0; g < 2; ++g) {
                    const __m256i s32 = _mm256_madd_epi16(p16[t][g], ones);
                    isum[t][g] = h == 0 ? s32 : _mm256_add_epi32(isum[t][g], s32);
                }
        }
        const __m256 dw[2] = {_mm256_load_ps(dwt0 + b * kQ8Panel), _mm256_load_ps(dwt1 + b * kQ8Panel)};
        #pragma GCC unroll 4
        for (int t = 0; t < TB; ++t) {
            int32_t bsum;
            std::memcpy(&bsum, bs[t] + b, sizeof(bsum));
            const __m256i bv = _mm256_set1_epi32(bsum);
            const __m256 xs = _mm256_set1_ps(q8x_scale(xd[t], b));
            for (int g = 0; g < 2; ++g) {
                const __m256 sc = _mm256_mul_ps(dw[g], xs);
                _mm256_store_ps(acc[t][g], _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t][g], bv)), sc,
                                                           _mm256_load_ps(acc[t][g])));
            }
        }
    }
    for (int t = 0; t < TB; ++t) std::memcpy(out[t], acc[t], 2 * kQ8Panel * sizeof(float));
}

thread_local std::vector<uint8_t> t_q8_panel;
thread_local std::vector<float> t_q8_dw;
thread_local std::vector<uint8_t> t_q8_panel1;  // the 16-row kernel's second panel
thread_local std::vector<float> t_q8_dw1;

// Runs kernel(tb, m0, bs, out) over the M tokens in groups of up to kQ8Tokens: tb is the group
// size as a compile-time constant, bs[t] token m0+t's block sums (see quantize_x_q8) and out[t]
// its output row from column r0.
template <class Kernel>
inline void q8_token_groups(int64_t K, const float* const* xd, int64_t M, float* C, int64_t ldc, int64_t r0,
                            Kernel kernel) {
    for (int64_t m0 = 0; m0 < M; m0 += kQ8Tokens) {
        const int tb = int(M - m0 < kQ8Tokens ? M - m0 : kQ8Tokens);
        const float* bs[kQ8Tokens];
        float* out[kQ8Tokens];
        for (int t = 0; t < tb; ++t) {
            bs[t] = xd[m0 + t] + q8x_pairs(K) * 8;
            out[t] = C + (m0 + t) * ldc + r0;
        }
        switch (tb) {
            case 3: kernel(std::integral_constant<int, 3>(), m0, bs, out); break;
            case 2: kernel(std::integral_constant<int, 2>(), m0, bs, out); break;
            default: kernel(std::integral_constant<int, 1>(), m0, bs, out); break;
        }
    }
}

template <int FMT>
void gemm_q8_fmt(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const int8_t* const* xq,
                 const float* const* xd, int64_t M, float* C, int64_t ldc) {
    const int64_t nb = K / kBlockElems;
    if (t_q8_panel.size() < size_t(nb * 256 + 32)) t_q8_panel.resize(size_t(nb * 256 + 32));
    if (t_q8_dw.size() < size_t(nb * kQ8Panel + 8)) t_q8_dw.resize(size_t(nb * kQ8Panel + 8));
    uint8_t* wt = (uint8_t*)(((uintptr_t)t_q8_panel.data() + 31) & ~uintptr_t(31));
    float* dwt = (float*)(((uintptr_t)t_q8_dw.data() + 31) & ~uintptr_t(31));
    int64_t r0 = 0;
    if constexpr (FMT == kMXFP4) {
        if (t_q8_panel1.size() < t_q8_panel.size()) t_q8_panel1.resize(t_q8_panel.size());
        if (t_q8_dw1.size() < t_q8_dw.size()) t_q8_dw1.resize(t_q8_dw.size());
        uint8_t* wt1 = (uint8_t*)(((uintptr_t)t_q8_panel1.data() + 31) & ~uintptr_t(31));
        float* dwt1 = (float*)(((uintptr_t)t_q8_dw1.data() + 31) & ~uintptr_t(31));
        for (; r0 + 2 * kQ8Panel <= N; r0 += 2 * kQ8Panel) {
            decode_panel_q8<FMT>(w + r0 * row_bytes, row_bytes, kQ8Panel, nb, wt, dwt);
            decode_panel_q8<FMT>(w + (r0 + kQ8Panel) * row_bytes, row_bytes, kQ8Panel, nb, wt1, dwt1);
            q8_token_groups(K, xd, M, C, ldc, r0, [&](auto tb, int64_t m0, const float* const* bs, float* const* out) {
                gemm_q8_micro16<tb()>(wt, wt1, dwt, dwt1, nb, xq + m0, xd + m0, bs, out);
            });
        }
    }
    for (; r0 < N; r0 += kQ8Panel) {
        const int nr = int(N - r0 < kQ8Panel ? N - r0 : kQ8Panel);
        decode_panel_q8<FMT>(w + r0 * row_bytes, row_bytes, nr, nb, wt, dwt);
        q8_token_groups(K, xd, M, C, ldc, r0, [&](auto tb, int64_t m0, const float* const* bs, float* const* out) {
            gemm_q8_micro<FMT, tb()>(wt, dwt, nb, xq + m0, xd + m0, bs, out, nr);
        });
    }
}

void gemm_q8(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const int8_t* const* xq,
             const float* const* xd, int64_t M, float* C, int64_t ldc) {
    if (fmt == kMXFP4) gemm_q8_fmt<kMXFP4>(w, row_bytes, N, K, xq, xd, M, C, ldc);
    else gemm_q8_fmt<kQ8_0>(w, row_bytes, N, K, xq, xd, M, C, ldc);
}

// ---- fast mode: activation quantizer, quantize_x_q8's vector twin (same bits; see common.h).
// x * (127 / amax) lies in [-127.00002, 127.00002], where cvtps's round-to-nearest-even equals
// the scalar magic-number rounding, and the clamp only ever sees +-127.
void quantize_q8(const float* x, int64_t K, int8_t* q, float* d) {
    const int64_t nb = K / kBlockElems;
    std::memset(q, 0, size_t(q8x_bytes(K)));
    std::memset(d, 0, size_t(q8x_scales(K)) * sizeof(float));
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    float* block_sums = d + q8x_pairs(K) * 8;
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * kBlockElems;
        int8_t* lo = q + (b / 2) * kQ8xPairBytes + (b % 2) * 16;
        float* db = d + (b / 2) * 8 + (b % 2) * 4;
        __m256 v[4];
        float amax;
        if (!load_block_absmax(xb, v, &amax)) {
            for (int i = 0; i < 4; ++i) db[i] = __builtin_nanf("");
            continue;  // q stays 0
        }
        const float scale = amax / 127.f;
        for (int i = 0; i < 4; ++i) db[i] = scale;
        const __m256 id = _mm256_set1_ps(amax >= kQ8TinyAmax ? 127.f / amax : 0.f);
        __m256i iv[4];
        for (int i = 0; i < 4; ++i)
            iv[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)), lim), nlim);
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        const __m256i qv = _mm256_permutevar8x32_epi32(p, order);  // elements 0..31 in order
        _mm_storeu_si128((__m128i*)lo, _mm256_castsi256_si128(qv));
        _mm_storeu_si128((__m128i*)(lo + 32), _mm256_extracti128_si256(qv, 1));
        // dword i of s: sum of elements 4i..4i+3; lane l of the stored sums covers 4l.. and 16+4l..
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, qv), ones16);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_mullo_epi32(s4, _mm_set1_epi32(12));
        _mm_storeu_si128((__m128i*)(q + (b / 2) * kQ8xPairBytes + 64 + (b % 2) * 16), s4);
        __m128i t = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        const int32_t block_sum = _mm_cvtsi128_si32(t);
        std::memcpy(block_sums + b, &block_sum, sizeof(block_sum));
    }
}

// ---- SwiGLU: swiglu_ref's operations, 8 lanes at a time (same bits; the tail runs swiglu_ref).
// Operand order keeps NaN: min/max_ps return their second operand when either is NaN.
inline __m256 exp8(__m256 x) {
    const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(kExpHi), _CMP_GT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(kExpLo), x);
    x = _mm256_min_ps(_mm256_set1_ps(kExpHi), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kExpC1), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kExpC2), r);
    __m256 p = _mm256_set1_ps(kExpP[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    return _mm256_blendv_ps(_mm256_mul_ps(y, s), _mm256_set1_ps(__builtin_inff()), big);
}

void swiglu(const float* g, const float* u, int64_t rows, int64_t n, const float* gb, const float* ub,
            float alpha, float limit, float* out, int64_t ldo) {
    const __m256 lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.f);
    const __m256 nalpha = _mm256_set1_ps(-alpha);
    const int64_t n8 = n / 8 * 8;
    for (int64_t a = 0; a < rows; ++a) {
        for (int64_t r = 0; r < n8; r += 8) {
            __m256 gv = _mm256_add_ps(_mm256_loadu_ps(g + a * n + r), gb ? _mm256_loadu_ps(gb + r) : _mm256_setzero_ps());
            __m256 uv = _mm256_add_ps(_mm256_loadu_ps(u + a * n + r), ub ? _mm256_loadu_ps(ub + r) : _mm256_setzero_ps());
            gv = _mm256_min_ps(lim, gv);
            uv = _mm256_max_ps(nlim, _mm256_min_ps(lim, uv));
            const __m256 e = exp8(_mm256_mul_ps(nalpha, gv));
            _mm256_storeu_ps(out + a * ldo + r, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_add_ps(uv, one)));
        }
        if (n8 < n)
            swiglu_ref(g + a * n + n8, u + a * n + n8, 1, n - n8, gb ? gb + n8 : nullptr, ub ? ub + n8 : nullptr,
                       alpha, limit, out + a * ldo + n8, ldo);
    }
}

}  // namespace

namespace avx2 {
void gemv_q8(int fmt, const uint8_t* w, int64_t rb, int64_t n, int64_t K, const int8_t* const* xq,
             const float* const* xd, int nt, float* out, int64_t ldo) {
    hm::gemv_q8(fmt, w, rb, n, K, xq, xd, nt, out, ldo);
}
void gemm_q8(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const int8_t* const* xq,
             const float* const* xd, int64_t M, float* C, int64_t ldc) {
    hm::gemm_q8(fmt, w, row_bytes, N, K, xq, xd, M, C, ldc);
}
void quantize_q8(const float* x, int64_t K, int8_t* q, float* d) { hm::quantize_q8(x, K, q, d); }
void quantize_q16(const float* x, int64_t K, int16_t* q, float* d) { hm::quantize_q16(x, K, q, d); }
void gemv_q16(int fmt, const uint8_t* w, int64_t rb, int64_t n, int64_t K, const int16_t* const* xq,
              const float* const* xd, int nt, float* out, int64_t ldo) {
    hm::gemv_q16(fmt, w, rb, n, K, xq, xd, nt, out, ldo);
}
void swiglu(const float* g, const float* u, int64_t rows, int64_t n, const float* gb, const float* ub,
            float alpha, float limit, float* out, int64_t ldo) {
    hm::swiglu(g, u, rows, n, gb, ub, alpha, limit, out, ldo);
}
}  // namespace avx2

// Zen 4 (run as AVX2), 2 threads, 2880- and 5760-row MXFP4: tile time / GEMV time 1.25 at 10 tokens,
// 1.15 at 12, 0.98-1.06 at 14, 0.9 at 16, 0.72-0.80 from 24 (one row per pass: every weight FMA
// loads its activations, where the GEMM's register block reuses them).
constexpr int kAvx2Mxfp4GemvMaxTokens = 14;

const KernelSet kAvx2Kernels = {"avx2", prep_x, gemv, decode, pack_a, gemm, avx2::gemv_q8,
                                avx2::attn_group, qgemm, avx2::gemm_q8, avx2::quantize_q8,
                                avx2::swiglu, avx2::quantize_q16, avx2::gemv_q16, quantize_x_d3, nullptr,
                                kAvx2Mxfp4GemvMaxTokens};

}  // namespace hm
#pragma GCC pop_options
