// AVX2 + FMA + F16C decoders of the ext formats (layouts: ext_scalar.cpp) and the fused GEMV that
// runs them (the driver is ext_avx512.cpp's with 8 lanes).
// Two shapes of decode: int32 lanes (vpmovzxbd loads 8 quant bytes, and/shift pick the nibble or
// 2-bit field) for the plain 4-bit and 2-bit codes (Q4_0/Q4_1, Q2_K, Q4_K); bytes (32 codes
// assembled per vector, then sign-extended 8 at a time) where high bits are merged in (Q5_0/Q5_1
// from the qh word, Q3_K, Q5_K, Q6_K: one op per 32 codes instead of per 8) or a pshufb lookup
// gives the value (IQ4_NL/IQ4_XS); per format, the shape that measured faster. Then one convert
// and one mul/FMA per 8 values. Every value gets numpy's one rounding (products before it are
// exact), so the results are the scalar set's bits.
// Internal linkage only, as in kern_avx2.cpp.
#include <algorithm>
#include <utility>

#include "common.h"
#include "ext_formats.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace hm {
namespace {

inline uint32_t u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// 8 bytes -> 8 zero-extended int32 lanes.
HM_ALWAYS_INLINE inline __m256i u8x8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}

HM_ALWAYS_INLINE inline __m256 cvt(__m256i q) { return _mm256_cvtepi32_ps(q); }
HM_ALWAYS_INLINE inline __m256i i32(int v) { return _mm256_set1_epi32(v); }

// Where the decoders put each vector of 8 values (element offset off within the block):
// StoreSink writes them out (decode_ext), FmaSink multiplies them into per-token accumulators
// (gemv_ext), so both run the same decoding code.
struct StoreSink {
    float* o;  // the block's first value
    HM_ALWAYS_INLINE void operator()(int off, __m256 v) const { _mm256_storeu_ps(o + off, v); }
};

// A sets of NT accumulators, used in turn per vector: A independent FMA chains per token hide
// the FMA latency when NT is small. The rotation is register renaming once the block is unrolled.
template <int NT, int A>
struct FmaSink {
    const float* x[NT];  // each token's activations at the block's first element
    __m256 acc[A][NT];
    HM_ALWAYS_INLINE void operator()(int off, __m256 v) {
        for (int t = 0; t < NT; ++t) acc[0][t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x[t] + off), acc[0][t]);
        for (int a = 0; a + 1 < A; ++a)
            for (int t = 0; t < NT; ++t) std::swap(acc[a][t], acc[a + 1][t]);
    }
};

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
template <class S>
HM_ALWAYS_INLINE inline void store_i8x32(__m256i q, __m256 s0, __m256 s1, S& o, int off) {
    __m256 f[4];
    widen_i8x32(q, f);
    for (int i = 0; i < 4; ++i) o(off + 8 * i, _mm256_mul_ps(i < 2 ? s0 : s1, f[i]));
}

// 32 codes of one sub-block in element order (bytes) -> dl * q - ml.
template <class S>
HM_ALWAYS_INLINE inline void store_k32(__m256i q, float dl, float ml, S& o, int off) {
    __m256 f[4];
    widen_i8x32(q, f);
    const __m256 d = _mm256_set1_ps(dl), m = _mm256_set1_ps(ml);
    for (int i = 0; i < 4; ++i) o(off + 8 * i, _mm256_fmsub_ps(d, f[i], m));
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

// The fp16 at p in every lane: vpbroadcastw + vcvtph2ps, two instructions where f16 + broadcast
// take four (the small blocks' GEMV is bound by instruction count).
HM_ALWAYS_INLINE inline __m256 bcast_f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _mm256_cvtph_ps(_mm_set1_epi16(short(h)));
}

// Keeps a scale array in memory: its per-sub-block broadcasts then load from it instead of
// extracting lanes with shuffles.
template <int N>
HM_ALWAYS_INLINE inline void pin(float* a) { __asm__("" : "+m"(*(float(*)[N])a)); }

// Sub-block scales: d times 8 unsigned / signed bytes (the low 8 of v), as numpy's fp32 products.
HM_ALWAYS_INLINE inline void scale8u(__m128i v, __m256 d, float* out) {
    _mm256_store_ps(out, _mm256_mul_ps(d, cvt(_mm256_cvtepu8_epi32(v))));
}
HM_ALWAYS_INLINE inline void scale8s(__m128i v, __m256 d, float* out) {
    _mm256_store_ps(out, _mm256_mul_ps(d, cvt(_mm256_cvtepi8_epi32(v))));
}

// One decoder per format, in two steps: prep(b, p) computes the block's scales into p, run(b, p,
// o) decodes the values and hands each vector of 8 to o(offset, v). The GEMV preps a block ahead
// (the scale chain is long; issued early it overlaps the previous block's FMAs).
template <int F>
struct Block;

// Pre of the single-scale blocks: d (and m) broadcast.
struct DPre {
    __m256 d;
};
struct DMPre {
    __m256 d, m;
};

template <>
struct Block<kQ4_0> {
    using Pre = DPre;
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { p.d = bcast_f16(b); }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        for (int g = 0; g < 2; ++g) {  // bytes 8g..8g+7 hold elements 8g.. (low) and 16+8g.. (high)
            const __m256i v = u8x8(b + 2 + 8 * g);
            o(8 * g, _mm256_mul_ps(p.d, cvt(_mm256_sub_epi32(_mm256_and_si256(v, i32(15)), i32(8)))));
            o(16 + 8 * g, _mm256_mul_ps(p.d, cvt(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), i32(8)))));
        }
    }
};

template <>
struct Block<kQ4_1> {
    using Pre = DMPre;
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { p.d = bcast_f16(b), p.m = bcast_f16(b + 2); }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        for (int g = 0; g < 2; ++g) {
            const __m256i v = u8x8(b + 4 + 8 * g);
            o(8 * g, _mm256_fmadd_ps(p.d, cvt(_mm256_and_si256(v, i32(15))), p.m));
            o(16 + 8 * g, _mm256_fmadd_ps(p.d, cvt(_mm256_srli_epi32(v, 4)), p.m));
        }
    }
};

// q - 16 = nib - 16 where the high bit is clear, nib where it is set.
template <>
struct Block<kQ5_0> {
    using Pre = DPre;
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { p.d = bcast_f16(b); }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const __m256i low = _mm256_andnot_si256(qh_bytes(u32(b + 2)), _mm256_set1_epi8(16));
        store_i8x32(_mm256_sub_epi8(nibbles32(b + 6), low), p.d, p.d, o, 0);
    }
};

template <>
struct Block<kQ5_1> {
    using Pre = DMPre;
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { p.d = bcast_f16(b), p.m = bcast_f16(b + 2); }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const __m256i high = _mm256_and_si256(qh_bytes(u32(b + 4)), _mm256_set1_epi8(16));
        __m256 f[4];
        widen_i8x32(_mm256_or_si256(nibbles32(b + 8), high), f);
        for (int i = 0; i < 4; ++i) o(8 * i, _mm256_fmadd_ps(p.d, f[i], p.m));
    }
};

// 32 IQ4 codes (16 bytes, low nibbles first) -> values via pshufb on the int8 table, times d.
template <class S>
HM_ALWAYS_INLINE inline void iq4_32(const uint8_t* qs, __m256 d, S& o, int off) {
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kIq4Values));
    store_i8x32(_mm256_shuffle_epi8(tbl, nibbles32(qs)), d, d, o, off);
}

template <>
struct Block<kIQ4_NL> {
    using Pre = DPre;
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { p.d = bcast_f16(b); }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        iq4_32(b + 2, p.d, o, 0);
    }
};

// The 8 sub-block scales d * (ls - 32): lane ib takes nibble ib of the 4 sl bytes and bits
// 2ib, 2ib+1 of sh.
template <>
struct Block<kIQ4_XS> {
    struct Pre {
        alignas(32) float dl[8];
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) {
        const __m256i sl = _mm256_srlv_epi32(i32(int(u32(b + 4))), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        const __m256i sh = _mm256_srlv_epi32(i32(b[2] | b[3] << 8), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
        const __m256i ls =
            _mm256_or_si256(_mm256_and_si256(sl, i32(15)), _mm256_slli_epi32(_mm256_and_si256(sh, i32(3)), 4));
        _mm256_store_ps(p.dl, _mm256_mul_ps(bcast_f16(b), cvt(_mm256_sub_epi32(ls, i32(32)))));
        pin<8>(p.dl);
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        for (int ib = 0; ib < 8; ++ib) iq4_32(b + 8 + 16 * ib, _mm256_broadcast_ss(p.dl + ib), o, 32 * ib);
    }
};

// K-quants: the sub-block scales go to float arrays, broadcast per 8 values.
template <>
struct Block<kQ2_K> {
    struct Pre {
        alignas(32) float dl[16], ml[16];
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) {
        const __m128i sc = _mm_loadu_si128((const __m128i*)b), m4 = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(sc, m4), hi = _mm_and_si128(_mm_srli_epi16(sc, 4), m4);
        const __m256 d = bcast_f16(b + 80), dmin = bcast_f16(b + 82);
        scale8u(lo, d, p.dl);
        scale8u(high8(lo), d, p.dl + 8);
        scale8u(hi, dmin, p.ml);
        scale8u(high8(hi), dmin, p.ml + 8);
        pin<16>(p.dl);
        pin<16>(p.ml);
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const uint8_t* qs = b + 16;
        for (int h = 0; h < 2; ++h)
            for (int g = 0; g < 4; ++g) {  // elements 128h + 32s + 8g.. come from bytes qs[32h + 8g..]
                __m256i v = u8x8(qs + 32 * h + 8 * g);
                for (int s = 0; s < 4; ++s, v = _mm256_srli_epi32(v, 2)) {
                    const int j = 8 * h + 2 * s + g / 2;
                    o(128 * h + 32 * s + 8 * g, _mm256_fmsub_ps(_mm256_broadcast_ss(p.dl + j),
                                                                cvt(_mm256_and_si256(v, i32(3))),
                                                                _mm256_broadcast_ss(p.ml + j)));
                }
            }
    }
};

template <>
struct Block<kQ3_K> {
    struct Pre {
        alignas(32) float dl[16];
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) {
        uint64_t sc[2];
        q3k_unpack(b + 96, sc);
        const __m128i s = _mm_sub_epi8(_mm_set_epi64x(int64_t(sc[1]), int64_t(sc[0])), _mm_set1_epi8(32));
        const __m256 d = bcast_f16(b + 108);
        scale8s(s, d, p.dl);
        scale8s(high8(s), d, p.dl + 8);
        pin<16>(p.dl);
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const uint8_t *hm = b, *qs = b + 32;
        // Bytes: 32 codes per step, then widened. 16-bit shifts are fine as only bits 0-1 of v and
        // bit 0 of m are read: what crosses from the neighbour byte never reaches them.
        const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
        __m256i m = _mm256_loadu_si256((const __m256i*)hm);  // byte l, bit 4h + s: element 128h + 32s + l
        for (int h = 0; h < 2; ++h) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * h));
            for (int s = 0; s < 4; ++s, v = _mm256_srli_epi16(v, 2), m = _mm256_srli_epi16(m, 1)) {
                const __m256i hb = _mm256_and_si256(_mm256_slli_epi16(m, 2), m4);
                const __m256i q = _mm256_or_si256(_mm256_and_si256(v, m3), hb);
                const float* sc2 = p.dl + 8 * h + 2 * s;
                store_i8x32(_mm256_sub_epi8(q, m4), _mm256_broadcast_ss(sc2), _mm256_broadcast_ss(sc2 + 1), o,
                            128 * h + 32 * s);
            }
        }
    }
};

// Q4_K / Q5_K: the 8 scales d * sc_i and mins dmin * m_i.
struct K4Pre {
    alignas(32) float dl[8], ml[8];
};
HM_ALWAYS_INLINE inline void k4_prep(const uint8_t* b, K4Pre& p) {
    uint32_t w[4];
    k4_unpack(b + 4, w);
    const __m128i v = _mm_setr_epi32(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
    scale8u(v, bcast_f16(b), p.dl);
    scale8u(high8(v), bcast_f16(b + 2), p.ml);
    pin<8>(p.dl);
    pin<8>(p.ml);
}

template <>
struct Block<kQ4_K> {
    using Pre = K4Pre;
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { k4_prep(b, p); }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const uint8_t* qs = b + 16;
        for (int i = 0; i < 4; ++i) {  // bytes 32i..32i+31: sub-block 2i (low nibbles), 2i+1 (high)
            const __m256 d0 = _mm256_broadcast_ss(p.dl + 2 * i), m0 = _mm256_broadcast_ss(p.ml + 2 * i);
            const __m256 d1 = _mm256_broadcast_ss(p.dl + 2 * i + 1), m1 = _mm256_broadcast_ss(p.ml + 2 * i + 1);
            for (int g = 0; g < 4; ++g) {
                const __m256i v = u8x8(qs + 32 * i + 8 * g);
                o(64 * i + 8 * g, _mm256_fmsub_ps(d0, cvt(_mm256_and_si256(v, i32(15))), m0));
                o(64 * i + 32 + 8 * g, _mm256_fmsub_ps(d1, cvt(_mm256_srli_epi32(v, 4)), m1));
            }
        }
    }
};

// Bytes: per pair i, 32 low and 32 high nibbles plus bits 2i, 2i+1 of the qh bytes (moved to bit
// 4; the 16-bit shifts never fill bits 0-1 from the neighbour byte within 6 shifts).
template <>
struct Block<kQ5_K> {
    using Pre = K4Pre;
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { k4_prep(b, p); }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const __m256i m4 = _mm256_set1_epi8(15), m16 = _mm256_set1_epi8(16);
        __m256i h = _mm256_loadu_si256((const __m256i*)(b + 16));  // byte l, bit i: sub-block i
        for (int i = 0; i < 4; ++i, h = _mm256_srli_epi16(h, 2)) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(b + 48 + 32 * i));
            const __m256i h0 = _mm256_and_si256(_mm256_slli_epi16(h, 4), m16);
            const __m256i h1 = _mm256_and_si256(_mm256_slli_epi16(h, 3), m16);
            const __m256i q0 = _mm256_or_si256(_mm256_and_si256(v, m4), h0);
            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), h1);
            store_k32(q0, p.dl[2 * i], p.ml[2 * i], o, 64 * i);
            store_k32(q1, p.dl[2 * i + 1], p.ml[2 * i + 1], o, 64 * i + 32);
        }
    }
};

template <>
struct Block<kQ6_K> {
    struct Pre {
        alignas(32) float dl[16];
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) {
        const __m128i sc = _mm_loadu_si128((const __m128i*)(b + 192));
        const __m256 d = bcast_f16(b + 208);
        scale8s(sc, d, p.dl);
        scale8s(high8(sc), d, p.dl + 8);
        pin<16>(p.dl);
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const uint8_t *ql = b, *qhp = b + 128;
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
                const float* sc2 = p.dl + 8 * h + 2 * s;
                store_i8x32(_mm256_sub_epi8(q[s], k32), _mm256_broadcast_ss(sc2), _mm256_broadcast_ss(sc2 + 1), o,
                            128 * h + 32 * s);
            }
        }
    }
};

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

using Vec = __m256;
constexpr int kLanes = 8;
HM_ALWAYS_INLINE inline Vec vzero() { return _mm256_setzero_ps(); }
HM_ALWAYS_INLINE inline Vec vload(const float* p) { return _mm256_load_ps(p); }
HM_ALWAYS_INLINE inline void vstore(float* p, Vec v) { _mm256_store_ps(p, v); }
HM_ALWAYS_INLINE inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
HM_ALWAYS_INLINE inline float vsum(Vec v) { return hsum(v); }
template <int F>
constexpr int kTwoTokenSets = ext_block_elems(F) == 256 ? 4 : 2;

#include "ext_driver.inc"

}  // namespace

namespace avx2 {

void decode_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* out) {
    decode_ext_any(fmt, w, row_bytes, n_rows, K, out);
}

void gemv_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs, int nt,
              float* out, int64_t ldo) {
    gemv_ext_any(fmt, w, row_bytes, n_rows, K, xs, nt, out, ldo);
}

}  // namespace avx2
}  // namespace hm

#pragma GCC pop_options
