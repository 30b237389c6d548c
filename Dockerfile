# syntax=docker/dockerfile:1
# moe-eplb images. Build one target at a time:
#   docker build --target vllm -t ghcr.io/moe-eplb/vllm:v0.32.0 .       # vLLM + the EPLB exporter plugin
#   docker build --target operator -t ghcr.io/moe-eplb/operator:0.1.0 .  # the operator (default target)
# The chart's default image (charts/moe-eplb-operator/values.yaml image.*) is
# ghcr.io/moe-eplb/operator with the chart's appVersion as tag; the CRD's default engine image is the
# vllm target. The operator stage stays LAST so that it is the default target.

# ==== operator ===================================================================================
# Slim, pinned Python; the package and its [operator] extra are installed into a venv in a build
# stage, and only that venv is copied into the final image (no compiler, no pip cache).
ARG OPERATOR_PYTHON=python:3.11.11-slim-bookworm

FROM ${OPERATOR_PYTHON} AS operator-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/moe-eplb
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
RUN /opt/moe-eplb/bin/pip install ".[operator]" \
 && /opt/moe-eplb/bin/moe-eplb --version

FROM ${OPERATOR_PYTHON} AS operator
LABEL org.opencontainers.image.title="moe-eplb operator" \
      org.opencontainers.image.description="Kubernetes operator for MoE models on vLLM with EPLB, and EPLB autotuning" \
      org.opencontainers.image.licenses="Apache-2.0"
# a fixed non-root user; the chart runs the pod as 10001 with a read-only root filesystem
RUN groupadd --system --gid 10001 moe-eplb \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin moe-eplb
COPY --from=operator-build /opt/moe-eplb /opt/moe-eplb
ENV PATH=/opt/moe-eplb/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MOE_EPLB_METRICS_PORT=8080 \
    MOE_EPLB_HEALTH_PORT=8081
USER 10001:10001
# 8080: Prometheus metrics (/metrics); 8081: health (/healthz, kopf's liveness endpoint)
EXPOSE 8080 8081
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('MOE_EPLB_HEALTH_PORT', '8081'), timeout=4)"]
ENTRYPOINT ["moe-eplb"]
CMD ["run"]
