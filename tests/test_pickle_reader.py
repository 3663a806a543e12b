"""Weights-only torch checkpoint reader: fixtures written once by real torch, hand-made pickles for the rest.

The ``.pt`` fixtures come from ``tests/fixtures/make_torch_fixtures.py`` (run once with torch; torch is
not needed here). Hand-made archives build ``data.pkl`` from raw protocol-2 opcodes.
"""

from __future__ import annotations

import ast
import os
import pickletools
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxspec
from mlxspec.loading import pickle_reader
from mlxspec.loading.pickle_reader import ALLOWED_GLOBALS, load_torch_weights

FIXTURES = Path(__file__).parent / "fixtures"
EVIL_MARKER = Path("/tmp/mlxspec_evil_pt_ran")  # what evil.pt's payload would create

MEDUSA_DTYPES = {"0.linear.weight": mx.float32, "0.linear.bias": mx.float32, "1.weight": mx.bfloat16}
EXTRA_DTYPES = {"strided.transposed": mx.float32, "strided.slice": mx.float32, "half.weight": mx.float16}
CHECKPOINT_DTYPES = {
    "state_dict.weight": mx.float32,
    "state_dict.bias": mx.float32,
    "extra.param": mx.float32,
    "extra.tagged": mx.float32,
    "ids": mx.uint16,
    "steps": mx.int64,
}


def _check_against_npz(weights: dict, npz: Path, dtypes: dict) -> None:
    expected = np.load(npz)
    assert sorted(weights) == sorted(expected.files)
    for name, array in weights.items():
        assert array.dtype == dtypes[name], name
        assert array.shape == expected[name].shape, name
        values = np.array(array.astype(mx.float32)) if array.dtype == mx.bfloat16 else np.array(array)
        np.testing.assert_array_equal(values, expected[name], err_msg=name)


# --- hand-made archives ----------------------------------------------------------------------


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _text(s: str) -> bytes:
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _ints(values) -> bytes:
    """A tuple of small non-negative ints."""
    return b"(" + b"".join(b"K" + bytes([v]) for v in values) + b"t"


def _tensor(storage: str, numel: int, offset: int, size, stride) -> bytes:
    """``_rebuild_tensor_v2`` over storage key '0', as torch.save writes it."""
    pid = (
        b"("
        + _text("storage")
        + _global("torch", storage)
        + _text("0")
        + _text("cpu")
        + b"K"
        + bytes([numel])
        + b"t"
    )
    hooks = _global("collections", "OrderedDict") + b")R"
    return (
        _global("torch._utils", "_rebuild_tensor_v2")
        + b"("
        + pid
        + b"Q"
        + b"K"
        + bytes([offset])
        + _ints(size)
        + _ints(stride)
        + b"\x89"
        + hooks
        + b"tR"
    )


def _state_dict(entries: dict[str, bytes]) -> bytes:
    return b"\x80\x02}(" + b"".join(_text(k) + v for k, v in entries.items()) + b"u."


def _archive(
    path: Path, pickle_bytes: bytes, storages: dict[str, bytes] = (), folder="any_name", byteorder="little"
) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{folder}/data.pkl", pickle_bytes)
        z.writestr(f"{folder}/byteorder", byteorder)
        for key, data in dict(storages).items():
            z.writestr(f"{folder}/data/{key}", data)
    return path


# --- good checkpoints ------------------------------------------------------------------------


def test_medusa_fixture_names_shapes_dtypes_values():
    weights = load_torch_weights(FIXTURES / "medusa_lm_head.pt")
    dtypes = {f"{h}.{k}": d for h in range(3) for k, d in MEDUSA_DTYPES.items()} | EXTRA_DTYPES
    _check_against_npz(weights, FIXTURES / "medusa_lm_head.npz", dtypes)
    assert weights["0.1.weight"].shape == (16, 8)
    assert weights["strided.transposed"].shape == (6, 4)
    np.testing.assert_array_equal(np.array(weights["strided.slice"]), np.arange(24.0).reshape(4, 6)[1:, 2:5])


def test_checkpoint_fixture_nested_parameter_v3_and_attributes():
    """Nested dicts flatten with dots, non-tensors drop, Parameter/uint16/attribute forms load."""
    weights = load_torch_weights(FIXTURES / "torch_checkpoint.pt")
    _check_against_npz(weights, FIXTURES / "torch_checkpoint.npz", CHECKPOINT_DTYPES)
    assert "epoch" not in weights


def test_folder_name_and_big_endian(tmp_path):
    values = np.arange(6, dtype=np.float32)
    storage = values.astype(">f4").tobytes()
    path = _archive(
        tmp_path / "be.bin",
        _state_dict({"w": _tensor("FloatStorage", 6, 1, (2, 2), (1, 2))}),
        {"0": storage},
        folder="pytorch_model",
        byteorder="big",
    )
    np.testing.assert_array_equal(np.array(load_torch_weights(path)["w"]), [[1, 3], [2, 4]])


def test_empty_tensor(tmp_path):
    path = _archive(
        tmp_path / "e.pt", _state_dict({"w": _tensor("IntStorage", 0, 0, (0, 3), (3, 1))}), {"0": b""}
    )
    assert load_torch_weights(path)["w"].shape == (0, 3)


# --- refused checkpoints ---------------------------------------------------------------------


def test_evil_fixture_refused_without_side_effect():
    ops = [
        (op.name, arg)
        for op, arg, _ in pickletools.genops(zipfile.ZipFile(FIXTURES / "evil.pt").read("evil/data.pkl"))
    ]
    assert ("GLOBAL", "posix system") in ops  # the fixture really carries a payload
    EVIL_MARKER.unlink(missing_ok=True)
    with pytest.raises(ValueError) as e:
        load_torch_weights(FIXTURES / "evil.pt")
    assert str(e.value) == (
        f"refusing to load {FIXTURES / 'evil.pt'}: it references posix.system, which a "
        "weights-only reader does not allow; convert it to safetensors"
    )
    assert not EVIL_MARKER.exists()


@pytest.mark.parametrize(
    "module, name",
    [
        ("builtins", "eval"),
        ("torch.storage", "_load_from_bytes"),
        ("builtins", "getattr"),
        ("torch", "load"),
        ("numpy", "load"),
    ],
)
def test_forbidden_globals(tmp_path, module, name):
    assert f"{module}.{name}" not in ALLOWED_GLOBALS
    pkl = b"\x80\x02" + _global(module, name) + b"(" + _text("1 + 1") + b"tR."
    with pytest.raises(ValueError, match=f"references {module}.{name}, which a weights-only"):
        load_torch_weights(_archive(tmp_path / "x.pt", pkl))


@pytest.mark.parametrize(
    "pkl, message",
    [
        (_state_dict({"w": _tensor("FloatStorage", 4, 0, (3, 2), (2, 1))}), "reaches past its storage"),
        (_state_dict({"w": _global("torch", "FloatStorage") + b")R"}), "corrupt torch checkpoint"),
        (
            b"\x80\x02" + _global("_codecs", "encode") + b"(" + _text("x") + _text("zlib_codec") + b"tR.",
            "codec",
        ),
        (b"\x80\x02" + _global("torch._utils", "_rebuild_tensor_v2") + b"(", "corrupt torch checkpoint"),
        (b"\x80\x02]" + b".", "expected a dict of tensors"),
        (b"\x80\x02}" + _text("epoch") + b"K\x03s.", "holds no tensors"),
    ],
)
def test_bad_pickles_give_clear_errors(tmp_path, pkl, message):
    path = _archive(tmp_path / "x.pt", pkl, {"0": bytes(16)})
    with pytest.raises(ValueError, match=message):
        load_torch_weights(path)


def test_truncated_garbage_and_legacy_files(tmp_path):
    good = (FIXTURES / "medusa_lm_head.pt").read_bytes()
    cases = {
        "truncated.pt": (good[: len(good) // 2], "truncated zip"),
        "garbage.pt": (
            os.urandom(64).replace(b"\x80", b"\x00").replace(b"PK", b"pk"),
            "not a torch checkpoint",
        ),
        "legacy.pt": (b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.", "legacy"),
        "empty.pt": (b"", "not a torch checkpoint"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=message):
            load_torch_weights(tmp_path / name)
    missing_storage = _archive(
        tmp_path / "m.pt", _state_dict({"w": _tensor("FloatStorage", 4, 0, (4,), (1,))})
    )
    with pytest.raises(ValueError, match="corrupt torch checkpoint"):
        load_torch_weights(missing_storage)


def test_no_torch_import_in_mlxspec():
    """No module of the package names torch in an import statement."""
    for source in Path(mlxspec.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] == "torch"], f"{source} imports torch"


@pytest.mark.parametrize("block", [False, True])
def test_loading_never_imports_torch(block):
    """In a fresh interpreter, loading leaves no torch module behind, and works with torch unimportable.

    The module is run from its file, so the package's own imports (transformers, seconds) are skipped.
    """
    script = f"""
import importlib.util, sys
if {block}:
    sys.modules["torch"] = None  # import torch now raises ImportError
spec = importlib.util.spec_from_file_location("pickle_reader", {str(Path(pickle_reader.__file__))!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.load_torch_weights({str(FIXTURES / "medusa_lm_head.pt")!r})
module.load_torch_weights({str(FIXTURES / "torch_checkpoint.pt")!r})
torch = [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
assert torch == (["torch"] if {block} else []), torch
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
