// Portable scalar kernels: the C++ reference every SIMD variant is tested against.
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

}  // namespace

const KernelSet kScalarKernels = {"scalar", prep_x, gemv, decode, pack_rows, gemm};

}  // namespace hm
