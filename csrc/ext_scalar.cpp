// Scalar reference decoders of ggml's other block types, the reference GEMV (decode a block, dot
// it), and the exported per-ISA test entry points (hm_ext_decode, hm_ext_gemv).
//
// Layouts (little-endian; d, dmin, m: fp16; "nib" = 4-bit field; value order = numpy's in
// gguf/quants.py, each value one float rounding after exact products):
//   Q4_0   18 B: d, qs[16]           e<16: qs[e]&15, else qs[e-16]>>4;   v = d*(nib-8)
//   Q4_1   20 B: d, m, qs[16]        nib as Q4_0;                         v = d*nib + m
//   Q5_0   22 B: d, qh u32, qs[16]   q = nib | ((qh>>e)&1)<<4;            v = d*(q-16)
//   Q5_1   24 B: d, m, qh, qs[16]    q as Q5_0;                           v = d*q + m
//   IQ4_NL 18 B: d, qs[16]           nib as Q4_0;                         v = d*kIq4[nib]
//   IQ4_XS 136 B: d, sh u16, sl[4], qs[128]; 8 sub-blocks of 32 (ib): 16 bytes qs[16ib..] in
//          Q4_0 order, ls = (sl[ib/2]>>4(ib%2))&15 | ((sh>>2ib)&3)<<4; v = (d*(ls-32))*kIq4[nib]
//   Q2_K   84 B: sc[16], qs[64], d, dmin; e = 128h+32s+l (l<32): q = (qs[32h+l]>>2s)&3,
//          j = e/16: v = (d*(sc[j]&15))*q - dmin*(sc[j]>>4)
//   Q3_K  110 B: hm[32], qs[64], sc[12], d; e = 128h+32s+l: q = ((qs[32h+l]>>2s)&3) - 4 +
//          4*((hm[l]>>(4h+s))&1); 6-bit scale j = e/16: lo = nib j of sc[0..7] (j<8: low nibbles,
//          j>=8: high), hi = (sc[8+j%4]>>2(j/4))&3; v = (d*((lo|hi<<4)-32))*q
//   Q4_K  144 B: d, dmin, sc[12], qs[128]; sub-block i = e/32 (0..7): byte qs[32(i/2)+e%32],
//          low nibble for even i, high for odd; 6-bit (scale, min) of i: i<4: (sc[i]&63,
//          sc[i+4]&63), else (sc[i+4]&15 | (sc[i-4]>>6)<<4, sc[i+4]>>4 | (sc[i]>>6)<<4);
//          v = (d*scale)*nib - dmin*min
//   Q5_K  176 B: d, dmin, sc[12], qh[32], qs[128]; as Q4_K with q = nib | ((qh[e%32]>>i)&1)<<4
//   Q6_K  210 B: ql[128], qh[64], sc[16] int8, d; e = 128h+r (r<128): lo = (ql[64h+r%64]>>4(r/64))&15,
//          hi = (qh[32h+r%32]>>2(r/32))&3, q = (lo|hi<<4)-32; v = (d*sc[e/16])*q
#include <cstring>

#include "common.h"
#include "ext_formats.h"

namespace hm {

namespace scalar {
namespace {

float f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return fp16_to_fp32(h);
}

// Nibble e of a 32-element block stored as 16 bytes: low nibbles first, then high nibbles.
int nib32(const uint8_t* qs, int e) { return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4; }

uint32_t u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

void q4_0(const uint8_t* b, float* o) {
    const float d = f16(b);
    for (int e = 0; e < 32; ++e) o[e] = d * float(nib32(b + 2, e) - 8);
}
void q4_1(const uint8_t* b, float* o) {
    const float d = f16(b), m = f16(b + 2);
    for (int e = 0; e < 32; ++e) o[e] = d * float(nib32(b + 4, e)) + m;
}
void q5_0(const uint8_t* b, float* o) {
    const float d = f16(b);
    const uint32_t qh = u32(b + 2);
    for (int e = 0; e < 32; ++e) o[e] = d * float((nib32(b + 6, e) | int((qh >> e) & 1) << 4) - 16);
}
void q5_1(const uint8_t* b, float* o) {
    const float d = f16(b), m = f16(b + 2);
    const uint32_t qh = u32(b + 4);
    for (int e = 0; e < 32; ++e) o[e] = d * float(nib32(b + 8, e) | int((qh >> e) & 1) << 4) + m;
}
void iq4_nl(const uint8_t* b, float* o) {
    const float d = f16(b);
    for (int e = 0; e < 32; ++e) o[e] = d * float(kIq4Values[nib32(b + 2, e)]);
}
void iq4_xs(const uint8_t* b, float* o) {
    const float d = f16(b);
    const int sh = b[2] | b[3] << 8;
    for (int ib = 0; ib < 8; ++ib) {
        const int ls = ((b[4 + ib / 2] >> 4 * (ib % 2)) & 15) | ((sh >> 2 * ib) & 3) << 4;
        const float dl = d * float(ls - 32);
        for (int e = 0; e < 32; ++e) o[32 * ib + e] = dl * float(kIq4Values[nib32(b + 8 + 16 * ib, e)]);
    }
}
void q2_k(const uint8_t* b, float* o) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = f16(b + 80), dmin = f16(b + 82);
    for (int e = 0; e < 256; ++e) {
        const int h = e / 128, s = (e / 32) % 4, l = e % 32, j = e / 16;
        const float dl = d * float(sc[j] & 15), ml = dmin * float(sc[j] >> 4);
        o[e] = dl * float((qs[32 * h + l] >> 2 * s) & 3) - ml;
    }
}
void q3_k(const uint8_t* b, float* o) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = f16(b + 108);
    for (int e = 0; e < 256; ++e) {
        const int h = e / 128, s = (e / 32) % 4, l = e % 32;
        const int q = ((qs[32 * h + l] >> 2 * s) & 3) - 4 + 4 * ((hm[l] >> (4 * h + s)) & 1);
        o[e] = (d * float(q3k_scale(sc, e / 16))) * float(q);
    }
}
void q4_k(const uint8_t* b, float* o) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *sc = b + 4, *qs = b + 16;
    for (int i = 0; i < 8; ++i) {
        int scale, min;
        k4_scale_min(sc, i, &scale, &min);
        const float dl = d * float(scale), ml = dmin * float(min);
        for (int l = 0; l < 32; ++l) o[32 * i + l] = dl * float((qs[32 * (i / 2) + l] >> 4 * (i % 2)) & 15) - ml;
    }
}
void q5_k(const uint8_t* b, float* o) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + 48;
    for (int i = 0; i < 8; ++i) {
        int scale, min;
        k4_scale_min(sc, i, &scale, &min);
        const float dl = d * float(scale), ml = dmin * float(min);
        for (int l = 0; l < 32; ++l) {
            const int q = ((qs[32 * (i / 2) + l] >> 4 * (i % 2)) & 15) | ((qh[l] >> i) & 1) << 4;
            o[32 * i + l] = dl * float(q) - ml;
        }
    }
}
void q6_k(const uint8_t* b, float* o) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = (const int8_t*)(b + 192);
    const float d = f16(b + 208);
    for (int e = 0; e < 256; ++e) {
        const int h = e / 128, r = e % 128;
        const int lo = (ql[64 * h + r % 64] >> 4 * (r / 64)) & 15, hi = (qh[32 * h + r % 32] >> 2 * (r / 32)) & 3;
        o[e] = (d * float(sc[e / 16])) * float((lo | hi << 4) - 32);
    }
}

template <void (*Block)(const uint8_t*, float*)>
void rows(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, int elems, int bytes, float* out) {
    for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t b = 0; b < K / elems; ++b) Block(w + r * row_bytes + b * bytes, out + r * K + b * elems);
}

// Each block decoded to a stack buffer and dotted with every token; eight partial sums per token
// (as a SIMD lane set would keep): shorter error chains than one running sum.
template <void (*Block)(const uint8_t*, float*)>
void gemv_rows(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, int elems, int bytes,
               const float* const* xs, int nt, float* out, int64_t ldo) {
    float buf[256];
    for (int64_t r = 0; r < n_rows; ++r) {
        float acc[kMaxGemvTokens][8] = {};
        for (int64_t b = 0; b < K / elems; ++b) {
            Block(w + r * row_bytes + b * bytes, buf);
            for (int t = 0; t < nt; ++t)
                for (int e = 0; e < elems; ++e) acc[t][e % 8] += buf[e] * xs[t][b * elems + e];
        }
        for (int t = 0; t < nt; ++t) {
            float s = 0.f;
            for (float a : acc[t]) s += a;
            out[t * ldo + r] = s;
        }
    }
}

}  // namespace

#define HM_EXT_SWITCH(fn, ...)                                             \
    switch (fmt) {                                                         \
        case kQ4_0: return fn<q4_0>(__VA_ARGS__);                          \
        case kQ4_1: return fn<q4_1>(__VA_ARGS__);                          \
        case kQ5_0: return fn<q5_0>(__VA_ARGS__);                          \
        case kQ5_1: return fn<q5_1>(__VA_ARGS__);                          \
        case kIQ4_NL: return fn<iq4_nl>(__VA_ARGS__);                      \
        case kIQ4_XS: return fn<iq4_xs>(__VA_ARGS__);                      \
        case kQ2_K: return fn<q2_k>(__VA_ARGS__);                          \
        case kQ3_K: return fn<q3_k>(__VA_ARGS__);                          \
        case kQ4_K: return fn<q4_k>(__VA_ARGS__);                          \
        case kQ5_K: return fn<q5_k>(__VA_ARGS__);                          \
        case kQ6_K: return fn<q6_k>(__VA_ARGS__);                          \
        default: return;                                                   \
    }

void decode_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* out) {
    const int E = ext_block_elems(fmt), B = ext_block_bytes(fmt);
    HM_EXT_SWITCH(rows, w, row_bytes, n_rows, K, E, B, out)
}

void gemv_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs, int nt,
              float* out, int64_t ldo) {
    const int E = ext_block_elems(fmt), B = ext_block_bytes(fmt);
    HM_EXT_SWITCH(gemv_rows, w, row_bytes, n_rows, K, E, B, xs, nt, out, ldo)
}

#undef HM_EXT_SWITCH

}  // namespace scalar

}  // namespace hm

// Test entry points: each ISA's decoder and GEMV, reached directly (the kernel table picks one).
// isa: 0 scalar, 1 AVX2, 2 AVX-512. Return 0, -1 for bad arguments, -3 for an ISA this CPU lacks.
extern "C" int hm_isa_supported(const char* name);  // api.cpp

namespace {

using DecodeFn = void (*)(int, const uint8_t*, int64_t, int64_t, int64_t, float*);
using GemvFn = void (*)(int, const uint8_t*, int64_t, int64_t, int64_t, const float* const*, int, float*, int64_t);

bool ext_isa(int isa, DecodeFn* dec, GemvFn* gemv) {
    static const char* const names[3] = {"scalar", "avx2", "avx512"};
    static const DecodeFn decs[3] = {hm::scalar::decode_ext, hm::avx2::decode_ext, hm::avx512::decode_ext};
    static const GemvFn gemvs[3] = {hm::scalar::gemv_ext, hm::avx2::gemv_ext, hm::avx512::gemv_ext};
    // Asked once: cpuid is slow (a VM exit under virtualisation) and this runs per call.
    static const bool ok[3] = {true, hm_isa_supported(names[1]) != 0, hm_isa_supported(names[2]) != 0};
    if (isa < 0 || isa > 2 || !ok[isa]) return false;
    *dec = decs[isa];
    *gemv = gemvs[isa];
    return true;
}

bool decode_args_ok(int fmt, int64_t row_bytes, int64_t n_rows, int64_t K) {
    return hm::ext_format(fmt) && n_rows >= 0 && K >= 0 && K % hm::ext_block_elems(fmt) == 0 &&
           row_bytes >= K / hm::ext_block_elems(fmt) * hm::ext_block_bytes(fmt);
}

}  // namespace

#define HM_EXT_API extern "C" __attribute__((visibility("default")))

HM_EXT_API int hm_ext_decode(int isa, int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K,
                             float* out) {
    DecodeFn dec;
    GemvFn gemv;
    if (!ext_isa(isa, &dec, &gemv)) return -3;
    if (!decode_args_ok(fmt, row_bytes, n_rows, K)) return -1;
    dec(fmt, w, row_bytes, n_rows, K, out);
    return 0;
}

// The ISA's fused GEMV (one thread).
HM_EXT_API int hm_ext_gemv(int isa, int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K,
                           const float* const* xs, int nt, float* out, int64_t ldo) {
    DecodeFn dec;
    GemvFn gemv;
    if (!ext_isa(isa, &dec, &gemv)) return -3;
    if (!decode_args_ok(fmt, row_bytes, n_rows, K) || nt < 1 || nt > hm::kMaxGemvTokens || ldo < n_rows) return -1;
    gemv(fmt, w, row_bytes, n_rows, K, xs, nt, out, ldo);
    return 0;
}
