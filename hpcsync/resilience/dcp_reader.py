"""Reading a torch.distributed.checkpoint directory without running its code.

DCP's ``.metadata`` is a pickle, and its planner loads non-tensor values with
``torch.load(weights_only=False)``: a checkpoint anyone could write to would run their code on
load. Here the metadata is unpickled by :class:`MetadataUnpickler`, which knows exactly the record
types DCP writes (by module and name: no dotted names, no other callables) and refuses to set
state on a class; every file it names must be a plain name inside the checkpoint's folder; and
non-tensor values load with ``weights_only=True``.

**Fast and still strict.** :class:`MetadataUnpickler` is Python's C unpickler: its opcodes cannot
be overridden, so state on a class is refused another way. Every class or function it may name
that Python would let it change (DCP's dataclasses, the enum, the path classes, a function) is
handed to it as a *guard*: a stand-in type that makes the real one's instances (``NEWOBJ``, a
call) and whose ``__setstate__`` refuses (pickle's ``BUILD`` on it, the one opcode that sets
attributes): such a class is never on the unpickler's stack. The immutable types (the builtins,
``torch.Size``: Python refuses any attribute set on them) and torch's dtypes, layouts and memory
formats (values) are handed over as they are.
:class:`ReferenceUnpickler`, the pure-Python one that checks ``BUILD`` opcode by opcode, is kept
to check it against (the tests) and to measure it (bench/bench_checkpoint.py). Best of 5 on a
loaded 2-core machine, a metadata of 51,200 chunks (1,024 ranks x 50 tensors): the reference
2.1 s, this one 0.5-0.7 s, as fast as ``pickle.loads`` (about 12 µs a chunk against 45 µs). At
1,024 ranks x 1,000 tensors (1,024,000 chunks, 159 MB): about 12 s a rank against about 45 s
(the reviewer's figures, 110 µs a chunk for the reference on a slower host: 2 minutes).

**Once per load, the same on every rank.** A load's metadata reaches every rank as the bytes
one rank checked whole (its checksum against the marker) and broadcast (the project's bounded
broadcast); each rank parses them with :func:`agreed_metadata`, which agrees the outcome (an
allgather of one word a rank): a metadata refused on one rank is the same CheckpointError on
every rank before DCP's own exchanges begin, never a hang. Each rank parses the whole (M about
155 B x T x N: 159 MB at 1,024 ranks and 1,000 tensors, 1.27 GB at 8,192), in parallel: a rank
parsing it once and sending the others a re-pickled copy would only add that rank's parse to the
path (the others still unpickle the same amount).
"""
from __future__ import annotations

import io
import os
import pickle
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..core.errors import CheckpointError, raise_if_any
from .checkpoint_io import numpy_safe_globals
from .checksums import CachedFileSystem

__all__ = ["MetadataUnpickler", "ReferenceUnpickler", "read_metadata", "parse_metadata", "agreed_metadata",
           "reader", "ranged_reader", "planner"]

_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_META, "Metadata"), (_META, "TensorStorageMetadata"), (_META, "BytesStorageMetadata"),
    (_META, "ChunkStorageMetadata"), (_META, "TensorProperties"), (_META, "MetadataIndex"),
    (_META, "StorageMeta"), (_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict"),
}
_NO_STATE = "a checkpoint's metadata may not set state on a class"
_IMMUTABLE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: Python refuses attributes set on such a type


def _allowed(module: str, name: str, find: Callable[[str, str], Any]) -> Any:
    """The object a metadata may name as ``module.name`` (found by ``find``), else UnpicklingError."""
    import torch

    if "." not in name and (module, name) in _ALLOWED:
        return find(module, name)
    if module == "torch" and "." not in name:
        found = getattr(torch, name, None)
        if isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
            return found
    raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


def _refuse_state(*_: Any) -> None:
    raise pickle.UnpicklingError(_NO_STATE)


class _Guard(type):
    """The type of a guard: calling one calls the real object."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls.real(*args, **kwargs)  # type: ignore[attr-defined]


_GUARDS: Dict[int, Any] = {}  # id(real) -> its guard (the reals are module globals: they live as long)


def _guard(real: Any) -> Any:
    """``real`` itself when it is an immutable type or not callable (a dtype), else its guard (see
    the module): ``NEWOBJ`` and a call make the real one's instances, ``BUILD`` on it is refused."""
    if (isinstance(real, type) and real.__flags__ & _IMMUTABLE) or not callable(real):
        return real
    guard = _GUARDS.get(id(real))
    if guard is None:
        def new(cls: Any, *args: Any, **kwargs: Any) -> Any:  # pickle's NEWOBJ: real.__new__(real, ...)
            return real.__new__(real, *args, **kwargs)

        guard = _GUARDS[id(real)] = _Guard(getattr(real, "__name__", "guard"), (), {
            "real": real, "__new__": new, "__setstate__": staticmethod(_refuse_state), "__slots__": ()})
    return guard


class MetadataUnpickler(pickle.Unpickler):  # the C one; state on a class is refused by the guards
    """The unpickler of DCP's metadata: only the names in ``_ALLOWED`` (and torch's dtypes,
    layouts and memory formats), and no state set on a class (pickle's BUILD on a type would
    change it for the whole process): see the module for how."""

    def find_class(self, module: str, name: str) -> Any:
        return _guard(_allowed(module, name, super().find_class))


class ReferenceUnpickler(pickle._Unpickler):  # the pure-Python one: its opcodes can be overridden
    """The same rules, checked opcode by opcode (BUILD on a class or function refused where it is
    met): about 3-4x slower than :class:`MetadataUnpickler`; kept to check it against and to
    measure it."""

    def find_class(self, module: str, name: str) -> Any:
        return _allowed(module, name, super().find_class)

    def load_build(self) -> None:
        if isinstance(self.stack[-2], (type, types.FunctionType)):
            raise pickle.UnpicklingError(_NO_STATE)
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


def read_metadata(path: str) -> Any:
    """The metadata at ``path``, read by :func:`parse_metadata`."""
    with open(path, "rb") as f:
        return parse_metadata(f.read())


def parse_metadata(data: bytes, unpickler: Any = None) -> Any:
    """DCP's metadata from its bytes, read by :class:`MetadataUnpickler` (or ``unpickler``, e.g.
    :class:`ReferenceUnpickler`); every file it names must be a plain name (no folder, no ``..``):
    a load reads nothing outside the checkpoint's folder."""
    metadata = (unpickler or MetadataUnpickler)(io.BytesIO(data)).load()
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", "")
        if type(rel) is not str:  # (a path object's str() and the path DCP joins need not agree)
            raise pickle.UnpicklingError(f"a checkpoint's metadata names a file by a {type(rel).__name__}, not a name")
        if not rel or "/" in rel or rel in (".", ".."):  # (no os.path call: a million chunks at 1,024 ranks)
            raise pickle.UnpicklingError(f"a checkpoint's metadata names the file {rel[:200]!r}, outside its folder")
    return metadata


def agreed_metadata(ctl: Any, data: Optional[bytes], where: str) -> Any:
    """Collective: DCP's metadata from ``data`` (the same bytes on every rank, checked and
    broadcast by one rank: see the module), parsed on every rank by :func:`parse_metadata`; a
    metadata missing or refused on any rank is one CheckpointError on every rank, naming
    ``where`` and the reason. Cost: one parse a rank (about 12 µs a chunk: 12 s at 1,024 ranks
    and 1,000 tensors) and an allgather of one word a rank (a few kB at 1,000 ranks)."""
    metadata, error = None, None
    try:
        if data is None:
            raise ValueError(f"{where} holds no DCP metadata")
        metadata = parse_metadata(bytes(data))
    except Exception as exc:  # (a planted pickle may raise anything: each is the same refusal)
        error = f"{where}: {type(exc).__name__}: {exc}" if data is not None else str(exc)
    raise_if_any(ctl, error, CheckpointError, "hpcsync.checkpoint: cannot load: ")
    return metadata


def reader(path: str, cache: Optional[Mapping[str, bytes]] = None, metadata: Any = None) -> Any:
    """DCP's FileSystemReader for the folder ``path``, its metadata ``metadata`` (parsed already:
    :func:`agreed_metadata`) or else read by :func:`read_metadata`; the files in ``cache``
    (``{path: bytes}``, read and checked already) read from memory."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    held = {os.path.normpath(k): v for k, v in (cache or {}).items()}

    class SafeReader(FileSystemReader):
        def __init__(self, folder: str) -> None:
            super().__init__(folder)
            self.fs = CachedFileSystem(held)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            parsed = metadata
            if parsed is None:
                where = os.path.normpath(os.fspath(self._get_metadata_path(kwargs.get("rank"))))
                parsed = parse_metadata(held[where]) if where in held else read_metadata(where)
            if getattr(parsed, "storage_meta", None) is None:
                parsed.storage_meta = StorageMeta()
            parsed.storage_meta.load_id = self.load_id
            return parsed

    return SafeReader(path)


def ranged_reader(metadata: Any, fetch: Callable[[List[Tuple[str, int, int]]], Dict[Tuple[str, int, int], Any]],
                  folder: str = "") -> Any:
    """A DCP reader that reads no folder of its own: its metadata is ``metadata`` (parsed already:
    :func:`agreed_metadata`) and :meth:`read_data` gets the bytes of every item its rank reads from
    one call of ``fetch`` (collective: every rank makes it once per load) with the item's
    ``(file name, offset, length)`` list, file names as in the metadata (inside ``folder``, when
    given: ``folder/name``). What each item then
    becomes is what DCP's own FileSystemReader makes of it (tensors with ``weights_only=True``)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed._shard._utils import narrow_tensor_by_index  # what DCP's own reader uses
    from torch.futures import Future

    class RangedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            parsed = metadata
            if getattr(parsed, "storage_meta", None) is None:
                parsed.storage_meta = StorageMeta()
            parsed.storage_meta.load_id = self.load_id
            return parsed

        def read_data(self, plan: Any, planner: Any) -> Any:
            items = [(req, self.storage_data[req.storage_index]) for req in plan.items]
            ranges = [(f"{folder}/{md.relative_path}" if folder else str(md.relative_path), int(md.offset),
                       int(md.length)) for _, md in items]
            got = fetch(ranges)
            for (req, md), where in zip(items, ranges):
                stream: Any = io.BytesIO(got[where])
                if getattr(md, "transform_descriptors", None):
                    stream = self.transforms.transform_load_stream(req, md.transform_descriptors, stream)
                    stream = io.BytesIO(stream.read(-1))
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, stream)
                    continue
                tensor = torch.load(stream, map_location="cpu", weights_only=True)
                tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
            fut: Future = Future()
            fut.set_result(None)
            return fut

    return RangedReader("/nonexistent-hpcsync-ranged-reader")


def planner(extra: Sequence[Any]) -> Any:
    """DCP's default load planner, non-tensor values loaded with ``weights_only=True`` (numpy's
    data types and ``extra`` allowed), and a checkpoint holding entries the template lacks refused
    (they would be dropped without a word: e.g. an optimizer's state not made yet)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # DCP's own (a private module)

    class SafePlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            extra_keys = sorted(set(self.metadata.state_dict_metadata) - set(self.state_dict))
            if extra_keys:
                raise ValueError(f"the checkpoint holds {len(extra_keys)} entries the template lacks (e.g. "
                                 f"{', '.join(extra_keys[:3])}): give load() a state of the same structure "
                                 "(get_state_dict(model, optim) makes the optimizer's state too)")
            return super().create_local_plan()

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            with torch.serialization.safe_globals([*numpy_safe_globals(), *extra]):
                obj = torch.load(value, map_location="cpu", weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()
