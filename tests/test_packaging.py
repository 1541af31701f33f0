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
