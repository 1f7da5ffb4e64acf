#!/usr/bin/env bash
# Set everything up (apt packages, .venv with agentcell editable) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
# The session tests install a real harness CLI (Codex) from the npm registry: npm is needed for them.
if ! command -v npm >/dev/null; then
  echo "+ apt-get install npm"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
fi
# Static checks first: style habits are part of the build (ruff; mypy --strict on src/).
.venv/bin/ruff check src tests bench
.venv/bin/mypy
exec .venv/bin/pytest "$@"
