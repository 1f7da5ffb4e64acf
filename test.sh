#!/usr/bin/env bash
# Set everything up (apt packages, .venv with agentcell editable) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec .venv/bin/pytest "$@"
