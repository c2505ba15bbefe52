// AVX-512 (F/BW/VL/VNNI) GEMV and decode. 16 lanes let one vpermps do the whole 16-entry E2M1
// lookup, so the activations stay in natural order. The int16 GEMV is the AVX2 one with vpdpwssd
// summing the products (one instruction for vpmaddwd + vpaddd). The fp32 tile GEMM is the AVX2
// kernel's scheme at 16 lanes; fast mode's int8 tile GEMM has its own VNNI kernel.
// Internal linkage only, as in kern_avx2.cpp.
#include <vector>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

namespace hm {
namespace {

constexpr int kPrefetchBytes = 2048;
constexpr int64_t kGemvChunkFloats = 2048;  // as kern_avx2.cpp: K-chunked activations of 8 KB
constexpr int64_t kGemvGroupRows = 24;
constexpr int64_t kGemvWholeBytes = 24 << 10;
inline void prefetch_row_l2(const uint8_t* row, int64_t row_bytes) {
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char*)row + o, _MM_HINT_T1);
}
constexpr int kPairRowsFromTokens = 5;  // GEMV token counts that take several rows per pass

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

// The block scale folded into the LUT: (e - 128) added to the exponent field of LUT2's nonzero
// entries gives LUT2 * 2^(e-128) exactly for e in [2, 252] (`bad` marks the rest).
struct ScaledLut {
    int32_t add[256];  // (e - 128) << 23
    uint8_t bad[256];  // e outside [2, 252]
    ScaledLut() {
        for (int e = 0; e < 256; ++e) {
            add[e] = (e - 128) * (1 << 23);
            bad[e] = e < 2 || e > 252;
        }
    }
};
const ScaledLut g_scaled_lut;

// One block's weights with the scale folded in (lo = elements 0..15, hi = 16..31), unchecked:
// the caller makes sure the block's exponent is in the exact range (g_scaled_lut.bad).
HM_ALWAYS_INLINE inline void mx_decode_with_scale(const uint8_t* blk, __m512 lut, __m512& lo, __m512& hi) {
    constexpr __mmask16 kNonzero = 0xFEFE;  // LUT2 entries 0 and 8 are zeros
    const __m512 ls = _mm512_castsi512_ps(_mm512_maskz_add_epi32(kNonzero, _mm512_castps_si512(lut),
                                                                 _mm512_set1_epi32(g_scaled_lut.add[blk[0]])));
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 1)));
    lo = _mm512_permutexvar_ps(idx, ls);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), ls);
}

// One block of one row against NT activation rows, accumulated into acc[NT].
template <int FMT, int NT, bool kPrefetch = true>
inline void gemv_block(const uint8_t* row, int64_t b, const float* const* xs, __m512 lut, __m512* acc) {
    constexpr int bb = FMT == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    const uint8_t* blk = row + b * bb;
    if (kPrefetch) _mm_prefetch((const char*)blk + kPrefetchBytes, _MM_HINT_T0);
    __m512 lo, hi, d;
    if (FMT == kMXFP4 && !g_scaled_lut.bad[blk[0]]) {  // two FMAs per token, no scale step
        mx_decode_with_scale(blk, lut, lo, hi);
        for (int t = 0; t < NT; ++t) {
            const float* xb = xs[t] + b * kBlockElems;
            acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[t]));
        }
        return;
    }
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

// R rows per pass for several tokens: each activation load feeds R rows' FMAs. MXFP4 blocks whose
// R exponents are all in the exact range fold the scale into the LUT (two FMAs per row and token).
template <int FMT, int NT, int R>
HM_ALWAYS_INLINE inline void gemv_block_rows(const uint8_t* row0, int64_t row_bytes, int64_t b, const float* const* xs,
                                             __m512 lut, __m512 (*acc)[NT]) {
    constexpr int bb = FMT == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    __m512 lo[R], hi[R], d[R];
    bool scaled = FMT == kMXFP4;
    for (int i = 0; i < R; ++i) {
        const uint8_t* blk = row0 + i * row_bytes + b * bb;
        _mm_prefetch((const char*)blk + kPrefetchBytes, _MM_HINT_T0);
        if (FMT == kMXFP4) scaled = scaled && !g_scaled_lut.bad[blk[0]];
    }
    if (FMT == kMXFP4 && scaled) {
        for (int i = 0; i < R; ++i) mx_decode_with_scale(row0 + i * row_bytes + b * bb, lut, lo[i], hi[i]);
        for (int t = 0; t < NT; ++t) {
            const float* xb = xs[t] + b * kBlockElems;
            const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            for (int i = 0; i < R; ++i) acc[i][t] = _mm512_fmadd_ps(hi[i], x1, _mm512_fmadd_ps(lo[i], x0, acc[i][t]));
        }
        return;
    }
    for (int i = 0; i < R; ++i) {
        const uint8_t* blk = row0 + i * row_bytes + b * bb;
        if (FMT == kMXFP4) {
            mx_decode(blk, lut, lo[i], hi[i]);
            d[i] = _mm512_set1_ps(g_e8m0_table[blk[0]]);
        } else {
            q8_decode(blk, lo[i], hi[i]);
            d[i] = q8_scale(blk);
        }
    }
    for (int t = 0; t < NT; ++t) {
        const float* xb = xs[t] + b * kBlockElems;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        for (int i = 0; i < R; ++i)
            acc[i][t] = _mm512_fmadd_ps(_mm512_fmadd_ps(hi[i], x1, _mm512_mul_ps(lo[i], x0)), d[i], acc[i][t]);
    }
}

template <int FMT, int NT, int R>
int64_t gemv_rows(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t nb, const float* const* xs,
                  __m512 lut, float* out, int64_t ldo) {
    int64_t r = 0;
    for (; r + R <= n_rows; r += R) {
        const uint8_t* row0 = w + r * row_bytes;
        __m512 acc[R][NT];
        for (int i = 0; i < R; ++i)
            for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) gemv_block_rows<FMT, NT, R>(row0, row_bytes, b, xs, lut, acc);
        for (int i = 0; i < R; ++i)
            for (int t = 0; t < NT; ++t) out[t * ldo + r + i] = _mm512_reduce_add_ps(acc[i][t]);
    }
    return r;
}

// One MXFP4 row against one token with the block scale folded into the LUT (two FMAs per block,
// four accumulators). False (row not written) when an exponent leaves the exact range; the
// caller then takes the scale-after-sum path.
inline bool mx_row_scaled_lut(const uint8_t* row, int64_t nb, const float* x, __m512 lut, float* out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    unsigned bad = 0;
    auto step = [&](int64_t b, int slot) HM_ALWAYS_INLINE {
        const uint8_t* blk = row + b * kMxfp4Bytes;
        _mm_prefetch((const char*)blk + kPrefetchBytes, _MM_HINT_T0);
        bad |= g_scaled_lut.bad[blk[0]];  // checked once per row: the row is redone if any is set
        __m512 lo, hi;
        mx_decode_with_scale(blk, lut, lo, hi);
        const float* xb = x + b * kBlockElems;
        acc[2 * slot] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[2 * slot]);
        acc[2 * slot + 1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[2 * slot + 1]);
    };
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        step(b, 0);
        step(b + 1, 1);
    }
    if (b < nb) step(b, 0);
    if (bad) return false;
    *out = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    return true;
}

// Rows per pass by token count: two from 5 tokens (Zen 4, Q8_0 head: at 3-4 tokens one row per
// pass over L1-sized K chunks is 1.2-1.3x faster, from 6 tokens two rows are; 3 or 4 rows no better).
template <int NT>
constexpr int rows_per_pass() { return NT >= kPairRowsFromTokens ? 2 : 1; }

// Per block: decoded weights times the activations, then one FMA by the block scale. Even and
// odd blocks use separate accumulators (explicit unroll keeps them in registers) to hide the
// FMA latency when NT is 1. One MXFP4 token (decode) folds the scale into the LUT instead.
template <int FMT, int NT>
void gemv_t(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs,
            float* out, int64_t ldo) {
    const int64_t nb = K / kBlockElems;
    const __m512 lut = mx_lut();
    int64_t r = 0;
    if constexpr (rows_per_pass<NT>() > 1) r = gemv_rows<FMT, NT, rows_per_pass<NT>()>(w, row_bytes, n_rows, nb, xs, lut, out, ldo);
    if (NT == 1 || NT * K * 4 <= kGemvWholeBytes) {  // the activations stay in L1: rows straight through
        for (; r < n_rows; ++r) {
            const uint8_t* row = w + r * row_bytes;
            if (FMT == kMXFP4 && NT == 1 && mx_row_scaled_lut(row, nb, xs[0], lut, out + r)) continue;
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
        return;
    }
    // Else K chunks of 8 KB of activations (an even block count, so each block keeps its even/odd
    // accumulator and the sums their order) while a group of rows passes over each chunk.
    const int64_t kcb = (kGemvChunkFloats / (NT * kBlockElems) + 1) / 2 * 2;
    alignas(64) float keep[kGemvGroupRows][2 * NT][16];
    for (int64_t r0 = r; r0 < n_rows; r0 += kGemvGroupRows) {
        const int64_t nr = n_rows - r0 < kGemvGroupRows ? n_rows - r0 : kGemvGroupRows;
        for (int64_t b0 = 0; b0 < nb; b0 += kcb) {
            const int64_t b1 = nb - b0 < kcb ? nb : b0 + kcb;
            for (int64_t i = 0; i < nr; ++i) {
                const uint8_t* row = w + (r0 + i) * row_bytes;
                if (b0 == 0 && i + 2 < nr) prefetch_row_l2(row + 2 * row_bytes, row_bytes);
                __m512 acc0[NT], acc1[NT];
                for (int t = 0; t < NT; ++t) {
                    acc0[t] = b0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(keep[i][2 * t]);
                    acc1[t] = b0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(keep[i][2 * t + 1]);
                }
                int64_t b = b0;
                for (; b + 1 < b1; b += 2) {
                    gemv_block<FMT, NT, false>(row, b, xs, lut, acc0);
                    gemv_block<FMT, NT, false>(row, b + 1, xs, lut, acc1);
                }
                if (b < b1) gemv_block<FMT, NT, false>(row, b, xs, lut, acc0);
                if (b1 < nb) {
                    for (int t = 0; t < NT; ++t) {
                        _mm512_store_ps(keep[i][2 * t], acc0[t]);
                        _mm512_store_ps(keep[i][2 * t + 1], acc1[t]);
                    }
                } else {
                    for (int t = 0; t < NT; ++t)
                        out[t * ldo + r0 + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
                }
            }
        }
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
inline __m256i dot16_acc(__m256i acc, __m256i w, __m256i x) { return _mm256_dpwssd_epi32(acc, w, x); }
inline __m256i dot16_first(__m256i w, __m256i x) { return _mm256_madd_epi16(w, x); }
#include "gemv_q16.inc"

// ---- fast mode, many tokens: the int8 GEMM with vpdpbusd (64 u8 x s8 products into 16 int32
// lanes per instruction; the AVX2 kernel needs maddubs + adds + madd for half as many).
// A panel of 16 rows is decoded once per call as unsigned bytes, k-quad major:
// wt[b*512 + q*64 + r*4 + i] = weight 4q+i of block b in row r, plus an offset that makes it
// unsigned (MXFP4: LUT2 + 12; Q8_0: quant + 128). Each token's 4 int8 activations of quad q are
// broadcast against it. The offset comes back out exactly: minus 12 resp. 128 times the block's
// sum of activations. Same int32 dots and float order as every ISA (KernelSet::gemm_q8).
constexpr int kV8Panel = 16;
constexpr int kV8Group = 4;  // panels per micro-kernel call (Zen 4: as fast as 2, a little faster at T=512)
constexpr int64_t kV8PanelBytes = 512;  // per block: 8 quads x 16 rows x 4 bytes

// 128 * (sum of the block's int8 activations), from the stored 12 * sum (an exact multiple of
// 12 within +-12 * 32 * 127): 43691 / 2^19 is 1/12 to 2.5e-7, so the rounded product is exact.
inline int32_t q8_offset_sum(int32_t bsum12) { return ((bsum12 * 43691 + (1 << 18)) >> 19) * 128; }

// Rows 4L + i (L, i < 4) of z[i]'s 128-bit lane L -> w[j] dword 4L + i = dword j of that row.
HM_ALWAYS_INLINE inline void transpose_4x4_lanes(const __m512i* z, __m512i* w) {
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    w[0] = _mm512_unpacklo_epi64(t0, t2);
    w[1] = _mm512_unpackhi_epi64(t0, t2);
    w[2] = _mm512_unpacklo_epi64(t1, t3);
    w[3] = _mm512_unpackhi_epi64(t1, t3);
}

// 16 bytes at src[r] + off for each row r < nr (zeros for the rest), transposed: w[j] dword r =
// bytes 4j..4j+3 of row r.
HM_ALWAYS_INLINE inline void load_16x16(const uint8_t* w, int64_t row_bytes, int nr, int64_t off, __m512i* out) {
    __m512i z[4];
    for (int i = 0; i < 4; ++i) {
        __m512i v = _mm512_setzero_si512();
        for (int L = 0; L < 4; ++L) {
            const int r = 4 * L + i;
            if (r < nr) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(w + r * row_bytes + off)), L);
        }
        z[i] = v;
    }
    transpose_4x4_lanes(z, out);
}

template <int FMT>
void decode_panel_v8(const uint8_t* w, int64_t row_bytes, int nr, int64_t nb, uint8_t* wt, float* dwt) {
    const __m512i m0f = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(char(0x80));
    const __m512i lut = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kMxfp4Lut2)),
                                        _mm512_set1_epi8(12));
    for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = wt + b * kV8PanelBytes;
        __m512i v[4];
        if constexpr (FMT == kMXFP4) {
            load_16x16(w, row_bytes, nr, b * kMxfp4Bytes + 1, v);  // dword j: nibbles of quads j and 4 + j
            for (int j = 0; j < 4; ++j) {
                _mm512_store_si512(o + j * 64, _mm512_shuffle_epi8(lut, _mm512_and_si512(v[j], m0f)));
                _mm512_store_si512(o + (4 + j) * 64,
                                   _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v[j], 4), m0f)));
            }
            for (int r = 0; r < kV8Panel; ++r)
                dwt[b * kV8Panel + r] = r < nr ? g_e8m0_table[w[r * row_bytes + b * kMxfp4Bytes]] : 0.f;
        } else {
            for (int h = 0; h < 2; ++h) {  // elements 16h .. 16h + 15: quads 4h .. 4h + 3
                load_16x16(w, row_bytes, nr, b * kQ8_0Bytes + 2 + 16 * h, v);
                for (int j = 0; j < 4; ++j) _mm512_store_si512(o + (4 * h + j) * 64, _mm512_xor_si512(v[j], flip));
            }
            for (int r = 0; r < kV8Panel; ++r) {
                uint16_t hbits = 0;
                if (r < nr) std::memcpy(&hbits, w + r * row_bytes + b * kQ8_0Bytes, 2);
                dwt[b * kV8Panel + r] = _cvtsh_ss(hbits);
            }
        }
    }
}

// NP panels (16 rows each; nr rows of the last are real) times TB tokens over all nb blocks.
template <int FMT, int TB, int NP>
__attribute__((noinline)) void gemm_v8_micro(const uint8_t* const* wt, const float* const* dwt, int64_t K,
                                             const int8_t* const* xq, const float* const* xd, float* const* out,
                                             int nr) {
    const int64_t nb = K / kBlockElems;
    __m512 acc[TB][NP];
    for (int t = 0; t < TB; ++t)
        for (int p = 0; p < NP; ++p) acc[t][p] = _mm512_setzero_ps();
    const int32_t* bs[TB];
    for (int t = 0; t < TB; ++t) bs[t] = (const int32_t*)(xd[t] + q8x_pairs(K) * 8);
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t xo = (b / 2) * kQ8xPairBytes + (b % 2) * 16;
        __m512i isum[TB][NP];
        for (int t = 0; t < TB; ++t)
            for (int p = 0; p < NP; ++p) isum[t][p] = _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
            __m512i wv[NP];
            for (int p = 0; p < NP; ++p) wv[p] = _mm512_load_si512(wt[p] + b * kV8PanelBytes + q * 64);
            for (int t = 0; t < TB; ++t) {
                int32_t x4;
                std::memcpy(&x4, xq[t] + xo + 32 * (q / 4) + 4 * (q % 4), 4);  // elements 4q .. 4q + 3
                const __m512i xv = _mm512_set1_epi32(x4);
                for (int p = 0; p < NP; ++p) isum[t][p] = _mm512_dpbusd_epi32(isum[t][p], wv[p], xv);
            }
        }
        for (int t = 0; t < TB; ++t) {
            const int32_t off = FMT == kMXFP4 ? bs[t][b] : q8_offset_sum(bs[t][b]);
            const __m512i ov = _mm512_set1_epi32(off);
            const __m512 xs = _mm512_set1_ps(q8x_scale(xd[t], b));
            for (int p = 0; p < NP; ++p) {
                const __m512 sc = _mm512_mul_ps(_mm512_load_ps(dwt[p] + b * kV8Panel), xs);
                acc[t][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[t][p], ov)), sc, acc[t][p]);
            }
        }
    }
    const __mmask16 last = __mmask16((1u << nr) - 1);
    for (int t = 0; t < TB; ++t)
        for (int p = 0; p < NP; ++p) {
            if (p + 1 < NP || nr == kV8Panel) _mm512_storeu_ps(out[t] + p * kV8Panel, acc[t][p]);
            else _mm512_mask_storeu_ps(out[t] + p * kV8Panel, last, acc[t][p]);
        }
}

thread_local std::vector<uint8_t> t_v8_panels;

// The per-thread panel buffer for nb blocks, 64-byte aligned: weights of kV8Group panels, then
// their scales.
inline uint8_t* v8_panel_buffer(int64_t nb) {
    const size_t bytes = size_t(kV8Group * nb * (kV8PanelBytes + kV8Panel * 4) + 64);
    if (t_v8_panels.size() < bytes) t_v8_panels.resize(bytes);
    return (uint8_t*)(((uintptr_t)t_v8_panels.data() + 63) & ~uintptr_t(63));
}

template <int FMT, int NP>
void gemm_v8_panels(const uint8_t* const* wt, const float* const* dwt, int64_t K, const int8_t* const* xq,
                    const float* const* xd, int64_t M, float* C, int64_t ldc, int64_t r0, int nr) {
    constexpr int TB = NP >= 4 ? 3 : 4;  // the int and float sums of TB x NP panels stay in registers
    for (int64_t m0 = 0; m0 < M; m0 += TB) {
        const int tb = int(M - m0 < TB ? M - m0 : TB);
        float* out[TB];
        for (int t = 0; t < tb; ++t) out[t] = C + (m0 + t) * ldc + r0;
        if (tb == TB) gemm_v8_micro<FMT, TB, NP>(wt, dwt, K, xq + m0, xd + m0, out, nr);
        else if (tb == 3) gemm_v8_micro<FMT, 3, NP>(wt, dwt, K, xq + m0, xd + m0, out, nr);
        else if (tb == 2) gemm_v8_micro<FMT, 2, NP>(wt, dwt, K, xq + m0, xd + m0, out, nr);
        else gemm_v8_micro<FMT, 1, NP>(wt, dwt, K, xq + m0, xd + m0, out, nr);
    }
}

template <int FMT>
void gemm_q8_fmt(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const int8_t* const* xq,
                 const float* const* xd, int64_t M, float* C, int64_t ldc) {
    const int64_t nb = K / kBlockElems;
    uint8_t* buf = v8_panel_buffer(nb);
    uint8_t* wt[kV8Group];
    float* dwt[kV8Group];
    for (int p = 0; p < kV8Group; ++p) {
        wt[p] = buf + p * nb * kV8PanelBytes;
        dwt[p] = (float*)(buf + kV8Group * nb * kV8PanelBytes) + p * nb * kV8Panel;
    }
    auto decode = [&](int64_t r0, int np, int nr_last) {
        for (int p = 0; p < np; ++p)
            decode_panel_v8<FMT>(w + (r0 + p * kV8Panel) * row_bytes, row_bytes, p + 1 < np ? kV8Panel : nr_last, nb,
                                 wt[p], dwt[p]);
    };
    int64_t r0 = 0;
    for (; r0 + kV8Group * kV8Panel <= N; r0 += kV8Group * kV8Panel) {
        decode(r0, kV8Group, kV8Panel);
        gemm_v8_panels<FMT, kV8Group>(wt, dwt, K, xq, xd, M, C, ldc, r0, kV8Panel);
    }
    for (; r0 < N; r0 += kV8Panel) {
        const int nr = int(N - r0 < kV8Panel ? N - r0 : kV8Panel);
        decode(r0, 1, nr);
        gemm_v8_panels<FMT, 1>(wt, dwt, K, xq, xd, M, C, ldc, r0, nr);
    }
}

void gemm_q8(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const int8_t* const* xq,
             const float* const* xd, int64_t M, float* C, int64_t ldc) {
    if (fmt == kMXFP4) gemm_q8_fmt<kMXFP4>(w, row_bytes, N, K, xq, xd, M, C, ldc);
    else gemm_q8_fmt<kQ8_0>(w, row_bytes, N, K, xq, xd, M, C, ldc);
}

}  // namespace
}  // namespace hm

// ---- three-digit activations (common.h: quantize_x_d3): VBMI byte permutes on top of the set's ISA.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")
namespace hm {
namespace {

// Per pair of blocks (34 bytes: e0, 16 nibble bytes, e1, 16 nibble bytes), one masked load, one
// vpermb into [b0 lo nibbles | b1 lo | b0 hi | b1 hi] order (the hi half shifted by 4), one vpermb
// through LUT2 + 12 repeated 4 times (index bits 4-5 are the other nibble; 6-7 are ignored).
struct D3Consts {
    __m512i lut, spread, eidx, fill;
    D3Consts() {
        alignas(64) uint8_t lut64[64], sp[64], ei[64], fl[64] = {};
        for (int i = 0; i < 64; ++i) lut64[i] = uint8_t(kMxfp4Lut2[i & 15] + 12);
        for (int i = 0; i < 16; ++i) sp[i] = sp[32 + i] = uint8_t(1 + i), sp[16 + i] = sp[48 + i] = uint8_t(18 + i);
        const uint8_t src[4] = {0, 17, 64, 81};  // e of blocks 4q..4q+3 in (pair A, pair B)
        for (int l = 0; l < 16; ++l) ei[4 * l] = src[l / 4], ei[4 * l + 1] = ei[4 * l + 2] = ei[4 * l + 3] = 0;
        fl[0] = fl[17] = 128;  // a missing block reads e = 128, nibbles 0
        lut = _mm512_load_si512(lut64);
        spread = _mm512_load_si512(sp);
        eidx = _mm512_load_si512(ei);
        fill = _mm512_load_si512(fl);
    }
};

template <bool kTail>
HM_ALWAYS_INLINE inline __m512i d3_weights(const uint8_t* blk, __mmask64 present, const D3Consts& c, __m512i& raw) {
    raw = kTail ? _mm512_mask_loadu_epi8(c.fill, present, blk) : _mm512_maskz_loadu_epi8(present, blk);
    __m512i z = _mm512_permutexvar_epi8(c.spread, raw);
    z = _mm512_mask_srli_epi16(z, 0xFFFF0000u, z, 4);
    return _mm512_permutexvar_epi8(z, c.lut);
}

// Horner over the three digits (h, m, l at X, X+64, X+128): sum (w+12) xi per lane, exact.
HM_ALWAYS_INLINE inline __m512i d3_digits(__m512i wv, const uint8_t* X) {
    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512(X));
    a = _mm512_dpbusd_epi32(_mm512_slli_epi32(a, 8), wv, _mm512_loadu_si512(X + 64));
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(a, 8), wv, _mm512_loadu_si512(X + 128));
}

constexpr __mmask64 kPairMask = (__mmask64(1) << 34) - 1, kBlockMask = (__mmask64(1) << 17) - 1;

// Quads [q0, q1) of one row (q0 even) for NT tokens: acc[2t + q % 2]; emin/emax gather the
// weight exponents for the range check.
template <int NT, bool kPrefetch>
inline void d3_quads(const uint8_t* row, int64_t q0, int64_t q1, int64_t nb, const uint8_t* const* xq,
                     const D3Consts& c, __m512* acc, __m512i& emin, __m512i& emax) {
    const int64_t nfull = nb / 4;
    auto step = [&](int64_t q, int slot) HM_ALWAYS_INLINE {
        const uint8_t* blk = row + q * 4 * kMxfp4Bytes;
        if (kPrefetch) {
            _mm_prefetch((const char*)blk + kPrefetchBytes, _MM_HINT_T0);
            _mm_prefetch((const char*)blk + kPrefetchBytes + 64, _MM_HINT_T0);
        }
        __m512i ra, rb, wa, wb;
        if (q < nfull) {
            wa = d3_weights<false>(blk, kPairMask, c, ra);
            wb = d3_weights<false>(blk + 2 * kMxfp4Bytes, kPairMask, c, rb);
        } else {  // the last, partial quad: missing blocks read as code 0, e = 128
            const int64_t rem = nb - 4 * q;
            wa = d3_weights<true>(blk, rem >= 2 ? kPairMask : kBlockMask, c, ra);
            wb = d3_weights<true>(blk + 2 * kMxfp4Bytes, rem == 3 ? kBlockMask : 0, c, rb);
        }
        const __m512i ev = _mm512_maskz_permutex2var_epi8(0x1111111111111111ull, ra, c.eidx, rb);
        emin = _mm512_min_epu32(emin, ev);
        emax = _mm512_max_epu32(emax, ev);
        for (int t = 0; t < NT; ++t) {
            const uint8_t* X = xq[t] + kD3HeadBytes + q * kD3QuadBytes;
            const __m512i a = d3_digits(wa, X), b = d3_digits(wb, X + 192);
            // lanes i and i+8 of each pair hold the same block: [A lo | B lo] + [A hi | B hi]
            __m512i f = _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE));
            f = _mm512_sub_epi32(f, _mm512_loadu_si512(X + 384));
            const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ev, _mm512_loadu_si512(X + 448)), 23));
            acc[2 * t + slot] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(f), sc, acc[2 * t + slot]);
        }
    };
    int64_t q = q0;
    for (; q + 1 < q1; q += 2) {
        step(q, 0);
        step(q + 1, 1);
    }
    if (q < q1) step(q, 0);
}

// The 16-lane sum in scalar::gemv_d3's order: (l, l+8), then (l, l+4), then (0+2) + (1+3).
inline float d3_hsum(__m512 a0, __m512 a1) {
    const __m512 s = _mm512_add_ps(a0, a1);
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
}

inline bool d3_in_range(__m512i emin, __m512i emax, int32_t lo, int32_t hi) {
    return int32_t(_mm512_reduce_min_epu32(emin)) >= lo && int32_t(_mm512_reduce_max_epu32(emax)) <= hi;
}

// Rows x NT tokens as gemv_q16_t: whole rows while the activations fit in L1, else K chunks
// over row groups. A row whose weight exponents leave [e_lo, e_hi] is redone by the reference.
template <int NT>
void gemv_d3_t(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const uint8_t* const* xq,
               float* out, int64_t ldo) {
    const int64_t nb = K / kBlockElems, nq = d3x_quads(K);
    const D3Consts c;
    int32_t lo = INT32_MIN, hi = INT32_MAX;
    float poison[NT];
    for (int t = 0; t < NT; ++t) {
        const D3Head h = d3x_head(xq[t]);
        lo = h.e_lo > lo ? h.e_lo : lo;
        hi = h.e_hi < hi ? h.e_hi : hi;
        poison[t] = h.poison;
    }
    auto finish = [&](int64_t r, const __m512* acc, __m512i emin, __m512i emax) {
        if (!d3_in_range(emin, emax, lo, hi)) {
            scalar::gemv_d3(w + r * row_bytes, row_bytes, 1, K, xq, NT, out + r, ldo);
            return;
        }
        for (int t = 0; t < NT; ++t) out[t * ldo + r] = d3_hsum(acc[2 * t], acc[2 * t + 1]) + poison[t];
    };
    const __m512i e0 = _mm512_set1_epi32(255), e1 = _mm512_setzero_si512();
    if (NT * nq * kD3QuadBytes <= kGemvWholeBytes) {
        for (int64_t r = 0; r < n_rows; ++r) {
            __m512 acc[2 * NT];
            for (int t = 0; t < 2 * NT; ++t) acc[t] = _mm512_setzero_ps();
            __m512i emin = e0, emax = e1;
            d3_quads<NT, true>(w + r * row_bytes, 0, nq, nb, xq, c, acc, emin, emax);
            finish(r, acc, emin, emax);
        }
        return;
    }
    const int64_t kcq = (kGemvChunkFloats * 4 / (NT * kD3QuadBytes) + 1) / 2 * 2;  // even: slots by q % 2
    alignas(64) float keep[kGemvGroupRows][2 * NT][16];
    alignas(64) uint32_t keep_e[kGemvGroupRows][2][16];
    for (int64_t r0 = 0; r0 < n_rows; r0 += kGemvGroupRows) {
        const int64_t nr = n_rows - r0 < kGemvGroupRows ? n_rows - r0 : kGemvGroupRows;
        for (int64_t q0 = 0; q0 < nq; q0 += kcq) {
            const int64_t q1 = nq - q0 < kcq ? nq : q0 + kcq;
            for (int64_t r = 0; r < nr; ++r) {
                const uint8_t* row = w + (r0 + r) * row_bytes;
                if (q0 == 0 && r + 2 < nr) prefetch_row_l2(row + 2 * row_bytes, row_bytes);
                __m512 acc[2 * NT];
                __m512i emin = e0, emax = e1;
                for (int t = 0; t < 2 * NT; ++t) acc[t] = q0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(keep[r][t]);
                if (q0) emin = _mm512_load_si512(keep_e[r][0]), emax = _mm512_load_si512(keep_e[r][1]);
                d3_quads<NT, false>(row, q0, q1, nb, xq, c, acc, emin, emax);
                if (q1 < nq) {
                    for (int t = 0; t < 2 * NT; ++t) _mm512_store_ps(keep[r][t], acc[t]);
                    _mm512_store_si512(keep_e[r][0], emin);
                    _mm512_store_si512(keep_e[r][1], emax);
                } else {
                    finish(r0 + r, acc, emin, emax);
                }
            }
        }
    }
}

void gemv_d3(const uint8_t* w, int64_t rb, int64_t n, int64_t K, const uint8_t* const* xq, int nt, float* out,
             int64_t ldo) {
    switch (nt) {
        case 1: return gemv_d3_t<1>(w, rb, n, K, xq, out, ldo);
        case 2: return gemv_d3_t<2>(w, rb, n, K, xq, out, ldo);
        case 3: return gemv_d3_t<3>(w, rb, n, K, xq, out, ldo);
        case 4: return gemv_d3_t<4>(w, rb, n, K, xq, out, ldo);
        case 5: return gemv_d3_t<5>(w, rb, n, K, xq, out, ldo);
        case 6: return gemv_d3_t<6>(w, rb, n, K, xq, out, ldo);
        case 7: return gemv_d3_t<7>(w, rb, n, K, xq, out, ldo);
        default: return gemv_d3_t<8>(w, rb, n, K, xq, out, ldo);
    }
}

}  // namespace
}  // namespace hm
#pragma GCC pop_options

namespace hm {
namespace {

// One block's 32 weights as exact floats (the tile's values), written to o[0..31].
inline void decode_block(int fmt, const uint8_t* blk, __m512 lut, float* o) {
    __m512 lo, hi, d;
    if (fmt == kMXFP4) {
        mx_decode(blk, lut, lo, hi);
        d = _mm512_set1_ps(g_e8m0_table[blk[0]]);
    } else {
        q8_decode(blk, lo, hi);
        d = q8_scale(blk);
    }
    _mm512_storeu_ps(o, _mm512_mul_ps(lo, d));
    _mm512_storeu_ps(o + 16, _mm512_mul_ps(hi, d));
}

void decode(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* tile) {
    const int64_t nb = K / kBlockElems, bb = fmt == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    const __m512 lut = mx_lut();
    for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t b = 0; b < nb; ++b) decode_block(fmt, w + r * row_bytes + b * bb, lut, tile + r * K + b * kBlockElems);
}

// ---- fp32 tile GEMM with the tokens in the 16 lanes and the weights broadcast (the AVX2 kernel's
// scheme at twice the width): on cores with two 512-bit FMA pipes (Intel server cores, Zen 5) it
// doubles the AVX2 kernel's FMA rate. Activations packed in groups of 16 rows, k-major:
// Ap[(g*K + k)*16 + j] = A[g*16 + j][k] (zero pad).
constexpr int kTok = 16;           // tokens per packed group (one zmm)
constexpr int kRb = 8, kTb = 2;    // weight rows x token groups per micro-kernel: 16 accumulators
constexpr int64_t kKc = 160;       // k per block: a 32-token slice (20 KB) stays in L1
constexpr int64_t kNc = 64;        // weight rows whose accumulators a token-group pair keeps

void pack_a16(const float* const* rows, int64_t M, int64_t K, float* Ap) {
    for (int64_t g = 0; g * kTok < M; ++g) {
        const int n = int(M - g * kTok < kTok ? M - g * kTok : kTok);
        float* dst = Ap + g * K * kTok;
        for (int j = 0; j < kTok; ++j) {
            const float* src = j < n ? rows[g * kTok + j] : nullptr;
            for (int64_t k = 0; k < K; ++k) dst[k * kTok + j] = src ? src[k] : 0.0f;
        }
    }
}

// RB weight rows x TB token groups over kc values of k, accumulators kept in tmp between calls
// (loaded unless `first`) so the caller can block K.
template <int RB, int TB>
void micro16(const float* Ap, int64_t lda, int64_t kc, const float* B, int64_t ldb, float* tmp, bool first) {
    __m512 acc[RB][TB];
    for (int r = 0; r < RB; ++r)
        for (int t = 0; t < TB; ++t)
            acc[r][t] = first ? _mm512_setzero_ps() : _mm512_load_ps(tmp + (r * kTb + t) * kTok);
    if constexpr (TB == 1) {
        // One token group: even and odd k in separate chains, else FMA latency sets the pace.
        __m512 odd[RB];
        for (int r = 0; r < RB; ++r) odd[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < kc; k += 2) {  // kc is a multiple of 32
            const __m512 a0 = _mm512_loadu_ps(Ap + k * kTok), a1 = _mm512_loadu_ps(Ap + (k + 1) * kTok);
            for (int r = 0; r < RB; ++r) {
                acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(B[r * ldb + k]), a0, acc[r][0]);
                odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(B[r * ldb + k + 1]), a1, odd[r]);
            }
        }
        for (int r = 0; r < RB; ++r) acc[r][0] = _mm512_add_ps(acc[r][0], odd[r]);
    } else {
        for (int64_t k = 0; k < kc; ++k) {
            __m512 a[TB];
            for (int t = 0; t < TB; ++t) a[t] = _mm512_loadu_ps(Ap + (t * lda + k) * kTok);
            for (int r = 0; r < RB; ++r) {
                const __m512 w = _mm512_set1_ps(B[r * ldb + k]);
                for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_fmadd_ps(w, a[t], acc[r][t]);
            }
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int t = 0; t < TB; ++t) _mm512_store_ps(tmp + (r * kTb + t) * kTok, acc[r][t]);
}

template <int TB>
void micro16_rb(int rb, const float* Ap, int64_t lda, int64_t kc, const float* B, int64_t ldb, float* tmp,
                bool first) {
    switch (rb) {
        case 8: return micro16<8, TB>(Ap, lda, kc, B, ldb, tmp, first);
        case 7: return micro16<7, TB>(Ap, lda, kc, B, ldb, tmp, first);
        case 6: return micro16<6, TB>(Ap, lda, kc, B, ldb, tmp, first);
        case 5: return micro16<5, TB>(Ap, lda, kc, B, ldb, tmp, first);
        case 4: return micro16<4, TB>(Ap, lda, kc, B, ldb, tmp, first);
        case 3: return micro16<3, TB>(Ap, lda, kc, B, ldb, tmp, first);
        case 2: return micro16<2, TB>(Ap, lda, kc, B, ldb, tmp, first);
        default: return micro16<1, TB>(Ap, lda, kc, B, ldb, tmp, first);
    }
}

// C rows of the tb token groups from g (panel accumulators in acc) for weight rows n0..n0+rb.
inline void store_panel(const float* tmp, int64_t g, int tb, int64_t M, int64_t n0, int rb, float* C, int64_t ldc) {
    for (int t = 0; t < tb; ++t)
        for (int j = 0; j < kTok && (g + t) * kTok + j < M; ++j)
            for (int r = 0; r < rb; ++r) C[((g + t) * kTok + j) * ldc + n0 + r] = tmp[(r * kTb + t) * kTok + j];
}

void gemm16(const float* Ap, int64_t M, const float* B, int64_t N, int64_t K, float* C, int64_t ldc) {
    const int64_t groups = (M + kTok - 1) / kTok;
    alignas(64) float acc[kNc / kRb][kRb * kTb * kTok];
    for (int64_t g = 0; g < groups; g += kTb) {
        const int tb = int(groups - g < kTb ? groups - g : kTb);
        for (int64_t nc0 = 0; nc0 < N; nc0 += kNc) {
            const int64_t nc = N - nc0 < kNc ? N - nc0 : kNc;
            for (int64_t k0 = 0; k0 < K; k0 += kKc) {
                const int64_t kc = K - k0 < kKc ? K - k0 : kKc;
                for (int64_t n0 = nc0; n0 < nc0 + nc; n0 += kRb) {
                    const int rb = int(nc0 + nc - n0 < kRb ? nc0 + nc - n0 : kRb);
                    float* tmp = acc[(n0 - nc0) / kRb];
                    if (tb == 2) micro16_rb<2>(rb, Ap + (g * K + k0) * kTok, K, kc, B + n0 * K + k0, K, tmp, k0 == 0);
                    else micro16_rb<1>(rb, Ap + (g * K + k0) * kTok, K, kc, B + n0 * K + k0, K, tmp, k0 == 0);
                }
            }
            for (int64_t n0 = nc0; n0 < nc0 + nc; n0 += kRb)
                store_panel(acc[(n0 - nc0) / kRb], g, tb, M, n0, int(nc0 + nc - n0 < kRb ? nc0 + nc - n0 : kRb), C, ldc);
        }
    }
}

// Few tokens (one packed group) straight from the quantized rows: per block the RB rows' 32
// weights are decoded into an L1 buffer, the accumulators stay in registers for the whole K.
template <int RB>
void qmicro16(int fmt, const uint8_t* w, int64_t row_bytes, int64_t K, const float* Ap, float* tmp) {
    const int64_t nb = K / kBlockElems, bb = fmt == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    const __m512 lut = mx_lut();
    alignas(64) float buf[RB][kBlockElems];
    __m512 acc[RB], odd[RB];
    for (int r = 0; r < RB; ++r) acc[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < RB; ++r) {
            const uint8_t* blk = w + r * row_bytes + b * bb;
            _mm_prefetch((const char*)blk + kPrefetchBytes, _MM_HINT_T0);
            decode_block(fmt, blk, lut, buf[r]);
        }
        const float* A = Ap + b * kBlockElems * kTok;
        for (int j = 0; j < kBlockElems; j += 2) {
            const __m512 a0 = _mm512_loadu_ps(A + j * kTok), a1 = _mm512_loadu_ps(A + (j + 1) * kTok);
            for (int r = 0; r < RB; ++r) {
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(buf[r][j]), a0, acc[r]);
                odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(buf[r][j + 1]), a1, odd[r]);
            }
        }
    }
    for (int r = 0; r < RB; ++r) _mm512_store_ps(tmp + r * kTb * kTok, _mm512_add_ps(acc[r], odd[r]));
}

void qgemm16(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* Ap, int64_t M,
             float* C, int64_t ldc) {
    alignas(64) float tmp[kRb * kTb * kTok];
    for (int64_t g = 0; g * kTok < M; ++g)
        for (int64_t n0 = 0; n0 < N; n0 += kRb) {
            const int rb = int(N - n0 < kRb ? N - n0 : kRb);
            const uint8_t* wr = w + n0 * row_bytes;
            const float* A = Ap + g * K * kTok;
            switch (rb) {
                case 8: qmicro16<8>(fmt, wr, row_bytes, K, A, tmp); break;
                case 7: qmicro16<7>(fmt, wr, row_bytes, K, A, tmp); break;
                case 6: qmicro16<6>(fmt, wr, row_bytes, K, A, tmp); break;
                case 5: qmicro16<5>(fmt, wr, row_bytes, K, A, tmp); break;
                case 4: qmicro16<4>(fmt, wr, row_bytes, K, A, tmp); break;
                case 3: qmicro16<3>(fmt, wr, row_bytes, K, A, tmp); break;
                case 2: qmicro16<2>(fmt, wr, row_bytes, K, A, tmp); break;
                default: qmicro16<1>(fmt, wr, row_bytes, K, A, tmp); break;
            }
            store_panel(tmp, g, 1, M, n0, rb, C, ldc);
        }
}

}  // namespace

// The scaled-LUT GEMV (two FMAs per 32 weights and token, as many as the GEMM) keeps up with the
// tile GEMM: Zen 4, 2 threads, 2880 x 2880, tile time / GEMV time 1.1-1.5 from 12 to 48 tokens,
// 0.95-1.0 at 64-96.
constexpr int kMxfp4GemvMaxTokens = 48;

const KernelSet kAvx512Kernels = {"avx512", prep_x, gemv, decode, pack_a16, gemm16,
                                  avx2::gemv_q8, avx2::attn_group, qgemm16, gemm_q8,
                                  avx2::quantize_q8, avx2::swiglu, avx2::quantize_q16, gemv_q16,
                                  quantize_x_d3, gemv_d3, kMxfp4GemvMaxTokens};

// The three-digit GEMV needs VBMI on top of the set's F/BW/VL/VNNI (Ice Lake, Zen 4 and later).
bool avx512_has_d3() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi");
}

}  // namespace hm
#pragma GCC pop_options
