#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine: install the full stack, lint, then pytest.
#   bash tests/run.sh [pytest args]
# Most tests wait on jobs (timeouts, schedulers, launchers), so they run on two workers; the
# tests marked `alone` measure time and run afterwards with nothing beside them (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash jobs/setup_env.sh --full
.venv/bin/ruff check .   # the lint configured in pyproject.toml
status=0
.venv/bin/python -m pytest tests -ra -n 2 --dist loadgroup -m "not alone" "$@" || status=$?
alone=0
.venv/bin/python -m pytest tests -ra -m alone "$@" || alone=$?
[ "$alone" = 5 ] && alone=0   # 5: the arguments selected none of them
[ "$status" = 5 ] && status=0
[ "$status" = 0 ] && status=$alone
exit "$status"
