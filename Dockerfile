# Two images, configured by INFER_WORKER_* environment variables (or a TOML file
# passed with --config):
#   docker build .               # CPU (the last stage, the default): ONNX Runtime, the bundled model
#   docker build --target gpu .  # GPU: CUDA, CuPy, torch; the bundled model as TorchScript
# Every stage installs within constraints.txt (scripts/lock.py): an image built
# today and one built next month hold the same versions until the pins move.
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY worker ./worker
COPY kernels ./kernels
RUN pip wheel --no-cache-dir --constraint constraints.txt --wheel-dir /wheels .

# GPU image: the worker with extras [gpu,torch,registry] (CuPy kernels, the torch engine on
# the CUDA-stream slot ring) on the CUDA runtime (NVRTC, which CuPy compiles the
# kernels with at start-up; torch's wheels bring their own CUDA libraries, so the
# host driver must support both CUDA 12.6 and the CUDA release of the torch wheel
# pip picks). Ubuntu 24.04's Python is 3.12, as in the CPU image. Run it with a
# GPU (`docker run --gpus 1`, or the compose profile `gpu`) and
# INFER_WORKER_MODEL__BACKEND=torch.
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04 AS gpu
ENV PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv
RUN useradd --create-home --uid 10001 worker
COPY --from=build /wheels /wheels
COPY constraints.txt /etc/infer-worker/constraints.txt
RUN pip install --no-cache-dir --constraint /etc/infer-worker/constraints.txt \
        --find-links /wheels "$(ls /wheels/infer_worker-*.whl)[gpu,torch,registry]" \
    && rm -rf /wheels
# The repository ships the digits model as ONNX (the CPU path's format): rebuild it
# as TorchScript for the torch engine, checked against ONNX Runtime on the held-out
# samples (the build fails if they differ). onnx is needed only to read the weights.
COPY scripts/digits_torchscript.py /tmp/digits_torchscript.py
RUN pip install --no-cache-dir --constraint /etc/infer-worker/constraints.txt onnx \
    && python /tmp/digits_torchscript.py /opt/infer-worker/models/digits.pt \
    && pip uninstall -y onnx \
    && rm /tmp/digits_torchscript.py
COPY worker.example.toml /etc/infer-worker/worker.toml
USER worker
EXPOSE 9108
ENTRYPOINT ["infer-worker"]
CMD ["run", "--config", "/etc/infer-worker/worker.toml"]

# CPU image: ONNX Runtime engine, the bundled model. The last stage, so a plain
# `docker build .` builds it.
FROM python:3.12-slim AS cpu
RUN useradd --create-home --uid 10001 worker
COPY --from=build /wheels /wheels
COPY constraints.txt /etc/infer-worker/constraints.txt
RUN pip install --no-cache-dir --constraint /etc/infer-worker/constraints.txt \
        --find-links /wheels "$(ls /wheels/infer_worker-*.whl)[registry]" \
    && rm -rf /wheels
COPY worker.example.toml /etc/infer-worker/worker.toml
USER worker
EXPOSE 9108
ENTRYPOINT ["infer-worker"]
CMD ["run", "--config", "/etc/infer-worker/worker.toml"]
