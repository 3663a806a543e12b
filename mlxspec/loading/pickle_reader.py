"""Read tensors from a torch checkpoint (``.pt``, ``.bin``) without torch and without running its pickle.

A torch checkpoint is a pickle, and unpickling runs whatever callables it names. Like
``torch.load(weights_only=True)``, ``load_torch_weights`` unpickles with a ``find_class`` that
resolves only the names a state dict of dense tensors needs (``ALLOWED_GLOBALS``), each to a local
stand-in: torch's own functions are never imported, and any other global is refused with a
``ValueError`` before anything is called. Storages arrive through ``persistent_load`` as
``('storage', storage_type, key, location, numel)`` and are read as raw bytes from the archive.

Only the zip format (torch >= 1.6, the default since) is read: ``<folder>/data.pkl`` holds the
pickle and ``<folder>/data/<key>`` each storage's bytes (little-endian unless ``<folder>/byteorder``
says ``big``); the folder name varies. The legacy format is refused.

The result is flat: nested dicts (``{"state_dict": {...}}``) are flattened with dots
(``state_dict.weight``) and non-tensor leaves (``"epoch": 3``, lists) are dropped. float64 tensors
become float32, the widest float MLX computes with on every device.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from math import prod
from pathlib import Path

import mlx.core as mx
import numpy as np

_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "DoubleStorage": "float64",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
"""Legacy typed storage classes (``torch.FloatStorage``...) and the dtype of their elements."""

# Element types read from storage bytes: (numpy dtype of the bytes, MLX dtype of the result).
_ELEMENT_TYPES = {
    "float32": ("f4", mx.float32),
    "float16": ("f2", mx.float16),
    "bfloat16": ("u2", mx.bfloat16),  # numpy has no bfloat16: read the bits, then view them
    "float64": ("f8", mx.float32),
    "int64": ("i8", mx.int64),
    "int32": ("i4", mx.int32),
    "int16": ("i2", mx.int16),
    "int8": ("i1", mx.int8),
    "uint8": ("u1", mx.uint8),
    "uint16": ("u2", mx.uint16),
    "uint32": ("u4", mx.uint32),
    "uint64": ("u8", mx.uint64),
    "bool": ("?", mx.bool_),
}

# torch dtypes a pickle may name (``torch.float8_e4m3fn``...) that have no MLX counterpart: named
# so the error says "unsupported dtype" rather than "forbidden global".
_OTHER_DTYPES = (
    "complex32 complex64 complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz "
    "float8_e8m0fnu float4_e2m1fn_x2 qint8 quint8 qint32 quint4x2 quint2x4 bits8 bits16"
).split()


class _Marker:
    """A stand-in for a torch class or dtype: a name to compare, never called, never mutated."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str):
        self.kind = kind
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name}>"


class _Storage:
    """One storage's bytes, as a flat numpy array of its element type in byte order ``order``."""

    __slots__ = ("data", "dtype", "order")

    def __init__(self, data: np.ndarray, dtype: str, order: str = "<"):
        self.data = data
        self.dtype = dtype
        self.order = order


class _Tensor:
    """A rebuilt tensor: a contiguous numpy array and the MLX dtype it becomes."""

    __slots__ = ("array", "dtype")

    def __init__(self, array: np.ndarray, dtype: mx.Dtype):
        self.array = array
        self.dtype = dtype

    def to_mlx(self) -> mx.array:
        if self.dtype == mx.bfloat16:
            return mx.array(self.array).view(mx.bfloat16)
        return mx.array(self.array, dtype=self.dtype)


def _strided(storage: _Storage, offset: int, size, stride) -> _Tensor:
    """Copy the elements of a strided view of ``storage`` into a contiguous ``_Tensor``.

    Raises:
        ValueError: if the view reaches outside the storage (``as_strided`` does not check).
    """
    size, stride = tuple(size), tuple(stride)
    numbers = (offset, *size, *stride)
    if len(size) != len(stride) or not all(type(n) is int and n >= 0 for n in numbers):
        raise ValueError(f"bad tensor layout: offset {offset}, size {size}, stride {stride}")
    data = storage.data
    if prod(size) == 0:
        return _Tensor(np.zeros(size, data.dtype), _ELEMENT_TYPES[storage.dtype][1])
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= data.size:
        raise ValueError(
            f"tensor of size {size}, stride {stride} at offset {offset} "
            f"reaches past its storage of {data.size} elements"
        )
    view = np.lib.stride_tricks.as_strided(
        data[offset:], shape=size, strides=[s * data.itemsize for s in stride], writeable=False
    )
    native = view.astype(view.dtype.newbyteorder("="), copy=True)  # contiguous, native byte order
    return _Tensor(native, _ELEMENT_TYPES[storage.dtype][1])


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _strided(storage, storage_offset, size, stride)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    return _strided(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(
    storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None
):
    """The form torch writes for dtypes without a typed storage (uint16...): bytes plus a dtype."""
    if not isinstance(dtype, _Marker) or dtype.kind != "dtype":
        raise ValueError(f"expected a torch dtype, got {type(dtype).__name__}")
    if dtype.name not in _ELEMENT_TYPES:
        raise ValueError(f"unsupported tensor dtype torch.{dtype.name}")
    if storage.dtype != "uint8":
        raise ValueError(f"a torch.{dtype.name} tensor over a typed {storage.dtype} storage")
    element = storage.data.view(np.dtype(_ELEMENT_TYPES[dtype.name][0]).newbyteorder(storage.order))
    return _strided(_Storage(element, dtype.name), storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad, backward_hooks):
    return data


def _rebuild_parameter_with_state(data, requires_grad, backward_hooks, state):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    """A tensor subclass or a tensor with Python attributes: rebuild the tensor, drop the rest."""
    if not (isinstance(new_type, _Marker) and new_type.kind == "tensor class"):
        raise ValueError(f"expected a torch tensor class, got {new_type!r}")
    if func not in _REBUILDERS:
        raise ValueError("expected a tensor rebuild function")
    return func(*args)


def _encode_latin1(text: str, encoding: str) -> bytes:
    """``_codecs.encode``, as protocol 2 uses it for ``bytes``; any codec but latin1 is refused."""
    if encoding != "latin1" or not isinstance(text, str):
        raise ValueError(f"_codecs.encode with codec {encoding!r} is not allowed")
    return text.encode("latin1")


def _size(dims=()) -> tuple:
    """``torch.Size(dims)``, as a plain tuple of ints."""
    dims = tuple(dims)
    if not all(type(d) is int for d in dims):
        raise ValueError(f"torch.Size of non-integers: {dims!r}")
    return dims


_REBUILDERS = (
    _rebuild_tensor,
    _rebuild_tensor_v2,
    _rebuild_tensor_v3,
    _rebuild_parameter,
    _rebuild_parameter_with_state,
)


def _allowed_globals() -> dict:
    allowed = {f"torch._utils.{f.__name__}": f for f in _REBUILDERS}
    allowed["torch._tensor._rebuild_from_type_v2"] = _rebuild_from_type_v2
    for name in _STORAGE_DTYPES:
        allowed[f"torch.{name}"] = _Marker("storage", name)
    allowed["torch.storage.UntypedStorage"] = allowed["torch.UntypedStorage"] = _Marker(
        "storage", "UntypedStorage"
    )
    for name in (*_ELEMENT_TYPES, *_OTHER_DTYPES):
        allowed[f"torch.{name}"] = _Marker("dtype", name)
    allowed["torch.Tensor"] = _Marker("tensor class", "Tensor")
    allowed["torch.nn.parameter.Parameter"] = _Marker("tensor class", "Parameter")
    allowed["torch.Size"] = _size
    allowed["collections.OrderedDict"] = OrderedDict
    allowed["_codecs.encode"] = _encode_latin1
    for kind in (set, frozenset):
        allowed[f"builtins.{kind.__name__}"] = kind
    return allowed


ALLOWED_GLOBALS = tuple(sorted(_allowed_globals()))
"""The ``module.name`` globals a checkpoint may reference; each resolves to a local stand-in."""


class _WeightsUnpickler(pickle.Unpickler):
    """Resolves only ``ALLOWED_GLOBALS`` and reads storages from the archive."""

    def __init__(self, file, path: Path, archive: zipfile.ZipFile, folder: str, byteorder: str):
        super().__init__(file)
        self._path = path
        self._archive = archive
        self._folder = folder
        self._byteorder = byteorder
        self._allowed = _allowed_globals()
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str):
        found = self._allowed.get(f"{module}.{name}")
        if found is None:
            raise ValueError(
                f"refusing to load {self._path}: it references {module}.{name}, which a weights-only "
                "reader does not allow; convert it to safetensors"
            )
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ValueError(f"unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not (isinstance(storage_type, _Marker) and storage_type.kind == "storage"):
            raise ValueError(f"expected a storage class in persistent id, got {storage_type!r}")
        if key not in self._storages:
            self._storages[key] = self._read_storage(storage_type.name, str(key), numel)
        return self._storages[key]

    def _read_storage(self, storage_name: str, key: str, numel: int) -> _Storage:
        dtype = _STORAGE_DTYPES.get(storage_name, "uint8")  # UntypedStorage: bytes
        raw = self._archive.read(f"{self._folder}/data/{key}")
        element = np.dtype(_ELEMENT_TYPES[dtype][0]).newbyteorder(self._byteorder)
        if type(numel) is not int or numel < 0 or len(raw) < numel * element.itemsize:
            raise ValueError(f"storage {key} holds {len(raw)} bytes, not {numel} x {element}")
        return _Storage(np.frombuffer(raw, element, count=numel), dtype, self._byteorder)


def _open_archive(path: Path) -> tuple[zipfile.ZipFile, str]:
    """Open ``path`` as a torch zip checkpoint and return it with its folder name."""
    with path.open("rb") as f:
        head = f.read(4)
    if not zipfile.is_zipfile(path):
        if head[:1] == b"\x80":
            raise ValueError(
                f"{path} is a legacy (torch < 1.6) checkpoint, which is not supported: "
                "re-save it with a newer torch or convert it to safetensors"
            )
        kind = "a truncated zip" if head == b"PK\x03\x04" else "not a torch checkpoint"
        raise ValueError(f"cannot read {path}: {kind} (expected a torch >= 1.6 zip archive)")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"cannot read {path}: corrupt zip archive ({e})") from e
    pickles = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
    if len(pickles) != 1:
        archive.close()
        raise ValueError(
            f"cannot read {path}: expected one <folder>/data.pkl in the archive, found {len(pickles)}"
        )
    return archive, pickles[0].split("/")[0]


def _flatten(tree: dict, prefix: str, out: dict[str, mx.array]) -> None:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _flatten(value, f"{name}.", out)
        elif isinstance(value, _Tensor):
            if name in out:
                raise ValueError(f"two tensors flatten to the same name {name!r}")
            out[name] = value.to_mlx()


def _byteorder(archive: zipfile.ZipFile, folder: str) -> str:
    try:
        order = archive.read(f"{folder}/byteorder").decode().strip()
    except KeyError:
        return "<"  # written before torch recorded it: little-endian
    if order not in ("little", "big"):
        raise ValueError(f"unknown byteorder {order!r}")
    return "<" if order == "little" else ">"


def load_torch_weights(path: str | Path) -> dict[str, mx.array]:
    """Load the tensors of a torch zip checkpoint without torch and without running its pickle.

    Args:
        path: A file written by ``torch.save`` (torch >= 1.6), e.g. ``medusa_lm_head.pt`` or
            ``pytorch_model.bin``.

    Returns:
        dict[str, mx.array]: name -> contiguous array, nested dict keys joined with dots;
        non-tensor values dropped. bfloat16/float16/float32 and integer dtypes are kept;
        float64 becomes float32.

    Raises:
        ValueError: if the checkpoint references a global outside ``ALLOWED_GLOBALS`` (the message
            names it), is legacy, truncated or not a torch checkpoint, holds an unsupported dtype,
            is not a dict at the top, or holds no tensor.
    """
    path = Path(path)
    archive, folder = _open_archive(path)
    with archive:
        try:
            byteorder = _byteorder(archive, folder)
            unpickler = _WeightsUnpickler(
                io.BytesIO(archive.read(f"{folder}/data.pkl")), path, archive, folder, byteorder
            )
            tree = unpickler.load()
        except ValueError as e:
            if str(e).startswith("refusing"):
                raise
            raise ValueError(f"cannot read {path}: {e}") from e
        except (
            pickle.UnpicklingError,
            EOFError,
            KeyError,
            TypeError,
            AttributeError,
            IndexError,
            zipfile.BadZipFile,
            OSError,
        ) as e:
            raise ValueError(f"cannot read {path}: corrupt torch checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(tree, dict):
        raise ValueError(
            f"cannot read {path}: expected a dict of tensors at the top, got {type(tree).__name__}"
        )
    weights: dict[str, mx.array] = {}
    _flatten(tree, "", weights)
    if not weights:
        raise ValueError(f"cannot read {path}: it holds no tensors")
    return weights
