// A pipeline's built-in ops on the GPU (worker/compute/ops: crop_boxes, nms; resize
// reuses preprocess.cu). Launched by worker/compute/gpu/ops.py.
//
// --- crop_boxes: crop_resize_pass, twice ------------------------------------------
//
// Contract: bit-exact with Pillow's Image.resize(size, BILINEAR) of each clipped crop
// (what worker.compute.ops.crops.crop_boxes calls). Pillow resizes in two separable
// passes with fixed-point integer coefficients and a uint8 intermediate rounded and
// clipped like the output; when it downscales, the filter's support grows with the
// scale (antialiasing), so an output pixel may read many source pixels. Which pass
// runs first depends on the box (Pillow 13 runs the vertical one first where the
// height shrinks more than twice as much as the width), so a pass is one generic
// kernel and each box's table row says which axis it resamples and where it reads.
// The coefficient tables and their bounds are computed on the host in double
// precision exactly as Pillow computes them (worker/compute/gpu/resample.py): the
// kernel only does the integer arithmetic, which has one answer wherever it runs.
//
// One pass, for n boxes (possibly of several images of different sizes). Box b writes
// a dense uint8 [R, X, CHANNELS] at dst + dst offset; output (r, x), tap i, channel c
// reads src[src offset + r*A + x*B + (start + i)*T + c], where (start, taps) and the
// weights are those of x (horizontal) or r (vertical) in the box's tables.
//   table    int64 [n, TABLE_COLS]: src offset, A, B, T (bytes), R, X, dst offset,
//            axis (0: horizontal, h_* tables by x; 1: vertical, v_* tables by r)
//   h_bounds int32 [n, OUT_W, 2]: first source index, taps used; h_coefs int32
//            [n, OUT_W, h_taps]: fixed-point weights (PRECISION_BITS)
//   v_bounds int32 [n, OUT_H, 2], v_coefs int32 [n, OUT_H, v_taps]: the same down
// Launched as source -> intermediate, then intermediate -> out [n, OUT_H, OUT_W, C].
//
// Integer range: weights are >= 0 (bilinear) and sum to 2^22 within a few units, so a
// sum is at most 255 * (2^22 + taps) + 2^21 < 2^31: int does not overflow, as in Pillow.
//
// --- nms: nms_mask ----------------------------------------------------------------
//
// torchvision's CUDA NMS scheme: boxes in descending score order (a stable device
// argsort, given as `order`), one block of NMS_BLOCK threads per 64x64 tile of
// (row box, column box); each row box's thread writes one 64-bit word: bit j set where
// column box j (later in the order) is suppressed by it. The greedy walk over the
// words is on the host (worker/compute/gpu/ops.py). IoU in float32 with each
// operation rounded (__f*_rn: no FMA contraction) in the order the NumPy reference
// computes it, and NaN handled as NumPy does, so each decision equals the reference's.
//
// Compile-time constants (-D defines from worker/compute/gpu/ops.py; the defaults
// only make the file compile standalone): OUT_H, OUT_W (crop size), CHANNELS (1..4).

#ifndef OUT_H
#define OUT_H 48
#endif
#ifndef OUT_W
#define OUT_W 48
#endif
#ifndef CHANNELS
#define CHANNELS 3
#endif

#if CHANNELS < 1 || CHANNELS > 4
#error "CHANNELS must be 1..4"
#endif

#define PRECISION_BITS 22  // Pillow's: 32 - 8 - 2
#define TABLE_COLS 8
#define NMS_BLOCK 64       // boxes a tile side: the bits of one mask word

typedef unsigned char u8;

// Pillow's clip8: the fixed-point sum's integer part, clamped to 0..255 (its lookup
// table is indexed by in >> PRECISION_BITS, an arithmetic shift).
__device__ __forceinline__ u8 clip8(int in) {
    const int v = in >> PRECISION_BITS;
    return (u8)(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// Boxes along grid y (looped past gridDim.y), a box's pixels grid-strided along x.
extern "C" __global__ void crop_resize_pass(
    const u8* __restrict__ src,
    const long long* __restrict__ table,
    const int* __restrict__ h_bounds,
    const int* __restrict__ h_coefs,
    int h_taps,
    const int* __restrict__ v_bounds,
    const int* __restrict__ v_coefs,
    int v_taps,
    int n_boxes,
    u8* __restrict__ dst) {
    for (int b = blockIdx.y; b < n_boxes; b += gridDim.y) {
        const long long* row = table + (long long)b * TABLE_COLS;
        const long long a_step = row[1], b_step = row[2], t_step = row[3];
        const long long cols = row[5];
        const long long total = row[4] * cols;
        const bool vertical = row[7] != 0;
        const u8* in = src + row[0];
        u8* out = dst + row[6];
        for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < total;
             p += (long long)gridDim.x * blockDim.x) {
            const long long r = p / cols;
            const long long x = p - r * cols;
            const long long at = vertical ? (long long)b * OUT_H + r : (long long)b * OUT_W + x;
            const int* bounds = vertical ? v_bounds : h_bounds;
            const int* k = vertical ? v_coefs + at * v_taps : h_coefs + at * h_taps;
            const int start = bounds[2 * at];
            const int taps = bounds[2 * at + 1];
            const u8* s = in + r * a_step + x * b_step + start * t_step;
            int acc[CHANNELS];
#pragma unroll
            for (int c = 0; c < CHANNELS; ++c) acc[c] = 1 << (PRECISION_BITS - 1);
            for (int i = 0; i < taps; ++i) {
                const int w = k[i];
#pragma unroll
                for (int c = 0; c < CHANNELS; ++c) acc[c] += (int)s[i * t_step + c] * w;
            }
            u8* d = out + p * CHANNELS;
#pragma unroll
            for (int c = 0; c < CHANNELS; ++c) d[c] = clip8(acc[c]);
        }
    }
}

// NumPy's maximum/minimum propagate NaN where fmaxf/fminf drop it; a + b is NaN then.
__device__ __forceinline__ float np_max(float a, float b) {
    return (a != a || b != b) ? a + b : fmaxf(a, b);
}
__device__ __forceinline__ float np_min(float a, float b) {
    return (a != a || b != b) ? a + b : fminf(a, b);
}

__device__ __forceinline__ float box_area(const float* b) {
    return __fmul_rn(np_max(0.0f, __fsub_rn(b[2], b[0])), np_max(0.0f, __fsub_rn(b[3], b[1])));
}

// Whether `b` is suppressed by the higher-scored `a`: the reference keeps b only where
// iou <= threshold, so a NaN IoU suppresses too.
__device__ __forceinline__ bool suppresses(const float* a, const float* b, float threshold) {
    const float w = np_max(0.0f, __fsub_rn(np_min(a[2], b[2]), np_max(a[0], b[0])));
    const float h = np_max(0.0f, __fsub_rn(np_min(a[3], b[3]), np_max(a[1], b[1])));
    const float inter = __fmul_rn(w, h);
    const float uni = __fsub_rn(__fadd_rn(box_area(a), box_area(b)), inter);
    const float iou = uni > 0.0f ? __fdiv_rn(inter, uni) : 0.0f;
    return !(iou <= threshold);
}

// Grid (column tiles, row tiles), NMS_BLOCK threads. mask: uint64 [n, column tiles];
// only the words at or right of a row's own tile are written (all the walk reads).
extern "C" __global__ void nms_mask(
    const float* __restrict__ boxes,
    const long long* __restrict__ order,
    int n,
    float threshold,
    unsigned long long* __restrict__ mask) {
    const int row_tile = blockIdx.y;
    const int col_tile = blockIdx.x;
    if (row_tile > col_tile) return;
    const int rows = min(n - row_tile * NMS_BLOCK, NMS_BLOCK);
    const int cols = min(n - col_tile * NMS_BLOCK, NMS_BLOCK);
    __shared__ float tile[NMS_BLOCK * 4];
    if (threadIdx.x < cols) {
        const float* b = boxes + 4 * order[col_tile * NMS_BLOCK + threadIdx.x];
#pragma unroll
        for (int j = 0; j < 4; ++j) tile[threadIdx.x * 4 + j] = b[j];
    }
    __syncthreads();
    if (threadIdx.x < rows) {
        const int i = row_tile * NMS_BLOCK + threadIdx.x;
        const float* a = boxes + 4 * order[i];
        unsigned long long bits = 0;
        for (int j = row_tile == col_tile ? threadIdx.x + 1 : 0; j < cols; ++j) {
            if (suppresses(a, tile + j * 4, threshold)) bits |= 1ULL << j;
        }
        mask[(long long)i * gridDim.x + col_tile] = bits;
    }
}
