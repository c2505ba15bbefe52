// AVX-512 (F/BW/VL) decoders of the ext formats (layouts: ext_scalar.cpp) and the fp32 row dot.
// 16 int32 lanes per vpmovzxbd load. Where a value is a function of 4 index bits, one vpermps on a
// 16-entry float table gives it directly (vpermps reads only the low 4 bits of each lane, so the
// nibble needs no masking); a 5th bit becomes a mask register (the Q5_0/Q5_1 qh word itself, or
// vptestmb over the K-quants' bit planes) that picks a second table. Q6_K's 6-bit codes are
// assembled as bytes, 64 per vector, then sign-extended 16 at a time. Every value gets numpy's
// one rounding, as in the scalar set.
// Internal linkage only, as in kern_avx512.cpp.
#include "common.h"
#include "ext_formats.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

namespace hm {
namespace {

inline float f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

inline uint32_t u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// 16 bytes -> 16 zero-extended int32 lanes.
HM_ALWAYS_INLINE inline __m512i u8x16(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
}

HM_ALWAYS_INLINE inline void store(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
HM_ALWAYS_INLINE inline __m512 bcast(float v) { return _mm512_set1_ps(v); }

// Float lookup tables indexed by 4 bits. Literal data, not built at load: a constructor in this
// file would be AVX-512 code running on every CPU.
struct Tables {
    float ident[16];    // i: Q4_1, Q4_K; Q5_1 / Q5_K without the high bit, Q5_0 with it
    float minus16[16];  // i - 16: Q5_0 without the high bit
    float plus16[16];   // i + 16: Q5_1 / Q5_K with it
    float q4_0[16];     // i - 8
    float iq4[16];      // kIq4Values
    float and3[16];     // i & 3: Q2_K, Q3_K with the high bit
    float and3m4[16];   // (i & 3) - 4: Q3_K without it
};
alignas(64) constexpr Tables kT = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1},
    {16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31},
    {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7},
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3},
    {-4, -3, -2, -1, -4, -3, -2, -1, -4, -3, -2, -1, -4, -3, -2, -1},
};

HM_ALWAYS_INLINE inline __m512 tbl(const float* t) { return _mm512_loadu_ps(t); }

// Value of the low 4 bits of each lane of idx, from t.
HM_ALWAYS_INLINE inline __m512 look(__m512i idx, const float* t) { return _mm512_permutexvar_ps(idx, tbl(t)); }

// As look, but lanes with their bit set in k read t1.
HM_ALWAYS_INLINE inline __m512 look2(__m512i idx, const float* t0, const float* t1, __mmask16 k) {
    return _mm512_mask_permutexvar_ps(look(idx, t0), k, idx, tbl(t1));
}

HM_ALWAYS_INLINE inline void q4_0(const uint8_t* b, float* o) {
    const __m512 d = bcast(f16(b));
    const __m512i v = u8x16(b + 2);
    store(o, _mm512_mul_ps(d, look(v, kT.q4_0)));
    store(o + 16, _mm512_mul_ps(d, look(_mm512_srli_epi32(v, 4), kT.q4_0)));
}

HM_ALWAYS_INLINE inline void q4_1(const uint8_t* b, float* o) {
    const __m512 d = bcast(f16(b)), m = bcast(f16(b + 2));
    const __m512i v = u8x16(b + 4);
    store(o, _mm512_fmadd_ps(d, look(v, kT.ident), m));
    store(o + 16, _mm512_fmadd_ps(d, look(_mm512_srli_epi32(v, 4), kT.ident), m));
}

// qh is the element mask: bit e set means element e has its high bit.
HM_ALWAYS_INLINE inline void q5_0(const uint8_t* b, float* o) {
    const __m512 d = bcast(f16(b));
    const uint32_t qh = u32(b + 2);
    const __m512i v = u8x16(b + 6);
    store(o, _mm512_mul_ps(d, look2(v, kT.minus16, kT.ident, __mmask16(qh))));
    store(o + 16, _mm512_mul_ps(d, look2(_mm512_srli_epi32(v, 4), kT.minus16, kT.ident, __mmask16(qh >> 16))));
}

HM_ALWAYS_INLINE inline void q5_1(const uint8_t* b, float* o) {
    const __m512 d = bcast(f16(b)), m = bcast(f16(b + 2));
    const uint32_t qh = u32(b + 4);
    const __m512i v = u8x16(b + 8);
    store(o, _mm512_fmadd_ps(d, look2(v, kT.ident, kT.plus16, __mmask16(qh)), m));
    store(o + 16, _mm512_fmadd_ps(d, look2(_mm512_srli_epi32(v, 4), kT.ident, kT.plus16, __mmask16(qh >> 16)), m));
}

HM_ALWAYS_INLINE inline void iq4_32(const uint8_t* qs, __m512 d, float* o) {
    const __m512i v = u8x16(qs);
    store(o, _mm512_mul_ps(d, look(v, kT.iq4)));
    store(o + 16, _mm512_mul_ps(d, look(_mm512_srli_epi32(v, 4), kT.iq4)));
}

HM_ALWAYS_INLINE inline void iq4_nl(const uint8_t* b, float* o) { iq4_32(b + 2, bcast(f16(b)), o); }

// Sub-block scales: d times 16 unsigned / signed bytes, as numpy's fp32 products, stored for
// per-sub-block broadcasts.
HM_ALWAYS_INLINE inline void scale16u(__m128i v, float d, float* out) {
    _mm512_store_ps(out, _mm512_mul_ps(bcast(d), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))));
}
HM_ALWAYS_INLINE inline void scale16s(__m128i v, float d, float* out) {
    _mm512_store_ps(out, _mm512_mul_ps(bcast(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))));
}
// The same for 8 bytes (the low 8 of v).
HM_ALWAYS_INLINE inline void scale8u(__m128i v, float d, float* out) {
    _mm256_store_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))));
}

// The 8 sub-block scales d * (ls - 32): lane ib takes nibble ib of the 4 sl bytes and bits
// 2ib, 2ib+1 of sh.
HM_ALWAYS_INLINE inline void iq4_xs(const uint8_t* b, float* o) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i sl = _mm256_srlv_epi32(_mm256_set1_epi32(int(u32(b + 4))), _mm256_slli_epi32(lanes, 2));
    const __m256i sh = _mm256_srlv_epi32(_mm256_set1_epi32(b[2] | b[3] << 8), _mm256_slli_epi32(lanes, 1));
    const __m256i ls = _mm256_or_si256(_mm256_and_si256(sl, _mm256_set1_epi32(15)),
                                       _mm256_slli_epi32(_mm256_and_si256(sh, _mm256_set1_epi32(3)), 4));
    const __m256 dls = _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)));
    alignas(32) float dl[8];
    _mm256_store_ps(dl, _mm256_mul_ps(_mm256_set1_ps(f16(b)), dls));
    for (int ib = 0; ib < 8; ++ib) iq4_32(b + 8 + 16 * ib, bcast(dl[ib]), o + 32 * ib);
}

// K-quants: the sub-block scales are unpacked once per super-block into float arrays, then
// broadcast per 16 values.
HM_ALWAYS_INLINE inline void q2_k(const uint8_t* b, float* o) {
    const uint8_t* qs = b + 16;
    const __m128i sc = _mm_loadu_si128((const __m128i*)b), m4 = _mm_set1_epi8(15);
    alignas(64) float dl[16], ml[16];
    scale16u(_mm_and_si128(sc, m4), f16(b + 80), dl);
    scale16u(_mm_and_si128(_mm_srli_epi16(sc, 4), m4), f16(b + 82), ml);
    for (int h = 0; h < 2; ++h)
        for (int g = 0; g < 2; ++g) {  // elements 128h + 32s + 16g.. from bytes qs[32h + 16g..]
            __m512i v = u8x16(qs + 32 * h + 16 * g);
            for (int s = 0; s < 4; ++s, v = _mm512_srli_epi32(v, 2)) {
                const int j = 8 * h + 2 * s + g;
                store(o + 128 * h + 32 * s + 16 * g,
                      _mm512_fmsub_ps(bcast(dl[j]), look(v, kT.and3), bcast(ml[j])));
            }
        }
}

HM_ALWAYS_INLINE inline void q3_k(const uint8_t* b, float* o) {
    const uint8_t *hm = b, *qs = b + 32;
    uint64_t sc[2];
    q3k_unpack(b + 96, sc);
    alignas(64) float dl[16];
    scale16s(_mm_sub_epi8(_mm_set_epi64x(int64_t(sc[1]), int64_t(sc[0])), _mm_set1_epi8(32)), f16(b + 108), dl);
    for (int h = 0; h < 2; ++h)
        for (int g = 0; g < 2; ++g) {
            __m512i v = u8x16(qs + 32 * h + 16 * g);
            // Byte l's bit 4h + s is element 128h + 32s + 16g + l's high bit; shifting 16-bit
            // lanes is fine as only bit 0 of each byte is tested.
            __m128i m = _mm_srli_epi16(_mm_loadu_si128((const __m128i*)(hm + 16 * g)), 4 * h);
            for (int s = 0; s < 4; ++s, v = _mm512_srli_epi32(v, 2), m = _mm_srli_epi16(m, 1)) {
                const __mmask16 k = _mm_test_epi8_mask(m, _mm_set1_epi8(1));
                store(o + 128 * h + 32 * s + 16 * g,
                      _mm512_mul_ps(bcast(dl[8 * h + 2 * s + g]), look2(v, kT.and3m4, kT.and3, k)));
            }
        }
}

HM_ALWAYS_INLINE inline void k4_scales(const uint8_t* sc, float d, float dmin, float* dl, float* ml) {
    uint32_t w[4];
    k4_unpack(sc, w);
    const __m128i v = _mm_setr_epi32(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
    scale8u(v, d, dl);
    scale8u(_mm_unpackhi_epi64(v, v), dmin, ml);
}

HM_ALWAYS_INLINE inline void q4_k(const uint8_t* b, float* o) {
    alignas(32) float dl[8], ml[8];
    k4_scales(b + 4, f16(b), f16(b + 2), dl, ml);
    const uint8_t* qs = b + 16;
    for (int p = 0; p < 4; ++p)  // bytes 32p..32p+31: sub-block 2p (low nibbles), 2p+1 (high)
        for (int g = 0; g < 2; ++g) {
            const __m512i v = u8x16(qs + 32 * p + 16 * g);
            const __m512 q0 = look(v, kT.ident), q1 = look(_mm512_srli_epi32(v, 4), kT.ident);
            store(o + 64 * p + 16 * g, _mm512_fmsub_ps(bcast(dl[2 * p]), q0, bcast(ml[2 * p])));
            store(o + 64 * p + 32 + 16 * g, _mm512_fmsub_ps(bcast(dl[2 * p + 1]), q1, bcast(ml[2 * p + 1])));
        }
}

HM_ALWAYS_INLINE inline void q5_k(const uint8_t* b, float* o) {
    alignas(32) float dl[8], ml[8];
    k4_scales(b + 4, f16(b), f16(b + 2), dl, ml);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int g = 0; g < 2; ++g) {
        __m128i h = _mm_loadu_si128((const __m128i*)(qh + 16 * g));  // byte l, bit i: sub-block i
        for (int p = 0; p < 4; ++p, h = _mm_srli_epi16(h, 2)) {
            const __mmask16 k0 = _mm_test_epi8_mask(h, _mm_set1_epi8(1));
            const __mmask16 k1 = _mm_test_epi8_mask(h, _mm_set1_epi8(2));
            const __m512i v = u8x16(qs + 32 * p + 16 * g);
            const __m512 q0 = look2(v, kT.ident, kT.plus16, k0);
            const __m512 q1 = look2(_mm512_srli_epi32(v, 4), kT.ident, kT.plus16, k1);
            store(o + 64 * p + 16 * g, _mm512_fmsub_ps(bcast(dl[2 * p]), q0, bcast(ml[2 * p])));
            store(o + 64 * p + 32 + 16 * g, _mm512_fmsub_ps(bcast(dl[2 * p + 1]), q1, bcast(ml[2 * p + 1])));
        }
    }
}

// 64 int8 values in element order -> floats, each 16 times its scale sc[0..3].
HM_ALWAYS_INLINE inline void store_i8x64(__m512i q, const float* sc, float* o) {
    const __m128i p[4] = {_mm512_castsi512_si128(q), _mm512_extracti32x4_epi32(q, 1),
                          _mm512_extracti32x4_epi32(q, 2), _mm512_extracti32x4_epi32(q, 3)};
    for (int c = 0; c < 4; ++c)
        store(o + 16 * c, _mm512_mul_ps(bcast(sc[c]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(p[c]))));
}

// Bytes, 64 codes per vector: per half h, the qh bytes sit in both 256-bit halves, the upper one
// shifted by 2, so one vector serves elements 0..63 (bits 0-1 | 2-3) and one 64..127 (bits 4-5 |
// 6-7). The 16-bit shifts move neighbour bits only into positions the masks drop.
HM_ALWAYS_INLINE inline void q6_k(const uint8_t* b, float* o) {
    alignas(64) float dl[16];
    scale16s(_mm_loadu_si128((const __m128i*)(b + 192)), f16(b + 208), dl);
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30), k32 = _mm512_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
        const __m512i ql = _mm512_loadu_si512(b + 64 * h);
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)));
        qh = _mm512_mask_srli_epi16(qh, __mmask32(0xFFFF0000u), qh, 2);
        const __m512i h0 = _mm512_and_si512(_mm512_slli_epi16(qh, 4), m30), h1 = _mm512_and_si512(qh, m30);
        const __m512i q0 = _mm512_or_si512(_mm512_and_si512(ql, m4), h0);
        const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), h1);
        store_i8x64(_mm512_sub_epi8(q0, k32), dl + 8 * h, o + 128 * h);
        store_i8x64(_mm512_sub_epi8(q1, k32), dl + 8 * h + 4, o + 128 * h + 64);
    }
}

template <void (*Block)(const uint8_t*, float*)>
void rows(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, int elems, int bytes, float* out) {
    for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t b = 0; b < K / elems; ++b) Block(w + r * row_bytes + b * bytes, out + r * K + b * elems);
}

// R rows x NT tokens, as the AVX2 dot_tile with 16 lanes (K % 32 == 0, so U = 2 steps evenly).
template <int R, int NT, int U>
void dot_tile(const float* W, int64_t K, const float* const* xs, float* out, int64_t ldo) {
    __m512 acc[U][R][NT];
    for (int u = 0; u < U; ++u)
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < NT; ++t) acc[u][r][t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16 * U)
        for (int u = 0; u < U; ++u) {
            __m512 w[R];
            for (int r = 0; r < R; ++r) w[r] = _mm512_loadu_ps(W + r * K + k + 16 * u);
            for (int t = 0; t < NT; ++t) {
                const __m512 x = _mm512_loadu_ps(xs[t] + k + 16 * u);
                for (int r = 0; r < R; ++r) acc[u][r][t] = _mm512_fmadd_ps(w[r], x, acc[u][r][t]);
            }
        }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) {
            __m512 s = acc[0][r][t];
            for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[u][r][t]);
            out[t * ldo + r] = _mm512_reduce_add_ps(s);
        }
}

// R = 4, the row count per decoded tile of the GEMV: R * U * NT accumulators plus R row vectors
// about fill the 32 zmm registers at nt = 7, 8, and still measured faster than R = 2 there.
template <int NT, int R, int U>
void dot_nt(const float* W, int64_t n_rows, int64_t K, const float* const* xs, float* out, int64_t ldo) {
    int64_t r = 0;
    for (; r + R <= n_rows; r += R) dot_tile<R, NT, U>(W + r * K, K, xs, out + r, ldo);
    for (; r < n_rows; ++r) dot_tile<1, NT, U>(W + r * K, K, xs, out + r, ldo);
}

}  // namespace

namespace avx512 {

void decode_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* out) {
    const int E = ext_block_elems(fmt), B = ext_block_bytes(fmt);
    switch (fmt) {
        case kQ4_0: return rows<q4_0>(w, row_bytes, n_rows, K, E, B, out);
        case kQ4_1: return rows<q4_1>(w, row_bytes, n_rows, K, E, B, out);
        case kQ5_0: return rows<q5_0>(w, row_bytes, n_rows, K, E, B, out);
        case kQ5_1: return rows<q5_1>(w, row_bytes, n_rows, K, E, B, out);
        case kIQ4_NL: return rows<iq4_nl>(w, row_bytes, n_rows, K, E, B, out);
        case kIQ4_XS: return rows<iq4_xs>(w, row_bytes, n_rows, K, E, B, out);
        case kQ2_K: return rows<q2_k>(w, row_bytes, n_rows, K, E, B, out);
        case kQ3_K: return rows<q3_k>(w, row_bytes, n_rows, K, E, B, out);
        case kQ4_K: return rows<q4_k>(w, row_bytes, n_rows, K, E, B, out);
        case kQ5_K: return rows<q5_k>(w, row_bytes, n_rows, K, E, B, out);
        case kQ6_K: return rows<q6_k>(w, row_bytes, n_rows, K, E, B, out);
        default: return;
    }
}

void dot_rows(const float* W, int64_t n_rows, int64_t K, const float* const* xs, int nt, float* out, int64_t ldo) {
    switch (nt) {
        case 1: return dot_nt<1, 4, 2>(W, n_rows, K, xs, out, ldo);
        case 2: return dot_nt<2, 4, 1>(W, n_rows, K, xs, out, ldo);
        case 3: return dot_nt<3, 4, 1>(W, n_rows, K, xs, out, ldo);
        case 4: return dot_nt<4, 4, 1>(W, n_rows, K, xs, out, ldo);
        case 5: return dot_nt<5, 4, 1>(W, n_rows, K, xs, out, ldo);
        case 6: return dot_nt<6, 4, 1>(W, n_rows, K, xs, out, ldo);
        case 7: return dot_nt<7, 4, 1>(W, n_rows, K, xs, out, ldo);
        case 8: return dot_nt<8, 4, 1>(W, n_rows, K, xs, out, ldo);
        default: return;
    }
}

}  // namespace avx512
}  // namespace hm

#pragma GCC pop_options
