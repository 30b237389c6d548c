# syntax=docker/dockerfile:1
# moe-eplb images. Build one target at a time:
#   docker build --target vllm -t ghcr.io/moe-eplb/vllm:v0.32.0 .       # vLLM + the EPLB exporter plugin
#   docker build --target operator -t ghcr.io/moe-eplb/operator:0.1.0 .  # the operator (default target)
# The chart's default image (charts/moe-eplb-operator/values.yaml image.*) is
# ghcr.io/moe-eplb/operator with the chart's appVersion as tag; the CRD's default engine image is the
# vllm target. The operator stage stays LAST so that it is the default target.

# Base images (global build args: declared before the first FROM so every stage can use them).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
ARG OPERATOR_PYTHON=python:3.11.11-slim-bookworm

# ==== vllm =======================================================================================
# The vLLM runtime the operator deploys by default (CRD default spec.engine.image): the official
# vLLM OpenAI server image at a pinned version, plus this package so that vLLM loads the per-expert
# load exporter plugin (entry point moe_eplb_exporter in vllm.general_plugins; see docs/exporter.md).
# Only the package and the base dependencies it needs at run time (numpy, pyyaml, prometheus-client,
# click, rich: all lower bounds that vLLM's own dependencies already satisfy, so nothing of vLLM's is
# replaced); never the [operator] extra (kopf, kubernetes, ...).
# Supported vLLM versions for the exporter: 0.12.0 - 0.32.x (change VLLM_IMAGE to rebuild on another).
FROM ${VLLM_IMAGE} AS vllm
LABEL org.opencontainers.image.title="vLLM with the moe-eplb per-expert load exporter" \
      org.opencontainers.image.description="Official vLLM OpenAI image + moe-eplb exporter plugin (port 9400, /metrics)" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY pyproject.toml README.md /tmp/moe-eplb/
COPY operator/ /tmp/moe-eplb/operator/
RUN set -eux; \
    if command -v uv >/dev/null 2>&1; then PIP="uv pip install --system --no-cache"; \
    else PIP="python3 -m pip install --no-cache-dir"; fi; \
    $PIP --no-deps /tmp/moe-eplb; \
    $PIP "numpy>=1.26,<3" "pyyaml>=6" "prometheus-client>=0.20" "click>=8" "rich>=13"; \
    rm -rf /tmp/moe-eplb; \
    python3 -c "import moe_eplb.exporter.plugin, vllm; from importlib.metadata import entry_points; \
assert 'moe_eplb_exporter' in {e.name for e in entry_points(group='vllm.general_plugins')}; \
print('moe-eplb exporter plugin installed for vLLM', vllm.__version__)"
# VLLM_PLUGINS is an allow-list: add other general plugins here, comma-separated, if you need them.
# MOE_EPLB_EXPORTER_MODE=full|reduced|off (reduced keeps a DeepSeek-V3 pod under 20k series).
ENV VLLM_PLUGINS=moe_eplb_exporter \
    MOE_EPLB_EXPORTER_PORT=9400 \
    MOE_EPLB_EXPORTER_MODE=full
# 8000: vLLM's OpenAI API and its own /metrics (port name http); 9400: the exporter (eplb-metrics)
EXPOSE 8000 9400
# ENTRYPOINT is the base image's (vllm serve ...); the operator passes the model and engine args.

# ==== operator ===================================================================================
# Slim, pinned Python; the package and its [operator] extra are installed into a venv in a build
# stage, and only that venv is copied into the final image (no compiler, no pip cache).
# (OPERATOR_PYTHON is declared with the other base images at the top: a global ARG must precede the first FROM)

FROM ${OPERATOR_PYTHON} AS operator-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/moe-eplb
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
# The product distribution only: the simulated cluster, the demo and the test rigs are a distribution
# of their own (harness/, docs/architecture.md) that is neither in the build context nor a dependency.
RUN /opt/moe-eplb/bin/pip install ".[operator]" \
 && /opt/moe-eplb/bin/moe-eplb --version \
 && ! /opt/moe-eplb/bin/python -c "import moe_eplb_harness" 2>/dev/null

FROM ${OPERATOR_PYTHON} AS operator
LABEL org.opencontainers.image.title="moe-eplb operator" \
      org.opencontainers.image.description="Kubernetes operator for MoE models on vLLM with EPLB, and EPLB autotuning" \
      org.opencontainers.image.licenses="Apache-2.0"
# a fixed non-root user; the chart runs the pod as 10001 with a read-only root filesystem
RUN groupadd --system --gid 10001 moe-eplb \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin moe-eplb
COPY --from=operator-build /opt/moe-eplb /opt/moe-eplb
# NUMBA_CACHE_DIR: the policy's compiled kernels (moe_eplb.eplb.replay.kernels) are cached in the /tmp
# emptyDir (the package directory is read-only, HOME does not exist): compiled once per pod, not
# once per process.
ENV PATH=/opt/moe-eplb/bin:$PATH \
    NUMBA_CACHE_DIR=/tmp/numba-cache \
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
