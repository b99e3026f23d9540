#!/bin/sh
# Installs kvgate from the wheel in WHEEL_DIR, with its embedded-redis extra (a redis-server for a lone
# container without KVGATE_REDIS_URL), into the environment of $PYTHON (default: python). The Dockerfile's
# final stage RUNs exactly this; tests/deploy/test_image.py runs it in a clean virtualenv.
#   usage: install.sh WHEEL_DIR
set -eu
[ "$#" -eq 1 ] || { echo "usage: install.sh WHEEL_DIR" >&2; exit 2; }
PY="${PYTHON:-python}"
set -- "$1"/kvgate-*.whl
[ "$#" -eq 1 ] && [ -f "$1" ] || { echo "install.sh: expected exactly one kvgate wheel, found: $*" >&2; exit 1; }
"$PY" -m pip install --disable-pip-version-check --no-input "$1[embedded-redis]"
"$PY" -m pip check
# What the image runs must import and answer: the console script, the stdlib health check.
"$PY" -m gateway.healthcheck --help >/dev/null
kvgate_bin="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")/kvgate"
"$kvgate_bin" serve --help >/dev/null
"$kvgate_bin" agent --help >/dev/null
