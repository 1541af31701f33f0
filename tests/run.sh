#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine: install the full stack, lint, then pytest.
#   bash tests/run.sh [pytest args]
# Most tests wait on jobs (timeouts, schedulers, launchers), so two runs go side by side: the
# tests marked `cluster` (namespace nodes, Slurm: one at a time) with the `heavy` ones, and
# all the others. Then the tests marked `alone` (bounds of wall time: light jobs) in two streams
# side by side, and last the `solo` ones (ratios, factors) with nothing beside them.
# Each run ends with its 12 slowest tests (the CI's 30 minutes are kept by them). See tests/conftest.py.
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
alone_log=$(mktemp)
trap 'rm -f "$cluster_log" "$alone_log"' EXIT
pids=()
stop() {   # Ctrl-C, TERM, HUP: each run is interrupted once, tears down its Slurm and nodes, and ends
  for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  cat "$cluster_log" "$alone_log"
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM HUP
# Both in sessions of their own, so that only the trap signals them; a background job ignores
# SIGINT, --default-signal gives pytest back its KeyboardInterrupt.
beside=(setsid env --default-signal=INT .venv/bin/python -m pytest tests -ra --durations=12)   # ($! is then pytest's pid)
"${beside[@]}" -p no:cacheprovider -m "(cluster or heavy) and not alone and not solo" "$@" >"$cluster_log" 2>&1 &
pids+=($!)
"${beside[@]}" -m "not cluster and not heavy and not alone and not solo" "$@" &
pids+=($!)
rest=0 cluster=0 alone0=0 alone1=0 solo=0
wait "${pids[1]}" || rest=$?
wait "${pids[0]}" || cluster=$?
pids=()
echo "---- beside them, the tests that build namespace nodes or use Slurm, and the heavy ones:"
cat "$cluster_log"
# The timed tests (light jobs that mostly wait for a timeout): two streams side by side, every
# other test each; then the solo ones (ratios, factors, sub-second bounds) and the timed tests
# that use namespace nodes or Slurm (one at a time) with nothing beside them.
HPCSYNC_TEST_SHARD=1/2 "${beside[@]}" -p no:cacheprovider -m "alone and not cluster" "$@" >"$alone_log" 2>&1 &
pids+=($!)
HPCSYNC_TEST_SHARD=0/2 "${beside[@]}" -m "alone and not cluster" "$@" &
pids+=($!)
wait "${pids[1]}" || alone0=$?
wait "${pids[0]}" || alone1=$?
pids=()
echo "---- beside them, the other half of the timed tests:"
cat "$alone_log"
.venv/bin/python -m pytest tests -ra --durations=12 -m "solo or (alone and cluster)" "$@" || solo=$?
[ "$rest$cluster$alone0$alone1$solo" = 55555 ] && exit 5   # the arguments selected no test at all
for rc in "$rest" "$cluster" "$alone0" "$alone1" "$solo"; do
  [ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"   # 5: none of this run's tests was selected
done
