// AVX-512 (F/BW/VL/VNNI) GEMV and decode. 16 lanes let one vpermps do the whole 16-entry E2M1
// lookup, so the activations stay in natural order. The int16 GEMV is the AVX2 one with vpdpwssd
// summing the products (one instruction for vpmaddwd + vpaddd). The tile GEMM is the AVX2 one.
// Internal linkage only, as in kern_avx2.cpp.
#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

namespace hm {
namespace {

constexpr int kPrefetchBytes = 2048;

inline __m512 mx_lut() {
    alignas(64) float v[16];
    for (int i = 0; i < 16; ++i) v[i] = float(kMxfp4Lut2[i]);
    return _mm512_load_ps(v);
}

// Weights of one block: lo = elements 0..15, hi = elements 16..31 (unscaled, doubled E2M1).
inline void mx_decode(const uint8_t* blk, __m512 lut, __m512& lo, __m512& hi) {
    __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 1)));
    lo = _mm512_permutexvar_ps(idx, lut);                          // uses the low 4 bits only
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lut);
}

inline void q8_decode(const uint8_t* blk, __m512& lo, __m512& hi) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18))));
}

inline __m512 q8_scale(const uint8_t* blk) {
    uint16_t h;
    std::memcpy(&h, blk, 2);
    return _mm512_set1_ps(_cvtsh_ss(h));
}

void prep_x(int, const float* x, float* xp, int64_t K) { std::memcpy(xp, x, K * sizeof(float)); }

// One block of one row against NT activation rows, accumulated into acc[NT].
template <int FMT, int NT>
inline void gemv_block(const uint8_t* row, int64_t b, const float* const* xs, __m512 lut, __m512* acc) {
    constexpr int bb = FMT == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    const uint8_t* blk = row + b * bb;
    _mm_prefetch((const char*)blk + kPrefetchBytes, _MM_HINT_T0);
    __m512 lo, hi, d;
    if (FMT == kMXFP4) {
        mx_decode(blk, lut, lo, hi);
        d = _mm512_set1_ps(g_e8m0_table[blk[0]]);
    } else {
        q8_decode(blk, lo, hi);
        d = q8_scale(blk);
    }
    for (int t = 0; t < NT; ++t) {
        const float* xb = xs[t] + b * kBlockElems;
        __m512 s = _mm512_mul_ps(lo, _mm512_loadu_ps(xb));
        s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), s);
        acc[t] = _mm512_fmadd_ps(s, d, acc[t]);
    }
}

// Per block: decoded weights times the activations, then one FMA by the block scale. Even and
// odd blocks use separate accumulators (explicit unroll keeps them in registers) to hide the
// FMA latency when NT is 1.
template <int FMT, int NT>
void gemv_t(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs,
            float* out, int64_t ldo) {
    const int64_t nb = K / kBlockElems;
    const __m512 lut = mx_lut();
    for (int64_t r = 0; r < n_rows; ++r) {
        const uint8_t* row = w + r * row_bytes;
        __m512 acc0[NT], acc1[NT];
        for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            gemv_block<FMT, NT>(row, b, xs, lut, acc0);
            gemv_block<FMT, NT>(row, b + 1, xs, lut, acc1);
        }
        if (b < nb) gemv_block<FMT, NT>(row, b, xs, lut, acc0);
        for (int t = 0; t < NT; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
    }
}

#include "gemv_dispatch.inc"

// ---- default path: the int16 GEMV (gemv_q16.inc) with VNNI sums.
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
constexpr int64_t kGemvChunkFloats = 2048;  // as kern_avx2.cpp: K-chunked activations of 8 KB
constexpr int64_t kGemvGroupRows = 24;
constexpr int64_t kGemvWholeBytes = 24 << 10;
inline void prefetch_row_l2(const uint8_t* row, int64_t row_bytes) {
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char*)row + o, _MM_HINT_T1);
}
inline __m256i dot16_acc(__m256i acc, __m256i w, __m256i x) { return _mm256_dpwssd_epi32(acc, w, x); }
inline __m256i dot16_first(__m256i w, __m256i x) { return _mm256_madd_epi16(w, x); }
#include "gemv_q16.inc"

void decode(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* tile) {
    const int64_t nb = K / kBlockElems;
    const __m512 lut = mx_lut();
    for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            float* o = tile + r * K + b * kBlockElems;
            __m512 lo, hi, d;
            if (fmt == kMXFP4) {
                const uint8_t* blk = w + r * row_bytes + b * kMxfp4Bytes;
                mx_decode(blk, lut, lo, hi);
                d = _mm512_set1_ps(g_e8m0_table[blk[0]]);
            } else {
                const uint8_t* blk = w + r * row_bytes + b * kQ8_0Bytes;
                q8_decode(blk, lo, hi);
                d = q8_scale(blk);
            }
            _mm512_storeu_ps(o, _mm512_mul_ps(lo, d));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(hi, d));
        }
}

}  // namespace

const KernelSet kAvx512Kernels = {"avx512", prep_x, gemv, decode, avx2::pack_a, avx2::gemm,
                                  avx2::gemv_q8, avx2::attn_group, avx2::qgemm, avx2::gemm_q8,
                                  avx2::quantize_q8, avx2::swiglu, avx2::quantize_q16, gemv_q16};

}  // namespace hm
#pragma GCC pop_options
