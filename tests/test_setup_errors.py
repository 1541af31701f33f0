"""A set-up error -- a malformed HPCSYNC_* setting, a bad argument of hpcsync.init() -- left
uncaught: said once for the whole job, in a few lines without a traceback, naming real ranks,
and every rank exits non-zero within seconds (docs/bootstrap.md, "Set-up errors").

The bad inputs are drawn from a seeded generator: for every setting of the table with a kind
(a flag, seconds, a count, a factor, M/N, a choice of words) one malformed value; each launcher
and size gets a share of them, the bad backend name, and one case where only the last rank has
the bad value. ``HPCSYNC_TEST_LONG=1`` runs every setting on every launcher and size."""
import random
import re
import time

import pytest

from hpcsync.core import settings
from launch import LAUNCHERS, LONG, run

pytestmark = pytest.mark.alone  # bounds of wall time: every rank must be gone within 30 s

SEED = 55
# Values malformed for each kind of setting. "" is not among them: an empty variable means unset
# (its default), as settings.text() reads it.
_COMMON = ["5s", "-1", "nan", "yes please"]
MALFORMED = {
    "flag": _COMMON + ["2", "enabled", "y e s"],
    "seconds": _COMMON + ["0", "inf", "-inf", "1e999", "5 s", "thirty"],
    "rate": _COMMON + ["0", "inf", "50MB/s"],
    "count": _COMMON + ["1.5", "+3", "1e3", "eight"],
    "factor": _COMMON + ["1", "0.5", "inf", "1,5"],
    "m/n": _COMMON + ["5/3", "0/5", "3", "3/", "a/b", "3/5/7"],
    "choice": _COMMON + ["maybe", "tcp mpi"],
    "epoch": ["tomorrow", "-1", "0", "nan", "inf", "5s", "2026-12-07"],
    "folder": ["/dev/null", "/dev/null/logs", "/etc/hostname/x", "/proc/self/fd/0/x"],  # (not folders)
}


def _typo(rng, name):
    """``name`` one letter off (dropped, doubled or two swapped), not a setting itself."""
    while True:
        i = rng.randrange(len("HPCSYNC_"), len(name) - 1)
        how = rng.randrange(3)
        t = (name[:i] + name[i + 1:] if how == 0 else name[:i] + name[i] + name[i:] if how == 1 else
             name[:i] + name[i + 1] + name[i] + name[i + 2:])
        if t not in settings.SETTINGS and t != name:
            return t


def _kind(s: settings.Setting) -> str:
    return "choice" if "|" in s.kind else s.kind


CHECKED = [s for s in settings.SETTINGS.values() if s.kind != "text"]
COMBOS = [("openmpi", 2), ("openmpi", 4), ("mpich", 2), ("mpich", 4)]


def _cases():
    rng = random.Random(SEED)
    drawn = [(s.name, rng.choice(MALFORMED[_kind(s)])) for s in CHECKED]
    order = list(range(len(drawn)))
    rng.shuffle(order)
    cases = []
    for k, (launcher, n) in enumerate(COMBOS):
        mine = [drawn[i] for i in order] if LONG else [drawn[i] for i in order[k::len(COMBOS)]]
        cases.append((launcher, n, "bogus", []))
        cases += [(launcher, n, "auto", [f"{name}={value}"]) for name, value in mine]
        name, value = drawn[order[k]]  # one rank alone with a malformed value, beside a bad backend
        cases.append((launcher, n, "bogus", [f"{name}={value}@last"]))
        cases.append((launcher, n, "auto", [f"{_typo(rng, rng.choice(sorted(settings.SETTINGS)))}=1"]))
    return cases


CASES = _cases()


def _id(case):
    launcher, n, backend, items = case
    return f"{launcher}-{n}-" + " ".join(([f"backend={backend}"] if backend != "auto" else []) + items)


def _said(backend, items):
    """What the explanation must contain, one entry per bad input."""
    said = [f"backend={backend!r}"] if backend not in ("auto", "gloo") else []
    return said + [f"{name}={value.removesuffix('@last')!r}" for name, _, value in (i.partition("=") for i in items)]


@pytest.mark.parametrize("launcher,n,backend,items", CASES, ids=[_id(c) for c in CASES])
def test_a_set_up_error_is_said_once_and_every_rank_exits(launcher, n, backend, items, tmp_path):
    t0 = time.monotonic()
    res = run(LAUNCHERS[launcher](), n, "setup_error.py", backend, *items, tmp_path=tmp_path, expect_ok=False,
              timeout=90)
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode != 0 and took < 30, (took, res)
    for r, d in enumerate(res.ranks):  # every rank's init raised it, and it escaped (exit status 1)
        assert d is not None and d["raised"] == "SetupError" and d["value_error"], (r, res)
    for words in _said(backend, items):
        assert out.count(words) == 1, (words, res)
    assert "Traceback" not in out and "rank ?" not in out, res
    said = [ln for ln in out.splitlines() if ln.startswith("[hpcsync]")]  # a header, a line a problem, the fix
    assert len(said) == 2 + len(_said(backend, items)) and said[-1].startswith("[hpcsync] fix: "), res
    alone = [i for i in items if i.endswith("@last")]
    words = _said("auto", alone)[0] if alone else _said(backend, items)[0]
    line = next(ln for ln in said if words in ln)
    assert (f"[rank {n - 1}]" in line) if alone else (f"all {n} ranks" in said[0]), (line, res)


def test_a_set_up_error_in_one_process(tmp_path):
    res = run(None, 1, "setup_error.py", "bogus", "HPCSYNC_TIMEOUT=5s", tmp_path=tmp_path, expect_ok=False, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and res.ranks[0]["raised"] == "SetupError", res
    assert out.count("backend='bogus'") == 1 and out.count("HPCSYNC_TIMEOUT='5s'") == 1, res
    assert "Traceback" not in out and "rank ?" not in out, res


def test_hpcsync_debug_shows_the_traceback_once(tmp_path):
    res = run(LAUNCHERS["openmpi"](), 2, "setup_error.py", "bogus", "HPCSYNC_DEBUG=1", tmp_path=tmp_path,
              expect_ok=False, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and out.count("Traceback") == 1 and out.count("backend='bogus'") == 1, res


@pytest.mark.parametrize("launcher,n", [("openmpi", 4), ("mpich", 2)])
def test_a_second_init_asking_for_more_is_one_block_when_uncaught(launcher, n, tmp_path):
    """``init()`` then ``init(backend=<another>)``: each rank's own check raises, and uncaught it
    is one report for the job, the explanation once, no traceback; the job ends."""
    t0 = time.monotonic()
    res = run(LAUNCHERS[launcher](), n, "init_twice.py", "uncaught", tmp_path=tmp_path, expect_ok=False, timeout=90)
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode != 0 and took < 30, (took, res)
    assert len(re.findall(r"already initialised, and this call asks for something else", out)) == 1, res
    assert "Traceback" not in out and "rank ?" not in out, res
