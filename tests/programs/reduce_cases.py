"""comm.reduce_dict over drawn (seeded) values, checked against a numpy ground truth: every rank
draws every rank's values, so each computes the true sum or mean itself.

    reduce_cases.py SEED CASES [torch]

Per case: average or not; one to three keys; per key a shape (sometimes a different one on some
ranks: (1,) and (2,), (2, 1) and (1, 2), () and (1,)) and a kind per rank (python int, float or
bool; numpy int32, int64, float32, float64 or bool; torch int32, int64, float32, float64 or
bool), mostly the same kind on every rank; 64-bit integers sometimes past 2**53 (a float64 sum
would round them). What this rank should get back:

- shapes that differ: a ValueError (tests/test_comm.py checks it is the same on every rank and
  names the keys, the ranks and the shapes);
- a sum of integers (int or bool) on every rank: the exact sum, an int for python values, int64
  for arrays and tensors (as torch.sum and numpy.sum give: int32 ones may not hold the sum);
- otherwise (a mean, or a float on some rank): the true value in floating point: a python
  float, the dtype given for float arrays and tensors, float64 for integer or bool numpy arrays,
  torch's default float dtype for integer or bool tensors.
"""
import random
import sys

import numpy as np
import torch

import hpcsync
from hpcsync import comm
from _report import report

seed, cases = int(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) > 3 and sys.argv[3] == "torch":
    hpcsync.init(backend="gloo", timeout=60)
rank, size = comm.get_rank(), comm.get_world_size()
rng = random.Random(seed)
PY = ["int", "float", "bool"]
NP = ["np.int32", "np.int64", "np.float32", "np.float64", "np.bool_"]
TORCH = ["torch.int32", "torch.int64", "torch.float32", "torch.float64", "torch.bool"]
SHAPES = [(), (1,), (2,), (3,), (2, 1), (1, 2), (2, 3)]
OTHER = {(): (1,), (1,): (2,), (2,): (1,), (3,): (2,), (2, 1): (1, 2), (1, 2): (2, 1), (2, 3): (3, 2)}


def integral(kind: str) -> bool:
    return kind.split(".")[-1].rstrip("_") in ("int", "bool", "int32", "int64")


def kind_for(shape: tuple) -> str:
    return rng.choice(PY + NP + TORCH if shape == () else NP + TORCH)


def draw_key() -> list:
    """[(shape, kind, values as nested python lists/scalars)] per rank."""
    shape = rng.choice(SHAPES)
    shapes = [OTHER[shape] if rng.random() < 0.12 else shape for _ in range(size)]
    same_kind = rng.random() < 0.7
    kind = kind_for(shape)
    per = []
    for s in shapes:
        k = kind if same_kind and (s == () or not kind.startswith(tuple(PY))) else kind_for(s)
        n = int(np.prod(s)) if s else 1
        base = k.split(".")[-1].rstrip("_")
        if base == "bool":
            flat = [rng.random() < 0.5 for _ in range(n)]
        elif base in ("int", "int64") and rng.random() < 0.3:  # past 2**53: exact only as integers
            flat = [rng.randint(2**54, 2**55) for _ in range(n)]
        elif base.startswith("int"):
            flat = [rng.randint(-5, 20) for _ in range(n)]
        else:
            flat = [rng.randint(-12, 12) / 4 for _ in range(n)]  # exact in float32
        per.append((s, k, flat))
    return per


def make(shape: tuple, kind: str, flat: list):
    if kind in PY:
        return {"int": int, "float": float, "bool": bool}[kind](flat[0])
    lib, name = kind.split(".")
    arr = np.array(flat, dtype=getattr(np, name)).reshape(shape)
    return arr if lib == "np" else torch.from_numpy(arr.copy())


def check(got, shape: tuple, kind: str, truth: np.ndarray, exact_int: bool) -> list:
    """What is wrong with ``got`` for this rank's ``kind`` (empty: nothing)."""
    problems = []
    if kind in PY:
        want_type = int if exact_int else float
        if type(got) is not want_type:
            problems.append(f"type {type(got).__name__}, want {want_type.__name__}")
        vals = np.asarray(got, dtype=np.int64 if exact_int and type(got) is int else np.float64)
    else:
        lib, name = kind.split(".")
        given = getattr(np if lib == "np" else torch, name)
        if lib == "np":
            want = np.int64 if exact_int else (
                given if name.startswith("float") else np.float64)
            if type(got) is not np.ndarray or got.dtype != np.dtype(want):
                problems.append(f"{type(got).__name__} {getattr(got, 'dtype', '')}, want ndarray {np.dtype(want)}")
            vals = np.asarray(got)
        else:
            want = torch.int64 if exact_int else (
                given if name.startswith("float") else torch.get_default_dtype())
            if not isinstance(got, torch.Tensor) or got.dtype != want:
                problems.append(f"{type(got).__name__} {getattr(got, 'dtype', '')}, want Tensor {want}")
                return problems
            vals = got.numpy()
        if tuple(vals.shape) != shape:
            problems.append(f"shape {tuple(vals.shape)}, want {shape}")
            return problems
    if exact_int:
        if not np.array_equal(vals.astype(np.int64), truth.astype(np.int64)) or not np.array_equal(vals, truth):
            problems.append(f"values {vals.tolist()}, want exactly {truth.tolist()}")
    else:
        single = str(getattr(got, "dtype", "")) in ("float32", "torch.float32")
        if not np.allclose(vals.astype(np.float64), truth, rtol=1e-6 if single else 1e-12, atol=0):
            problems.append(f"values {vals.tolist()}, want {truth.tolist()}")
    return problems


out = {"rank": rank, "world_size": size, "cases": []}
for _ in range(cases):
    average = rng.random() < 0.5
    keys = rng.sample(["loss", "acc", "n", "top1", "count"], rng.randint(1, 3))
    drawn = {k: draw_key() for k in keys}
    mine = {k: make(*per[rank]) for k, per in drawn.items()}
    record = {"average": average, "keys": {k: [[list(s), kind] for s, kind, _ in per] for k, per in drawn.items()},
              "error": None, "problems": []}
    try:
        got = comm.reduce_dict(mine, average=average)
    except Exception as exc:  # noqa: BLE001 - what the rank saw is the result
        record["error"] = f"{type(exc).__name__}: {exc}"
        got = None
    mismatched = [k for k, per in drawn.items() if len({s for s, _, _ in per}) > 1]
    if got is not None:
        if mismatched:
            record["problems"].append(f"no error for the shapes of {mismatched}: {got!r}"[:300])
        elif sorted(got) != sorted(keys):
            record["problems"].append(f"keys {sorted(got)}, want {sorted(keys)}")
        else:
            for k, per in drawn.items():
                shape, kind, _ = per[rank]
                every_int = all(integral(kd) for _, kd, _ in per)
                total = sum(np.array(flat, dtype=np.int64 if integral(kd) else np.float64).reshape(s)
                            for s, kd, flat in per)
                truth = total / size if average else total
                record["problems"] += [f"{k!r}: {p}" for p in
                                       check(got[k], shape, kind, np.asarray(truth), every_int and not average)]
    out["cases"].append(record)
report(rank, out)
