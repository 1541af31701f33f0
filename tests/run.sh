#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine: install the full stack, lint, then pytest.
#   bash tests/run.sh [pytest args]
# Most tests wait on jobs (timeouts, schedulers, launchers), so two runs go side by side: the
# tests marked `cluster` (namespace nodes, Slurm: one at a time) with the `heavy` ones, and
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
cluster_log=$(mktemp)
trap 'rm -f "$cluster_log"' EXIT
pids=()
stop() {   # Ctrl-C, TERM, HUP: each run is interrupted once, tears down its Slurm and nodes, and ends
  for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  cat "$cluster_log"
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM HUP
# Both in sessions of their own, so that only the trap signals them; a background job ignores
# SIGINT, --default-signal gives pytest back its KeyboardInterrupt.
beside=(setsid env --default-signal=INT .venv/bin/python -m pytest tests -ra)   # ($! is then pytest's pid)
"${beside[@]}" -p no:cacheprovider -m "(cluster or heavy) and not alone" "$@" >"$cluster_log" 2>&1 &
pids+=($!)
"${beside[@]}" -m "not cluster and not heavy and not alone" "$@" &
pids+=($!)
rest=0 cluster=0 alone=0
wait "${pids[1]}" || rest=$?
wait "${pids[0]}" || cluster=$?
pids=()
echo "---- beside them, the tests that build namespace nodes or use Slurm, and the heavy ones:"
cat "$cluster_log"
.venv/bin/python -m pytest tests -ra -m alone "$@" || alone=$?
[ "$rest$cluster$alone" = 555 ] && exit 5   # the arguments selected no test at all
for rc in "$rest" "$cluster" "$alone"; do
  [ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"   # 5: none of this run's tests was selected
done
