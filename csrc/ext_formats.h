// ggml's other block types (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K..Q6_K): decoders to
// float32 and the fused GEMV (the same decoders feeding FMAs). Layouts and value
// formulas: the comment at the top of ext_scalar.cpp. Every decoder is bit-exact with the gguf
// package's numpy dequantize (gguf/quants.py, which follows ggml's dequantize_row_*): each value
// takes at most one float rounding there (the products before it are exact), so FMA contraction
// cannot change it.
#pragma once
#include <cstdint>
#include <cstring>

namespace hm {

// Format ids are ggml's type ids.
enum ExtFormat : int {
    kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
    kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23,
};

// Constant expressions, so each per-format kernel knows its block shape at compile time.
constexpr int ext_block_bytes(int fmt) {
    switch (fmt) {
        case kQ4_0: return 18; case kQ4_1: return 20; case kQ5_0: return 22; case kQ5_1: return 24;
        case kIQ4_NL: return 18; case kQ2_K: return 84; case kQ3_K: return 110; case kQ4_K: return 144;
        case kQ5_K: return 176; case kQ6_K: return 210; case kIQ4_XS: return 136;
        default: return 0;
    }
}
constexpr bool ext_format(int fmt) { return ext_block_bytes(fmt) != 0; }  // one of ExtFormat
constexpr int ext_block_elems(int fmt) {  // 32 or 256
    return fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ5_0 || fmt == kQ5_1 || fmt == kIQ4_NL ? 32 : 256;
}

// IQ4_NL / IQ4_XS code values.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K / Q5_K: the 6-bit scale and min of sub-block i (0..7) from the 12 packed bytes sc.
inline void k4_scale_min(const uint8_t* sc, int i, int* scale, int* min) {
    if (i < 4) {
        *scale = sc[i] & 63;
        *min = sc[i + 4] & 63;
    } else {
        *scale = (sc[i + 4] & 15) | (sc[i - 4] >> 6) << 4;
        *min = (sc[i + 4] >> 4) | (sc[i] >> 6) << 4;
    }
}

// Q4_K / Q5_K, word-parallel (the SIMD sets' form): the eight scales (words 0, 1: bytes in
// sub-block order) and the eight mins (words 2, 3), four 6-bit fields per 32-bit word.
inline void k4_unpack(const uint8_t* sc, uint32_t out[4]) {
    uint32_t a, b, c;
    std::memcpy(&a, sc, 4);
    std::memcpy(&b, sc + 4, 4);
    std::memcpy(&c, sc + 8, 4);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, two = 0x03030303u;
    out[0] = a & low6;
    out[1] = (c & low4) | ((a >> 6) & two) << 4;
    out[2] = b & low6;
    out[3] = ((c >> 4) & low4) | ((b >> 6) & two) << 4;
}

// Q3_K, word-parallel: the sixteen 6-bit scales as bytes, each still offset by +32 (two 64-bit
// words, sub-blocks 0..7 and 8..15).
inline void q3k_unpack(const uint8_t* sc, uint64_t out[2]) {
    uint64_t a;
    uint32_t c;
    std::memcpy(&a, sc, 8);
    std::memcpy(&c, sc + 8, 4);
    const uint64_t low4 = 0x0f0f0f0f0f0f0f0full;
    const uint32_t two = 0x03030303u;
    const uint64_t hi_lo = (c & two) | uint64_t((c >> 2) & two) << 32;  // bits 4-5 of scales 0..7
    const uint64_t hi_hi = ((c >> 4) & two) | uint64_t((c >> 6) & two) << 32;  // of 8..15
    out[0] = (a & low4) | hi_lo << 4;
    out[1] = ((a >> 4) & low4) | hi_hi << 4;
}

// Q3_K: the signed 6-bit scale of sub-block j (0..15) from the 12 packed bytes sc.
inline int q3k_scale(const uint8_t* sc, int j) {
    const int lo = (j < 8 ? sc[j] : sc[j - 8] >> 4) & 15;
    const int hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | hi << 4) - 32;
}

// decode_ext: out[r*K + k] = W[r][k] for r < n_rows, k < K (K a multiple of the block), rows
// row_bytes apart. gemv_ext: out[t*ldo + r] = dot(W[r], xs[t]) for r < n_rows, t < nt
// (1..kMaxGemvTokens), same K; each weight decoded to decode_ext's value and multiplied into fp32
// sums (summation order the ISA's). The SIMD sets FMA the decoded vectors straight from registers;
// the scalar reference decodes one block to the stack.
namespace scalar {
void decode_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* out);
void gemv_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs, int nt,
              float* out, int64_t ldo);
}  // namespace scalar
namespace avx2 {
void decode_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* out);
void gemv_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs, int nt,
              float* out, int64_t ldo);
}  // namespace avx2
namespace avx512 {
void decode_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* out);
void gemv_ext(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs, int nt,
              float* out, int64_t ldo);
}  // namespace avx512

}  // namespace hm
