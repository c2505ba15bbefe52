// AVX-512 (F/BW/VL) decoders of the ext formats (layouts: ext_scalar.cpp) and the fused GEMV that
// runs them. 16 int32 lanes per vpmovzxbd load. Where a value is a function of 4 index bits times
// the block's (or sub-block's) scale, the 16-entry value table is scaled once and one vpermps per
// 16 values gives the weights (vpermps reads only the low 4 bits of each lane, so the nibble needs
// no masking); a 5th bit picks a second table through vpermt2ps (Q5_0/Q5_1 from the qh word, Q5_K
// from its bit planes); Q3_K's 3-bit index uses a repeated 8-entry table. Q6_K's 6-bit codes are
// assembled as bytes, 64 per vector, then sign-extended 16 at a time. Every value gets numpy's one
// rounding, as in the scalar set (each table entry is the same fp32 operation on the same operands).
// Internal linkage only, as in kern_avx512.cpp.
#include <algorithm>
#include <utility>

#include "common.h"
#include "ext_formats.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

namespace hm {
namespace {

// Through vmovd, not _cvtsh_ss: GCC builds that with vpinsrw merging into whatever register it
// picks, a false dependency on an older value.
inline float f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
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

HM_ALWAYS_INLINE inline __m512 bcast(float v) { return _mm512_set1_ps(v); }

// The fp16 at p in every lane: vpbroadcastw + vcvtph2ps, two instructions where f16 + bcast
// take four (the small blocks' GEMV is bound by instruction count).
HM_ALWAYS_INLINE inline __m512 bcast_f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _mm512_cvtph_ps(_mm256_set1_epi16(short(h)));
}

// Where the decoders put each vector of 16 values (element offset off within the block):
// StoreSink writes them out (decode_ext), FmaSink multiplies them into per-token accumulators
// (gemv_ext), so both run the same decoding code.
struct StoreSink {
    float* o;  // the block's first value
    HM_ALWAYS_INLINE void operator()(int off, __m512 v) const { _mm512_storeu_ps(o + off, v); }
};

// A sets of NT accumulators, used in turn per vector: A independent FMA chains per token hide
// the FMA latency when NT is small. The rotation is register renaming once the block is unrolled.
template <int NT, int A>
struct FmaSink {
    const float* x[NT];  // each token's activations at the block's first element
    __m512 acc[A][NT];
    HM_ALWAYS_INLINE void operator()(int off, __m512 v) {
        for (int t = 0; t < NT; ++t) acc[0][t] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x[t] + off), acc[0][t]);
        for (int a = 0; a + 1 < A; ++a)
            for (int t = 0; t < NT; ++t) std::swap(acc[a][t], acc[a + 1][t]);
    }
};

// Float lookup tables indexed by 4 bits. Literal data, not built at load: a constructor in this
// file would be AVX-512 code running on every CPU.
struct Tables {
    float ident[16];    // i: Q4_1, Q4_K; Q5_1 / Q5_K without the high bit, Q5_0 with it
    float minus16[16];  // i - 16: Q5_0 without the high bit
    float plus16[16];   // i + 16: Q5_1 / Q5_K with it
    float q4_0[16];     // i - 8
    float iq4[16];      // kIq4Values
    float and3[16];     // i & 3: Q2_K
    float q3[16];       // (i & 7) - 4: Q3_K's code | high bit << 2
};
alignas(64) constexpr Tables kT = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1},
    {16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31},
    {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7},
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3},
    {-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3},
};

HM_ALWAYS_INLINE inline __m512 tbl(const float* t) { return _mm512_loadu_ps(t); }

// Value of the low 4 bits of each lane of idx, from t.
HM_ALWAYS_INLINE inline __m512 look(__m512i idx, const float* t) { return _mm512_permutexvar_ps(idx, tbl(t)); }

// Keeps a scale array in memory: its per-sub-block broadcasts then load from it (load ports, or
// an FMA's {1to16} operand) instead of extracting lanes with shuffles, which compete with the
// decode's permutes.
template <int N, class T>
HM_ALWAYS_INLINE inline void pin(T* a) { __asm__("" : "+m"(*(T(*)[N])a)); }

// Sub-block scales: d times 16 unsigned / signed bytes, as numpy's fp32 products.
HM_ALWAYS_INLINE inline void scale16u(__m128i v, float d, float* out) {
    _mm512_store_ps(out, _mm512_mul_ps(bcast(d), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))));
    pin<16>(out);
}
HM_ALWAYS_INLINE inline void scale16s(__m128i v, float d, float* out) {
    _mm512_store_ps(out, _mm512_mul_ps(bcast(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))));
    pin<16>(out);
}

// One decoder per format, in two steps: prep(b, p) computes the block's scales (or scaled value
// tables) into p, run(b, p, o) decodes the values and hands each vector of 16 to o(offset, v).
// The GEMV preps a block ahead: prep is a long load -> unpack -> convert -> multiply chain that,
// issued just before its block, left the pipes idle (Q4_K ran ~15% slower).
template <int F>
struct Block;

// Where a value is a fixed function of a nibble times the block scale, prep scales the whole
// 16-entry table (the same fp32 products, lane by lane) and run is one vpermps per 16 values.
template <>
struct Block<kQ4_0> {
    struct Pre {
        __m512 t;  // d * (i - 8)
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { p.t = _mm512_mul_ps(bcast_f16(b), tbl(kT.q4_0)); }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const __m512i v = u8x16(b + 2);
        o(0, _mm512_permutexvar_ps(v, p.t));
        o(16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), p.t));
    }
};

template <>
struct Block<kQ4_1> {
    struct Pre {
        __m512 t;  // d * i + m
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) {
        p.t = _mm512_fmadd_ps(bcast_f16(b), tbl(kT.ident), bcast_f16(b + 2));
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const __m512i v = u8x16(b + 4);
        o(0, _mm512_permutexvar_ps(v, p.t));
        o(16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), p.t));
    }
};

// 32 5-bit codes (16 nibble bytes, low nibbles first; qh bit e = element e's high bit) looked up
// in the 32-entry table t0 | t1 with vpermt2ps, whose index bit 4 picks t1.
template <class S>
HM_ALWAYS_INLINE inline void q5_32(const uint8_t* qs, uint32_t qh, __m512 t0, __m512 t1, S& o) {
    const __m512i v = u8x16(qs), b4 = _mm512_set1_epi32(16);
    const __m512i lo = _mm512_mask_or_epi32(_mm512_andnot_si512(b4, v), __mmask16(qh), v, b4);
    const __m512i hi = _mm512_srli_epi32(v, 4);
    o(0, _mm512_permutex2var_ps(t0, lo, t1));
    o(16, _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(hi, __mmask16(qh >> 16), hi, b4), t1));
}

// qh is the element mask: bit e set means element e has its high bit.
template <>
struct Block<kQ5_0> {
    struct Pre {
        __m512 t0, t1;  // d * (i - 16), d * i: without / with the high bit
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) {
        const __m512 d = bcast_f16(b);
        p.t0 = _mm512_mul_ps(d, tbl(kT.minus16));
        p.t1 = _mm512_mul_ps(d, tbl(kT.ident));
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        q5_32(b + 6, u32(b + 2), p.t0, p.t1, o);
    }
};

template <>
struct Block<kQ5_1> {
    struct Pre {
        __m512 t0, t1;  // d * i + m, d * (i + 16) + m
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) {
        const __m512 d = bcast_f16(b), m = bcast_f16(b + 2);
        p.t0 = _mm512_fmadd_ps(d, tbl(kT.ident), m);
        p.t1 = _mm512_fmadd_ps(d, tbl(kT.plus16), m);
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        q5_32(b + 8, u32(b + 4), p.t0, p.t1, o);
    }
};

// 32 IQ4 codes (16 bytes, low nibbles first) looked up in t, the scaled code table.
template <class S>
HM_ALWAYS_INLINE inline void iq4_32(const uint8_t* qs, __m512 t, S& o, int off) {
    const __m512i v = u8x16(qs);
    o(off, _mm512_permutexvar_ps(v, t));
    o(off + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t));
}

template <>
struct Block<kIQ4_NL> {
    struct Pre {
        __m512 t;  // d * kIq4Values[i]
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { p.t = _mm512_mul_ps(bcast_f16(b), tbl(kT.iq4)); }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        iq4_32(b + 2, p.t, o, 0);
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
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i sl = _mm256_srlv_epi32(_mm256_set1_epi32(int(u32(b + 4))), _mm256_slli_epi32(lanes, 2));
        const __m256i sh = _mm256_srlv_epi32(_mm256_set1_epi32(b[2] | b[3] << 8), _mm256_slli_epi32(lanes, 1));
        const __m256i ls = _mm256_or_si256(_mm256_and_si256(sl, _mm256_set1_epi32(15)),
                                           _mm256_slli_epi32(_mm256_and_si256(sh, _mm256_set1_epi32(3)), 4));
        const __m256 dls = _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)));
        _mm256_store_ps(p.dl, _mm256_mul_ps(_mm256_set1_ps(f16(b)), dls));
        pin<8>(p.dl);
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        for (int ib = 0; ib < 8; ++ib) iq4_32(b + 8 + 16 * ib, _mm512_mul_ps(tbl(kT.iq4), bcast(p.dl[ib])), o, 32 * ib);
    }
};

// K-quants: the sub-block scales go to float arrays, broadcast per 16 values.
template <>
struct Block<kQ2_K> {
    struct Pre {
        alignas(64) float dl[16], ml[16];
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) {
        const __m128i sc = _mm_loadu_si128((const __m128i*)b), m4 = _mm_set1_epi8(15);
        scale16u(_mm_and_si128(sc, m4), f16(b + 80), p.dl);
        scale16u(_mm_and_si128(_mm_srli_epi16(sc, 4), m4), f16(b + 82), p.ml);
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const uint8_t* qs = b + 16;
        for (int h = 0; h < 2; ++h)
            for (int g = 0; g < 2; ++g) {  // elements 128h + 32s + 16g.. from bytes qs[32h + 16g..]
                __m512i v = u8x16(qs + 32 * h + 16 * g);
                for (int s = 0; s < 4; ++s, v = _mm512_srli_epi32(v, 2)) {
                    const int j = 8 * h + 2 * s + g;
                    o(128 * h + 32 * s + 16 * g, _mm512_fmsub_ps(bcast(p.dl[j]), look(v, kT.and3), bcast(p.ml[j])));
                }
            }
    }
};

template <>
struct Block<kQ3_K> {
    struct Pre {
        alignas(64) float dl[16];
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) {
        uint64_t sc[2];
        q3k_unpack(b + 96, sc);
        const __m128i s = _mm_sub_epi8(_mm_set_epi64x(int64_t(sc[1]), int64_t(sc[0])), _mm_set1_epi8(32));
        scale16s(s, f16(b + 108), p.dl);
    }
    // Per (h, s), the 32 indices code | high bit << 2 are built as bytes in one vpternlogd (bit 3
    // holds a leftover, so the table repeats after 8 entries; bits 4-7 vpermps ignores), then
    // widened 16 at a time and looked up in the sub-block's table dl * (i - 4).
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const __m256i hm = _mm256_loadu_si256((const __m256i*)b);  // byte l, bit 4h + s: element 128h + 32s + l
        for (int h = 0; h < 2; ++h) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 32 + 32 * h));
            for (int s = 0; s < 4; ++s) {
                // 16-bit shifts: what crosses from the neighbour byte lands in bits 3-7 or is masked.
                const int hb = 4 * h + s;
                const __m256i hi = hb >= 2 ? _mm256_srli_epi16(hm, hb - 2) : _mm256_slli_epi16(hm, 2 - hb);
                const __m256i c = _mm256_ternarylogic_epi32(_mm256_srli_epi16(q, 2 * s), hi, _mm256_set1_epi8(3), 0xE4);
                const __m128i half[2] = {_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)};
                for (int g = 0; g < 2; ++g) {
                    const __m512 t = _mm512_mul_ps(tbl(kT.q3), bcast(p.dl[8 * h + 2 * s + g]));
                    o(128 * h + 32 * s + 16 * g, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(half[g]), t));
                }
            }
        }
    }
};

// Q4_K / Q5_K: v[i] = d * sc_i, v[8 + i] = dmin * m_i (i < 8), as numpy's fp32 products.
struct K4Pre {
    alignas(64) float v[16];
};
// k4_unpack's word arithmetic on the block's first four 32-bit words [d|dmin, a, b, c] at once:
// bytes s0-3 = a & 63, s4-7 = c & 15 | (a >> 6) << 4, m0-3 = b & 63, m4-7 = c >> 4 | (b >> 6) << 4.
HM_ALWAYS_INLINE inline void k4_prep(const uint8_t* b, K4Pre& p) {
    const __m128i x = _mm_loadu_si128((const __m128i*)b);
    const __m128i acbc = _mm_srlv_epi32(_mm_shuffle_epi32(x, _MM_SHUFFLE(3, 2, 3, 1)), _mm_setr_epi32(0, 0, 0, 4));
    const __m128i lo = _mm_and_si128(acbc, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i aabb = _mm_shuffle_epi32(x, _MM_SHUFFLE(2, 2, 1, 1));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(aabb, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    const __m128i sm = _mm_or_si128(lo, hi);
    // d in lanes 0..7, dmin in 8..15: the two fp16 words spread, then converted.
    const __m256i spread = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512 dd = _mm512_cvtph_ps(_mm256_permutexvar_epi16(spread, _mm256_castsi128_si256(x)));
    _mm512_store_ps(p.v, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm))));
    pin<16>(p.v);
}

// The values dl * i - ml (i < 16, from t) of one sub-block as a vpermps table. dl * i is exact
// (dl has at most 17 significant bits, i at most 5), so this rounds once, as numpy's dl * q - ml.
HM_ALWAYS_INLINE inline __m512 ktable(const float* t, const float& dl, const float& ml) {
    return _mm512_fmsub_ps(tbl(t), bcast(dl), bcast(ml));
}

template <>
struct Block<kQ4_K> {
    using Pre = K4Pre;
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { k4_prep(b, p); }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const uint8_t* qs = b + 16;
        for (int i = 0; i < 4; ++i) {  // bytes 32i..32i+31: sub-block 2i (low nibbles), 2i+1 (high)
            const __m512 t0 = ktable(kT.ident, p.v[2 * i], p.v[8 + 2 * i]);
            const __m512 t1 = ktable(kT.ident, p.v[2 * i + 1], p.v[9 + 2 * i]);
            for (int g = 0; g < 2; ++g) {
                const __m512i v = u8x16(qs + 32 * i + 16 * g);
                o(64 * i + 16 * g, _mm512_permutexvar_ps(v, t0));
                o(64 * i + 32 + 16 * g, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t1));
            }
        }
    }
};

// The 5-bit codes of a sub-block pair are built as bytes, 32 per op (nibble | high bit moved to
// bit 4; bits 5-7 keep leftovers that vpermt2ps ignores), widened 16 at a time and looked up in
// the sub-block's two 16-entry tables dl * q - ml (q < 16, q >= 16) with one vpermt2ps.
template <>
struct Block<kQ5_K> {
    using Pre = K4Pre;
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) { k4_prep(b, p); }
    // Bit 2i (or 2i + 1) of each qh byte moved to bit 4.
    HM_ALWAYS_INLINE static __m256i to_bit4(__m256i qh, int bit) {
        return bit <= 4 ? _mm256_slli_epi16(qh, 4 - bit) : _mm256_srli_epi16(qh, bit - 4);
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 16));  // byte l, bit i: sub-block i
        const __m256i m4 = _mm256_set1_epi8(15);
        for (int i = 0; i < 4; ++i) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(b + 48 + 32 * i));
            // (a & m4) | (h & ~m4): the nibble and the moved high bit.
            const __m256i c[2] = {
                _mm256_ternarylogic_epi32(v, to_bit4(qh, 2 * i), m4, 0xE4),
                _mm256_ternarylogic_epi32(_mm256_srli_epi16(v, 4), to_bit4(qh, 2 * i + 1), m4, 0xE4),
            };
            for (int n = 0; n < 2; ++n) {  // sub-block 2i + n
                const int j = 2 * i + n;
                const __m512 t0 = ktable(kT.ident, p.v[j], p.v[8 + j]), t1 = ktable(kT.plus16, p.v[j], p.v[8 + j]);
                const __m128i half[2] = {_mm256_castsi256_si128(c[n]), _mm256_extracti128_si256(c[n], 1)};
                for (int g = 0; g < 2; ++g)
                    o(64 * i + 32 * n + 16 * g, _mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(half[g]), t1));
            }
        }
    }
};

// 64 int8 values in element order -> floats, each 16 times its scale sc[0..3].
template <class S>
HM_ALWAYS_INLINE inline void i8x64(__m512i q, const float* sc, S& o, int off) {
    const __m128i p[4] = {_mm512_castsi512_si128(q), _mm512_extracti32x4_epi32(q, 1),
                          _mm512_extracti32x4_epi32(q, 2), _mm512_extracti32x4_epi32(q, 3)};
    for (int c = 0; c < 4; ++c)
        o(off + 16 * c, _mm512_mul_ps(bcast(sc[c]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(p[c]))));
}

// Bytes, 64 codes per vector: per half h, the qh bytes sit in both 256-bit halves, the upper one
// shifted by 2, so one vector serves elements 0..63 (bits 0-1 | 2-3) and one 64..127 (bits 4-5 |
// 6-7). The 16-bit shifts move neighbour bits only into positions the masks drop.
template <>
struct Block<kQ6_K> {
    struct Pre {
        alignas(64) float dl[16];
    };
    HM_ALWAYS_INLINE static void prep(const uint8_t* b, Pre& p) {
        scale16s(_mm_loadu_si128((const __m128i*)(b + 192)), f16(b + 208), p.dl);
    }
    template <class S>
    HM_ALWAYS_INLINE static void run(const uint8_t* b, const Pre& p, S& o) {
        const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30), k32 = _mm512_set1_epi8(32);
        for (int h = 0; h < 2; ++h) {
            const __m512i ql = _mm512_loadu_si512(b + 64 * h);
            __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)));
            qh = _mm512_mask_srli_epi16(qh, __mmask32(0xFFFF0000u), qh, 2);
            const __m512i h0 = _mm512_and_si512(_mm512_slli_epi16(qh, 4), m30), h1 = _mm512_and_si512(qh, m30);
            const __m512i q0 = _mm512_or_si512(_mm512_and_si512(ql, m4), h0);
            const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), h1);
            i8x64(_mm512_sub_epi8(q0, k32), p.dl + 8 * h, o, 128 * h);
            i8x64(_mm512_sub_epi8(q1, k32), p.dl + 8 * h + 4, o, 128 * h + 64);
        }
    }
};

using Vec = __m512;
constexpr int kLanes = 16;
HM_ALWAYS_INLINE inline Vec vzero() { return _mm512_setzero_ps(); }
HM_ALWAYS_INLINE inline Vec vload(const float* p) { return _mm512_load_ps(p); }
HM_ALWAYS_INLINE inline void vstore(float* p, Vec v) { _mm512_store_ps(p, v); }
HM_ALWAYS_INLINE inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
HM_ALWAYS_INLINE inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
template <int F>
constexpr int kTwoTokenSets = 2;

#include "ext_driver.inc"

}  // namespace

namespace avx512 {

void decode_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* out) {
    decode_ext_any(fmt, w, row_bytes, n_rows, K, out);
}

void gemv_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs, int nt,
              float* out, int64_t ldo) {
    gemv_ext_any(fmt, w, row_bytes, n_rows, K, xs, nt, out, ldo);
}

}  // namespace avx512
}  // namespace hm

#pragma GCC pop_options
