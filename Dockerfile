# syntax=docker/dockerfile:1
# Switchyard on a CUDA runtime base. With a GPU (NVIDIA container toolkit) the RAPIDS engines are selected;
# without one the same image runs its CPU and PostgreSQL engines (GET /v1/engines says why GPU ones are off).
# Build a CPU-only image with:  docker build --build-arg EXTRAS= -t switchyard:cpu .
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE} AS build
ARG EXTRAS=gpu
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Every top-level package the wheel holds (tests/test_artifacts.py builds the wheel from exactly these files).
COPY pyproject.toml README.md ./
COPY service ./service
COPY indexes ./indexes
COPY spatial ./spatial
COPY olap ./olap
COPY migrations ./migrations
COPY loadtests ./loadtests
COPY client ./client
RUN pip install ./client ".${EXTRAS:+[$EXTRAS]}"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --create-home switchyard \
 && mkdir -p /var/lib/switchyard && chown switchyard /var/lib/switchyard
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    SWITCHYARD_HOST=0.0.0.0 \
    SWITCHYARD_PORT=8000 \
    SWITCHYARD_DATA_DIR=/var/lib/switchyard
USER switchyard
VOLUME /var/lib/switchyard
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=6 \
  CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4).status != 200)"]
# Exec form: the service is PID 1 and receives SIGTERM itself, for a graceful drain.
CMD ["switchyard", "serve"]
