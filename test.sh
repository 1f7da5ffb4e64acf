#!/usr/bin/env bash
# Set everything up (apt packages, .venv with agentcell editable) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
# Static checks first: style habits are part of the build (ruff; mypy --strict on src/).
.venv/bin/ruff check src tests bench
.venv/bin/mypy
exec .venv/bin/pytest "$@"
