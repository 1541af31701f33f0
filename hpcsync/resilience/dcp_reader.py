"""Reading a torch.distributed.checkpoint directory without running its code.

DCP's ``.metadata`` is a pickle, and its planner loads non-tensor values with
``torch.load(weights_only=False)``: a checkpoint anyone could write to would run their code on
load. Here the metadata is unpickled by a pure-Python unpickler that knows exactly the record
types DCP writes (by module and name: no dotted names, no other callables) and refuses to set
state on a class; every file it names must be a plain name inside the checkpoint's folder; and
non-tensor values load with ``weights_only=True``.
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .checkpoint_io import numpy_safe_globals
from .checksums import CachedFileSystem

__all__ = ["MetadataUnpickler", "read_metadata", "parse_metadata", "reader", "ranged_reader", "planner"]

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


class MetadataUnpickler(pickle._Unpickler):  # the pure-Python one: its opcodes can be overridden
    """The unpickler of DCP's metadata: only the names in ``_ALLOWED`` (and torch's dtypes,
    layouts and memory formats), and no state set on a class (pickle's BUILD on a type would
    change it for the whole process)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if "." not in name and (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            found = getattr(torch, name, None)
            if isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")

    def load_build(self) -> None:
        if isinstance(self.stack[-2], type):
            raise pickle.UnpicklingError("a checkpoint's metadata may not set state on a class")
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


def read_metadata(path: str) -> Any:
    """The metadata at ``path``, read by :func:`parse_metadata`."""
    with open(path, "rb") as f:
        return parse_metadata(f.read())


def parse_metadata(data: bytes) -> Any:
    """DCP's metadata from its bytes, read by :class:`MetadataUnpickler`; every file it names must
    be a plain name (no folder, no ``..``): a load reads nothing outside the checkpoint's folder."""
    metadata = MetadataUnpickler(io.BytesIO(data)).load()
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or rel != os.path.basename(rel) or rel in (".", ".."):
            raise pickle.UnpicklingError(f"a checkpoint's metadata names the file {rel!r}, outside its folder")
    return metadata


def reader(path: str, cache: Optional[Mapping[str, bytes]] = None) -> Any:
    """DCP's FileSystemReader for the folder ``path``, its metadata read by :func:`read_metadata`;
    the files in ``cache`` (``{path: bytes}``, read and checked already) read from memory."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    held = {os.path.normpath(k): v for k, v in (cache or {}).items()}

    class SafeReader(FileSystemReader):
        def __init__(self, folder: str) -> None:
            super().__init__(folder)
            self.fs = CachedFileSystem(held)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            where = os.path.normpath(os.fspath(self._get_metadata_path(kwargs.get("rank"))))
            metadata = parse_metadata(held[where]) if where in held else read_metadata(where)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def ranged_reader(metadata: bytes, fetch: Callable[[List[Tuple[str, int, int]]], Dict[Tuple[str, int, int], Any]],
                  folder: str = "") -> Any:
    """A DCP reader that reads no folder of its own: its metadata is ``metadata`` (bytes, read by
    :func:`parse_metadata`) and :meth:`read_data` gets the bytes of every item its rank reads from
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
            parsed = parse_metadata(metadata)
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
