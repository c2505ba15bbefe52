// Decode attention, AVX2 + FMA: the g query heads that share a KV head walk the keys in blocks
// small enough for L1, so each key/value row is fetched from the cache once per KV head and
// reused by all g heads. Falls back to the scalar reference when d is not a multiple of 8.
#include <cmath>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

namespace hm {
namespace avx2 {
namespace {

constexpr int64_t kKeyBlock = 64;  // 64 keys x d=64 floats = 16 KB of K (or V) per block

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int64_t d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    if (i < d) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);  // d % 16 == 8
    return hsum(_mm256_add_ps(s0, s1));
}

}  // namespace

void attn_group(const float* q, int g, const float* K, const float* V, int64_t n, int64_t d,
                const uint8_t* vis, const float* sink, float scale, float* p, float* out) {
    if (d % 8) return scalar::attn_group(q, g, K, V, n, d, vis, sink, scale, p, out);
    float m[kMaxAttnGroup], denom[kMaxAttnGroup];
    for (int h = 0; h < g; ++h) m[h] = sink[h];
    for (int64_t j0 = 0; j0 < n; j0 += kKeyBlock) {
        const int64_t j1 = j0 + kKeyBlock < n ? j0 + kKeyBlock : n;
        for (int h = 0; h < g; ++h) {
            float* ph = p + h * n;
            for (int64_t j = j0; j < j1; ++j) {
                if (vis && !vis[j]) continue;
                ph[j] = dot(q + h * d, K + j * d, d) * scale;
                if (ph[j] > m[h]) m[h] = ph[j];  // NaN never wins: it returns through exp below
            }
        }
    }
    for (int h = 0; h < g; ++h) {
        float* ph = p + h * n;
        float s = std::exp(sink[h] - m[h]);
        for (int64_t j = 0; j < n; ++j) {
            if (vis && !vis[j]) continue;
            ph[j] = std::exp(ph[j] - m[h]);
            s += ph[j];
        }
        denom[h] = s;
    }
    // out_h = sum_j p_hj v_j / denom_h: key blocks outermost (a V block stays in L1 for the g
    // heads), 64 output floats (8 registers) at a time, partial sums parked in out.
    for (int64_t i = 0; i < g * d; ++i) out[i] = 0.f;
    for (int64_t j0 = 0; j0 < n; j0 += kKeyBlock) {
        const int64_t j1 = j0 + kKeyBlock < n ? j0 + kKeyBlock : n;
        for (int h = 0; h < g; ++h) {
            const float* ph = p + h * n;
            for (int64_t i0 = 0; i0 < d; i0 += 64) {
                const int nv = int((d - i0 < 64 ? d - i0 : 64) / 8);
                float* oh = out + h * d + i0;
                __m256 acc[8];
                for (int r = 0; r < nv; ++r) acc[r] = _mm256_loadu_ps(oh + 8 * r);
                for (int64_t j = j0; j < j1; ++j) {
                    if (vis && !vis[j]) continue;
                    const __m256 w = _mm256_set1_ps(ph[j]);
                    const float* vj = V + j * d + i0;
                    for (int r = 0; r < nv; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8 * r), acc[r]);
                }
                for (int r = 0; r < nv; ++r) _mm256_storeu_ps(oh + 8 * r, acc[r]);
            }
        }
    }
    for (int h = 0; h < g; ++h) {
        const __m256 inv = _mm256_set1_ps(1.f / denom[h]);
        for (int64_t i = 0; i < d; i += 8)
            _mm256_storeu_ps(out + h * d + i, _mm256_mul_ps(_mm256_loadu_ps(out + h * d + i), inv));
    }
}

}  // namespace avx2
}  // namespace hm
#pragma GCC pop_options
