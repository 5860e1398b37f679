# vllmfit: the operator (`vllmfit operator`), the node agent (`vllmfit agent`) and the CLI.
#   docker build -t ghcr.io/vllmfit/vllmfit:0.1.0 .
# The Helm chart (charts/vllmfit) runs this image as uid 65532 with a read-only root filesystem.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
WORKDIR /src
# Dependencies first (cached while only the source changes), from the hashed lock files: every
# package pinned, every downloaded file checked against its sha256 (`make lock` regenerates them).
COPY requirements/ requirements/
RUN /opt/venv/bin/pip install --require-hashes --no-deps -r requirements/build.txt -r requirements/runtime.txt
COPY . .
# The project itself, built offline with the locked setuptools (the catalog is package data).
RUN /opt/venv/bin/pip wheel --no-deps --no-build-isolation --no-index -w /tmp/dist . \
 && /opt/venv/bin/pip install --no-deps --no-index /tmp/dist/vllmfit-*.whl \
 && /opt/venv/bin/vllmfit --version \
 && /opt/venv/bin/vllmfit gpus --output json > /dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="vllmfit" \
      org.opencontainers.image.description="Fit vLLM deployments onto shared GPUs without out-of-memory" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/vllmfit/vllmfit"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
USER 65532:65532
ENTRYPOINT ["vllmfit"]
CMD ["--help"]
