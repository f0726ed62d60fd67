// The CUDA backend's kernels, compiled at run time by NVRTC (no toolkit at build time).
// One source for every storage type: the host prepends `#define DT_F32`, `DT_BF16` or
// `DT_F16`; values are loaded to float with `ld` and stored with `st`, so all arithmetic is
// f32. No headers are included (NVRTC may have none): bf16 is widened by a shift, and f16
// through PTX conversions.
//
// Layouts (row-major): activations [tokens, width]; the KV cache of one layer is
// [block][kv_head][slot][dim]; blocks are exported in the layout every backend exchanges
// (BlockLayout::LayerKvHeadSlotDim in transfer.rs), so they move between backends.

#define NEG_INF __int_as_float(0xff800000)

#if defined(DT_F32)
typedef float T;
__device__ __forceinline__ float ld(T x) { return x; }
__device__ __forceinline__ T st(float x) { return x; }
#elif defined(DT_BF16)
typedef unsigned short T;
__device__ __forceinline__ float ld(T x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ T st(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (T)0x7fc0;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);                          // round to nearest even
    return (T)(u >> 16);
}
#else
typedef unsigned short T;
__device__ __forceinline__ float ld(T x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }
__device__ __forceinline__ T st(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
#endif

// Sum over the block (blockDim.x a multiple of 32, at most 1024).
__device__ float block_sum(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = lane < warps ? part[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ float block_max(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = lane < warps ? part[lane] : NEG_INF;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// out[t] = table[ids[t]]: grid (tokens), block (256).
extern "C" __global__ void embedding(const T* table, const unsigned int* ids, T* out, int hidden) {
    const T* row = table + (size_t)ids[blockIdx.x] * hidden;
    T* o = out + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = row[i];
}

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w: grid (rows), block (1024: a decode step
// has one row, so the row's block is all the kernel has).
extern "C" __global__ void rmsnorm(const T* x, const float* w, T* out, int hidden, float eps) {
    const T* row = x + (size_t)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) { float v = ld(row[i]); ss += v * v; }
    float r = rsqrtf(block_sum(ss) / hidden + eps);
    T* o = out + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = st(w[i] * (ld(row[i]) * r));
}

// x[r][c] += b[c]: grid (rows), block (256).
extern "C" __global__ void add_bias(T* x, const float* b, int cols) {
    T* row = x + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) row[i] = st(ld(row[i]) + b[i]);
}

// Rope on the q and k heads of each token's qkv row (halves style), then its k and v into
// the token's cache slot: grid (tokens), block (512).
extern "C" __global__ void rope_store(T* qkv, const int* pos, const int* blk, const float* inv_freq,
                                      T* kc, T* vc, int heads, int kv_heads, int d, int bs) {
    int t = blockIdx.x, half = d / 2, p = pos[t];
    int width = (heads + 2 * kv_heads) * d;
    T* row = qkv + (size_t)t * width;
    for (int i = threadIdx.x; i < (heads + kv_heads) * half; i += blockDim.x) {
        int h = i / half, j = i % half;
        float s, c;
        sincosf((float)p * inv_freq[j], &s, &c);
        T* x = row + h * d;
        float u = ld(x[j]), v = ld(x[j + half]);
        x[j] = st(u * c - v * s);
        x[j + half] = st(v * c + u * s);
    }
    __syncthreads();
    int slot = p % bs;
    size_t base = (size_t)blk[t] * kv_heads * bs * d;
    for (int i = threadIdx.x; i < kv_heads * d; i += blockDim.x) {
        int g = i / d, j = i % d;
        size_t at = base + ((size_t)g * bs + slot) * d + j;
        kc[at] = row[heads * d + g * d + j];
        vc[at] = row[(heads + kv_heads) * d + g * d + j];
    }
}

// Paged attention, one block per (token, query head): scores against every cached position
// the token may see (causal, optionally a sliding window), softmax, weighted sum of values.
// `scores` is scratch of [tokens * heads][max_ctx]. grid (tokens, heads), block (128).
extern "C" __global__ void paged_attention(const T* qkv, T* out, const T* kc, const T* vc,
                                           const int* pos, const int* seq, const int* tables,
                                           const int* table_off, float* scores, int max_ctx,
                                           int heads, int kv_heads, int d, int bs, float scale,
                                           int window) {
    int t = blockIdx.x, h = blockIdx.y, p = pos[t];
    int g = h / (heads / kv_heads);
    int width = (heads + 2 * kv_heads) * d;
    const T* q = qkv + (size_t)t * width + h * d;
    const int* table = tables + table_off[seq[t]];
    extern __shared__ float qs[];
    for (int i = threadIdx.x; i < d; i += blockDim.x) qs[i] = ld(q[i]);
    __syncthreads();
    int lo = window > 0 ? max(0, p + 1 - window) : 0;
    float* s = scores + ((size_t)t * heads + h) * max_ctx;
    float mx = NEG_INF;
    for (int j = lo + threadIdx.x; j <= p; j += blockDim.x) {
        const T* k = kc + (((size_t)table[j / bs] * kv_heads + g) * bs + j % bs) * d;
        float acc = 0.0f;
        for (int i = 0; i < d; i++) acc += qs[i] * ld(k[i]);
        acc *= scale;
        s[j] = acc;
        mx = fmaxf(mx, acc);
    }
    mx = block_max(mx);
    float sum = 0.0f;
    for (int j = lo + threadIdx.x; j <= p; j += blockDim.x) {
        float e = __expf(s[j] - mx);
        s[j] = e;
        sum += e;
    }
    sum = block_sum(sum);
    __syncthreads();
    T* o = out + (size_t)t * heads * d + h * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = lo; j <= p; j++) {
            const T* v = vc + (((size_t)table[j / bs] * kv_heads + g) * bs + j % bs) * d;
            acc += s[j] * ld(v[i]);
        }
        o[i] = st(acc / sum);
    }
}

// out[r][i] = silu(gu[r][i]) * gu[r][inter + i]: grid (rows, ceil(inter / 256)), block (256).
// One element per thread: a block per row alone left a decode step's one row to one SM.
extern "C" __global__ void silu_mul(const T* gu, T* out, int inter) {
    int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    const T* row = gu + (size_t)blockIdx.x * 2 * inter;
    float g = ld(row[i]);
    out[(size_t)blockIdx.x * inter + i] = st(g / (1.0f + __expf(-g)) * ld(row[inter + i]));
}

// out[i] = x[rows[i]]: grid (n), block (256).
extern "C" __global__ void gather_rows(const T* x, const int* rows, T* out, int width) {
    const T* r = x + (size_t)rows[blockIdx.x] * width;
    T* o = out + (size_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) o[i] = r[i];
}

// KV block copy between the cache and a contiguous staging buffer of `n` blocks:
// `to_cache` scatters staging[i] into cache block ids[i], otherwise gathers. One layer's K or
// V at a time. grid (n), block (256).
extern "C" __global__ void kv_block_copy(T* cache, T* staging, const int* ids, int block_elems,
                                         int to_cache) {
    T* c = cache + (size_t)ids[blockIdx.x] * block_elems;
    T* s = staging + (size_t)blockIdx.x * block_elems;
    for (int i = threadIdx.x; i < block_elems; i += blockDim.x) {
        if (to_cache) c[i] = s[i]; else s[i] = c[i];
    }
}

// Logits to f32 for the host: grid (n), block (256).
extern "C" __global__ void to_f32(const T* x, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ld(x[i]);
}
