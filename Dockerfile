# kvgate's image. The builder makes the wheel from this tree (it compiles gateway/kv/native: BUILDER has a C
# compiler and Python's headers); the final stage installs it into a virtualenv with deploy/image/install.sh
# (the same script tests/deploy/test_image.py runs in a clean virtualenv) and keeps no compiler or build tool.
# BASE is any image with Python 3.11 (python3, venv, pip), BUILDER the same Python with gcc and its headers:
# the official ones by default; `make image` builds both on Debian bases made with mmdebstrap
# (scripts/images.py, docs/deploy.md).
#   docker build -t kvgate:0.1.0 .
#   podman build --build-arg BASE=localhost/kvgate-debian:bookworm \
#       --build-arg BUILDER=localhost/kvgate-debian-build:bookworm -t localhost/kvgate:dev .
# PIP_CERT and PIP_FIND_LINKS, when given, reach pip in the RUN steps (a private trust store, a local wheel
# folder mounted into the build); they are not kept in the image's environment.
ARG BASE=python:3.11-slim
ARG BUILDER=python:3.11

FROM ${BUILDER} AS build
ARG PIP_CERT
ARG PIP_FIND_LINKS
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway gateway
COPY lua lua
RUN python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE}
ARG PIP_CERT
ARG PIP_FIND_LINKS
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PATH=/opt/kvgate/bin:$PATH
COPY --from=build /wheels /wheels
COPY deploy/image/install.sh /usr/local/lib/kvgate/install.sh
RUN python3 -m venv /opt/kvgate \
    && sh /usr/local/lib/kvgate/install.sh /wheels \
    && rm -rf /wheels \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/kvgate --create-home kvgate
USER 10001:10001
WORKDIR /var/lib/kvgate
ENV KVGATE_DATA_DIR=/var/lib/kvgate KVGATE_STORE=/adapters KVGATE_HOST=0.0.0.0 KVGATE_PORT=8080
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "gateway.healthcheck"]
ENTRYPOINT ["kvgate"]
CMD ["serve"]
