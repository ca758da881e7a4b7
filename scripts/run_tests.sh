#!/usr/bin/env bash
# Installs what is missing (venv, packages, chromium), then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
