// C ABI of the kernel library (loaded with ctypes by hybridmoe/kernels/_lib.py): ISA dispatch,
// thread pool, dense quantized linear, fused gpt-oss MoE layer. Return 0 on success, <0 on error.
#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "ext_formats.h"
#include "threadpool.h"

#define HM_API extern "C" __attribute__((visibility("default")))

namespace hm {

float g_e8m0_table[256];
float g_e8m0_div256[256];

namespace {

constexpr int64_t kChunkRows = 24;  // rows per work unit (multiple of the GEMM's 6); 24 x 2880 fp32 = 276 KB tile
// Rows per work unit on the GEMV path (no tile): each unit is a fresh stream for the hardware
// prefetcher, so longer ones read faster (Zen 4, 2 threads: head +10%, MoE T=1 +4% over 24 rows).
constexpr int64_t kGemvUnitRows = 96;
// Rows per work unit of the int8 tile GEMM (fast mode, many tokens): whole 16-row panels, four
// per call of the VNNI kernel (24-row units left it a half-empty second panel).
constexpr int64_t kQ8TileRows = 64;
constexpr int kErrBadArg = -1, kErrBadExpert = -2, kErrBadIsa = -3;

std::mutex g_call_mu;  // one op at a time owns the pool and the scratch buffers
std::unique_ptr<ThreadPool> g_pool;
const KernelSet* g_ks = nullptr;
// Tokens per expert (or dense call) up to which the fp32 GEMV beats tile + GEMM, per weight format
// (bench/kernels.py --gemv-max-tokens moves both). MXFP4: the kernel set's own (KernelSet), unless
// set (-1: not set). Q8_0, Zen 4, 2 threads, 2880-wide rows, tile time / GEMV time: 1.1 at 14
// tokens, 0.94-1.04 at 16, ~0.9-1.0 beyond.
constexpr int kQ8GemvMaxTokens = 16;
std::atomic<int> g_gemv_max_tokens_mxfp4{-1};
std::atomic<int> g_gemv_max_tokens_q8_0{kQ8GemvMaxTokens};
// Activation arithmetic, chosen per call (each model instance carries its own):
//   kActF32:  fp32 activations (exact to fp32 rounding; the default);
//   kActI16:  the GEMV path (few tokens per expert / dense call) multiplies two-term int16
//             activations (quantize_x_q16: fp32-like error, integer products); the tile path
//             stays fp32. Opt-in until it is faster than the fp32 GEMV (docs/DESIGN.md);
//   kActI8:   fast math: int8 activations on the GEMV and the tile path (~1e-2 relative error);
//   kActI8x3: the MXFP4 GEMV path multiplies three-digit int8 activations (quantize_x_d3: ~2^-22 of
//             the block max, fp32-like; vpdpbusd) where the ISA has that GEMV (AVX-512 VNNI + VBMI);
//             Q8_0, the tile path and other ISAs stay fp32.
constexpr int kActF32 = 0, kActI16 = 1, kActI8 = 2, kActI8x3 = 3;
bool act_ok(int act) { return act == kActF32 || act == kActI16 || act == kActI8 || act == kActI8x3; }

// Fast mode's crossover: the int8 tile GEMM overtakes the int8 GEMV much sooner. Zen 4, 2880 x
// 2880 MXFP4, 1 and 2 threads, GEMM time / GEMV time: VNNI 1.0-1.1 at 2 tokens, 0.8 at 4,
// 0.45-0.6 from 6; the AVX2 kernels 1.2 at 2, 0.9 at 4, 0.6-0.75 from 6.
constexpr int kFastGemvMaxTokens = 2;
std::atomic<int> g_q8_gemv_max_tokens{kFastGemvMaxTokens};

// Ext formats: the fused GEMV serves one pass of tokens; past it the tile GEMM reuses each decoded
// row for every token.
constexpr int kExtGemvMaxTokens = kMaxGemvTokens;

// Tokens per expert (or dense call) that still take the GEMV path in this activation mode.
int64_t gemv_max_tokens(int act, int fmt) {
    if (ext_format(fmt)) return kExtGemvMaxTokens;
    if (act == kActI8) return g_q8_gemv_max_tokens.load();
    if (fmt == kQ8_0) return g_gemv_max_tokens_q8_0.load();
    const int n = g_gemv_max_tokens_mxfp4.load();
    return n >= 0 ? n : g_ks->mxfp4_gemv_max_tokens;
}

// The three-digit GEMV runs for MXFP4 weights on a set that has one.
bool d3_gemv_for(const KernelSet* ks, int fmt) {
    return fmt == kMXFP4 && ks->gemv_d3 && (ks != &kAvx512Kernels || avx512_has_d3());
}

bool cpu_has_f16c() {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

bool isa_supported(const std::string& name) {
    __builtin_cpu_init();
    if (name == "scalar") return true;
    if (name == "avx2")
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    if (name == "avx512")
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && isa_supported("avx2");
    return false;
}

const KernelSet* kernels_for(const std::string& name) {
    if (name == "avx512") return &kAvx512Kernels;
    if (name == "avx2") return &kAvx2Kernels;
    if (name == "scalar") return &kScalarKernels;
    return nullptr;
}

struct Init {
    Init() {
        for (int e = 0; e < 256; ++e) {
            g_e8m0_table[e] = e8m0_half(uint8_t(e));
            g_e8m0_div256[e] = g_e8m0_table[e] / 256.f;  // a power of two >= 2^-136: exact
        }
        g_ks = isa_supported("avx512") ? &kAvx512Kernels
               : isa_supported("avx2") ? &kAvx2Kernels
                                       : &kScalarKernels;
        g_pool = std::make_unique<ThreadPool>(1);
    }
} g_init;

// MXFP4 and Q8_0 have kernels of their own in every mode; the other ggml block types (the ext
// formats) are decoded to float32 rows and multiplied in fp32, whatever the activation mode.
bool native_fmt(int fmt) { return fmt == kMXFP4 || fmt == kQ8_0; }
bool fmt_ok(int fmt) { return native_fmt(fmt) || ext_format(fmt); }
int64_t block_elems_of(int fmt) { return ext_format(fmt) ? ext_block_elems(fmt) : kBlockElems; }
bool k_ok(int fmt, int64_t K) { return K > 0 && K % block_elems_of(fmt) == 0; }

int64_t row_bytes_of(int fmt, int64_t K) {
    if (ext_format(fmt)) return K / ext_block_elems(fmt) * ext_block_bytes(fmt);
    return K / kBlockElems * (fmt == kMXFP4 ? kMxfp4Bytes : kQ8_0Bytes);
}

// Ext formats compute in fp32 in every mode (no int8/int16 kernels of their own).
int effective_act(int act, int fmt) { return ext_format(fmt) ? kActF32 : act; }

// The ext decoders and fused GEMV of a kernel set.
struct ExtKernels {
    void (*decode)(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, float* out);
    void (*gemv)(int fmt, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t K, const float* const* xs,
                 int nt, float* out, int64_t ldo);
};
const ExtKernels kExtScalar = {scalar::decode_ext, scalar::gemv_ext};
const ExtKernels kExtAvx2 = {avx2::decode_ext, avx2::gemv_ext};
const ExtKernels kExtAvx512 = {avx512::decode_ext, avx512::gemv_ext};
const ExtKernels& ext_kernels(const KernelSet* ks) {
    return ks == &kAvx512Kernels ? kExtAvx512 : ks == &kAvx2Kernels ? kExtAvx2 : kExtScalar;
}

// GEMV-path unit rows for a matrix of n_rows: the long units once it has 8 of them (small
// matrices keep enough units to share out). A function of n_rows alone, and even, so a matrix is
// cut the same way in any call and at any thread count (the GEMVs pair rows 2k, 2k+1: same bits).
int64_t gemv_unit_rows(int64_t n_rows) { return n_rows >= 8 * kGemvUnitRows ? kGemvUnitRows : kChunkRows; }

// Cache-line aligned storage for the scratch buffers: activation rows (K * 4 bytes apart, a
// multiple of 64 for every gpt-oss shape) then never split a 32-byte load across two lines.
template <class T>
struct LineAligned {
    using value_type = T;
    LineAligned() = default;
    template <class U>
    LineAligned(const LineAligned<U>&) {}
    T* allocate(size_t n) {
        void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
        if (!p) throw std::bad_alloc();
        return static_cast<T*>(p);
    }
    void deallocate(T* p, size_t) { std::free(p); }
    template <class U>
    bool operator==(const LineAligned<U>&) const { return true; }
};
template <class T>
using Scratch = std::vector<T, LineAligned<T>>;

// Scratch reused across calls (guarded by g_call_mu) and per thread (tiles, partial outputs).
Scratch<float> g_xp, g_xg, g_act, g_actp, g_ys, g_xd, g_ad;
Scratch<int8_t> g_xq, g_aq;  // fast mode: quantized activations (tokens, then act rows)
Scratch<int16_t> g_x16, g_a16;  // default GEMV path: int16 activations (tokens, then act rows)
Scratch<float> g_xd16, g_ad16;
Scratch<uint8_t> g_x3, g_a3;  // three-digit activations (tokens, then act rows)
thread_local Scratch<float> t_tile, t_buf0, t_buf1;

template <class T, class A>
T* grow(std::vector<T, A>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

struct QuantCtx {
    const float* const* x;
    int64_t M, K;
    int8_t* q;
    float* d;
    std::atomic<int64_t> next{0};
};

// Default GEMV path: M rows -> int16 (quantize_x_q16 layout), xq[m] / xd[m] pointing at them.
// Serial: at most a few tokens per call take this path.
void quantize_rows16(const float* const* x, int64_t M, int64_t K, int16_t* q, float* d,
                     const int16_t** xq, const float** xd) {
    for (int64_t m = 0; m < M; ++m) {
        xq[m] = q + m * q16x_elems(K);
        xd[m] = d + m * q16x_scales(K);
        g_ks->quantize_q16(x[m], K, q + m * q16x_elems(K), d + m * q16x_scales(K));
    }
}

// Three-digit GEMV path: M rows -> quantize_x_d3 rows in q, xq[m] pointing at them (serial: few tokens).
void quantize_rows_d3(const float* const* x, int64_t M, int64_t K, uint8_t* q, const uint8_t** xq) {
    for (int64_t m = 0; m < M; ++m) {
        xq[m] = q + m * d3x_bytes(K);
        g_ks->quantize_d3(x[m], K, q + m * d3x_bytes(K));
    }
}

void quantize_job(void* p, int) {
    auto& c = *static_cast<QuantCtx*>(p);
    for (int64_t m; (m = c.next.fetch_add(1, std::memory_order_relaxed)) < c.M;)
        g_ks->quantize_q8(c.x[m], c.K, c.q + m * q8x_bytes(c.K), c.d + m * q8x_scales(c.K));
}

// Quantizes the M rows x[m] (K floats each) into q/d and points xq[m]/xd[m] at them (fast mode).
// Many rows (a prompt) go over the pool: serial, they took ~15% of an int8 GEMM call.
void quantize_rows(const float* const* x, int64_t M, int64_t K, int8_t* q, float* d,
                   const int8_t** xq, const float** xd) {
    QuantCtx c;
    c.x = x; c.M = M; c.K = K; c.q = q; c.d = d;
    if (M >= 8) g_pool->run(quantize_job, &c);
    else quantize_job(&c, 0);
    for (int64_t m = 0; m < M; ++m) {
        xq[m] = q + m * q8x_bytes(K);
        xd[m] = d + m * q8x_scales(K);
    }
}

// out[a*n_rows + r] = W[r] . A[a] for a < M: fused GEMV (A = M rows prepped by prep_x) or
// tile + GEMM (A packed by pack_a); with xq non-null (fast mode), the int8 GEMV on xq[a]/xd[a],
// or on the tile path the int8 GEMM.
// Ext formats: out[a*n_rows + r] = W[r] . A[a]: the tile path decodes the unit to float32 and runs
// the fp32 GEMM on A packed by pack_a; the GEMV path runs the fused GEMV (weights decoded in
// registers) on the M natural-order rows of A, kMaxGemvTokens per pass.
void ext_rows_times(const KernelSet* ks, int fmt, bool tile_path, const uint8_t* w, int64_t row_bytes,
                    int64_t n_rows, int64_t K, const float* A, int64_t M, float* out) {
    const ExtKernels& ex = ext_kernels(ks);
    if (tile_path) {
        float* tile = grow(t_tile, size_t(n_rows * K));
        ex.decode(fmt, w, row_bytes, n_rows, K, tile);
        ks->gemm(A, M, tile, n_rows, K, out, n_rows);
        return;
    }
    for (int64_t a0 = 0; a0 < M; a0 += kMaxGemvTokens) {
        const int nt = int(std::min<int64_t>(kMaxGemvTokens, M - a0));
        const float* xs[kMaxGemvTokens];
        for (int t = 0; t < nt; ++t) xs[t] = A + (a0 + t) * K;
        ex.gemv(fmt, w, row_bytes, n_rows, K, xs, nt, out + a0 * n_rows, n_rows);
    }
}

// One activation row in the order ks's fused GEMV wants for fmt (ext formats: natural order).
void prep_row(const KernelSet* ks, int fmt, const float* x, float* xp, int64_t K) {
    if (ext_format(fmt)) std::memcpy(xp, x, size_t(K) * sizeof(float));
    else ks->prep_x(fmt, x, xp, K);
}

void rows_times(const KernelSet* ks, int fmt, bool tile_path, const uint8_t* w, int64_t row_bytes,
                int64_t n_rows, int64_t K, const float* A, int64_t M, float* out,
                const int8_t* const* xq = nullptr, const float* const* xd = nullptr,
                const int16_t* const* x16 = nullptr, const float* const* d16 = nullptr,
                const uint8_t* const* x3 = nullptr) {
    if (ext_format(fmt)) {
        ext_rows_times(ks, fmt, tile_path, w, row_bytes, n_rows, K, A, M, out);
        return;
    }
    // Even passes (12 tokens: 6 + 6, not 8 + 4): a 1..3-token pass runs at half the FLOP rate.
    const int64_t passes = (M + kMaxGemvTokens - 1) / kMaxGemvTokens, per_pass = (M + passes - 1) / passes;
    if (xq && tile_path) {
        ks->gemm_q8(fmt, w, row_bytes, n_rows, K, xq, xd, M, out, n_rows);
        return;
    }
    if (xq && !tile_path) {
        for (int64_t a0 = 0; a0 < M; a0 += per_pass) {
            const int nt = int(std::min<int64_t>(per_pass, M - a0));
            ks->gemv_q8(fmt, w, row_bytes, n_rows, K, xq + a0, xd + a0, nt, out + a0 * n_rows, n_rows);
        }
        return;
    }
    if (x3 && !tile_path) {
        for (int64_t a0 = 0; a0 < M; a0 += per_pass) {
            const int nt = int(std::min<int64_t>(per_pass, M - a0));
            ks->gemv_d3(w, row_bytes, n_rows, K, x3 + a0, nt, out + a0 * n_rows, n_rows);
        }
        return;
    }
    if (x16 && !tile_path) {
        for (int64_t a0 = 0; a0 < M; a0 += per_pass) {
            const int nt = int(std::min<int64_t>(per_pass, M - a0));
            ks->gemv_q16(fmt, w, row_bytes, n_rows, K, x16 + a0, d16 + a0, nt, out + a0 * n_rows, n_rows);
        }
        return;
    }
    if (tile_path && M <= kQgemmMaxTokens) {
        ks->qgemm(fmt, w, row_bytes, n_rows, K, A, M, out, n_rows);
        return;
    }
    if (tile_path) {
        float* tile = grow(t_tile, size_t(n_rows * K));
        ks->decode(fmt, w, row_bytes, n_rows, K, tile);
        ks->gemm(A, M, tile, n_rows, K, out, n_rows);
        return;
    }
    for (int64_t a0 = 0; a0 < M; a0 += per_pass) {
        const int nt = int(std::min<int64_t>(per_pass, M - a0));
        const float* xs[kMaxGemvTokens];
        for (int t = 0; t < nt; ++t) xs[t] = A + (a0 + t) * K;
        ks->gemv(fmt, w, row_bytes, n_rows, K, xs, nt, out + a0 * n_rows, n_rows);
    }
}

// ---------------------------------------------------------------- dense linear
constexpr int kMaxLinearMats = 8;  // matrices sharing one input in one call (q, k, v)

struct LinearMat {
    const uint8_t* w;
    int64_t N, row_stride, unit_rows;
    const float* bias;
    float* out;  // out[t*ldo + r]
    int64_t ldo, unit0;  // first work unit of this matrix
};

struct LinearCtx {
    const KernelSet* ks;
    int fmt;
    bool tile_path;
    const float* x;  // [T, K] prepped for the GEMV path, or packed for the tile path
    std::vector<const int8_t*> xq;  // fast mode GEMV: quantized rows (else empty)
    std::vector<const float*> xd;
    std::vector<const int16_t*> x16;  // default GEMV path: int16 rows (else empty)
    std::vector<const float*> d16;
    std::vector<const uint8_t*> x3;  // three-digit GEMV path: quantized rows (else empty)
    int64_t T, K;
    LinearMat mats[kMaxLinearMats];
    int n_mats;
    int64_t num_units;
    std::atomic<int64_t> next{0};
};

void linear_job(void* p, int) {
    auto& c = *static_cast<LinearCtx*>(p);
    for (int64_t u; (u = c.next.fetch_add(1, std::memory_order_relaxed)) < c.num_units;) {
        int m = 0;
        while (m + 1 < c.n_mats && u >= c.mats[m + 1].unit0) ++m;
        const LinearMat& a = c.mats[m];
        const int64_t r0 = (u - a.unit0) * a.unit_rows, nr = std::min(a.unit_rows, a.N - r0);
        float* buf = grow(t_buf0, size_t(c.T * nr));
        rows_times(c.ks, c.fmt, c.tile_path, a.w + r0 * a.row_stride, a.row_stride, nr, c.K, c.x, c.T, buf,
                   c.xq.empty() ? nullptr : c.xq.data(), c.xd.empty() ? nullptr : c.xd.data(),
                   c.x16.empty() ? nullptr : c.x16.data(), c.d16.empty() ? nullptr : c.d16.data(),
                   c.x3.empty() ? nullptr : c.x3.data());
        for (int64_t t = 0; t < c.T; ++t)
            for (int64_t r = 0; r < nr; ++r)
                a.out[t * a.ldo + r0 + r] = buf[t * nr + r] + (a.bias ? a.bias[r0 + r] : 0.f);
    }
}

// ---------------------------------------------------------------- fused MoE
struct Slot {
    int32_t expert;
    int64_t first, count;  // assignments [first, first + count) in expert-sorted order
    bool tile_path;
    int64_t xg_off, actp_off;  // float offsets of this slot's prepped/packed inputs
};

struct MoeCtx {
    const KernelSet* ks;
    int fmt, down_fmt;  // gate/up's and down's formats
    int64_t H, I;
    const uint8_t *gate, *up, *down;
    int64_t gate_es, up_es, down_es;  // byte strides between experts
    const float *gb, *ub, *db;
    float alpha, limit;
    std::vector<Slot> slots;
    std::vector<int32_t> asg_token;
    std::vector<float> asg_weight;
    std::vector<int64_t> asg_pos;  // [T*k]: sorted position of routing entry (t, j)
    bool fast = false;  // int8 activations for every slot (GEMV and tile)
    bool act16 = false;  // int16 activations for the GEMV slots (the tile slots stay fp32)
    bool d3 = false;  // three-digit activations for the GEMV slots (the tile slots stay fp32)
    std::vector<const uint8_t*> asg_x3, asg_a3;  // d3: per sorted assignment (GEMV slots only)
    std::vector<const int16_t*> asg_x16, asg_a16;  // act16: per sorted assignment (GEMV slots only)
    std::vector<const float*> asg_xd16, asg_ad16;
    std::vector<const int8_t*> asg_xq, asg_aq;  // fast: per sorted assignment, its token's / act's row
    std::vector<const float*> asg_xd, asg_ad;
    float *xg, *act, *actp, *ys, *out;
    int64_t T, k, chunk_rows, chunks_i, chunks_h;
    std::atomic<int64_t> next{0};
};

void moe_gate_up_job(void* p, int) {
    auto& c = *static_cast<MoeCtx*>(p);
    const int64_t rb = row_bytes_of(c.fmt, c.H), n_units = int64_t(c.slots.size()) * c.chunks_i;
    for (int64_t u; (u = c.next.fetch_add(1, std::memory_order_relaxed)) < n_units;) {
        const Slot& s = c.slots[size_t(u / c.chunks_i)];
        const int64_t r0 = (u % c.chunks_i) * c.chunk_rows, nr = std::min(c.chunk_rows, c.I - r0);
        float* g = grow(t_buf0, size_t(s.count * nr));
        float* v = grow(t_buf1, size_t(s.count * nr));
        const float* A = c.xg + s.xg_off;
        const int8_t* const* xq = c.fast ? c.asg_xq.data() + s.first : nullptr;
        const float* const* xd = c.fast ? c.asg_xd.data() + s.first : nullptr;
        const bool q16 = c.act16 && !s.tile_path;
        const int16_t* const* x16 = q16 ? c.asg_x16.data() + s.first : nullptr;
        const float* const* d16 = q16 ? c.asg_xd16.data() + s.first : nullptr;
        const uint8_t* const* x3 = c.d3 && !s.tile_path ? c.asg_x3.data() + s.first : nullptr;
        rows_times(c.ks, c.fmt, s.tile_path, c.gate + s.expert * c.gate_es + r0 * rb, rb, nr, c.H, A, s.count, g,
                   xq, xd, x16, d16, x3);
        rows_times(c.ks, c.fmt, s.tile_path, c.up + s.expert * c.up_es + r0 * rb, rb, nr, c.H, A, s.count, v,
                   xq, xd, x16, d16, x3);
        const float* gb = c.gb ? c.gb + s.expert * c.I + r0 : nullptr;
        const float* ub = c.ub ? c.ub + s.expert * c.I + r0 : nullptr;
        c.ks->swiglu(g, v, s.count, nr, gb, ub, c.alpha, c.limit, c.act + s.first * c.I + r0, c.I);
    }
}

// Down projection per (expert, row chunk): each expert's rows are read once and multiplied by
// all of its tokens; y (+ down bias) goes to the assignment's own row of ys, so no races.
void moe_down_job(void* p, int) {
    auto& c = *static_cast<MoeCtx*>(p);
    const int64_t rb = row_bytes_of(c.down_fmt, c.I), n_units = int64_t(c.slots.size()) * c.chunks_h;
    for (int64_t u; (u = c.next.fetch_add(1, std::memory_order_relaxed)) < n_units;) {
        const Slot& s = c.slots[size_t(u / c.chunks_h)];
        const int64_t r0 = (u % c.chunks_h) * c.chunk_rows, nr = std::min(c.chunk_rows, c.H - r0);
        float* y = grow(t_buf0, size_t(s.count * nr));
        const bool q16 = c.act16 && !s.tile_path;
        rows_times(c.ks, c.down_fmt, s.tile_path, c.down + s.expert * c.down_es + r0 * rb, rb, nr, c.I,
                   c.actp + s.actp_off, s.count, y, c.fast ? c.asg_aq.data() + s.first : nullptr,
                   c.fast ? c.asg_ad.data() + s.first : nullptr, q16 ? c.asg_a16.data() + s.first : nullptr,
                   q16 ? c.asg_ad16.data() + s.first : nullptr,
                   c.d3 && !s.tile_path ? c.asg_a3.data() + s.first : nullptr);
        const float* db = c.db ? c.db + s.expert * c.H + r0 : nullptr;
        for (int64_t a = 0; a < s.count; ++a) {
            float* dst = c.ys + (s.first + a) * c.H + r0;
            for (int64_t r = 0; r < nr; ++r) dst[r] = y[a * nr + r] + (db ? db[r] : 0.f);
        }
    }
}

// out[t] = sum_j w[t, j] * ys[pos(t, j)], j in routing order: deterministic for any thread count.
void moe_combine_job(void* p, int) {
    auto& c = *static_cast<MoeCtx*>(p);
    const int64_t cols = 720, per_token = (c.H + cols - 1) / cols, n_units = c.T * per_token;
    for (int64_t u; (u = c.next.fetch_add(1, std::memory_order_relaxed)) < n_units;) {
        const int64_t t = u / per_token, c0 = (u % per_token) * cols, nc = std::min(cols, c.H - c0);
        float* o = c.out + t * c.H + c0;
        std::fill_n(o, nc, 0.f);
        for (int64_t j = 0; j < c.k; ++j) {
            const int64_t a = c.asg_pos[size_t(t * c.k + j)];
            const float w = c.asg_weight[size_t(a)];
            const float* y = c.ys + a * c.H + c0;
            for (int64_t r = 0; r < nc; ++r) o[r] += w * y[r];
        }
    }
}

}  // namespace
}  // namespace hm

using namespace hm;

HM_API int hm_abi_version() { return 11; }

HM_API int hm_isa_supported(const char* name) { return isa_supported(name) ? 1 : 0; }

HM_API int hm_set_isa(const char* name) {
    const KernelSet* ks = kernels_for(name);
    if (!ks) return kErrBadArg;
    if (!isa_supported(name)) return kErrBadIsa;
    std::lock_guard<std::mutex> lock(g_call_mu);
    g_ks = ks;
    return 0;
}

HM_API const char* hm_get_isa() { return g_ks->name; }

HM_API int hm_set_num_threads(int n) {
    if (n < 1 || n > 1024) return kErrBadArg;
    std::lock_guard<std::mutex> lock(g_call_mu);
    if (g_pool->size() != n) {
        g_pool.reset();
        g_pool = std::make_unique<ThreadPool>(n);
    }
    return 0;
}

HM_API int hm_get_num_threads() { return g_pool->size(); }

// The fp32 crossover of one weight format (fmt), or of both (fmt = 0); n = -1 restores the default.
HM_API int hm_set_gemv_max_tokens(int fmt, int n) {
    if (n < -1 || (fmt != 0 && !native_fmt(fmt))) return kErrBadArg;
    if (fmt == 0 || fmt == kMXFP4) g_gemv_max_tokens_mxfp4 = n;
    if (fmt == 0 || fmt == kQ8_0) g_gemv_max_tokens_q8_0 = n < 0 ? kQ8GemvMaxTokens : n;
    return 0;
}

HM_API int hm_get_gemv_max_tokens(int fmt) { return native_fmt(fmt) ? int(gemv_max_tokens(kActF32, fmt)) : kErrBadArg; }

HM_API int hm_set_q8_gemv_max_tokens(int n) {  // n = -1 restores the default
    if (n < -1) return kErrBadArg;
    g_q8_gemv_max_tokens = n < 0 ? kFastGemvMaxTokens : n;
    return 0;
}

HM_API int hm_get_q8_gemv_max_tokens() { return g_q8_gemv_max_tokens; }

// dst[r*K + k] = W[r][k] (float32) through the current ISA's decoder; rows are row_stride apart.
HM_API int hm_dequant(int fmt, const uint8_t* w, int64_t n_rows, int64_t row_stride, int64_t K, float* dst) {
    if (!fmt_ok(fmt) || !k_ok(fmt, K) || n_rows < 0 || row_stride < row_bytes_of(fmt, K))
        return kErrBadArg;
    std::lock_guard<std::mutex> lock(g_call_mu);
    if (ext_format(fmt)) ext_kernels(g_ks).decode(fmt, w, row_stride, n_rows, K, dst);
    else g_ks->decode(fmt, w, row_stride, n_rows, K, dst);
    return 0;
}

// For each of n matrices: out_i[t*ldo_i + r] = x[T, K] @ W_i[N_i, K]^T (+ bias_i), W_i quantized
// (MXFP4 or Q8_0, all the same format), rows row_stride_i apart. One input preparation and one
// pass of the pool for all of them (q, k and v of a layer in one call). act: kActF32/I16/I8.
HM_API int hm_linear_multi(int fmt, const float* x, int64_t T, int64_t K, int n, const uint8_t* const* ws,
                           const int64_t* Ns, const int64_t* row_strides, const float* const* biases,
                           float* const* outs, const int64_t* ldos, int act) {
    if (!fmt_ok(fmt) || !act_ok(act) || T < 0 || !k_ok(fmt, K) || n < 1 || n > kMaxLinearMats)
        return kErrBadArg;
    act = effective_act(act, fmt);
    for (int i = 0; i < n; ++i)
        if (Ns[i] < 0 || row_strides[i] < row_bytes_of(fmt, K) || ldos[i] < Ns[i]) return kErrBadArg;
    if (T == 0) return 0;
    std::lock_guard<std::mutex> lock(g_call_mu);
    LinearCtx c;
    c.ks = g_ks;
    c.fmt = fmt;
    c.tile_path = T > gemv_max_tokens(act, fmt);
    if (act == kActI8) {
        std::vector<const float*> rows(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) rows[size_t(t)] = x + t * K;
        c.xq.resize(size_t(T));
        c.xd.resize(size_t(T));
        quantize_rows(rows.data(), T, K, grow(g_xq, size_t(T * q8x_bytes(K))), grow(g_xd, size_t(T * q8x_scales(K))),
                      c.xq.data(), c.xd.data());
        c.x = nullptr;
    } else if (!c.tile_path && act == kActI8x3 && d3_gemv_for(c.ks, fmt)) {
        std::vector<const float*> rows(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) rows[size_t(t)] = x + t * K;
        c.x3.resize(size_t(T));
        quantize_rows_d3(rows.data(), T, K, grow(g_x3, size_t(T * d3x_bytes(K))), c.x3.data());
        c.x = nullptr;
    } else if (!c.tile_path && act == kActI16) {
        std::vector<const float*> rows(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) rows[size_t(t)] = x + t * K;
        c.x16.resize(size_t(T));
        c.d16.resize(size_t(T));
        quantize_rows16(rows.data(), T, K, grow(g_x16, size_t(T * q16x_elems(K))),
                        grow(g_xd16, size_t(T * q16x_scales(K))), c.x16.data(), c.d16.data());
        c.x = nullptr;
    } else if (!c.tile_path) {
        float* xp = grow(g_xp, size_t(T * K));
        for (int64_t t = 0; t < T; ++t) prep_row(c.ks, fmt, x + t * K, xp + t * K, K);
        c.x = xp;
    } else {
        std::vector<const float*> rows(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) rows[size_t(t)] = x + t * K;
        float* xp = grow(g_xp, size_t(packed_floats(T, K)));
        c.ks->pack_a(rows.data(), T, K, xp);
        c.x = xp;
    }
    c.T = T; c.K = K; c.n_mats = n;
    int64_t units = 0;
    for (int i = 0; i < n; ++i) {
        const int64_t unit_rows = !c.tile_path ? gemv_unit_rows(Ns[i]) : act == kActI8 ? kQ8TileRows : kChunkRows;
        c.mats[i] = {ws[i], Ns[i], row_strides[i], unit_rows, biases[i], outs[i], ldos[i], units};
        units += (Ns[i] + unit_rows - 1) / unit_rows;
    }
    c.num_units = units;
    g_pool->run(linear_job, &c);
    return 0;
}

// out[T, N] = x[T, K] @ W[N, K]^T (+ bias[N]); W quantized (MXFP4 or Q8_0), rows row_stride apart.
HM_API int hm_linear(int fmt, const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t N,
                     int64_t row_stride, const float* bias, float* out, int act) {
    return hm_linear_multi(fmt, x, T, K, 1, &w, &N, &row_stride, &bias, &out, &N, act);
}

// gpt-oss MoE layer: out[T, H] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]). Gate/up tensors are
// [E, I, H/32 blocks] and down [E, H, I/32 blocks], rows contiguous, experts *_es bytes apart.
// act: kActF32 / kActI16 / kActI8 / kActI8x3 (see above).
namespace hm {
namespace {
bool moe_args_ok(int64_t T, int64_t H, int64_t k, int64_t E, int64_t I, int fmt, int down_fmt, int act) {
    return fmt_ok(fmt) && fmt_ok(down_fmt) && act_ok(act) && T >= 0 && k >= 1 && E >= 1 && k_ok(fmt, H) &&
           k_ok(down_fmt, I);
}

// hm_moe_forward's work, ids already checked; the caller holds g_call_mu.
void moe_forward_locked(const float* x, int64_t T, int64_t H, const int32_t* ids, const float* wts, int64_t k,
                        int64_t E, int64_t I, int fmt, int down_fmt, const uint8_t* gate, int64_t gate_es,
                        const uint8_t* up, int64_t up_es, const uint8_t* down, int64_t down_es,
                        const float* gate_bias, const float* up_bias, const float* down_bias, float alpha,
                        float limit, float* out, int act) {
    // The activation rows are laid out once for both projections: the native kernels' modes
    // only where gate/up and down share a native format; else fp32 everywhere.
    if (fmt != down_fmt) act = kActF32;
    act = effective_act(act, fmt);
    MoeCtx c;
    c.ks = g_ks; c.fmt = fmt; c.down_fmt = down_fmt; c.H = H; c.I = I; c.T = T; c.k = k;
    c.gate = gate; c.up = up; c.down = down;
    c.gate_es = gate_es; c.up_es = up_es; c.down_es = down_es;
    c.gb = gate_bias; c.ub = up_bias; c.db = down_bias;
    c.alpha = alpha; c.limit = limit; c.out = out;
    c.fast = act == kActI8;
    c.act16 = act == kActI16;
    c.d3 = act == kActI8x3 && d3_gemv_for(g_ks, fmt);

    // Group the T*k assignments by expert (counting sort, stable in token order).
    const int64_t gemv_max = std::min(gemv_max_tokens(act, fmt), gemv_max_tokens(act, down_fmt));
    std::vector<int64_t> offset(size_t(E) + 1, 0);
    for (int64_t i = 0; i < T * k; ++i) ++offset[size_t(ids[i]) + 1];
    for (int64_t e = 0; e < E; ++e) {
        const int64_t n = offset[size_t(e) + 1];
        offset[size_t(e) + 1] += offset[size_t(e)];
        if (n) c.slots.push_back({int32_t(e), offset[size_t(e)], n, n > gemv_max, 0, 0});
    }
    const int64_t n_asg = T * k;
    c.asg_token.resize(size_t(n_asg));
    c.asg_weight.resize(size_t(n_asg));
    c.asg_pos.resize(size_t(n_asg));
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t i = 0; i < n_asg; ++i) {
        const int64_t pos = fill[size_t(ids[i])]++;
        c.asg_token[size_t(pos)] = int32_t(i / k);
        c.asg_pos[size_t(i)] = pos;
        c.asg_weight[size_t(pos)] = wts[i];
    }
    // Per-slot inputs: GEMV slots get prep_x'd rows, tile slots the GEMM's packed layout.
    // Fast mode: GEMV slots read int8 rows instead: each token quantized once (here), each
    // assignment's activation row once (before the down projection).
    int64_t xg_size = 0, actp_size = 0;
    for (Slot& s : c.slots) {
        s.xg_off = xg_size;
        s.actp_off = actp_size;
        const bool fp32_rows = !c.fast && (s.tile_path || !(c.act16 || c.d3));
        xg_size += !fp32_rows ? 0 : s.tile_path ? packed_floats(s.count, H) : s.count * H;
        actp_size += !fp32_rows ? 0 : s.tile_path ? packed_floats(s.count, I) : s.count * I;
    }
    if (c.act16) {  // each token quantized once; GEMV-slot assignments point at their token's row
        bool any = false;
        for (const Slot& s : c.slots) any = any || !s.tile_path;
        if (any) {
            std::vector<const float*> tok(static_cast<size_t>(T));
            for (int64_t t = 0; t < T; ++t) tok[size_t(t)] = x + t * H;
            std::vector<const int16_t*> tq(static_cast<size_t>(T));
            std::vector<const float*> td(static_cast<size_t>(T));
            quantize_rows16(tok.data(), T, H, grow(g_x16, size_t(T * q16x_elems(H))),
                            grow(g_xd16, size_t(T * q16x_scales(H))), tq.data(), td.data());
            c.asg_x16.resize(size_t(n_asg));
            c.asg_xd16.resize(size_t(n_asg));
            for (int64_t a = 0; a < n_asg; ++a) {
                c.asg_x16[size_t(a)] = tq[size_t(c.asg_token[size_t(a)])];
                c.asg_xd16[size_t(a)] = td[size_t(c.asg_token[size_t(a)])];
            }
            c.asg_a16.assign(size_t(n_asg), nullptr);
            c.asg_ad16.assign(size_t(n_asg), nullptr);
        }
    }
    if (c.d3) {  // as act16: each token quantized once for the GEMV-slot assignments
        bool any = false;
        for (const Slot& s : c.slots) any = any || !s.tile_path;
        if (any) {
            std::vector<const float*> tok(static_cast<size_t>(T));
            for (int64_t t = 0; t < T; ++t) tok[size_t(t)] = x + t * H;
            std::vector<const uint8_t*> tq(static_cast<size_t>(T));
            quantize_rows_d3(tok.data(), T, H, grow(g_x3, size_t(T * d3x_bytes(H))), tq.data());
            c.asg_x3.resize(size_t(n_asg));
            for (int64_t a = 0; a < n_asg; ++a) c.asg_x3[size_t(a)] = tq[size_t(c.asg_token[size_t(a)])];
            c.asg_a3.assign(size_t(n_asg), nullptr);
        }
    }
    if (c.fast) {
        std::vector<const float*> tok(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) tok[size_t(t)] = x + t * H;
        std::vector<const int8_t*> tq(static_cast<size_t>(T));
        std::vector<const float*> td(static_cast<size_t>(T));
        quantize_rows(tok.data(), T, H, grow(g_xq, size_t(T * q8x_bytes(H))), grow(g_xd, size_t(T * q8x_scales(H))),
                      tq.data(), td.data());
        c.asg_xq.resize(size_t(n_asg));
        c.asg_xd.resize(size_t(n_asg));
        c.asg_aq.assign(size_t(n_asg), nullptr);
        c.asg_ad.assign(size_t(n_asg), nullptr);
        for (int64_t a = 0; a < n_asg; ++a) {
            c.asg_xq[size_t(a)] = tq[size_t(c.asg_token[size_t(a)])];
            c.asg_xd[size_t(a)] = td[size_t(c.asg_token[size_t(a)])];
        }
    }
    c.xg = grow(g_xg, size_t(xg_size));
    c.act = grow(g_act, size_t(n_asg * I));
    c.actp = grow(g_actp, size_t(actp_size));
    c.ys = grow(g_ys, size_t(n_asg * H));
    std::vector<const float*> rows;
    for (const Slot& s : c.slots) {
        if (c.fast) break;  // fast mode reads the quantized token rows instead
        if ((c.act16 || c.d3) && !s.tile_path) continue;  // reads the int16 / three-digit token rows
        rows.clear();
        for (int64_t a = s.first; a < s.first + s.count; ++a) rows.push_back(x + int64_t(c.asg_token[size_t(a)]) * H);
        if (s.tile_path) c.ks->pack_a(rows.data(), s.count, H, c.xg + s.xg_off);
        else
            for (int64_t a = 0; a < s.count; ++a) prep_row(c.ks, fmt, rows[size_t(a)], c.xg + s.xg_off + a * H, H);
    }
    // Fast mode: the int8 GEMM's units (the fp32 tile of the default mode is sized for 24 rows).
    // A call without tile slots (decode) takes the GEMV path's longer units.
    bool any_tile = false;
    for (const Slot& s : c.slots) any_tile = any_tile || s.tile_path;
    c.chunk_rows = !any_tile ? gemv_unit_rows(std::min(H, I))
                   : c.fast  ? kQ8TileRows
                             : kChunkRows;
    c.chunks_i = (I + c.chunk_rows - 1) / c.chunk_rows;
    c.chunks_h = (H + c.chunk_rows - 1) / c.chunk_rows;
    g_pool->run(moe_gate_up_job, &c);
    for (const Slot& s : c.slots) {
        rows.clear();
        for (int64_t a = s.first; a < s.first + s.count; ++a) rows.push_back(c.act + a * I);
        if (c.fast)
            quantize_rows(rows.data(), s.count, I, grow(g_aq, size_t(n_asg * q8x_bytes(I))) + s.first * q8x_bytes(I),
                          grow(g_ad, size_t(n_asg * q8x_scales(I))) + s.first * q8x_scales(I),
                          c.asg_aq.data() + s.first, c.asg_ad.data() + s.first);
        else if (c.d3 && !s.tile_path)
            quantize_rows_d3(rows.data(), s.count, I, grow(g_a3, size_t(n_asg * d3x_bytes(I))) + s.first * d3x_bytes(I),
                             c.asg_a3.data() + s.first);
        else if (c.act16 && !s.tile_path)
            quantize_rows16(rows.data(), s.count, I, grow(g_a16, size_t(n_asg * q16x_elems(I))) + s.first * q16x_elems(I),
                            grow(g_ad16, size_t(n_asg * q16x_scales(I))) + s.first * q16x_scales(I),
                            c.asg_a16.data() + s.first, c.asg_ad16.data() + s.first);
        else if (s.tile_path) c.ks->pack_a(rows.data(), s.count, I, c.actp + s.actp_off);
        else
            for (int64_t a = 0; a < s.count; ++a) prep_row(c.ks, down_fmt, rows[size_t(a)], c.actp + s.actp_off + a * I, I);
    }
    c.next.store(0);
    g_pool->run(moe_down_job, &c);
    c.next.store(0);
    g_pool->run(moe_combine_job, &c);
}

void rms_norm_rows(const float* x, int64_t rows, int64_t n, const float* w, float eps, float* out) {
    for (int64_t t = 0; t < rows; ++t) {
        const float* xr = x + t * n;
        double ss = 0.0;
        for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
        const float r = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
        float* o = out + t * n;
        for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * r * w[i];
    }
}

// gpt-oss routing of one token: the k largest logits (ties to the lower expert id), softmax over
// those k only (max subtracted, as torch.softmax).
void route_token(const float* logits, int64_t E, int64_t k, int32_t* ids, float* wts) {
    for (int64_t j = 0; j < k; ++j) {
        int32_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
            bool taken = false;
            for (int64_t i = 0; i < j; ++i) taken = taken || ids[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = int32_t(e);
        }
        ids[j] = best;
    }
    const float top = logits[ids[0]];
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += (wts[j] = std::exp(logits[ids[j]] - top));
    for (int64_t j = 0; j < k; ++j) wts[j] /= sum;
}

Scratch<float> g_normed, g_router_in, g_logits;

// logits[t, e] = h[t] . w[e] + b[e]. Few tokens: 16 partial sums per dot (vectorised by the
// compiler at the baseline ISA), as the tile GEMM would pad each token group to 16 (~30x the
// work at decode); a prompt chunk: the ISA's tile GEMM.
void router_logits(const float* h, int64_t T, int64_t H, const float* w, const float* b, int64_t E, float* out) {
    if (T >= 16 && H % 8 == 0) {
        std::vector<const float*> rows(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) rows[size_t(t)] = h + t * H;
        float* hp = grow(g_router_in, size_t(packed_floats(T, H)));
        g_ks->pack_a(rows.data(), T, H, hp);
        g_ks->gemm(hp, T, w, E, H, out, E);
        if (b)
            for (int64_t t = 0; t < T; ++t)
                for (int64_t e = 0; e < E; ++e) out[t * E + e] += b[e];
        return;
    }
    for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < E; ++e) {
            const float *x = h + t * H, *r = w + e * H;
            float acc[16] = {};
            int64_t i = 0;
            for (; i + 16 <= H; i += 16)
                for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * r[i + j];
            float sum = 0.f;
            for (; i < H; ++i) sum += x[i] * r[i];
            for (int j = 0; j < 16; ++j) sum += acc[j];
            out[t * E + e] = sum + (b ? b[e] : 0.f);
        }
}
}  // namespace
}  // namespace hm

HM_API int hm_moe_forward(const float* x, int64_t T, int64_t H, const int32_t* ids, const float* wts,
                          int64_t k, int64_t E, int64_t I, int fmt, int down_fmt, const uint8_t* gate,
                          int64_t gate_es, const uint8_t* up, int64_t up_es, const uint8_t* down, int64_t down_es,
                          const float* gate_bias, const float* up_bias, const float* down_bias,
                          float alpha, float limit, float* out, int act) {
    if (!moe_args_ok(T, H, k, E, I, fmt, down_fmt, act)) return kErrBadArg;
    if (T == 0) return 0;
    for (int64_t i = 0; i < T * k; ++i)
        if (ids[i] < 0 || ids[i] >= E) return kErrBadExpert;
    std::lock_guard<std::mutex> lock(g_call_mu);
    moe_forward_locked(x, T, H, ids, wts, k, E, I, fmt, down_fmt, gate, gate_es, up, up_es, down, down_es,
                       gate_bias, up_bias, down_bias, alpha, limit, out, act);
    return 0;
}

// A gpt-oss MoE block in one call (a decode step's layer pays one call instead of ~8 torch ops,
// each slow right after the weight stream): h = RMSNorm(x) * norm_w; logits = h @ router_w^T +
// router_b (router_w [E, H] float32); top-k and softmax over the k (route_token); out = x +
// experts(h). The routing goes to ids_out / wts_out [T, k] when those are non-null.
HM_API int hm_moe_block(const float* x, int64_t T, int64_t H, const float* norm_w, float eps,
                        const float* router_w, const float* router_b, int64_t k, int64_t E, int64_t I, int fmt,
                        int down_fmt, const uint8_t* gate, int64_t gate_es, const uint8_t* up, int64_t up_es,
                        const uint8_t* down, int64_t down_es, const float* gate_bias, const float* up_bias,
                        const float* down_bias, float alpha, float limit, float* out, int act, int32_t* ids_out,
                        float* wts_out) {
    if (!moe_args_ok(T, H, k, E, I, fmt, down_fmt, act) || k > E) return kErrBadArg;
    if (T == 0) return 0;
    std::lock_guard<std::mutex> lock(g_call_mu);
    float* h = grow(g_normed, size_t(T * H));
    rms_norm_rows(x, T, H, norm_w, eps, h);
    float* logits = grow(g_logits, size_t(T * E));
    router_logits(h, T, H, router_w, router_b, E, logits);
    std::vector<int32_t> ids(size_t(T * k));
    std::vector<float> wts(size_t(T * k));
    for (int64_t t = 0; t < T; ++t) route_token(logits + t * E, E, k, ids.data() + t * k, wts.data() + t * k);
    moe_forward_locked(h, T, H, ids.data(), wts.data(), k, E, I, fmt, down_fmt, gate, gate_es, up, up_es, down,
                       down_es, gate_bias, up_bias, down_bias, alpha, limit, out, act);
    for (int64_t i = 0; i < T * H; ++i) out[i] = x[i] + out[i];
    if (ids_out) std::copy(ids.begin(), ids.end(), ids_out);
    if (wts_out) std::copy(wts.begin(), wts.end(), wts_out);
    return 0;
}

// ---------------------------------------------------------------- decode attention
// One new token of one sequence against its head-major float32 KV cache: the whole attention
// step in one call, so a decode step does not pay ~40 small torch ops per layer (each one slow
// right after a weight stream has flushed the caches).
namespace hm {
namespace {
struct AttnCtx {
    const KernelSet* ks;
    const float *q, *Kc, *Vc, *sinks;
    const uint8_t* vis;
    int64_t Hkv, g, d, slots, n;
    float scale;
    float* out;
    std::atomic<int64_t> next{0};
};

thread_local std::vector<float> t_attn_p;

void attn_job(void* p, int) {
    auto& c = *static_cast<AttnCtx*>(p);
    for (int64_t u; (u = c.next.fetch_add(1, std::memory_order_relaxed)) < c.Hkv;) {
        float* scratch = grow(t_attn_p, size_t(c.g * c.n));
        c.ks->attn_group(c.q + u * c.g * c.d, int(c.g), c.Kc + u * c.slots * c.d, c.Vc + u * c.slots * c.d, c.n,
                         c.d, c.vis, c.sinks + u * c.g, c.scale, scratch, c.out + u * c.g * c.d);
    }
}

// NeoX half rotation in place: x*cos + (x2, x1)*sin per head, cos/sin [d] (sin signed).
void rope_heads(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; ++h) {
        float* v = x + h * d;
        for (int64_t i = 0; i < half; ++i) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] + b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

std::vector<uint8_t> g_vis;
}  // namespace
}  // namespace hm

// q [Hq*d] and k [Hkv*d] are roped in place (cos/sin [d] from RopeTable; null: no rope), k and
// v are written to `slot` of Kc/Vc ([Hkv][slots][d]), and for a ring layer kpos[slot] = pos.
// out [Hq*d] = attention of q over slots 0..n_keys-1 with one sink logit per query head. Visible
// keys: a full layer (kpos null) sees every slot < n_keys; a ring layer the slots with
// 0 <= kpos <= pos and, when window > 0, kpos > pos - window.
HM_API int hm_attn_decode(float* q, float* k, const float* v, int64_t Hq, int64_t Hkv, int64_t d,
                          const float* cos, const float* sin, float* Kc, float* Vc, int64_t slots,
                          int64_t slot, int64_t* kpos, int64_t pos, int64_t n_keys, int64_t window,
                          const float* sinks, float scale, float* out) {
    if (Hq < 1 || Hkv < 1 || Hq % Hkv || Hq / Hkv > kMaxAttnGroup || d < 2 || d % 2 || slots < 1 ||
        slot < 0 || slot >= slots || n_keys < 1 || n_keys > slots || pos < 0 || window < 0 || (!cos) != (!sin))
        return kErrBadArg;
    std::lock_guard<std::mutex> lock(g_call_mu);
    if (cos) {
        rope_heads(q, Hq, d, cos, sin);
        rope_heads(k, Hkv, d, cos, sin);
    }
    for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(Kc + (h * slots + slot) * d, k + h * d, size_t(d) * sizeof(float));
        std::memcpy(Vc + (h * slots + slot) * d, v + h * d, size_t(d) * sizeof(float));
    }
    const uint8_t* vis = nullptr;
    if (kpos) {
        kpos[slot] = pos;
        uint8_t* m = grow(g_vis, size_t(n_keys));
        for (int64_t j = 0; j < n_keys; ++j)
            m[j] = kpos[j] >= 0 && kpos[j] <= pos && (window == 0 || kpos[j] > pos - window);
        vis = m;
    }
    AttnCtx c;
    c.ks = g_ks; c.q = q; c.Kc = Kc; c.Vc = Vc; c.sinks = sinks; c.vis = vis;
    c.Hkv = Hkv; c.g = Hq / Hkv; c.d = d; c.slots = slots; c.n = n_keys; c.scale = scale; c.out = out;
    g_pool->run(attn_job, &c);
    return 0;
}

// ---------------------------------------------------------------- RMSNorm
// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, rows of n floats; mean accumulated in double.
// A decode step normalises a few rows twice per layer: one short call instead of the handful of
// torch ops RMSNorm costs on the CPU (each slow right after a weight stream).
HM_API int hm_rms_norm(const float* x, int64_t rows, int64_t n, const float* w, float eps, float* out) {
    if (rows < 0 || n < 1) return kErrBadArg;
    rms_norm_rows(x, rows, n, w, eps, out);
    return 0;
}

// ---------------------------------------------------------------- read-bandwidth probe
// Sums 64-bit words of [p, p + n_bytes) on all pool threads: the read-bandwidth yardstick the
// benchmarks put beside the kernels (same loads, same threads, no compute to hide behind).
namespace hm {
namespace {
struct ProbeCtx {
    const uint64_t* p;
    int64_t n_words, n_units;
    std::atomic<int64_t> next{0};
    std::atomic<uint64_t> sum{0};
};
constexpr int64_t kProbeWords = 1 << 16;  // 512 KB per unit

void probe_job(void* ctx, int) {
    auto& c = *static_cast<ProbeCtx*>(ctx);
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int64_t u; (u = c.next.fetch_add(1, std::memory_order_relaxed)) < c.n_units;) {
        const int64_t i0 = u * kProbeWords, i1 = std::min(c.n_words, i0 + kProbeWords);
        int64_t i = i0;
        for (; i + 4 <= i1; i += 4) {
            s0 += c.p[i]; s1 += c.p[i + 1]; s2 += c.p[i + 2]; s3 += c.p[i + 3];
        }
        for (; i < i1; ++i) s0 += c.p[i];
    }
    c.sum.fetch_add(s0 + s1 + s2 + s3, std::memory_order_relaxed);
}
}  // namespace
}  // namespace hm

HM_API uint64_t hm_read_probe(const uint8_t* p, int64_t n_bytes) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    ProbeCtx c;
    c.p = reinterpret_cast<const uint64_t*>(p);
    c.n_words = n_bytes / 8;
    c.n_units = (c.n_words + kProbeWords - 1) / kProbeWords;
    g_pool->run(probe_job, &c);
    return c.sum.load();
}

// Fast mode's activation quantizer on one row, for tests: q gets q8x_bytes(K) bytes, d
// q8x_scales(K) floats (the layout common.h describes). Returns the byte count of q.
HM_API int64_t hm_quantize_q8(const float* x, int64_t K, int8_t* q, float* d) {
    if (K <= 0 || K % hm::kBlockElems != 0) return hm::kErrBadArg;
    std::lock_guard<std::mutex> lock(hm::g_call_mu);
    hm::g_ks->quantize_q8(x, K, q, d);
    return hm::q8x_bytes(K);
}

// Default path's activation quantizer on one row, for tests: q gets q16x_elems(K) int16, d
// q16x_scales(K) floats (layout in common.h). Returns the element count of q.
HM_API int64_t hm_quantize_q16(const float* x, int64_t K, int16_t* q, float* d) {
    if (K <= 0 || K % hm::kBlockElems != 0) return hm::kErrBadArg;
    std::lock_guard<std::mutex> lock(hm::g_call_mu);
    hm::g_ks->quantize_q16(x, K, q, d);
    return hm::q16x_elems(K);
}

// Three-digit quantizer on one row, for tests: q gets d3x_bytes(K) bytes (layout in common.h).
// Returns that byte count.
HM_API int64_t hm_quantize_d3(const float* x, int64_t K, uint8_t* q) {
    if (K <= 0 || K % hm::kBlockElems != 0) return hm::kErrBadArg;
    std::lock_guard<std::mutex> lock(hm::g_call_mu);
    hm::g_ks->quantize_d3(x, K, q);
    return hm::d3x_bytes(K);
}

// Whether act=kActI8x3 uses the three-digit GEMV for MXFP4 on the current ISA (else it is fp32).
HM_API int hm_d3_active() { return hm::d3_gemv_for(hm::g_ks, hm::kMXFP4) ? 1 : 0; }

// gpt-oss's clamped SwiGLU over rows x n (the MoE's activation step), for tests; see KernelSet::swiglu.
HM_API int hm_swiglu(const float* g, const float* u, int64_t rows, int64_t n, const float* gb, const float* ub,
                     float alpha, float limit, float* out, int64_t ldo) {
    if (rows < 0 || n < 0 || ldo < n) return hm::kErrBadArg;
    std::lock_guard<std::mutex> lock(hm::g_call_mu);
    hm::g_ks->swiglu(g, u, rows, n, gb, ub, alpha, limit, out, ldo);
    return 0;
}
