"""The GPU inference stage: ``stage`` (the loop side), ``launch`` (the thread
side that enqueues work on CUDA streams), ``slots`` (preallocated per-stream
buffers), ``kernels`` (CuPy RawKernels from kernels/), ``plan`` (start-up
decisions). Imports without CuPy; CUDA is touched only when a stage is built.
"""
