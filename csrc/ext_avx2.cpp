// AVX2 + FMA + F16C decoders of the ext formats (layouts: ext_scalar.cpp) and the fp32 row dot.
// Two shapes of decode: int32 lanes (vpmovzxbd loads 8 quant bytes, and/shift pick the nibble or
// 2-bit field) for the plain 4-bit and 2-bit codes (Q4_0/Q4_1, Q2_K, Q4_K); bytes (32 codes
// assembled per vector, then sign-extended 8 at a time) where high bits are merged in (Q5_0/Q5_1
// from the qh word, Q3_K, Q5_K, Q6_K: one op per 32 codes instead of per 8) or a pshufb lookup
// gives the value (IQ4_NL/IQ4_XS); per format, the shape that measured faster. Then one convert
// and one mul/FMA per 8 values. Every value gets numpy's one rounding (products before it are
// exact), so the results are the scalar set's bits.
// Internal linkage only, as in kern_avx2.cpp.
#include "common.h"
#include "ext_formats.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
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

// 8 bytes -> 8 zero-extended int32 lanes.
HM_ALWAYS_INLINE inline __m256i u8x8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}

HM_ALWAYS_INLINE inline void store(float* o, __m256 v) { _mm256_storeu_ps(o, v); }
HM_ALWAYS_INLINE inline __m256 cvt(__m256i q) { return _mm256_cvtepi32_ps(q); }
HM_ALWAYS_INLINE inline __m256i i32(int v) { return _mm256_set1_epi32(v); }

HM_ALWAYS_INLINE inline __m128i high8(__m128i v) { return _mm_unpackhi_epi64(v, v); }

// 32 int8 values in element order -> 32 floats.
HM_ALWAYS_INLINE inline void widen_i8x32(__m256i q, __m256* f) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    f[0] = cvt(_mm256_cvtepi8_epi32(lo));
    f[1] = cvt(_mm256_cvtepi8_epi32(high8(lo)));
    f[2] = cvt(_mm256_cvtepi8_epi32(hi));
    f[3] = cvt(_mm256_cvtepi8_epi32(high8(hi)));
}

// 32 int8 values in element order -> floats times s0 (elements 0..15) and s1 (16..31).
HM_ALWAYS_INLINE inline void store_i8x32(__m256i q, __m256 s0, __m256 s1, float* o) {
    __m256 f[4];
    widen_i8x32(q, f);
    for (int i = 0; i < 4; ++i) store(o + 8 * i, _mm256_mul_ps(i < 2 ? s0 : s1, f[i]));
}

// 32 codes of one sub-block in element order (bytes) -> dl * q - ml.
HM_ALWAYS_INLINE inline void store_k32(__m256i q, float dl, float ml, float* o) {
    __m256 f[4];
    widen_i8x32(q, f);
    const __m256 d = _mm256_set1_ps(dl), m = _mm256_set1_ps(ml);
    for (int i = 0; i < 4; ++i) store(o + 8 * i, _mm256_fmsub_ps(d, f[i], m));
}

// The 32 nibbles of 16 bytes as bytes in element order (low nibbles, then high nibbles).
HM_ALWAYS_INLINE inline __m256i nibbles32(const uint8_t* qs) {
    const __m128i q = _mm_loadu_si128((const __m128i*)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}

// Byte e = 0xFF where bit e of qh is set (Q5_0 / Q5_1): each qh byte spread over 8 bytes, one
// bit tested per byte.
HM_ALWAYS_INLINE inline __m256i qh_bytes(uint32_t qh) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(qh)), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

HM_ALWAYS_INLINE inline void q4_0(const uint8_t* b, float* o) {
    const __m256 d = _mm256_set1_ps(f16(b));
    for (int g = 0; g < 2; ++g) {  // bytes 8g..8g+7 hold elements 8g.. (low) and 16+8g.. (high)
        const __m256i v = u8x8(b + 2 + 8 * g);
        store(o + 8 * g, _mm256_mul_ps(d, cvt(_mm256_sub_epi32(_mm256_and_si256(v, i32(15)), i32(8)))));
        store(o + 16 + 8 * g, _mm256_mul_ps(d, cvt(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), i32(8)))));
    }
}

HM_ALWAYS_INLINE inline void q4_1(const uint8_t* b, float* o) {
    const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
    for (int g = 0; g < 2; ++g) {
        const __m256i v = u8x8(b + 4 + 8 * g);
        store(o + 8 * g, _mm256_fmadd_ps(d, cvt(_mm256_and_si256(v, i32(15))), m));
        store(o + 16 + 8 * g, _mm256_fmadd_ps(d, cvt(_mm256_srli_epi32(v, 4)), m));
    }
}

// q - 16 = nib - 16 where the high bit is clear, nib where it is set.
HM_ALWAYS_INLINE inline void q5_0(const uint8_t* b, float* o) {
    const __m256 d = _mm256_set1_ps(f16(b));
    const __m256i low = _mm256_andnot_si256(qh_bytes(u32(b + 2)), _mm256_set1_epi8(16));
    const __m256i q = _mm256_sub_epi8(nibbles32(b + 6), low);
    store_i8x32(q, d, d, o);
}

HM_ALWAYS_INLINE inline void q5_1(const uint8_t* b, float* o) {
    const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
    const __m256i high = _mm256_and_si256(qh_bytes(u32(b + 4)), _mm256_set1_epi8(16));
    const __m256i q = _mm256_or_si256(nibbles32(b + 8), high);
    __m256 f[4];
    widen_i8x32(q, f);
    for (int i = 0; i < 4; ++i) store(o + 8 * i, _mm256_fmadd_ps(d, f[i], m));
}

// 32 IQ4 codes (16 bytes, low nibbles first) -> values via pshufb on the int8 table, times d.
HM_ALWAYS_INLINE inline void iq4_32(const uint8_t* qs, __m256 d, float* o) {
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kIq4Values));
    store_i8x32(_mm256_shuffle_epi8(tbl, nibbles32(qs)), d, d, o);
}

HM_ALWAYS_INLINE inline void iq4_nl(const uint8_t* b, float* o) { iq4_32(b + 2, _mm256_set1_ps(f16(b)), o); }

// Sub-block scales: d times 8 unsigned / signed bytes (the low 8 of v), as numpy's fp32 products,
// stored for per-sub-block broadcasts.
HM_ALWAYS_INLINE inline void scale8u(__m128i v, float d, float* out) {
    _mm256_store_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), cvt(_mm256_cvtepu8_epi32(v))));
}
HM_ALWAYS_INLINE inline void scale8s(__m128i v, float d, float* out) {
    _mm256_store_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), cvt(_mm256_cvtepi8_epi32(v))));
}

// The 8 sub-block scales d * (ls - 32): lane ib takes nibble ib of the 4 sl bytes and bits
// 2ib, 2ib+1 of sh.
HM_ALWAYS_INLINE inline void iq4_xs(const uint8_t* b, float* o) {
    const __m256i sl = _mm256_srlv_epi32(i32(int(u32(b + 4))), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i sh = _mm256_srlv_epi32(i32(b[2] | b[3] << 8), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i ls =
        _mm256_or_si256(_mm256_and_si256(sl, i32(15)), _mm256_slli_epi32(_mm256_and_si256(sh, i32(3)), 4));
    alignas(32) float dl[8];
    store(dl, _mm256_mul_ps(_mm256_set1_ps(f16(b)), cvt(_mm256_sub_epi32(ls, i32(32)))));
    for (int ib = 0; ib < 8; ++ib) iq4_32(b + 8 + 16 * ib, _mm256_broadcast_ss(dl + ib), o + 32 * ib);
}

// K-quants: the sub-block scales are unpacked once per super-block into float arrays, then
// broadcast per 8 values.
HM_ALWAYS_INLINE inline void q2_k(const uint8_t* b, float* o) {
    const uint8_t* qs = b + 16;
    const __m128i sc = _mm_loadu_si128((const __m128i*)b), m4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(sc, m4), hi = _mm_and_si128(_mm_srli_epi16(sc, 4), m4);
    alignas(32) float dl[16], ml[16];
    const float d = f16(b + 80), dmin = f16(b + 82);
    scale8u(lo, d, dl);
    scale8u(high8(lo), d, dl + 8);
    scale8u(hi, dmin, ml);
    scale8u(high8(hi), dmin, ml + 8);
    for (int h = 0; h < 2; ++h)
        for (int g = 0; g < 4; ++g) {  // elements 128h + 32s + 8g.. come from bytes qs[32h + 8g..]
            __m256i v = u8x8(qs + 32 * h + 8 * g);
            for (int s = 0; s < 4; ++s, v = _mm256_srli_epi32(v, 2)) {
                const int j = 8 * h + 2 * s + g / 2;
                store(o + 128 * h + 32 * s + 8 * g, _mm256_fmsub_ps(_mm256_broadcast_ss(dl + j),
                                                                    cvt(_mm256_and_si256(v, i32(3))),
                                                                    _mm256_broadcast_ss(ml + j)));
            }
        }
}

HM_ALWAYS_INLINE inline void q3_k(const uint8_t* b, float* o) {
    const uint8_t *hm = b, *qs = b + 32;
    uint64_t sc[2];
    q3k_unpack(b + 96, sc);
    const __m128i s = _mm_sub_epi8(_mm_set_epi64x(int64_t(sc[1]), int64_t(sc[0])), _mm_set1_epi8(32));
    alignas(32) float dl[16];
    const float d = f16(b + 108);
    scale8s(s, d, dl);
    scale8s(high8(s), d, dl + 8);
    // Bytes: 32 codes per step, then widened. 16-bit shifts are fine as only bits 0-1 of v and
    // bit 0 of m are read: what crosses from the neighbour byte never reaches them.
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    __m256i m = _mm256_loadu_si256((const __m256i*)hm);  // byte l, bit 4h + s: element 128h + 32s + l
    for (int h = 0; h < 2; ++h) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * h));
        for (int s = 0; s < 4; ++s, v = _mm256_srli_epi16(v, 2), m = _mm256_srli_epi16(m, 1)) {
            const __m256i hb = _mm256_and_si256(_mm256_slli_epi16(m, 2), m4);
            const __m256i q = _mm256_or_si256(_mm256_and_si256(v, m3), hb);
            const float* sc2 = dl + 8 * h + 2 * s;
            store_i8x32(_mm256_sub_epi8(q, m4), _mm256_broadcast_ss(sc2), _mm256_broadcast_ss(sc2 + 1),
                        o + 128 * h + 32 * s);
        }
    }
}

HM_ALWAYS_INLINE inline void k4_scales(const uint8_t* sc, float d, float dmin, float* dl, float* ml) {
    uint32_t w[4];
    k4_unpack(sc, w);
    const __m128i v = _mm_setr_epi32(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
    scale8u(v, d, dl);
    scale8u(high8(v), dmin, ml);
}

HM_ALWAYS_INLINE inline void q4_k(const uint8_t* b, float* o) {
    alignas(32) float dl[8], ml[8];
    k4_scales(b + 4, f16(b), f16(b + 2), dl, ml);
    const uint8_t* qs = b + 16;
    for (int p = 0; p < 4; ++p) {  // bytes 32p..32p+31: sub-block 2p (low nibbles), 2p+1 (high)
        const __m256 d0 = _mm256_broadcast_ss(dl + 2 * p), m0 = _mm256_broadcast_ss(ml + 2 * p);
        const __m256 d1 = _mm256_broadcast_ss(dl + 2 * p + 1), m1 = _mm256_broadcast_ss(ml + 2 * p + 1);
        for (int g = 0; g < 4; ++g) {
            const __m256i v = u8x8(qs + 32 * p + 8 * g);
            store(o + 64 * p + 8 * g, _mm256_fmsub_ps(d0, cvt(_mm256_and_si256(v, i32(15))), m0));
            store(o + 64 * p + 32 + 8 * g, _mm256_fmsub_ps(d1, cvt(_mm256_srli_epi32(v, 4)), m1));
        }
    }
}

// Bytes: per pair p, 32 low and 32 high nibbles plus bits 2p, 2p+1 of the qh bytes (moved to bit
// 4; the 16-bit shifts never fill bits 0-1 from the neighbour byte within 6 shifts).
HM_ALWAYS_INLINE inline void q5_k(const uint8_t* b, float* o) {
    alignas(32) float dl[8], ml[8];
    k4_scales(b + 4, f16(b), f16(b + 2), dl, ml);
    const __m256i m4 = _mm256_set1_epi8(15), m16 = _mm256_set1_epi8(16);
    __m256i h = _mm256_loadu_si256((const __m256i*)(b + 16));  // byte l, bit i: sub-block i
    for (int p = 0; p < 4; ++p, h = _mm256_srli_epi16(h, 2)) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(b + 48 + 32 * p));
        const __m256i h0 = _mm256_and_si256(_mm256_slli_epi16(h, 4), m16);
        const __m256i h1 = _mm256_and_si256(_mm256_slli_epi16(h, 3), m16);
        const __m256i q0 = _mm256_or_si256(_mm256_and_si256(v, m4), h0);
        const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), h1);
        store_k32(q0, dl[2 * p], ml[2 * p], o + 64 * p);
        store_k32(q1, dl[2 * p + 1], ml[2 * p + 1], o + 64 * p + 32);
    }
}

HM_ALWAYS_INLINE inline void q6_k(const uint8_t* b, float* o) {
    const uint8_t *ql = b, *qhp = b + 128;
    const __m128i sc = _mm_loadu_si128((const __m128i*)(b + 192));
    const float d = f16(b + 208);
    alignas(32) float dl[16];
    scale8s(sc, d, dl);
    scale8s(high8(sc), d, dl + 8);
    // Bytes: the 32 codes of element 128h + 32s + l for each s, then widened. The 16-bit shifts
    // move neighbour bits only into positions the masks drop.
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
        const __m256i a = _mm256_loadu_si256((const __m256i*)(ql + 64 * h));
        const __m256i c = _mm256_loadu_si256((const __m256i*)(ql + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(qhp + 32 * h));
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)),
            _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(qh, m30)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30)),
        };
        for (int s = 0; s < 4; ++s) {
            const float* sc2 = dl + 8 * h + 2 * s;
            store_i8x32(_mm256_sub_epi8(q[s], k32), _mm256_broadcast_ss(sc2), _mm256_broadcast_ss(sc2 + 1),
                        o + 128 * h + 32 * s);
        }
    }
}

template <void (*Block)(const uint8_t*, float*)>
void rows(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, int elems, int bytes, float* out) {
    for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t b = 0; b < K / elems; ++b) Block(w + r * row_bytes + b * bytes, out + r * K + b * elems);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// R rows x NT tokens: each W vector is loaded once for all NT tokens, each x vector once for all
// R rows; U independent k-steps keep enough FMA chains in flight when R * NT is small.
template <int R, int NT, int U>
void dot_tile(const float* W, int64_t K, const float* const* xs, float* out, int64_t ldo) {
    __m256 acc[U][R][NT];
    for (int u = 0; u < U; ++u)
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < NT; ++t) acc[u][r][t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8 * U)
        for (int u = 0; u < U; ++u) {
            __m256 w[R];
            for (int r = 0; r < R; ++r) w[r] = _mm256_loadu_ps(W + r * K + k + 8 * u);
            for (int t = 0; t < NT; ++t) {
                const __m256 x = _mm256_loadu_ps(xs[t] + k + 8 * u);
                for (int r = 0; r < R; ++r) acc[u][r][t] = _mm256_fmadd_ps(w[r], x, acc[u][r][t]);
            }
        }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) {
            __m256 s = acc[0][r][t];
            for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[u][r][t]);
            out[t * ldo + r] = hsum(s);
        }
}

// R divides 4, the row count per decoded tile of the GEMV; R * U * NT accumulators plus R row
// vectors about fill the 16 ymm registers (per nt, the R that measured fastest).
template <int NT, int R, int U>
void dot_nt(const float* W, int64_t n_rows, int64_t K, const float* const* xs, float* out, int64_t ldo) {
    int64_t r = 0;
    for (; r + R <= n_rows; r += R) dot_tile<R, NT, U>(W + r * K, K, xs, out + r, ldo);
    for (; r < n_rows; ++r) dot_tile<1, NT, U>(W + r * K, K, xs, out + r, ldo);
}

}  // namespace

namespace avx2 {

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
        case 4: return dot_nt<4, 2, 1>(W, n_rows, K, xs, out, ldo);
        case 5: return dot_nt<5, 2, 1>(W, n_rows, K, xs, out, ldo);
        case 6: return dot_nt<6, 2, 1>(W, n_rows, K, xs, out, ldo);
        case 7: return dot_nt<7, 2, 1>(W, n_rows, K, xs, out, ldo);
        case 8: return dot_nt<8, 1, 1>(W, n_rows, K, xs, out, ldo);
        default: return;
    }
}

}  // namespace avx2
}  // namespace hm

#pragma GCC pop_options
