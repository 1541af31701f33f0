"""The type check: mypy (``[tool.mypy]`` in pyproject.toml) once over the package.
``hpcsync.core`` is checked with --strict's flags and must stay clean; every other module is held
to its count in ``tests/mypy_baseline.json``, which may only shrink: a module above its count
fails, and so does one below it, with the lower number to write into the baseline."""
import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = Path(__file__).resolve().parent / "mypy_baseline.json"
_ERROR = re.compile(r"^(hpcsync/[\w/]+)\.py:\d+(?::\d+)?: error: ")


def _module(path: str) -> str:
    return path.removesuffix("/__init__").replace("/", ".")


def test_mypy_core_strict_and_the_rest_at_most_the_baseline(tmp_path):
    # No skip: a test stack without mypy fails here (jobs/setup_env.sh --full installs it).
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy_cache"),
                          "--no-error-summary", "--no-pretty", "--no-color-output", "hpcsync"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - start
    assert "No module named mypy" not in run.stderr, f"mypy is not installed: bash jobs/setup_env.sh --full\n{run.stderr}"
    assert run.returncode in (0, 1) and not run.stderr.strip(), f"mypy did not run (rc {run.returncode}):\n{run.stderr}"
    errors = [line for line in run.stdout.splitlines() if _ERROR.match(line)]
    counts = Counter(_module(_ERROR.match(line).group(1)) for line in errors)
    print(f"mypy: {len(errors)} errors in {len(counts)} modules, {took:.1f} s")
    core = [line for line in errors if line.startswith("hpcsync/core/")]
    assert not core, "hpcsync.core is checked strict and must stay clean:\n" + "\n".join(core)
    baseline = json.loads(BASELINE.read_text())
    over = {m: (n, baseline.get(m, 0)) for m, n in sorted(counts.items()) if n > baseline.get(m, 0)}
    below = {m: (counts.get(m, 0), n) for m, n in sorted(baseline.items()) if counts.get(m, 0) < n}
    assert not over, ("mypy errors above tests/mypy_baseline.json (module: now, baseline):\n"
                      + "\n".join(f"  {m}: {n} > {b}" for m, (n, b) in over.items()) + "\n"
                      + "\n".join(line for line in errors if _module(_ERROR.match(line).group(1)) in over))
    assert not below, ("fewer mypy errors than tests/mypy_baseline.json says: lower it (the baseline only shrinks):\n"
                       + "\n".join(f'  "{m}": {n},  (was {b})' for m, (n, b) in below.items()))
