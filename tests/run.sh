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
for arg in "$@"; do   # options that one run must own (a selection, a folder, a report, the cache): one plain run
  case "$arg" in
    -m|-m*|--basetemp*|--junit*|--lf|--ff|--sw|--last-failed|--failed-first|--stepwise*|--cache-clear)
      exec .venv/bin/python -m pytest tests -ra "$@" ;;
  esac
done
pytest() { .venv/bin/python -m pytest tests -ra "$@"; }
cluster_log=$(mktemp)
cluster_pid=
stop_cluster() {   # on Ctrl-C or TERM: the background run tears down its Slurm and nodes, then says what it saw
  if [ -n "$cluster_pid" ]; then kill -INT "$cluster_pid" 2>/dev/null || true; wait "$cluster_pid" || true; cat "$cluster_log"; fi
  rm -f "$cluster_log"
}
trap 'stop_cluster; exit 130' INT TERM
# (a background job ignores SIGINT; --default-signal gives pytest back its KeyboardInterrupt)
env --default-signal=INT .venv/bin/python -m pytest tests -ra -p no:cacheprovider \
  -m "(cluster or example) and not alone" "$@" >"$cluster_log" 2>&1 &
cluster_pid=$!
rest=0 cluster=0 alone=0
pytest -m "not cluster and not example and not alone" "$@" || rest=$?
wait "$cluster_pid" || cluster=$?
cluster_pid=
echo "---- beside them, the tests that build namespace nodes or use Slurm, and the example trainings:"
cat "$cluster_log"
rm -f "$cluster_log"
pytest -m alone "$@" || alone=$?
[ "$rest$cluster$alone" = 555 ] && exit 5   # the arguments selected no test at all
for rc in "$rest" "$cluster" "$alone"; do
  [ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"   # 5: none of this run's tests was selected
done
