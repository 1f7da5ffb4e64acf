#!/usr/bin/env bash
# Set everything up (apt packages, .venv with agentcell editable) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
# The harness tests install the real CLIs from npm and PyPI (tests/harnesses.py, cached under
# /opt/agentcell-test/harnesses); OpenCode fetches ripgrep from github.com unless it is installed.
need=()
command -v npm >/dev/null || need+=(npm)
command -v rg >/dev/null || need+=(ripgrep)
# tests/test_workday.py drives Claude Code's TUI in tmux, as a person's terminal.
command -v tmux >/dev/null || need+=(tmux)
# tests/test_k8s.py runs kubectl's client-side validation (against a stand-in of the API server's documents).
command -v kubectl >/dev/null || need+=(kubernetes-client)
if [ ${#need[@]} -gt 0 ]; then
  echo "+ apt-get install ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
# Static checks first: style habits are part of the build (ruff; mypy --strict on src/).
.venv/bin/ruff check src tests bench
.venv/bin/mypy
# The documentation site (mkdocs.yml): a broken link or page fails the build; the CLI reference in it is
# generated from the parsers. Built into a directory of its own, removed after.
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
exec .venv/bin/pytest "$@"
