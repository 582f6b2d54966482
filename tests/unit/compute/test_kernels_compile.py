"""kernels/*.cu compile without a GPU, with the defines the worker injects at run time.

Three checks, each skipped with its reason when its tool is missing (kernels/ops.cu
is also run on the CPU, in test_ops_cu_on_cpu.py):

- ``nvcc -ptx`` for sm_80 and sm_90, for the default defines and for the exact
  ``-D`` sets ``worker.kernels`` builds from configs (NHWC, half output, 3 and 4
  channels, softmax off, top-k 5, half logits, k larger than the row);
- NVRTC, which is what CuPy compiles RawModules with at run time, and which is
  stricter than nvcc (no implicit host headers: no ``INFINITY``, no
  ``cuda_fp16.h``); found in the ``nvidia-cuda-nvrtc-cu12`` wheel or on the
  library path;
- preprocess.cu compiled as *host* C++ (a few shims for the CUDA intrinsics) and
  run on the CPU must equal the NumPy reference bit for bit: the kernel's index
  arithmetic and float operation order are the reference's, independently of a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import importlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.models import image_pre
from worker.compute.gpu import kernels
from worker.compute.gpu import ops as gpu_ops
from worker.compute.gpu.slots import pack_images
from worker.model.preprocess import ImagePreprocess, preprocess

KERNELS = kernels.kernel_dir()
ARCHS = ("80", "90")

PRE_CONFIGS = {
    "digits": image_pre(),
    "rgb-nhwc-half": image_pre(
        size=(224, 224),
        channels=3,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        layout="NHWC",
        dtype="float16",
    ),
    "rgba-nchw-f32": image_pre(
        size=(31, 17), channels=4, mean=(0.1, 0.2, 0.3, 0.4), std=(1.0, 2.0, 3.0, 0.5)
    ),
}
POST_DEFINES = {
    "digits-softmax-top3": kernels.postprocess_defines(10, 3, True, "float32"),
    "raw-top5-half": kernels.postprocess_defines(1000, 5, False, "float16"),
    "k-over-row": kernels.postprocess_defines(3, 5, True, "float32"),
    "wide-row": kernels.postprocess_defines(21843, 5, True, "float32"),
}
COMBOS: dict[str, tuple[str, kernels.Defines]] = {
    "preprocess-defaults": ("preprocess.cu", ()),
    **{
        f"preprocess-{k}": ("preprocess.cu", kernels.preprocess_defines(c))
        for k, c in PRE_CONFIGS.items()
    },
    "postprocess-defaults": ("postprocess.cu", ()),
    **{f"postprocess-{k}": ("postprocess.cu", d) for k, d in POST_DEFINES.items()},
    # The pipeline ops (worker.compute.gpu.ops): crops of each channel count the
    # kernel takes, a wide one, and NMS's own specialisation (none).
    "ops-defaults": ("ops.cu", ()),
    "ops-nms": ("ops.cu", gpu_ops.NMS_DEFINES),
    "ops-crop-48x320-rgb": ("ops.cu", gpu_ops.crop_defines((48, 320), 3)),
    "ops-crop-1x1-grey": ("ops.cu", gpu_ops.crop_defines((1, 1), 1)),
    "ops-crop-7x5-rgba": ("ops.cu", gpu_ops.crop_defines((7, 5), 4)),
}


def test_every_kernel_file_is_covered() -> None:
    on_disk = {p.name for p in KERNELS.glob("*.cu")}
    assert on_disk == set(kernels.KERNEL_FILES)
    assert on_disk == {file for file, _ in COMBOS.values()}


# --- nvcc ---------------------------------------------------------------------------


def _nvcc(file: str, defines: kernels.Defines, arch: str, out: Path) -> tuple[int, str]:
    cmd = [
        "nvcc", "-ptx", f"-arch=sm_{arch}", *kernels.compile_options(defines),
        "-o", str(out), str(KERNELS / file),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, proc.stderr


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[int, str, Path]]:
    """Every (combo, arch) compiled once, in parallel."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: cannot compile-check kernels/*.cu")
    out_dir = tmp_path_factory.mktemp("ptx")
    jobs = [(name, arch) for name in COMBOS for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {
            job: pool.submit(_nvcc, *COMBOS[job[0]], job[1], out_dir / f"{job[0]}.{job[1]}.ptx")
            for job in jobs
        }
        return {
            job: (*fut.result(), out_dir / f"{job[0]}.{job[1]}.ptx") for job, fut in futures.items()
        }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("combo", list(COMBOS))
def test_nvcc_compiles_to_ptx(
    ptx: dict[tuple[str, str], tuple[int, str, Path]], combo: str, arch: str
) -> None:
    rc, stderr, out = ptx[(combo, arch)]
    assert rc == 0, f"nvcc failed for {combo} sm_{arch}:\n{stderr}"
    text = out.read_text()
    for entry in kernels.ENTRY_POINTS[COMBOS[combo][0]]:
        assert f".entry {entry}(" in text, f'{entry} missing from the PTX (not extern "C"?)'


def test_preprocess_ptx_has_no_fused_multiply_add(
    ptx: dict[tuple[str, str], tuple[int, str, Path]],
) -> None:
    # An FMA rounds once where NumPy rounds twice: the reference would not match
    # (ops.cu's NMS IoU included).
    for combo in (c for c in COMBOS if c.startswith(("preprocess", "ops"))):
        for arch in ARCHS:
            text = ptx[(combo, arch)][2].read_text()
            assert "fma.rn.f32" not in text, f"{combo} sm_{arch} contracts into FMA"


# --- NVRTC (what CuPy uses) ---------------------------------------------------------


def _find_nvrtc() -> ctypes.CDLL | None:
    candidates: list[str] = []
    try:
        pkg = importlib.import_module("nvidia.cuda_nvrtc")  # the nvidia-cuda-nvrtc-cu12 wheel
        lib_dir = Path(next(iter(pkg.__path__))) / "lib"
        candidates += sorted(str(p) for p in lib_dir.glob("libnvrtc.so*") if "alt" not in p.name)
    except ImportError:
        pass
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for cand in candidates:
        try:
            return ctypes.CDLL(cand)
        except OSError:
            continue
    return None


@pytest.fixture(scope="module")
def nvrtc() -> ctypes.CDLL:
    lib = _find_nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12 to check NVRTC)")
    return lib


def _nvrtc_compile(lib: ctypes.CDLL, source: str, options: list[str]) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram: {rc}"
    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
        return rc, buf.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("combo", list(COMBOS))
def test_nvrtc_compiles(nvrtc: ctypes.CDLL, combo: str) -> None:
    file, defines = COMBOS[combo]
    source = kernels.kernel_source(file)
    for arch in ARCHS:
        options = [*kernels.compile_options(defines), f"--gpu-architecture=compute_{arch}"]
        rc, log = _nvrtc_compile(nvrtc, source, options)
        assert rc == 0, f"NVRTC failed for {combo} compute_{arch}:\n{log}"


# --- preprocess.cu on the CPU vs the NumPy reference ---------------------------------

HOST_SHIM = r"""
#include <math.h>
#include <algorithm>
#include <cstdio>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
struct HostDim3 { unsigned x, y, z; };
static HostDim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};
static HostDim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
// IEEE single operations, each rounded (compiled with -ffp-contract=off).
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
using std::min;
#include "preprocess.cu"

static std::vector<char> slurp(const char* path) {
    FILE* f = fopen(path, "rb");
    std::vector<char> data;
    char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) data.insert(data.end(), buf, buf + n);
    fclose(f);
    return data;
}

int main(int argc, char** argv) {  // packed.bin table.bin n_images out.bin
    std::vector<char> packed = slurp(argv[1]), table = slurp(argv[2]);
    int n = atoi(argv[3]);
    std::vector<float> out((size_t)n * OUT_H * OUT_W * CHANNELS);
    // One "thread": the kernel's grid-stride loop covers every output pixel.
    preprocess_batch((const unsigned char*)packed.data(), (const long long*)table.data(), n,
                     out.data());
    FILE* f = fopen(argv[4], "wb");
    fwrite(out.data(), sizeof(float), out.size(), f);
    fclose(f);
    return 0;
}
"""


@pytest.fixture(scope="module")
def host_compiler() -> str:
    for cc in ("g++", "clang++", "c++"):
        path = shutil.which(cc)
        if path:
            return path
    pytest.skip("no host C++ compiler to run preprocess.cu on the CPU")


def _host_preprocess(
    cxx: str, work: Path, images: list[np.ndarray], cfg: ImagePreprocess
) -> np.ndarray:
    cfg32 = dataclasses.replace(cfg, dtype="float32")
    exe = work / "pre"
    src = work / "shim.cpp"
    src.write_text(HOST_SHIM)
    flags = [f"-D{k}={v}" for k, v in kernels.preprocess_defines(cfg32)]
    cmd = [cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-I", str(KERNELS), *flags,
           "-o", str(exe), str(src)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    total = sum(img.size for img in images)
    packed = np.zeros(total, np.uint8)
    table = np.zeros((len(images), 3), np.int64)
    pack_images(images, packed, table)
    packed.tofile(work / "packed.bin")
    table.tofile(work / "table.bin")
    out = work / "out.bin"
    subprocess.run([str(exe), str(work / "packed.bin"), str(work / "table.bin"),
                    str(len(images)), str(out)], check=True, timeout=60)  # fmt: skip
    h, w = cfg.size
    shape = (
        (len(images), cfg.channels, h, w)
        if cfg.layout == "NCHW"
        else (len(images), h, w, cfg.channels)
    )
    return np.fromfile(out, dtype=np.float32).reshape(shape)


def _images(rng: np.random.Generator, channels: int) -> Iterator[np.ndarray]:
    sizes = [(1, 1), (2, 3), (8, 8), (9, 7), (17, 31), (64, 5), (31, 17), (100, 1), (3, 250)]
    for h, w in sizes:
        yield rng.integers(0, 256, (h, w, channels), dtype=np.uint8)


@pytest.mark.parametrize("name", ["digits", "rgb-nhwc-half", "rgba-nchw-f32"])
def test_preprocess_kernel_source_matches_numpy_bit_for_bit(
    host_compiler: str, tmp_path: Path, name: str
) -> None:
    cfg = PRE_CONFIGS[name]
    if name == "rgb-nhwc-half":  # keep the host run small; same code path
        cfg = dataclasses.replace(cfg, size=(37, 23))
    rng = np.random.default_rng(7)
    images = list(_images(rng, cfg.channels))
    got = _host_preprocess(host_compiler, tmp_path, images, cfg)
    want = preprocess(images, dataclasses.replace(cfg, dtype="float32"))
    assert got.shape == want.shape
    diff = np.abs(got - want)
    assert np.array_equal(got, want), (
        f"max diff {diff.max()} at {np.unravel_index(diff.argmax(), diff.shape)}"
    )
