// Postprocessing on device, before the device-to-host copy: softmax and top-k per
// row, so only k indices and k scores per request cross PCIe instead of a whole
// row of logits.
//
// Contract: worker/postprocess.py (softmax over the row, numerically stable; top-k
// descending with ties to the lower index, i.e. NumPy's stable argsort of -x).
// NaN handling also follows NumPy: a NaN logit makes the row's maximum NaN, so the
// whole softmax row is NaN (x - max), and NaN sorts after every number.
//
// One block per row. Each reduction is a warp shuffle followed by one pass over
// the per-warp partials in shared memory, which every thread reads in the same
// order, so all threads hold bit-identical results without another broadcast.
//
// Top-k without scratch memory: pass j looks for the best element that comes
// strictly after pass j-1's pick in the total order (value descending, NaN last,
// index ascending), so picks never repeat and need not be marked. Probabilities
// are recomputed in each pass instead of being stored (the row may not fit in
// shared memory); top-k is O(TOP_K * NUM_CLASSES / BLOCK_SIZE) per thread.
//
// Compile-time constants (injected as -D defines by worker/kernels.py):
//   NUM_CLASSES   elements per row
//   TOP_K         k (clamped to NUM_CLASSES)
//   APPLY_SOFTMAX 1: scores are probabilities; 0: scores are the raw values
//   IN_HALF       1: logits are IEEE binary16 (bit patterns); 0: float32
//   BLOCK_SIZE    threads per block (a multiple of 32, <= 1024); launch with exactly this

#ifndef NUM_CLASSES
#define NUM_CLASSES 1000
#endif
#ifndef TOP_K
#define TOP_K 5
#endif
#ifndef APPLY_SOFTMAX
#define APPLY_SOFTMAX 1
#endif
#ifndef IN_HALF
#define IN_HALF 0
#endif
#ifndef BLOCK_SIZE
#define BLOCK_SIZE 256
#endif

#if BLOCK_SIZE % 32 != 0 || BLOCK_SIZE < 32 || BLOCK_SIZE > 1024
#error "BLOCK_SIZE must be a multiple of 32 in 32..1024"
#endif
#if NUM_CLASSES < 1 || TOP_K < 1
#error "NUM_CLASSES and TOP_K must be >= 1"
#endif

#define K_EFF (TOP_K < NUM_CLASSES ? TOP_K : NUM_CLASSES)
#define NUM_WARPS (BLOCK_SIZE / 32)
#define FULL_MASK 0xffffffffu

#if IN_HALF
typedef unsigned short in_t;
__device__ __forceinline__ float load(in_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#else
typedef float in_t;
__device__ __forceinline__ float load(in_t f) { return f; }
#endif

// max that propagates NaN, like NumPy's ndarray.max
__device__ __forceinline__ float max_nan(float a, float b) {
    return isnan(a) ? a : (isnan(b) ? b : fmaxf(a, b));
}

// True when (av, ai) comes strictly before (bv, bi) in the output order:
// larger value first, NaN after every number, equal values by lower index.
// ai/bi < 0 mean "no element" and come after everything.
__device__ __forceinline__ bool before(float av, int ai, float bv, int bi) {
    if (bi < 0) return ai >= 0;
    if (ai < 0) return false;
    const bool an = isnan(av);
    const bool bn = isnan(bv);
    if (an != bn) return bn;
    if (!an && av != bv) return av > bv;
    return ai < bi;
}

__device__ float block_max(float v, float* shared) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = max_nan(v, __shfl_xor_sync(FULL_MASK, v, off));
    __syncthreads();  // the previous reduction may still be reading `shared`
    if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = shared[0];
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) r = max_nan(r, shared[w]);
    return r;
}

__device__ float block_sum(float v, float* shared) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = shared[0];
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) r += shared[w];
    return r;
}

__device__ void block_best(float& v, int& i, float* shared_v, int* shared_i) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, off);
        const int oi = __shfl_xor_sync(FULL_MASK, i, off);
        if (before(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
        shared_v[threadIdx.x >> 5] = v;
        shared_i[threadIdx.x >> 5] = i;
    }
    __syncthreads();
    v = shared_v[0];
    i = shared_i[0];
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) {
        if (before(shared_v[w], shared_i[w], v, i)) {
            v = shared_v[w];
            i = shared_i[w];
        }
    }
}

struct RowStats {
    float max;
    float sum;
};

// max and sum(exp(x - max)) of one row, identical in every thread of the block.
__device__ RowStats row_stats(const in_t* __restrict__ x, float* shared) {
    float m = __int_as_float(0xff800000);  // -inf (NVRTC does not define INFINITY)
    for (int c = threadIdx.x; c < NUM_CLASSES; c += BLOCK_SIZE) m = max_nan(m, load(x[c]));
    m = block_max(m, shared);
    float s = 0.0f;
    for (int c = threadIdx.x; c < NUM_CLASSES; c += BLOCK_SIZE) s += expf(load(x[c]) - m);
    s = block_sum(s, shared);
    RowStats r;
    r.max = m;
    r.sum = s;
    return r;
}

__device__ __forceinline__ float probability(float x, RowStats st) {
    return __fdiv_rn(expf(__fsub_rn(x, st.max)), st.sum);
}

// scores[row, :K_EFF] and indices[row, :K_EFF]; launch grid = n_rows, block = BLOCK_SIZE.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) softmax_topk(
    const in_t* __restrict__ logits,
    int n_rows,
    long long* __restrict__ out_indices,
    float* __restrict__ out_scores) {
    __shared__ float shared_v[NUM_WARPS];
    __shared__ int shared_i[NUM_WARPS];
    const int row = blockIdx.x;
    if (row >= n_rows) return;  // uniform per block: no thread skips a barrier
    const in_t* x = logits + (long long)row * NUM_CLASSES;
#if APPLY_SOFTMAX
    const RowStats st = row_stats(x, shared_v);
#endif
    float prev_v = 0.0f;
    int prev_i = -1;
    for (int k = 0; k < K_EFF; ++k) {
        float best_v = 0.0f;
        int best_i = -1;
        for (int c = threadIdx.x; c < NUM_CLASSES; c += BLOCK_SIZE) {
#if APPLY_SOFTMAX
            const float v = probability(load(x[c]), st);
#else
            const float v = load(x[c]);
#endif
            // Eligible: anything in pass 0, afterwards only what follows the last pick.
            const bool eligible = k == 0 || before(prev_v, prev_i, v, c);
            if (eligible && before(v, c, best_v, best_i)) {
                best_v = v;
                best_i = c;
            }
        }
        block_best(best_v, best_i, shared_v, shared_i);
        if (threadIdx.x == 0) {
            out_indices[(long long)row * K_EFF + k] = best_i;
            out_scores[(long long)row * K_EFF + k] = best_v;
        }
        prev_v = best_v;
        prev_i = best_i;
    }
}

// probabilities[row, :NUM_CLASSES] (softmax without top-k); launch as softmax_topk.
extern "C" __global__ void __launch_bounds__(BLOCK_SIZE) softmax_rows(
    const in_t* __restrict__ logits, int n_rows, float* __restrict__ out) {
    __shared__ float shared[NUM_WARPS];
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const in_t* x = logits + (long long)row * NUM_CLASSES;
    const RowStats st = row_stats(x, shared);
    float* y = out + (long long)row * NUM_CLASSES;
    for (int c = threadIdx.x; c < NUM_CLASSES; c += BLOCK_SIZE) y[c] = probability(load(x[c]), st);
}
