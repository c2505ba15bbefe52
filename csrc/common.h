// Shared definitions for the hybridmoe CPU kernels: block formats and the per-ISA kernel table.
// Block layouts: docs/formats.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <climits>
#include <cstring>

// On a GEMV's per-block step (a lambda or helper): GCC's unit-growth limits otherwise decide
// per file whether it is inlined, and out of line its vector accumulators go through memory.
#define HM_ALWAYS_INLINE __attribute__((always_inline))

namespace hm {

constexpr int kBlockElems = 32;     // MXFP4 and Q8_0 both hold 32 weights per block
constexpr int kMxfp4Bytes = 17;     // uint8 e8m0 scale + 16 bytes of nibbles
constexpr int kQ8_0Bytes = 34;      // fp16 scale + 32 int8
constexpr int kMaxGemvTokens = 8;   // tokens sharing one decode in the fused GEMV

enum Format : int { kMXFP4 = 39, kQ8_0 = 8 };

// E2M1 values doubled (ggml's table), so they are small integers; -0 stored as +0.
constexpr int8_t kMxfp4Lut2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml's "half" e8m0 convention: d = 2^(e-128), exact for every byte (e=0,1 are subnormal).
inline float e8m0_half(uint8_t e) {
    uint32_t bits = e >= 2 ? (uint32_t(e) - 1) << 23 : (0x00200000u << e);
    float d;
    std::memcpy(&d, &bits, 4);
    return d;
}

// Table of e8m0_half for all 256 bytes; filled once at load (api.cpp).
extern float g_e8m0_table[256];

inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);                 // inf / nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);         // normal
    } else if (man == 0) {
        bits = sign;                                             // zero
    } else {                                                     // subnormal: renormalise
        int e = -1;
        do { man <<= 1; ++e; } while (!(man & 0x400));
        bits = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// One ISA's kernels. Weight pointers address row 0 of a block of rows; rows are row_bytes apart.
// "prepared" x: the layout prep_x() produced for this ISA and format (a per-block permutation).
struct KernelSet {
    const char* name;
    // x [K] -> xp [K] in the order this ISA's fused GEMV wants for `fmt`.
    void (*prep_x)(int fmt, const float* x, float* xp, int64_t K);
    // out[t*ldo + r] = dot(W[r], x_t) for r < n_rows, t < nt (nt <= kMaxGemvTokens); no bias.
    void (*gemv)(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K,
                 const float* const* xs, int nt, float* out, int64_t ldo);
    // tile[r*K + k] = W[r][k] as float32, natural order, bit-exact.
    void (*decode)(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K,
                   float* tile);
    // M rows of K floats -> Ap, the layout this ISA's gemm reads (packed_floats(M, K) floats).
    void (*pack_a)(const float* const* rows, int64_t M, int64_t K, float* Ap);
    // C[m*ldc + n] = dot(A[m], B[n]) over K (K % 8 == 0), A packed by pack_a, B row-major [N, K].
    void (*gemm)(const float* Ap, int64_t M, const float* B, int64_t N, int64_t K, float* C, int64_t ldc);
    // Fast mode (int8 activations): like gemv, with x_t given as quantize_x_q8's output, xq[t]
    // and xd[t] (pair layout). Per row and token, for each pair of blocks (2p, 2p+1): 8 exact
    // int32 sums c[l] (l < 4: block 2p, elements 4l..4l+3 and 16+4l..16+4l+3; l >= 4: the same
    // for block 2p+1), s[l] = d_w * d_x of that block (fp32 mul), acc[l] = fma(c[l], s[l], acc[l]);
    // finally hsum8(acc). Every ISA does exactly this, so all variants agree bit for bit.
    void (*gemv_q8)(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K,
                    const int8_t* const* xq, const float* const* xd, int nt, float* out, int64_t ldo);
    // Decode attention for the g (<= kMaxAttnGroup) query heads q [g][d] that share one KV head:
    // K, V rows [n][d]; vis[j] != 0 marks the visible keys (null: all n); one sink logit per
    // head. out[h] = sum_j p_hj v_j, p_h = softmax over {scale * q_h . k_j : visible j} and the
    // sink (which takes mass, adds no value). p: scratch of g * n floats.
    void (*attn_group)(const float* q, int g, const float* K, const float* V, int64_t n, int64_t d,
                       const uint8_t* vis, const float* sink, float scale, float* p, float* out);
    // C[m*ldc + r] = dot(W[r], A[m]) for r < N, m < M, straight from the quantized rows (no tile;
    // for few tokens, M <= kQgemmMaxTokens), A packed by this ISA's pack_a.
    void (*qgemm)(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* Ap,
                  int64_t M, float* C, int64_t ldc);
    // Fast mode, many tokens: C[m*ldc + r] for r < N, m < M with x_m given as quantize_x_q8's
    // output (xq[m], xd[m]). Per row and token, for each block b in order: the exact int32 dot
    // c_b of the integer weights (MXFP4: LUT2 values; Q8_0: the int8 quants) and the int8
    // activations, s_b = d_w * d_x (fp32 mul), acc = fma(c_b, s_b, acc); C = acc. Every ISA does
    // exactly this (bit-identical).
    void (*gemm_q8)(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const int8_t* const* xq,
                    const float* const* xd, int64_t M, float* C, int64_t ldc);
    // Fast mode: one activation row x [K] -> q / d exactly as quantize_x_q8 (below) writes them.
    void (*quantize_q8)(const float* x, int64_t K, int8_t* q, float* d);
    // gpt-oss's clamped SwiGLU for rows a < rows, r < n: g = min(g[a*n+r] + gb[r], limit),
    // u = clamp(u[a*n+r] + ub[r], +-limit), out[a*ldo+r] = g / (1 + exp_ref(-alpha * g)) * (u + 1)
    // (null biases add 0). NaN passes both clamps. Every ISA computes exactly swiglu_ref's bits.
    void (*swiglu)(const float* g, const float* u, int64_t rows, int64_t n, const float* gb, const float* ub,
                   float alpha, float limit, float* out, int64_t ldo);
    // Default path (int16 activations): one activation row x [K] -> q / d exactly as
    // quantize_x_q16 (below) writes them (bit-identical on every ISA).
    void (*quantize_q16)(const float* x, int64_t K, int16_t* q, float* d);
    // Like gemv, with x_t given as quantize_x_q16's output (xq[t], xd[t]): per block the exact
    // integer dots of the weights (MXFP4: LUT2 values; Q8_0: the quants) with the hi and the lo
    // int16 terms, (hi + lo 2^-16) times d_w * d_x, summed in fp32 (lane order is the ISA's: a
    // stated tolerance, not bits).
    void (*gemv_q16)(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K,
                     const int16_t* const* xq, const float* const* xd, int nt, float* out, int64_t ldo);
    // Three-digit activations: one activation row x [K] -> q (d3x_bytes(K)) exactly as
    // quantize_x_d3 (below) writes it (bit-identical on every ISA).
    void (*quantize_d3)(const float* x, int64_t K, uint8_t* q);
    // Like gemv, MXFP4 only, with x_t given as quantize_x_d3's output xq[t]: per quad lane the exact
    // int32 F (see quantize_x_d3), acc[t][q % 2][lane] += F * 2^(e_w - 128 + kx) (exact product,
    // one rounding), out = the fixed 16-lane sum of acc[t][0] + acc[t][1], plus the row's poison.
    // Null where the ISA has none (the caller then uses the fp32 GEMV).
    void (*gemv_d3)(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const uint8_t* const* xq,
                    int nt, float* out, int64_t ldo);
    // Tokens per expert (or dense call) up to which this set's fp32 MXFP4 GEMV beats its tile GEMM
    // (measured; the default until set_gemv_max_tokens overrides it).
    int mxfp4_gemv_max_tokens;
};

constexpr int kQgemmMaxTokens = 16;  // qgemm's token groups are decoded once per pair of 8

constexpr int kMaxAttnGroup = 64;  // query heads per KV head the attention kernels accept

// Fast mode activations: per 32-block d = max|x|/127, q = round-to-nearest(x/d) in [-127, 127].
// A block holding NaN or +-inf gets d = NaN (and q = 0), so the dot products come out NaN rather
// than quantization swallowing it. Stored by pairs of blocks (2p, 2p+1) for the GEMV, which
// decodes two MXFP4 blocks per 256-bit vector: 96 bytes per pair,
//   [b0 elements 0..15 | b1 elements 0..15 | b0 elements 16..31 | b1 elements 16..31] (int8),
//   then 8 int32: 12 * (sum of the 8 q that int32 lane l of the dot product covers: l < 4 block
//   b0, elements 4l..4l+3 and 16+4l..16+4l+3; l >= 4 the same in b1), the correction that lets
//   the MXFP4 GEMV multiply unsigned LUT2+12 weights (maddubs) and subtract it afterwards;
// and 8 scales per pair [d0 x4 | d1 x4]; an odd last block's missing partner is zeros (q and d).
// After the pairs' scales, one int32 per block (stored in the float array's bytes): 12 * (sum of
// the block's q), the correction the int8 GEMM subtracts (its lanes hold rows, not k groups).
// Shared by every ISA (runs once per token: K elements).
inline int64_t q8x_pairs(int64_t K) { return (K / kBlockElems + 1) / 2; }
constexpr int kQ8xPairBytes = 96;
inline int64_t q8x_bytes(int64_t K) { return q8x_pairs(K) * kQ8xPairBytes; }
inline int64_t q8x_scales(int64_t K) { return q8x_pairs(K) * 8 + K / kBlockElems; }
inline int32_t q8x_block_sum(const float* d, int64_t K, int64_t b) {
    int32_t v;
    std::memcpy(&v, d + q8x_pairs(K) * 8 + b, sizeof(v));
    return v;
}

constexpr float kQ8TinyAmax = 1e-30f;

// exp for the SwiGLU, as a fixed sequence of IEEE operations so SIMD twins give the same bits:
// n = round(x log2 e), r = x - n ln2 (two fmas, Cody-Waite), a degree-7 polynomial for e^r (Cephes
// coefficients), times 2^n. Within 2 ulp of exp on [-87.3, 88.3]; below: clamped (a tiny normal
// number instead of a denormal or 0); above 88.3: +inf (exp(88.3) is within 2x of FLT_MAX); NaN
// returns NaN.
constexpr float kExpHi = 88.3f, kExpLo = -87.3f, kLog2e = 1.44269504088896341f;
constexpr float kExpC1 = 0.693359375f, kExpC2 = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
inline float exp_ref(float x) {
    if (x != x) return x;
    if (x > kExpHi) return __builtin_inff();
    x = x < kExpLo ? kExpLo : x;
    const float n = __builtin_nearbyintf(x * kLog2e);
    float r = __builtin_fmaf(n, -kExpC1, x);
    r = __builtin_fmaf(n, -kExpC2, r);
    float p = kExpP[0];
    for (int i = 1; i < 6; ++i) p = __builtin_fmaf(p, r, kExpP[i]);
    const float y = __builtin_fmaf(p, r * r, r) + 1.f;
    const int32_t bits = (int32_t(n) + 127) << 23;
    float s;
    std::memcpy(&s, &bits, sizeof(s));
    return y * s;
}

inline void swiglu_ref(const float* g, const float* u, int64_t rows, int64_t n, const float* gb, const float* ub,
                       float alpha, float limit, float* out, int64_t ldo) {
    for (int64_t a = 0; a < rows; ++a)
        for (int64_t r = 0; r < n; ++r) {
            float gv = g[a * n + r] + (gb ? gb[r] : 0.f);
            float uv = u[a * n + r] + (ub ? ub[r] : 0.f);
            gv = gv > limit ? limit : gv;  // NaN falls through both clamps
            uv = uv > limit ? limit : (uv < -limit ? -limit : uv);
            out[a * ldo + r] = gv / (1.f + exp_ref(-alpha * gv)) * (uv + 1.f);
        }
}

// max |x| over one 32-block; false when the block holds a NaN or an inf (its scale becomes NaN).
inline bool block_absmax(const float* xb, float* amax) {
    bool finite = true;
    for (int j = 0; j < kBlockElems; ++j) {
        const float a = xb[j] < 0.f ? -xb[j] : xb[j];
        if (!(a <= 3.4028234663852886e38f)) finite = false;
        else if (a > *amax) *amax = a;
    }
    return finite;
}

// The reference quantizer (the scalar set's quantize_q8); SIMD twins must match it bit for bit.
inline void quantize_x_q8(const float* x, int64_t K, int8_t* q, float* d) {
    const float kMagic = 12582912.f;  // 1.5 * 2^23: (v + magic) - magic rounds v to nearest even
    const int64_t nb = K / kBlockElems;
    std::memset(q, 0, size_t(q8x_bytes(K)));
    std::memset(d, 0, size_t(q8x_scales(K)) * sizeof(float));
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * kBlockElems;
        int8_t* lo = q + (b / 2) * kQ8xPairBytes + (b % 2) * 16;  // elements 0..15; 16..31: 32 bytes on
        float* db = d + (b / 2) * 8 + (b % 2) * 4;
        float amax = 0.f;
        const bool finite = block_absmax(xb, &amax);
        const float scale = finite ? amax / 127.f : __builtin_nanf("");
        for (int i = 0; i < 4; ++i) db[i] = scale;
        if (!finite) continue;  // q stays 0
        // Blocks below kQ8TinyAmax quantize to zeros: 127 / amax would overflow to inf (and
        // 0 * inf to NaN) for the tiniest ones; their share of a dot product is < 1e-30 anyway.
        const float id = amax >= kQ8TinyAmax ? 127.f / amax : 0.f;
        for (int j = 0; j < kBlockElems; ++j) {
            float v = (xb[j] * id + kMagic) - kMagic;
            v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
            lo[j < 16 ? j : j + 16] = int8_t(int(v));
        }
        int32_t sums[4];
        for (int l = 0; l < 4; ++l) {
            int32_t sum = 0;
            for (int j = 4 * l; j < 4 * l + 4; ++j) sum += lo[j] + lo[j + 32];
            sums[l] = 12 * sum;
        }
        std::memcpy(q + (b / 2) * kQ8xPairBytes + 64 + (b % 2) * 16, sums, sizeof(sums));
        const int32_t block_sum = sums[0] + sums[1] + sums[2] + sums[3];
        std::memcpy(d + q8x_pairs(K) * 8 + b, &block_sum, sizeof(block_sum));
    }
}

// Default path activations: per 32-block d = max|x|/32767, v = x * (32767/max|x|) (fp32),
// hi = round-to-nearest-even(v) in [-32767, 32767], lo = rne((v - hi) * 65536) clamped to
// +-32767 (v - hi is exact): x = d (hi + lo 2^-16) to ~2^-24 of the block max, fp32-like. The
// GEMV multiplies both terms (vpmaddwd: twice the integer products, no extra decode work); one
// int16 term alone misses the 1e-4 budget on the test models' logits.
// NaN or +-inf in a block gives d = NaN, q = 0 (NaN outputs, never swallowed); max|x| <
// kQ8TinyAmax gives q = 0. Stored by pairs of blocks (2p, 2p+1): 64 hi then 64 lo int16 per
// pair, each in 4 runs of 16:
//   [b0 0..7 | b1 0..7] [b0 8..15 | b1 8..15] [b0 16..23 | b1 16..23] [b0 24..31 | b1 24..31],
// the order in which a 256-bit unpack of the decoded weight bytes of the two blocks leaves
// them (so the weights need no cross-lane shuffle); and 8 floats per pair [d0 x4 | d1 x4]. An
// odd last block's missing partner is zeros (q and d).
inline int64_t q16x_elems(int64_t K) { return q8x_pairs(K) * 128; }
inline int64_t q16x_scales(int64_t K) { return q8x_pairs(K) * 8; }
inline int64_t q16x_elem(int64_t b, int j) {  // position of element j of block b's hi term (lo: +64)
    return (b / 2) * 128 + (j / 8) * 16 + (b % 2) * 8 + j % 8;
}
inline float q16x_scale(const float* d, int64_t b) { return d[(b / 2) * 8 + (b % 2) * 4]; }
constexpr float kQ16Lo = 1.f / 65536.f;

// The reference int16 quantizer (the scalar set's quantize_q16); SIMD twins match it bit for bit.
inline void quantize_x_q16(const float* x, int64_t K, int16_t* q, float* d) {
    const float kMagic = 12582912.f;  // 1.5 * 2^23: (v + magic) - magic rounds v to nearest even
    const int64_t nb = K / kBlockElems;
    std::memset(q, 0, size_t(q16x_elems(K)) * sizeof(int16_t));
    std::memset(d, 0, size_t(q16x_scales(K)) * sizeof(float));
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * kBlockElems;
        float amax = 0.f;
        const bool finite = block_absmax(xb, &amax);
        const float scale = finite ? amax / 32767.f : __builtin_nanf("");
        for (int i = 0; i < 4; ++i) d[(b / 2) * 8 + (b % 2) * 4 + i] = scale;
        if (!finite) continue;
        const float id = amax >= kQ8TinyAmax ? 32767.f / amax : 0.f;
        for (int j = 0; j < kBlockElems; ++j) {
            const float v = xb[j] * id;
            float h = (v + kMagic) - kMagic;
            h = h > 32767.f ? 32767.f : (h < -32767.f ? -32767.f : h);
            float l = ((v - h) * 65536.f + kMagic) - kMagic;
            l = l > 32767.f ? 32767.f : (l < -32767.f ? -32767.f : l);
            q[q16x_elem(b, j)] = int16_t(int(h));
            q[q16x_elem(b, j) + 64] = int16_t(int(l));
        }
    }
}

// Three-digit activations (Activations.INT8X3): per 32-block a power-of-two scale 2^kx with
// max|x| < 2^(kx + 22), xi = rne(x / 2^kx) (|xi| <= 2^22: the scaling is exact, so xi carries 22-23
// bits of the block max, as fp32 does), split into balanced signed bytes xi = h 2^16 + m 2^8 + l
// (l, m in [-128, 127], |h| <= 64). The MXFP4 GEMV multiplies LUT2 + 12 (unsigned 0..24) with each
// digit (vpdpbusd: exact int32, no saturation), combines the digits in int32 (Horner: shifts by 8),
// subtracts 12 * (the lane's sum of xi) stored here, converts once and applies 2^(e_w - 128 + kx)
// with one FMA. Layout per row: a 64-byte head, then per quad of blocks (4q..4q+3) 512 bytes:
//   [pair A = blocks 4q, 4q+1: h, m, l, 64 bytes each][pair B = 4q+2, 4q+3: h, m, l],
//   each 64-byte digit run in quantize_x_q8's pair order [b0 0..15 | b1 0..15 | b0 16..31 | b1 16..31];
//   int32 corr[16], int32 kxm1[16]: lane L belongs to block 4q + L/4 and covers its elements
//   {4i..4i+3} and {16+4i..16+4i+3}, i = L % 4 (the two vpdpbusd lanes i and i+8 of that pair);
//   corr = 12 * sum of those 8 xi, kxm1 = kx - 1 (so the scale's float bits are (e_w + kxm1) << 23).
// Zero blocks (max|x| < kQ8TinyAmax), non-finite blocks and the missing blocks of a last quad have
// zero digits and kxm1 = kx_min - 1 (a scale the range below keeps finite). Head: int32 e_lo, e_hi,
// float poison: the fast scale is exact when every weight exponent e_w lies in [e_lo, e_hi]
// (e_lo = 2 - kx_min, e_hi = 226 - kx_max: the scale is a normal float and F * scale < 2^127),
// else the row is recomputed with ldexp (exact for any e_w); poison is NaN when x holds a NaN or
// an inf (every output of the row then is NaN), else 0.
constexpr int kD3HeadBytes = 64, kD3QuadBytes = 512;
inline int64_t d3x_quads(int64_t K) { return (K / kBlockElems + 3) / 4; }
inline int64_t d3x_bytes(int64_t K) { return kD3HeadBytes + d3x_quads(K) * kD3QuadBytes; }
// Byte offset of the top digit of element j of block b (middle digit: +64, low digit: +128).
inline int64_t d3x_elem(int64_t b, int j) {
    return kD3HeadBytes + (b / 4) * kD3QuadBytes + ((b / 2) % 2) * 192 + (b % 2) * 16 + (j < 16 ? j : j + 16);
}
struct D3Head {
    int32_t e_lo, e_hi;
    float poison;
};
inline D3Head d3x_head(const uint8_t* q) {
    D3Head h;
    std::memcpy(&h, q, sizeof(h));
    return h;
}
inline int32_t d3x_lane(const uint8_t* q, int64_t quad, int field, int lane) {  // field 0: corr, 1: kxm1
    int32_t v;
    std::memcpy(&v, q + kD3HeadBytes + quad * kD3QuadBytes + 384 + field * 64 + lane * 4, sizeof(v));
    return v;
}

// The reference three-digit quantizer (every ISA's quantize_d3); integer-exact, so SIMD twins match.
inline void quantize_x_d3(const float* x, int64_t K, uint8_t* q) {
    const float kMagic = 12582912.f;  // 1.5 * 2^23: (v + magic) - magic rounds v to nearest even
    const int64_t nb = K / kBlockElems, nq = d3x_quads(K);
    constexpr int32_t kUnset = INT32_MIN;
    std::memset(q, 0, size_t(d3x_bytes(K)));
    auto lane_ptr = [&](int64_t b, int field, int i) {
        return q + kD3HeadBytes + (b / 4) * kD3QuadBytes + 384 + field * 64 + ((b % 4) * 4 + i) * 4;
    };
    for (int64_t b = 0; b < 4 * nq; ++b)
        for (int i = 0; i < 4; ++i) std::memcpy(lane_ptr(b, 1, i), &kUnset, 4);
    int kx_min = 1 << 20, kx_max = -(1 << 20);
    bool finite = true;
    for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + b * kBlockElems;
        float amax = 0.f;
        if (!block_absmax(xb, &amax)) {
            finite = false;
            continue;
        }
        if (amax < kQ8TinyAmax) continue;
        uint32_t bits;
        std::memcpy(&bits, &amax, 4);
        const int kx = int(bits >> 23) - 148;  // amax in [2^(kx+21), 2^(kx+22))
        const uint32_t ubits = uint32_t(127 - kx) << 23;
        float up;  // 2^-kx, a normal float for every kx here (-121..106)
        std::memcpy(&up, &ubits, 4);
        int32_t xi[kBlockElems];
        for (int j = 0; j < kBlockElems; ++j) {
            xi[j] = int32_t((xb[j] * up + kMagic) - kMagic);  // exact scaling, |v| <= 2^22
            const int32_t l = ((xi[j] + 128) & 255) - 128, r = (xi[j] - l) / 256;
            const int32_t m = ((r + 128) & 255) - 128, h = (r - m) / 256;
            q[d3x_elem(b, j)] = uint8_t(int8_t(h));
            q[d3x_elem(b, j) + 64] = uint8_t(int8_t(m));
            q[d3x_elem(b, j) + 128] = uint8_t(int8_t(l));
        }
        for (int i = 0; i < 4; ++i) {
            int32_t sum = 0;
            for (int k = 4 * i; k < 4 * i + 4; ++k) sum += xi[k] + xi[k + 16];
            const int32_t corr = 12 * sum, kxm1 = kx - 1;
            std::memcpy(lane_ptr(b, 0, i), &corr, 4);
            std::memcpy(lane_ptr(b, 1, i), &kxm1, 4);
        }
        kx_min = kx < kx_min ? kx : kx_min;
        kx_max = kx > kx_max ? kx : kx_max;
    }
    if (kx_min > kx_max) kx_min = kx_max = 0;  // no nonzero block
    const int32_t fill = kx_min - 1;
    for (int64_t b = 0; b < 4 * nq; ++b)
        for (int i = 0; i < 4; ++i) {
            int32_t v;
            std::memcpy(&v, lane_ptr(b, 1, i), 4);
            if (v == kUnset) std::memcpy(lane_ptr(b, 1, i), &fill, 4);
        }
    const D3Head head = {2 - kx_min, 226 - kx_max, finite ? 0.f : __builtin_nanf("")};
    std::memcpy(q, &head, sizeof(head));
}

namespace scalar {  // the reference three-digit GEMV; the SIMD ones fall back to it per row
void gemv_d3(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const uint8_t* const* xq, int nt,
             float* out, int64_t ldo);
}

// Table of e8m0_half / 256 (exact): the int16 GEMV multiplies MXFP4 weights as LUT2 * 256 (the
// decoded byte in the high half of a 16-bit lane, no sign extension needed).
extern float g_e8m0_div256[256];

// Where element j of block b sits in a quantize_x_q8 row, and that block's activation scale.
inline int64_t q8x_elem(int64_t b, int j) {
    return (b / 2) * kQ8xPairBytes + (b % 2) * 16 + (j < 16 ? j : j + 16);
}
inline float q8x_scale(const float* d, int64_t b) { return d[(b / 2) * 8 + (b % 2) * 4]; }

// Enough for every ISA's pack_a: groups of 8 tokens (AVX2), 16 (AVX-512), plain rows (scalar).
inline int64_t packed_floats(int64_t M, int64_t K) { return (M + 15) / 16 * 16 * K; }

// Row-major copy: the packing of the scalar set, whose gemm reads plain rows.
inline void pack_rows(const float* const* rows, int64_t M, int64_t K, float* Ap) {
    for (int64_t m = 0; m < M; ++m) std::memcpy(Ap + m * K, rows[m], size_t(K) * sizeof(float));
}

// AVX2 kernels the AVX-512 set shares (the fp32 tile GEMM and qgemm are its own: 16 tokens per
// packed group).
namespace avx2 {
void gemv_q8(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K,
             const int8_t* const* xq, const float* const* xd, int nt, float* out, int64_t ldo);
void gemm_q8(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const int8_t* const* xq,
             const float* const* xd, int64_t M, float* C, int64_t ldc);
void quantize_q8(const float* x, int64_t K, int8_t* q, float* d);
void swiglu(const float* g, const float* u, int64_t rows, int64_t n, const float* gb, const float* ub,
            float alpha, float limit, float* out, int64_t ldo);
void quantize_q16(const float* x, int64_t K, int16_t* q, float* d);
void gemv_q16(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const int16_t* const* xq,
              const float* const* xd, int nt, float* out, int64_t ldo);
}  // namespace avx2

namespace scalar {
void attn_group(const float* q, int g, const float* K, const float* V, int64_t n, int64_t d,
                const uint8_t* vis, const float* sink, float scale, float* p, float* out);
}
namespace avx2 {  // shared by the AVX-512 set: decode attention is not where the time goes
void attn_group(const float* q, int g, const float* K, const float* V, int64_t n, int64_t d,
                const uint8_t* vis, const float* sink, float scale, float* p, float* out);
}

extern const KernelSet kScalarKernels;
extern const KernelSet kAvx2Kernels;
extern const KernelSet kAvx512Kernels;
bool avx512_has_d3();  // kAvx512Kernels.gemv_d3 may run (it also needs VBMI)

}  // namespace hm
