"""kernels/ops.cu itself, compiled as host C++ (a few shims for the CUDA built-ins) and
run on the CPU: its crops equal Pillow's (``crops.crop_boxes``) bit for bit and its
NMS mask, walked as ``worker.compute.gpu.ops`` walks it, keeps the CPU ``nms``'s
indices. The twin's NumPy references are checked in test_gpu_ops.py; this checks the
CUDA source's arithmetic, which a GPU then only has to run (tests/gpu/test_gpu_ops.py).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.unit.compute.test_gpu_ops import random_boxes, random_detections
from worker.compute.gpu import kernels
from worker.compute.gpu import ops as gpu_ops
from worker.compute.gpu.resample import crop_plan
from worker.compute.ops.crops import crop_boxes
from worker.compute.ops.nms import nms

SHIM = r"""
#include <math.h>
#include <stdlib.h>
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
struct HostDim3 { unsigned x, y, z; };
static HostDim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};
static HostDim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
static inline void __syncthreads() {}
// IEEE single operations, each rounded (compiled with -ffp-contract=off).
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
using std::min;
#include "ops.cu"

template <class T> static std::vector<T> slurp(const char* path) {
    FILE* f = fopen(path, "rb");
    std::vector<T> data;
    T v;
    while (fread(&v, sizeof v, 1, f) == 1) data.push_back(v);
    fclose(f);
    return data;
}

int main(int argc, char** argv) {
    if (argv[1][0] == 'c') {  // crop DIR n h_taps v_taps tmp_bytes out_bytes
        std::string d = argv[2];
        int n = atoi(argv[3]), ht = atoi(argv[4]), vt = atoi(argv[5]);
        auto src = slurp<unsigned char>((d + "/src").c_str());
        auto first = slurp<long long>((d + "/first").c_str());
        auto second = slurp<long long>((d + "/second").c_str());
        auto hb = slurp<int>((d + "/hb").c_str()), hc = slurp<int>((d + "/hc").c_str());
        auto vb = slurp<int>((d + "/vb").c_str()), vc = slurp<int>((d + "/vc").c_str());
        std::vector<unsigned char> tmp(atol(argv[6]) + 1), out(atol(argv[7]));
        // One "thread" and one box row of blocks: the loops cover every box and pixel.
        crop_resize_pass(src.data(), first.data(), hb.data(), hc.data(), ht, vb.data(),
                         vc.data(), vt, n, tmp.data());
        crop_resize_pass(tmp.data(), second.data(), hb.data(), hc.data(), ht, vb.data(),
                         vc.data(), vt, n, out.data());
        FILE* f = fopen((d + "/out").c_str(), "wb");
        fwrite(out.data(), 1, out.size(), f);
        fclose(f);
    } else {  // nms DIR n threshold
        std::string d = argv[2];
        int n = atoi(argv[3]);
        float threshold = strtof(argv[4], nullptr);
        auto boxes = slurp<float>((d + "/boxes").c_str());
        auto order = slurp<long long>((d + "/order").c_str());
        int tiles = (n + NMS_BLOCK - 1) / NMS_BLOCK;
        std::vector<unsigned long long> mask((size_t)n * tiles);
        gridDim = {(unsigned)tiles, (unsigned)tiles, 1};
        blockDim = {NMS_BLOCK, 1, 1};
        for (unsigned by = 0; by < (unsigned)tiles; ++by)
            for (unsigned bx = 0; bx < (unsigned)tiles; ++bx)
                // Threads run one after another, so each block runs twice: the first
                // round fills the shared tile, the second computes with all of it
                // (and writes every word again).
                for (int round = 0; round < 2; ++round)
                    for (unsigned t = 0; t < NMS_BLOCK; ++t) {
                        blockIdx = {bx, by, 0};
                        threadIdx = {t, 0, 0};
                        nms_mask(boxes.data(), order.data(), n, threshold, mask.data());
                    }
        FILE* f = fopen((d + "/mask").c_str(), "wb");
        fwrite(mask.data(), 8, mask.size(), f);
        fclose(f);
    }
    return 0;
}
"""


def _build(work: Path, defines: kernels.Defines) -> Path:
    cxx = next((p for p in map(shutil.which, ("g++", "clang++", "c++")) if p), None)
    if cxx is None:
        pytest.skip("no host C++ compiler to run ops.cu on the CPU")
    (work / "shim.cpp").write_text(SHIM)
    exe = work / "ops"
    flags = [f"-D{k}={v}" for k, v in defines]
    subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-I", str(kernels.kernel_dir()),
                    *flags, "-o", str(exe), str(work / "shim.cpp")], check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    return exe


@pytest.mark.parametrize(("size", "channels"), [((17, 23), 3), ((48, 9), 1), ((1, 1), 3)])
def test_ops_cu_crops_equal_pillow(tmp_path: Path, size: tuple[int, int], channels: int) -> None:
    exe = _build(tmp_path, gpu_ops.crop_defines(size, channels))
    rng = np.random.default_rng(size[0] * 10 + channels)
    shapes = [(37, 53), (2, 1), (200, 9), (300, 400), (6, 700)]
    images = [rng.integers(0, 256, (h, w, channels), dtype=np.uint8) for h, w in shapes]
    boxes = [random_boxes(rng, 5, h, w) for h, w in shapes]
    offsets = list(np.cumsum([0] + [i.nbytes for i in images])[:-1])
    plan = crop_plan(shapes, offsets, boxes, size, channels)
    np.concatenate([i.reshape(-1) for i in images]).tofile(tmp_path / "src")
    tables = {"first": plan.first, "second": plan.second, "hb": plan.h_bounds,
              "hc": plan.h_coefs, "vb": plan.v_bounds, "vc": plan.v_coefs}  # fmt: skip
    for name, array in tables.items():
        np.ascontiguousarray(array).tofile(tmp_path / name)
    pairs = zip(images, boxes, strict=True)
    want = np.concatenate([crop_boxes(i, b, size)["crops"] for i, b in pairs])
    args = [plan.n_boxes, plan.h_coefs.shape[2], plan.v_coefs.shape[2], plan.tmp_bytes, want.size]
    subprocess.run([str(exe), "crop", str(tmp_path), *map(str, args)], check=True, timeout=120)
    got = np.fromfile(tmp_path / "out", np.uint8).reshape(want.shape)
    diff = np.abs(got.astype(int) - want)
    assert diff.max() == 0, f"{np.count_nonzero(diff)} values differ, by up to {diff.max()}"


def test_ops_cu_nms_mask_keeps_the_cpu_nms_indices(tmp_path: Path) -> None:
    exe = _build(tmp_path, gpu_ops.NMS_DEFINES)
    for n, ties in [(1, False), (64, True), (65, False), (300, True)]:
        boxes, scores = random_detections(np.random.default_rng(n), n, ties)
        order = np.argsort(-scores, kind="stable")
        boxes.tofile(tmp_path / "boxes")
        order.astype(np.int64).tofile(tmp_path / "order")
        for iou in (0.0, 0.3, 0.5, 1.0):
            threshold = float(np.float32(iou)).hex()
            subprocess.run([str(exe), "nms", str(tmp_path), str(n), threshold], check=True,
                           timeout=60)  # fmt: skip
            mask = np.fromfile(tmp_path / "mask", np.uint64).reshape(n, -1)
            kept = order[gpu_ops.greedy_keep(mask, scores[order], 0.0, 0)]
            np.testing.assert_array_equal(kept, nms(boxes, scores, iou)["indices"],
                                          err_msg=f"n {n} iou {iou}")  # fmt: skip
