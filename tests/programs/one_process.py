"""One process, no MPI (HPCSYNC_MPI=0): every collective feature runs through the one-process
communicator and gives what N ranks would give with N=1."""
import os
import sys

import numpy as np

import hpcsync
from hpcsync import comm, h5
from hpcsync.core.torchcomm import world
from _report import report

out_dir = sys.argv[1]
out = {"world_size": comm.get_world_size(), "transport": repr(world()), "uses_mpi": hpcsync.topology().uses_mpi}

# file sync: a header kept, the parts folder removed
with hpcsync.SyncedFile(os.path.join(out_dir, "m.csv"), strip_header=True) as part:
    with part.open() as f:
        f.write("step,loss\n0,1.5\n1,0.5")
out["merged"] = open(os.path.join(out_dir, "m.csv")).read()
out["parts_left"] = sorted(os.listdir(out_dir))
# an exception in the block: this process's own exception, the part kept
try:
    with hpcsync.SyncedFile(os.path.join(out_dir, "bad.csv")) as part:
        raise KeyError("boom")
except KeyError as exc:
    out["own_exception"] = repr(exc)
out["bad_part_kept"] = os.path.exists(part.path) and not os.path.exists(os.path.join(out_dir, "bad.csv"))
try:
    hpcsync.sync_file(os.path.join(out_dir, "missing.csv"))
except hpcsync.SyncError as exc:
    out["missing_error"] = str(exc)

# comm helpers, the local group included
comm.create_local_process_group()
out["local_group_size"] = comm.get_local_process_group().Get_size()
out["gathered"] = comm.all_gather({"r": comm.get_rank()})
comm.synchronize()
comm.monitored_barrier(timeout=5)

# HDF5: the serial path, rows in order, attributes
ok, why = h5.parallel_available()
out["h5_parallel"], out["h5_why"] = ok, why
h5.write_rows(os.path.join(out_dir, "rows.h5"), {"x": np.arange(6).reshape(3, 2)}, attrs={"epoch": 3})
import h5py  # noqa: E402

with h5py.File(os.path.join(out_dir, "rows.h5")) as f:
    out["h5_rows"], out["h5_epoch"] = f["x"][()].tolist(), int(f.attrs["epoch"])

# stage-in of a small tree
src = os.path.join(out_dir, "src")
os.makedirs(os.path.join(src, "sub"))
with open(os.path.join(src, "sub", "a.bin"), "wb") as f:
    f.write(os.urandom(10000))
res = hpcsync.stage(src, os.path.join(out_dir, "dst"))
out["staged_files"] = res.files
out["staged_same"] = open(os.path.join(out_dir, "dst", "sub", "a.bin"), "rb").read() == \
    open(os.path.join(src, "sub", "a.bin"), "rb").read()
report(0, out)
