// Fused batch preprocessing: uint8 HWC images of any size -> normalised model input.
//
// Contract: identical to worker/preprocess.py (the NumPy reference), which the GPU
// tests compare against. Every float operation below uses the explicitly rounded
// intrinsics (__fmul_rn, __fadd_rn, __fsub_rn): nvcc and NVRTC contract a*b+c into
// an FMA by default, and an FMA rounds once where NumPy rounds twice, so without
// them the output would differ from the reference in the last bit.
//
// Input: all images of the batch packed back to back in one byte buffer (so one
// host-to-device copy moves the whole batch) plus a table with one row per image:
//   table[3*i + 0] = byte offset of image i in `src`
//   table[3*i + 1] = its height, table[3*i + 2] = its width
// (CHANNELS interleaved bytes per pixel, rows contiguous: the wire's C-order HWC.)
//
// One thread per output pixel computes all CHANNELS values of that pixel, so the
// bilinear weights and source offsets are computed once per pixel, not per channel.
// Grid-stride loop: any grid size covers any batch.
//
// Compile-time constants (injected as -D defines by worker/kernels.py; the defaults
// below only make the file compile standalone):
//   OUT_H, OUT_W      model input size
//   CHANNELS          1..4
//   LAYOUT_NCHW       1: [N, C, H, W]; 0: [N, H, W, C]
//   OUT_HALF          1: IEEE binary16 output (stored as its bit pattern); 0: float32
//   SCALE             applied to the 0..255 pixel value (float literal, e.g. a hex float)
//   MEAN_c, INV_STD_c per channel c < CHANNELS; INV_STD_c = float32(1) / float32(std_c),
//                     rounded exactly as the reference rounds it.

#ifndef OUT_H
#define OUT_H 224
#endif
#ifndef OUT_W
#define OUT_W 224
#endif
#ifndef CHANNELS
#define CHANNELS 3
#endif
#ifndef LAYOUT_NCHW
#define LAYOUT_NCHW 1
#endif
#ifndef OUT_HALF
#define OUT_HALF 0
#endif
#ifndef SCALE
#define SCALE 0x1.010102p-8f  // float32(1 / 255)
#endif
#ifndef MEAN_0
#define MEAN_0 0.0f
#endif
#ifndef MEAN_1
#define MEAN_1 0.0f
#endif
#ifndef MEAN_2
#define MEAN_2 0.0f
#endif
#ifndef MEAN_3
#define MEAN_3 0.0f
#endif
#ifndef INV_STD_0
#define INV_STD_0 1.0f
#endif
#ifndef INV_STD_1
#define INV_STD_1 1.0f
#endif
#ifndef INV_STD_2
#define INV_STD_2 1.0f
#endif
#ifndef INV_STD_3
#define INV_STD_3 1.0f
#endif

#if CHANNELS < 1 || CHANNELS > 4
#error "CHANNELS must be 1..4"
#endif

#if OUT_HALF
// The bit pattern of an IEEE binary16 value. Converted with the PTX instruction that
// cuda_fp16.h's __float2half_rn uses (round to nearest even, like NumPy's astype):
// no dependency on cuda_fp16.h being on NVRTC's include path.
typedef unsigned short out_t;
__device__ __forceinline__ out_t to_out(float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
#else
typedef float out_t;
__device__ __forceinline__ out_t to_out(float v) { return v; }
#endif

__device__ __forceinline__ float channel_mean(int c) {
    return c == 0 ? MEAN_0 : c == 1 ? MEAN_1 : c == 2 ? MEAN_2 : MEAN_3;
}

__device__ __forceinline__ float channel_inv_std(int c) {
    return c == 0 ? INV_STD_0 : c == 1 ? INV_STD_1 : c == 2 ? INV_STD_2 : INV_STD_3;
}

// Source coordinates of one output index along one axis, as the reference's _axis():
//   scale = float32(in / out) (the division in double, then rounded, like NumPy)
//   src   = clip((dst + 0.5) * scale - 0.5, 0, in - 1)
//   i0 = floor(src), i1 = min(i0 + 1, in - 1), frac = src - i0
struct Axis {
    int i0;
    int i1;
    float frac;
};

__device__ __forceinline__ Axis axis_coord(int dst, int n_in, float scale) {
    float src = __fsub_rn(__fmul_rn(__fadd_rn((float)dst, 0.5f), scale), 0.5f);
    src = fminf(fmaxf(src, 0.0f), (float)(n_in - 1));
    Axis a;
    a.i0 = (int)floorf(src);
    a.i1 = min(a.i0 + 1, n_in - 1);
    a.frac = __fsub_rn(src, (float)a.i0);
    return a;
}

__device__ __forceinline__ float lerp_rn(float a, float b, float w) {
    // a + (b - a) * w, rounded after every operation, in the reference's order.
    return __fadd_rn(a, __fmul_rn(__fsub_rn(b, a), w));
}

extern "C" __global__ void preprocess_batch(
    const unsigned char* __restrict__ src,
    const long long* __restrict__ table,
    int n_images,
    out_t* __restrict__ dst) {
    const long long pixels_per_image = (long long)OUT_H * OUT_W;
    const long long total = pixels_per_image * n_images;
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < total;
         p += (long long)gridDim.x * blockDim.x) {
        const int n = (int)(p / pixels_per_image);
        const int rem = (int)(p - (long long)n * pixels_per_image);
        const int y = rem / OUT_W;
        const int x = rem - y * OUT_W;

        const long long offset = table[3 * n + 0];
        const int in_h = (int)table[3 * n + 1];
        const int in_w = (int)table[3 * n + 2];
        const unsigned char* img = src + offset;

        const float scale_y = (float)((double)in_h / (double)OUT_H);
        const float scale_x = (float)((double)in_w / (double)OUT_W);
        const Axis ay = axis_coord(y, in_h, scale_y);
        const Axis ax = axis_coord(x, in_w, scale_x);

        const long long row0 = (long long)ay.i0 * in_w;
        const long long row1 = (long long)ay.i1 * in_w;
        const unsigned char* pa = img + (row0 + ax.i0) * CHANNELS;  // (y0, x0)
        const unsigned char* pb = img + (row0 + ax.i1) * CHANNELS;  // (y0, x1)
        const unsigned char* pc = img + (row1 + ax.i0) * CHANNELS;  // (y1, x0)
        const unsigned char* pd = img + (row1 + ax.i1) * CHANNELS;  // (y1, x1)

#pragma unroll
        for (int c = 0; c < CHANNELS; ++c) {
            const float top = lerp_rn((float)pa[c], (float)pb[c], ax.frac);
            const float bottom = lerp_rn((float)pc[c], (float)pd[c], ax.frac);
            const float pix = lerp_rn(top, bottom, ay.frac);
            // (pix * SCALE - mean) * inv_std, as the reference computes it.
            const float v = __fmul_rn(__fsub_rn(__fmul_rn(pix, SCALE), channel_mean(c)),
                                      channel_inv_std(c));
#if LAYOUT_NCHW
            const long long o = (((long long)n * CHANNELS + c) * OUT_H + y) * OUT_W + x;
#else
            const long long o = (((long long)n * OUT_H + y) * OUT_W + x) * CHANNELS + c;
#endif
            dst[o] = to_out(v);
        }
    }
}
