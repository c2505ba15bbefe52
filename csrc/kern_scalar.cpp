// Portable scalar kernels: the C++ reference every SIMD variant is tested against.
#include <cmath>

#include "common.h"

namespace hm {
namespace {

void decode_block(int fmt, const uint8_t* blk, float* out) {
    if (fmt == kMXFP4) {
        const float d = g_e8m0_table[blk[0]];
        for (int j = 0; j < 16; ++j) {
            out[j] = float(kMxfp4Lut2[blk[1 + j] & 0x0f]) * d;        // element j: low nibble
            out[j + 16] = float(kMxfp4Lut2[blk[1 + j] >> 4]) * d;     // element j+16: high nibble
        }
    } else {
        uint16_t h;
        std::memcpy(&h, blk, 2);
        const float d = fp16_to_fp32(h);
        for (int j = 0; j < 32; ++j) out[j] = float(int8_t(blk[2 + j])) * d;
    }
}

int block_bytes(int fmt) { return fmt == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes; }

void prep_x(int, const float* x, float* xp, int64_t K) { std::memcpy(xp, x, K * sizeof(float)); }

void gemv(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K,
          const float* const* xs, int nt, float* out, int64_t ldo) {
    const int64_t nb = K / kBlockElems, bb = block_bytes(fmt);
    float wf[kBlockElems];
    for (int64_t r = 0; r < n_rows; ++r) {
        const uint8_t* row = w + r * row_bytes;
        float acc[kMaxGemvTokens] = {};
        for (int64_t b = 0; b < nb; ++b) {
            decode_block(fmt, row + b * bb, wf);
            for (int t = 0; t < nt; ++t) {
                const float* xb = xs[t] + b * kBlockElems;
                float s = 0.f;
                for (int j = 0; j < kBlockElems; ++j) s += wf[j] * xb[j];
                acc[t] += s;
            }
        }
        for (int t = 0; t < nt; ++t) out[t * ldo + r] = acc[t];
    }
}

void decode(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* tile) {
    const int64_t nb = K / kBlockElems, bb = block_bytes(fmt);
    for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t b = 0; b < nb; ++b)
            decode_block(fmt, w + r * row_bytes + b * bb, tile + r * K + b * kBlockElems);
}

void gemm_rows(const float* A, int64_t lda, int64_t M, const float* B, int64_t ldb, int64_t N,
               int64_t K, float* C, int64_t ldc) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            float s = 0.f;
            for (int64_t k = 0; k < K; ++k) s += A[m * lda + k] * B[n * ldb + k];
            C[m * ldc + n] = s;
        }
}

void gemm(const float* Ap, int64_t M, const float* B, int64_t N, int64_t K, float* C, int64_t ldc) {
    gemm_rows(Ap, K, M, B, K, N, K, C, ldc);
}

// ---- fast mode: int8 activations (the reference twin of avx2's gemv_q8; same integer math and
// the same float operations in the same order, so the two agree bit for bit).
// Signed integer weights of one block in natural order, and the block's weight scale.
void load_w_int(int fmt, const uint8_t* blk, int8_t* wv, float& dw) {
    if (fmt == kMXFP4) {
        for (int j = 0; j < 16; ++j) {
            wv[j] = kMxfp4Lut2[blk[1 + j] & 0x0f];
            wv[j + 16] = kMxfp4Lut2[blk[1 + j] >> 4];
        }
        dw = g_e8m0_table[blk[0]];
    } else {
        uint16_t h;
        std::memcpy(&h, blk, 2);
        dw = fp16_to_fp32(h);
        for (int j = 0; j < 32; ++j) wv[j] = int8_t(blk[2 + j]);
    }
}

// The AVX2 hsum: (lanes i + i+4), then (0+2) + (1+3).
inline float hsum8(const float* a) {
    const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    return (s0 + s2) + (s1 + s3);
}

void gemv_q8(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K,
             const int8_t* const* xq, const float* const* xd, int nt, float* out, int64_t ldo) {
    const int64_t nb = K / kBlockElems, bb = block_bytes(fmt), np = q8x_pairs(K);
    int8_t wv[2][32];
    float dw[2];
    for (int64_t r = 0; r < n_rows; ++r) {
        const uint8_t* row = w + r * row_bytes;
        for (int t = 0; t < nt; ++t) {
            float acc[8] = {};
            for (int64_t p = 0; p < np; ++p) {
                for (int h = 0; h < 2; ++h) {
                    if (2 * p + h < nb) load_w_int(fmt, row + (2 * p + h) * bb, wv[h], dw[h]);
                    else {
                        std::memset(wv[h], 0, 32);
                        dw[h] = 0.f;
                    }
                }
                const int8_t* xp = xq[t] + p * kQ8xPairBytes;
                const float* dp = xd[t] + p * 8;
                for (int h = 0; h < 2; ++h)
                    for (int l = 0; l < 4; ++l) {
                        int32_t c = 0;
                        for (int j = 4 * l; j < 4 * l + 4; ++j)
                            c += int32_t(wv[h][j]) * xp[16 * h + j] + int32_t(wv[h][j + 16]) * xp[32 + 16 * h + j];
                        const float sc = dw[h] * dp[4 * h + l];
                        acc[4 * h + l] = std::fma(float(c), sc, acc[4 * h + l]);
                    }
            }
            out[t * ldo + r] = hsum8(acc);
        }
    }
}

void qgemm(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* Ap, int64_t M,
           float* C, int64_t ldc) {
    const int64_t nb = K / kBlockElems, bb = block_bytes(fmt);
    float wf[kBlockElems];
    for (int64_t r = 0; r < N; ++r)
        for (int64_t m = 0; m < M; ++m) {
            float s = 0.f;
            for (int64_t b = 0; b < nb; ++b) {
                decode_block(fmt, w + r * row_bytes + b * bb, wf);
                for (int j = 0; j < kBlockElems; ++j) s += wf[j] * Ap[m * K + b * kBlockElems + j];
            }
            C[m * ldc + r] = s;
        }
}

void gemm_q8(int fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const int8_t* const* xq,
             const float* const* xd, int64_t M, float* C, int64_t ldc) {
    const int64_t nb = K / kBlockElems;
    const int64_t bb = fmt == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes;
    int8_t wv[kBlockElems];
    for (int64_t r = 0; r < N; ++r)
        for (int64_t m = 0; m < M; ++m) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; ++b) {
                float dw;
                load_w_int(fmt, w + r * row_bytes + b * bb, wv, dw);
                int32_t c = 0;
                for (int j = 0; j < kBlockElems; ++j) c += int32_t(wv[j]) * xq[m][q8x_elem(b, j)];
                const float sc = dw * q8x_scale(xd[m], b);
                acc = std::fma(float(c), sc, acc);
            }
            C[m * ldc + r] = acc;
        }
}

// ---- default path: int16 activations. The exact integer dot per block, times d_w * d_x.
void gemv_q16(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K,
              const int16_t* const* xq, const float* const* xd, int nt, float* out, int64_t ldo) {
    const int64_t nb = K / kBlockElems, bb = block_bytes(fmt);
    int8_t wv[kBlockElems];
    for (int64_t r = 0; r < n_rows; ++r)
        for (int t = 0; t < nt; ++t) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; ++b) {
                float dw;
                load_w_int(fmt, w + r * row_bytes + b * bb, wv, dw);
                int32_t hi = 0, lo = 0;
                for (int j = 0; j < kBlockElems; ++j) {
                    hi += int32_t(wv[j]) * xq[t][q16x_elem(b, j)];
                    lo += int32_t(wv[j]) * xq[t][q16x_elem(b, j) + 64];
                }
                acc += std::fma(float(lo), kQ16Lo, float(hi)) * (dw * q16x_scale(xd[t], b));
            }
            out[t * ldo + r] = acc;
        }
}

}  // namespace

// ---- three-digit activations: the reference GEMV (common.h defines the layout and the sums).
namespace scalar {
void gemv_d3(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const uint8_t* const* xq, int nt,
             float* out, int64_t ldo) {
    const int64_t nb = K / kBlockElems, nq = d3x_quads(K);
    uint8_t wu[4][kBlockElems];  // LUT2 + 12 of the quad's blocks; a missing block: code 0, e = 128
    int e[4];
    for (int64_t r = 0; r < n_rows; ++r) {
        const uint8_t* row = w + r * row_bytes;
        for (int t = 0; t < nt; ++t) {
            const uint8_t* X = xq[t];
            float acc[2][16] = {};
            for (int64_t qd = 0; qd < nq; ++qd) {
                for (int k = 0; k < 4; ++k) {
                    const int64_t b = 4 * qd + k;
                    const uint8_t* blk = row + b * kMxfp4Bytes;
                    e[k] = b < nb ? blk[0] : 128;
                    for (int j = 0; j < 16; ++j) {
                        wu[k][j] = uint8_t(12 + (b < nb ? kMxfp4Lut2[blk[1 + j] & 0x0f] : 0));
                        wu[k][j + 16] = uint8_t(12 + (b < nb ? kMxfp4Lut2[blk[1 + j] >> 4] : 0));
                    }
                }
                for (int lane = 0; lane < 16; ++lane) {
                    const int k = lane / 4, i = lane % 4;
                    const int64_t b = 4 * qd + k;
                    int32_t f = -d3x_lane(X, qd, 0, lane);
                    for (int half = 0; half < 2; ++half) {  // elements 4i.. and 16+4i..: one vpdpbusd lane each
                        int32_t a = 0;
                        for (int d = 0; d < 3; ++d) {
                            int32_t dot = 0;
                            for (int j = 4 * i + 16 * half; j < 4 * i + 16 * half + 4; ++j)
                                dot += int32_t(wu[k][j]) * int8_t(X[d3x_elem(b, j) + 64 * d]);
                            a = a * 256 + dot;
                        }
                        f += a;
                    }
                    const int n = e[k] - 128 + d3x_lane(X, qd, 1, lane) + 1;
                    acc[qd % 2][lane] += std::ldexp(float(f), n);
                }
            }
            float s[16];
            for (int l = 0; l < 16; ++l) s[l] = acc[0][l] + acc[1][l];
            for (int l = 0; l < 8; ++l) s[l] += s[l + 8];
            for (int l = 0; l < 4; ++l) s[l] += s[l + 4];
            out[t * ldo + r] = ((s[0] + s[2]) + (s[1] + s[3])) + d3x_head(X).poison;
        }
    }
}
}  // namespace scalar

const KernelSet kScalarKernels = {"scalar", prep_x, gemv, decode, pack_rows, gemm, gemv_q8,
                                  scalar::attn_group, qgemm, gemm_q8, quantize_x_q8, swiglu_ref,
                                  quantize_x_q16, gemv_q16, quantize_x_d3, scalar::gemv_d3, 16};

}  // namespace hm
