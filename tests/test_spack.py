"""spack.yaml is valid YAML with the structure Spack requires."""
import yaml

from launch import ROOT


def test_spack_environment_structure():
    doc = yaml.safe_load((ROOT / "spack.yaml").read_text())
    assert set(doc) == {"spack"}
    env = doc["spack"]
    assert isinstance(env["specs"], list) and all(isinstance(s, str) for s in env["specs"])
    names = {s.split("@")[0].split("+")[0].split("~")[0] for s in env["specs"]}
    assert {"python", "py-mpi4py", "py-h5py", "hdf5", "py-numpy", "py-pytest", "py-torch"} <= names
    assert any(s.startswith("py-h5py+mpi") for s in env["specs"]) and any(s.startswith("hdf5+mpi") for s in env["specs"])
    assert env["packages"]["mpi"]["require"], "the MPI provider is chosen in one place"
    assert env["view"] is True and env["concretizer"]["unify"] is True
    assert env["develop"]["py-hpcsync"]["path"] == "."
