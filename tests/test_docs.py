"""The documentation builds with warnings as errors, and says what the code says."""
import re
import subprocess
import sys

import pytest

from launch import ROOT


def test_sphinx_builds_without_warnings(tmp_path):
    p = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"),
                        str(tmp_path / "html")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("sync_file", "SyncedFile", "stage", "ProcessGroupHpcsync", "report_timeout", "init"):
        assert 'id="hpcsync.' in api and name in api, name  # autodoc found the docstrings


# Run sphinx as if these packages were not installed: each import of them fails.
_WITHOUT = """
import sys
class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDE:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hidden())
from sphinx.cmd.build import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("missing", [("lightning", "pytorch_lightning", "lightning_fabric"),
                                     ("torch", "numpy", "psutil", "mpi4py", "h5py", "lightning", "pytorch_lightning")],
                         ids=["without-lightning", "with-sphinx-alone"])
def test_the_readmes_docs_command_needs_no_optional_package(missing, tmp_path):
    """The README's `pip install -r docs/requirements.txt && sphinx-build -W ...` where Lightning
    is not installed (the quickstart's environment), or nothing but Sphinx: autodoc imports every
    module documented, and docs/conf.py mocks the packages that are missing."""
    code = f"HIDE = {set(missing)!r}\n" + _WITHOUT
    p = subprocess.run([sys.executable, "-c", code, "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"),
                        str(tmp_path / "html")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("start.bootstrap.init", "data.filesync.sync_file", "resilience.lightning.HpcsyncEnvironment",
                 "resilience.lightning.trainer_kwargs"):
        assert f'id="hpcsync.{name}"' in api, name  # documented, not left out for a failed import


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
