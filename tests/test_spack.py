"""spack.yaml and the py-hpcsync recipe: the points a real Spack checks, without Spack.

CI cannot clone Spack; tests/spack_concretize.sh runs the real `spack -e . concretize` (README
quotes its result). These tests keep the file from drifting back into what broke there.
"""
import ast
import re
import tomllib

import yaml

from launch import ROOT

RECIPE = ROOT / "jobs/spack_repo/hpcsync/packages/py_hpcsync/package.py"


def _env():
    return yaml.safe_load((ROOT / "spack.yaml").read_text())["spack"]


def test_spack_environment_structure():
    env = _env()
    names = {re.split(r"[@+~ ]", s)[0] for s in env["specs"]}
    assert {"python", "hdf5", "py-h5py", "py-torch", "py-hpcsync", "py-pytest"} <= names
    assert any(s.startswith("py-h5py+mpi") for s in env["specs"]) and any(s.startswith("hdf5+mpi") for s in env["specs"])
    assert env["packages"]["mpi"]["require"] == ["openmpi"], "the MPI provider is chosen in one place"
    assert env["view"] is True and env["concretizer"]["unify"] is True
    assert env["develop"]["py-hpcsync"]["path"] == "."
    # Spack's newest torch is 2.12.x: never require what pip installs here (2.13)
    assert not any(re.search(r"py-torch@2\.1[3-9]", s) for s in env["specs"])


def test_openmpi_keeps_its_launchers_and_has_no_pmi_variant():
    reqs = _env()["packages"]["openmpi"]["require"]
    flat = yaml.safe_dump(reqs)
    assert "+pmi" not in flat.replace("+pmix", ""), "+pmi is PMI-1/2 and only exists for Open MPI <= 4"
    assert "schedulers=slurm" in reqs
    # ~legacylaunchers (the default with schedulers=slurm on Open MPI <= 4) replaces mpirun by a stub
    assert {"spec": "+legacylaunchers", "when": "@:4"} in reqs


def test_slurm_is_the_clusters_not_built():
    slurm = _env()["packages"]["slurm"]
    assert slurm["buildable"] is False and slurm["externals"][0]["spec"].startswith("slurm@")


def test_repo_uses_package_api_v2_layout():
    repos = _env()["repos"]
    assert repos == {"hpcsync": "jobs/spack_repo/hpcsync"}
    repo = yaml.safe_load((ROOT / repos["hpcsync"] / "repo.yaml").read_text())["repo"]
    assert repo["namespace"] == "hpcsync" and repo["api"].startswith("v2.")
    src = RECIPE.read_text()
    assert "from spack_repo.builtin.build_systems.python import PythonPackage" in src


def _recipe_calls(name):
    tree = ast.parse(RECIPE.read_text())
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name]


def test_recipe_versions_are_fetchable():
    versions = {c.args[0].value: {k.arg for k in c.keywords} for c in _recipe_calls("version")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] in versions
    assert all(kw & {"branch", "tag", "commit", "sha256"} for kw in versions.values()), "spack info/audit need a source"
    assert re.search(r'^\s+git = ', RECIPE.read_text(), re.M)


def test_recipe_reflects_pyproject_minimums_and_extras():
    deps = {c.args[0].value for c in _recipe_calls("depends_on")}
    variants = {c.args[0].value for c in _recipe_calls("variant")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spack_name = {"mpi4py": "py-mpi4py", "torch": "py-torch", "h5py": "py-h5py", "numpy": "py-numpy",
                  "psutil": "py-psutil", "lightning": "py-lightning", "pytest": "py-pytest", "pyyaml": "py-pyyaml"}
    wanted = list(project["dependencies"])
    for extra in ("mpi", "torch", "h5", "lightning", "test"):
        wanted += project["optional-dependencies"][extra]
    for req in wanted:
        m = re.fullmatch(r"([a-z0-9]+)>=([\d.]+)", req)
        if not m:
            continue
        name, low = m.groups()
        assert any(d.startswith(f"{spack_name[name]}@{low}:") for d in deps), (req, sorted(deps))
    py_min = project["requires-python"].removeprefix(">=")
    assert f"python@{py_min}:" in deps
    assert {"torch", "h5", "lightning"} <= variants
