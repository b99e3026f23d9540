# kvgate gateway image: the package, its Lua scripts (inside the wheel) and a redis-server for the
# embedded default. Not built in this repository's CI (the dev machines have no Docker engine).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY lua lua
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 kvgate
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir '/wheels/kvgate-0.1.0-py3-none-any.whl[embedded-redis]' && rm -rf /wheels
USER kvgate
WORKDIR /var/lib/kvgate
ENV KVGATE_DATA_DIR=/var/lib/kvgate KVGATE_STORE=/adapters KVGATE_HOST=0.0.0.0 KVGATE_PORT=8080
EXPOSE 8080
ENTRYPOINT ["kvgate"]
CMD ["serve"]
