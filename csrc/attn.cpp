// Decode attention (one new query token against a float32 KV cache), portable reference. The
// AVX2 twin is attn_avx2.cpp; both follow the contract of KernelSet::attn_group in common.h.
#include <cmath>
#include <limits>

#include "common.h"

namespace hm {
namespace scalar {

void attn_group(const float* q, int g, const float* K, const float* V, int64_t n, int64_t d,
                const uint8_t* vis, const float* sink, float scale, float* p, float* out) {
    for (int h = 0; h < g; ++h) {
        const float* qh = q + h * d;
        float* ph = p + h * n;
        // Max over the visible scores and the sink; NaN scores are left out of the max and come
        // back through exp() below, so a NaN input always reaches the output.
        float m = sink[h];
        for (int64_t j = 0; j < n; ++j) {
            if (vis && !vis[j]) continue;
            const float* kj = K + j * d;
            float s = 0.f;
            for (int64_t i = 0; i < d; ++i) s += qh[i] * kj[i];
            ph[j] = s * scale;
            if (ph[j] > m) m = ph[j];
        }
        float denom = std::exp(sink[h] - m);
        for (int64_t j = 0; j < n; ++j) {
            if (vis && !vis[j]) continue;
            ph[j] = std::exp(ph[j] - m);
            denom += ph[j];
        }
        float* oh = out + h * d;
        for (int64_t i = 0; i < d; ++i) oh[i] = 0.f;
        for (int64_t j = 0; j < n; ++j) {
            if (vis && !vis[j]) continue;
            const float w = ph[j] / denom;
            const float* vj = V + j * d;
            for (int64_t i = 0; i < d; ++i) oh[i] += w * vj[i];
        }
    }
}

}  // namespace scalar
}  // namespace hm
