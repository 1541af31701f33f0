"""Stage-in never writes into its own source: a destination that is the source, lies inside it or
holds it -- after symbolic links and ``..`` are resolved, a missing destination judged by the
path it would have -- is refused on every rank before anything is written or created. Folders
that merely share a name prefix (``/data/set``, ``/data/set2``) are apart.

The decision is checked against pairs of paths drawn at random (nested at random depth, spelled
through chains of links, ``..``, doubled and trailing slashes, relative to a random folder) whose
truth comes from how they were drawn; real jobs show the refusal on every rank, and the source
untouched."""
import hashlib
import json
import os
import random
import re
import stat
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

import hpcsync
from launch import PY, clean_env, mpich, openmpi, run
from test_staging import _same_error_everywhere, make_tree

PREFIXED = ["set", "set2", "set.old", "se", "sets"]  # names sharing a prefix: siblings, never nested
WHY = {"same": "the destination is the source", "inside": "the destination is inside the source",
       "holds": "the source is inside the destination"}


def state(root: Path) -> dict:
    """Everything under ``root`` (``root`` too), byte for byte: kind, mode, size, mtime, ctime,
    the content's hash or the link's target."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for p in [folder, *(os.path.join(folder, n) for n in files + [d for d in dirs if os.path.islink(
                os.path.join(folder, d))])]:
            s = os.lstat(p)
            what: object = None
            if stat.S_ISLNK(s.st_mode):
                what = os.readlink(p)
            elif stat.S_ISREG(s.st_mode):
                with open(p, "rb") as f:
                    what = hashlib.sha1(f.read()).hexdigest()
            out[os.path.relpath(p, root)] = (s.st_mode, s.st_size, s.st_mtime_ns, s.st_ctime_ns, what)
    return out


# -- the decision, on generated pairs ------------------------------------------------------------

def real_tree(root: Path, rng: random.Random) -> Tuple[List[Path], List[Path]]:
    """Folders three levels deep under ``root`` named from :data:`PREFIXED`, a few files; no links."""
    dirs, files, level = [root], [], [root]
    for _ in range(3):
        below = []
        for d in level:
            for name in rng.sample(PREFIXED, rng.randint(1, 3)):
                (d / name).mkdir()
                below.append(d / name)
            for name in rng.sample(["f", "f2", "set.txt"], rng.randint(0, 2)):
                (d / name).write_text(name)
                files.append(d / name)
        dirs += below
        level = below
    return dirs, files


def draw(rng: random.Random, dirs: List[Path], files: List[Path]) -> Tuple[Path, Path]:
    """A (source, destination) pair of real paths (the destination perhaps missing), biased to
    every relation: the same, nested either way at any depth, siblings sharing a name prefix."""
    src = rng.choice(files) if rng.random() < 0.25 else rng.choice(dirs)
    how = rng.choice(["same", "inside", "holds", "sibling", "sibling", "apart"])
    if how == "same":
        dst = src
    elif how == "inside":
        below = [d for d in dirs if src in d.parents]
        dst = rng.choice(below) if below and rng.random() < 0.5 else src
        for _ in range(rng.randint(1 if dst == src else 0, 3)):
            dst = dst / f"new{rng.randint(0, 9)}"
    elif how == "holds":
        dst = rng.choice(list(src.parents))  # up to "/"
    elif how == "sibling":
        name = src.name
        dst = src.parent / rng.choice([name + "2", name + ".old", name + "s", name[:-1] or "x", "x" + name])
        if rng.random() < 0.3:
            dst = dst / "new"
    else:
        dst = rng.choice(dirs) / rng.choice(["", "new"])
    return src, dst


def truth(src: Path, dst: Path) -> Optional[str]:
    """How two real paths overlap, from their parts."""
    s, d = src.parts, dst.parts
    if s == d:
        return "same"
    if d[:len(s)] == s:
        return "inside"
    if s[:len(d)] == d:
        return "holds"
    return None


class Speller:
    """Spells a real path as a user might: through a link (or a chain of two, absolute or
    relative) to one of its existing folders, with ``NAME/..`` inserted (NAME missing, a folder
    or a link: stage takes ``..`` as written, like ``os.path.abspath``), ``.``, doubled or
    trailing slashes, and relative to the working folder."""

    def __init__(self, root: Path, links: Path, rng: random.Random) -> None:
        self.root, self.links, self.rng, self.made = root, links, rng, []

    def link_to(self, target: Path) -> Path:
        rng, n = self.rng, len(self.made)
        link = self.links / f"l{n}"
        os.symlink(os.path.relpath(target, self.links) if rng.random() < 0.5 else target, link)
        if rng.random() < 0.3:
            os.symlink(link.name, self.links / f"l{n}c")
            link = self.links / f"l{n}c"
        self.made.append(link.name)
        return link

    def __call__(self, real: Path, cwd: Path) -> str:
        rng = self.rng
        anchors = [p for p in [real, *real.parents] if p.exists() and (p == self.root or self.root in p.parents)]
        if anchors and rng.random() < 0.6:
            anchor = rng.choice(anchors)
            comps = [*self.link_to(anchor).parts[1:], *real.relative_to(anchor).parts]
        else:
            comps = list(real.parts[1:])
        for _ in range(rng.randint(0, 2)):
            at = rng.randint(0, len(comps))
            if self.links.name in comps and self.made and rng.random() < 0.4:  # a link, then ..
                at = comps.index(self.links.name) + 1
            comps[at:at] = rng.choice([["nope", ".."], [rng.choice(PREFIXED), ".."], ["."],
                                       [rng.choice(self.made or ["nope"]), ".."]])
        if rng.random() < 0.3:  # relative to the working folder, by hand (os.path.relpath would drop the ..)
            here = cwd.parts[1:]
            common = 0
            while common < min(len(here), len(comps)) and here[common] == comps[common]:
                common += 1
            comps = [".."] * (len(here) - common) + comps[common:]
            text = "/".join(comps) or "."
        else:
            text = "/" + "/".join(comps)
        if rng.random() < 0.2 and "/" in text[1:]:
            at = text.index("/", 1)
            text = text[:at] + "/" + text[at:]
        return text + "/" * rng.randint(0, 1)


@pytest.mark.parametrize("seed", range(4))
def test_the_decision_matches_the_real_paths_of_generated_pairs(tmp_path, monkeypatch, seed):
    from hpcsync.data.staging.overlap import overlap

    rng = random.Random(seed)
    base = tmp_path.resolve()
    root, links = base / "real", base / "links"
    root.mkdir()
    links.mkdir()
    dirs, files = real_tree(root, rng)
    spell = Speller(root, links, rng)
    seen: Counter = Counter()
    for case in range(500):
        src, dst = draw(rng, dirs, files)
        cwd = rng.choice(dirs)
        monkeypatch.chdir(cwd)
        s, d = spell(src, cwd), spell(dst, cwd)
        for text, real in ((s, src), (d, dst)):  # the generator's own check, by realpath
            assert os.path.realpath(os.path.abspath(text)) == str(real), (seed, case, text, real)
        want, got = truth(src, dst), overlap(s, d)
        where = f"seed {seed} case {case}: overlap({s!r}, {d!r}) [real {src} -> {dst}] = {got!r}"
        if want is None:
            assert got is None, where
        else:
            assert got is not None and WHY[want] in got, where
        sibling = want is None and src.parent == dst.parent and (src.name.startswith(dst.name) or
                                                                   dst.name.startswith(src.name))
        seen[want, src in files, sibling] += 1
    # every relation came up, for folders and for a file as the source, and name-prefix siblings
    assert all(seen[w, f, False] for w in WHY for f in (False, True)) and seen[None, False, True] >= 20, seen


# -- stage itself --------------------------------------------------------------------------------

def test_one_process_refuses_each_overlap_and_touches_nothing(tmp_path, monkeypatch):
    """The issue's case first (a copy nested into the source on each call), then the same folder,
    a link to the source on either side, ``..`` and a relative path, the source inside the
    destination, a file as the source; nothing changes anywhere under the test's folder. Then
    siblings that share the source's name prefix are staged."""
    top = tmp_path / "data"
    src = top / "set"
    make_tree(src, files=6)
    alias = tmp_path / "alias"
    os.symlink(src, alias)
    monkeypatch.chdir(src / "d0")
    before, source = state(tmp_path), state(src)
    script = src / "script.sh"
    inside, same, holds = WHY["inside"], WHY["same"], WHY["holds"]
    for s, d, why in [(src, src / "inner", inside), (src, src, same), (src, f"{alias}/inner/deeper/", inside),
                      (alias, src / "d1", inside), (src, "../e/../inner", inside), (f"{src}/", f"{alias}//", same),
                      (src, top, holds), (src / "d0", f"{alias}/d0/..", holds), (src / "d1" / "e1", tmp_path, holds),
                      (script, src, holds), (script, f"{alias}/script.sh", same), (script, script / "x", inside)]:
        with pytest.raises(hpcsync.StageError, match=re.escape(why)):
            hpcsync.stage(s, d)
        assert state(tmp_path) == before, (s, d)
    for d in (top / "set2", top / "se", top / "set.old" / "x"):
        r = hpcsync.stage(src, d)
        assert r.copied_files == r.files > 0, d
    hpcsync.stage(script, top / "script.sh2")
    assert (top / "script.sh2" / "script.sh").read_text() == script.read_text()
    assert state(src) == source


def test_the_source_mounted_elsewhere_is_still_the_source(tmp_path):
    """A bind mount shows the source under a second name that no link resolves (a cluster's
    second mount of one export does the same): a destination in that view, that view itself, or
    one holding the source through it, is refused; nothing changes."""
    src = tmp_path / "data" / "set"
    make_tree(src, files=6)
    view = tmp_path / "view"
    view.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(view)], check=True)
    try:
        before = state(src)
        for s, d, why in [(src, view / "inner", WHY["inside"]), (src, view, WHY["same"]),
                          (view, src / "d1" / "x", WHY["inside"]), (src / "d0", view, WHY["holds"])]:
            with pytest.raises(hpcsync.StageError, match=re.escape(why)):
                hpcsync.stage(s, d)
            assert state(src) == before and not (src / "inner").exists(), (s, d)
        r = hpcsync.stage(view, tmp_path / "apart")
        assert r.copied_files == r.files > 0
    finally:
        subprocess.run(["umount", "-l", str(view)])


@pytest.mark.parametrize("how", ["inside", "holds"])
def test_every_rank_refuses_the_same_overlap_at_once(tmp_path, how):
    """Open MPI, 3 ranks on one node: the destination inside the source (missing, spelled through
    a link to the source, with ``..`` and a trailing slash), or holding it; the same StageError on
    every rank within seconds (the timeout is minutes), the source byte for byte as it was,
    nothing created."""
    work = tmp_path.resolve() / "work"
    src = work / "data" / "set"
    make_tree(src, files=10)
    os.symlink(src, work / "alias")
    s, d = (str(src), f"{work}/alias/x/../inner/deeper/") if how == "inside" else (str(src / "d1"), str(src))
    before = state(work)
    t0 = time.monotonic()
    res = run(openmpi(), 3, "stage.py", s, d, json.dumps({"timeout": 300}), tmp_path=tmp_path, expect_ok=False,
              timeout=240)
    took = time.monotonic() - t0
    error = _same_error_everywhere(res, 3, f"rank 0: node {os.uname().nodename}: ", WHY[how])
    assert took < 60, (took, error)
    assert state(work) == before and not (src / "inner").exists(), error


def test_a_node_that_sees_the_destination_inside_the_source_refuses_it_for_all(tmp_path):
    """Two ranks of one host, rank 1 in a mount namespace where a folder on the way to the
    destination holds a link into the source (rank 0 sees a plain empty folder): two nodes, and
    the node that would write into the source refuses for both, before rank 0's node creates
    anything. Each node judges its own view of the destination."""
    tmp = tmp_path.resolve()
    src, plain, other = tmp / "src", tmp / "plain", tmp / "other"
    make_tree(src, files=10)
    plain.mkdir()
    other.mkdir()
    os.symlink(src, other / "data")
    dst = plain / "data" / "inner"
    before = state(src)
    lau = openmpi()
    out = tmp / "out"
    out.mkdir()
    prog = str(Path(__file__).parent / "programs" / "stage.py")
    cmd = [*lau.argv, "-n", "1", PY, prog, str(src), str(dst), ":", "-n", "1", "unshare", "--mount", "sh", "-c",
           f"mount --bind {other} {plain} && exec {PY} {prog} {src} {dst}"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=clean_env({**lau.env, "HPCSYNC_TEST_OUT": str(out)}), capture_output=True,
                       text=True, timeout=240)
    took = time.monotonic() - t0
    ranks = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
             for r in range(2)]
    assert p.returncode != 0 and None not in ranks, p.stdout + p.stderr
    errors = {d["error"] for d in ranks}
    assert len(errors) == 1, errors
    (error,) = errors
    assert error.startswith("StageError: ") and f"rank 1: node {os.uname().nodename}: " in error, error
    assert f"{WHY['inside']} ({src}/inner is in {src})" in error and "rank 0:" not in error, error
    assert took < 60, (took, error)
    assert state(src) == before and os.listdir(plain) == [] and os.listdir(other) == ["data"]


def test_the_cli_refuses_the_source_as_its_own_destination(tmp_path):
    """``hpcsync stage D D`` under MPICH's mpiexec, 2 ranks: each rank says the error, exit 2."""
    src = tmp_path.resolve() / "set"
    make_tree(src, files=5)
    before = state(src)
    lau = mpich()
    p = subprocess.run([*lau.command(2), PY, "-m", "hpcsync", "stage", str(src), f"{src}/./"],
                       env=clean_env(lau.env), capture_output=True, text=True, timeout=240)
    assert p.returncode != 0 and p.stderr.count(f"hpcsync stage: error: stage of {src} to {src} failed: ") == 2, \
        p.stdout + p.stderr
    assert p.stderr.count(WHY["same"]) == 2 and "staged " not in p.stdout, p.stderr
    assert state(src) == before
