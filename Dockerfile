# kvgate's image. The builder makes the wheel from this tree; the final stage installs it with
# deploy/image/install.sh (the same script tests/test_image.py runs in a clean virtualenv: no container
# engine runs here) and keeps no compiler or build tool. Kubernetes: deploy/ and docs/deploy.md.
#   docker build -t kvgate:0.1.0 .

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY lua lua
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY --from=build /wheels /wheels
COPY deploy/image/install.sh /usr/local/lib/kvgate/install.sh
RUN sh /usr/local/lib/kvgate/install.sh /wheels \
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
