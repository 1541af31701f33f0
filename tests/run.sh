#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine: install the full stack, lint, then pytest.
#   bash tests/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash jobs/setup_env.sh --full
.venv/bin/ruff check .   # the lint configured in pyproject.toml
exec .venv/bin/python -m pytest tests -ra "$@"
