"""A regular (non-editable) install ships every module: what Spack's recipe and `pip install .` get."""
import shutil
import subprocess
import zipfile

from launch import PY, ROOT


def test_wheel_holds_every_module(tmp_path):
    src = tmp_path / "src"  # a copy: pip builds in the source tree, and a stale build/ could hide a gap
    shutil.copytree(ROOT / "hpcsync", src / "hpcsync", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    p = subprocess.run([PY, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w",
                        str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    wheel = next(tmp_path.glob("hpcsync-*.whl"))
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    tree = {str(f.relative_to(ROOT)) for f in (ROOT / "hpcsync").rglob("*.py")}
    assert tree and tree == shipped, sorted(tree ^ shipped)
    assert "hpcsync/py.typed" in zipfile.ZipFile(wheel).namelist()


def test_the_claimed_versions_are_the_tested_ones():
    """pyproject.toml requires the release series CI runs (hpcsync/start/versions.py; lower only
    where the Spack route needs it), the running stack is inside the tested series (else CI
    tests something else than the claims), and `hpcsync doctor` warns outside them."""
    import platform
    import re
    import tomllib
    from importlib.metadata import version

    from hpcsync.start.doctor import OK, WARN, version_check
    from hpcsync.start.versions import TESTED, outside

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == TESTED["python"].spec()
    specs = {}
    for req in project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]:
        name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", req).groups()
        if name in TESTED:
            assert specs.setdefault(name, spec) == spec, (name, spec, specs[name])  # the same in every extra
    assert specs == {name: t.spec() for name, t in TESTED.items() if name != "python"}, specs
    running = {"python": platform.python_version(), **{n: version(n) for n in TESTED if n != "python"}}
    assert not [outside(n, v) for n, v in running.items() if outside(n, v)], running
    assert version_check(running).status == OK
    warned = version_check({**running, "torch": "2.14.1", "python": "3.12.4"})
    assert warned.status == WARN and "torch 2.14.1: hpcsync is tested with torch >=2.13,<2.14" in warned.detail
    assert "python 3.12.4: hpcsync is tested with python >=3.11,<3.12" in warned.detail
    assert version_check({**running, "numpy": "1.26.4"}).status == WARN
    assert version_check({**running, "torch": "2.12.1"}).status == WARN  # installable (Spack's), not tested
