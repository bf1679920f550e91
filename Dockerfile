# syntax=docker/dockerfile:1
# The endpoint picker image: `docker build -t epp .` (see README, "Container").

# --- build: wheels for the package and its dependencies -----------------------------------------
# The full image, for its C compiler: the package has two small extensions (epp/prefix/_native.c,
# epp/wire/_fast.c).
FROM python:3.11 AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY epp ./epp
COPY plugins ./plugins
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# --- run: a slim interpreter, the installed wheels, and nothing else ------------------------------
FROM python:3.11-slim
# No .pyc writes (the Kubernetes manifests mount the root filesystem read-only); logs unbuffered.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# inference_extension_info's commit label: `docker build --build-arg EPP_BUILD_COMMIT=$(git rev-parse HEAD) .`
# (its build_ref label is the package's version unless EPP_BUILD_REF is set).
ARG EPP_BUILD_COMMIT=""
ENV EPP_BUILD_COMMIT=${EPP_BUILD_COMMIT}
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin epp
# The wheels are bind-mounted from the build stage, so they never become a layer of this image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels epp && \
    # xds-protos' old copy of opentelemetry/proto may have replaced opentelemetry-proto's (--tracing needs it).
    pip install --no-cache-dir --no-index --find-links=/wheels --no-deps --force-reinstall opentelemetry-proto
USER 65532:65532
# gRPC ext_proc, gRPC health, Prometheus /metrics (the upstream picker's ports).
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp", "serve"]
