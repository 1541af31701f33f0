#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine: install the full stack, lint, then pytest.
#   bash tests/run.sh [pytest args]
# Most tests wait on jobs (timeouts, schedulers, launchers), so two runs go side by side: the
# tests marked `cluster` (namespace nodes, Slurm: one at a time) with the `example` trainings, and
# all the others. Then the tests marked `alone` (they measure time) run with nothing beside them.
# See tests/conftest.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash jobs/setup_env.sh --full
.venv/bin/ruff check .   # the lint configured in pyproject.toml
pytest() { .venv/bin/python -m pytest tests -ra "$@"; }
passed() { [ "$1" = 0 ] || [ "$1" = 5 ]; }   # 5: the arguments selected none of these tests
for arg in "$@"; do   # a mark expression of the caller's own: one plain run of it
  case "$arg" in -m|-m*) exec .venv/bin/python -m pytest tests -ra "$@" ;; esac
done
cluster_log=$(mktemp)
trap 'rm -f "$cluster_log"' EXIT
pytest -p no:cacheprovider -m "(cluster or example) and not alone" "$@" >"$cluster_log" 2>&1 &
cluster_pid=$!
rest=0 cluster=0 alone=0
pytest -m "not cluster and not example and not alone" "$@" || rest=$?
wait "$cluster_pid" || cluster=$?
echo "---- beside them, the tests that build namespace nodes or use Slurm, and the example trainings:"
cat "$cluster_log"
pytest -m alone "$@" || alone=$?
for rc in "$rest" "$cluster" "$alone"; do passed "$rc" || exit "$rc"; done
