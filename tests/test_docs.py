"""The documentation builds with warnings as errors, and says what the code says."""
import re
import subprocess
import sys

from launch import ROOT


def test_sphinx_builds_without_warnings(tmp_path):
    p = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"),
                        str(tmp_path / "html")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("sync_file", "SyncedFile", "stage", "ProcessGroupHpcsync", "report_timeout", "init"):
        assert 'id="hpcsync.' in api and name in api, name  # autodoc found the docstrings


def test_readme_is_short_and_every_setting_is_documented():
    """The README is a front door (about 100 lines: the detail lives in docs/), each of its links
    into docs/ names a page that exists, and every setting is in docs/settings.md."""
    from hpcsync.core import settings

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120, len(readme.splitlines())
    for page in re.findall(r"\(docs/([\w.]+)\)", readme):
        assert (ROOT / "docs" / page).exists(), page
    assert not re.search(r"\bissue \d|\bsession\b|\blent\b", readme + "".join(
        p.read_text() for p in (ROOT / "docs").glob("*.md")), re.I)
    documented = (ROOT / "docs" / "settings.md").read_text()
    assert all(f"`{name}`" in documented for name in settings.SETTINGS)
