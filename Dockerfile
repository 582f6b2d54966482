# CPU image: ONNX Runtime engine, the bundled model, configuration by
# INFER_WORKER_* environment variables (or a TOML file passed with --config).
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY kernels ./kernels
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim
RUN useradd --create-home --uid 10001 worker
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY worker.example.toml /etc/infer-worker/worker.toml
USER worker
EXPOSE 9108
ENTRYPOINT ["infer-worker"]
CMD ["run", "--config", "/etc/infer-worker/worker.toml"]
