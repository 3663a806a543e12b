"""No lost work, no traceback from the disk (issue 46, items 2 and 3): ``bench -o`` checks its destination
before measuring and never loses finished measurements; ``convert`` writes under a temporary name and renames,
so a full disk leaves no truncated model, and a rerun replaces an unfinished output with a clear message.

Tests run as root here, where ``chmod`` does not stop writes: a read-only folder is simulated by a write that
raises ``PermissionError(EACCES)`` (the real ``chmod`` variant runs, and asserts, only when not root)."""

from __future__ import annotations

import errno
import json
import os

import pytest

import gguf_fixtures as gf
from mlxspec.commands.cli import main

BENCH = ["--drafters", "none", "--no-control", "--repeats", "1", "--max-tokens", "2", "--prompt", "Say hi.",
         "--blas", "keep"]


def error_line(capsys, code, expect):
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("mlxspec: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert expect in lines[0], lines[0]
    return out, err


def no_measuring(monkeypatch):
    import mlxspec.commands.bench as bench

    def refuse(*a, **k):
        raise AssertionError("measured before checking --output")

    monkeypatch.setattr(bench, "load_model", refuse)


def test_bench_output_into_a_missing_folder_or_onto_a_folder_is_refused_before_measuring(tmp_path, capsys,
                                                                                      monkeypatch):
    no_measuring(monkeypatch)
    missing = tmp_path / "no" / "such" / "bench.json"
    error_line(capsys, main(["bench", *BENCH, "-o", str(missing)]),
               f"the folder {missing.parent} does not exist")
    error_line(capsys, main(["bench", *BENCH, "-o", str(tmp_path)]), "is a folder")
    (tmp_path / "file").write_text("x")
    error_line(capsys, main(["bench", *BENCH, "-o", str(tmp_path / "file" / "b.json")]), "is not a folder")


def test_bench_output_into_a_read_only_folder_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    no_measuring(monkeypatch)
    import mlxspec.commands.files as files

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path))

    monkeypatch.setattr(files.tempfile, "NamedTemporaryFile", denied)
    error_line(capsys, main(["bench", *BENCH, "-o", str(tmp_path / "b.json")]), "cannot write in")


@pytest.mark.skipif(os.geteuid() == 0,
                    reason="root writes into a chmod 555 folder; the simulated test above covers it")
def test_bench_output_into_a_chmod_read_only_folder_is_refused_before_measuring(
    tmp_path, capsys, monkeypatch
):
    no_measuring(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        error_line(capsys, main(["bench", *BENCH, "-o", str(locked / "b.json")]), "cannot write in")
    finally:
        locked.chmod(0o755)


def test_bench_keeps_finished_measurements_when_the_final_write_fails(tmp_path, tiny_model_dir, capsys,
                                                                      monkeypatch):
    """The disk fills (or the folder turns read-only) during the runs: the JSON goes to a file in the
    temporary folder, the line says where, and the verdict is still printed."""
    import mlxspec.commands.files as files

    output = tmp_path / "bench.json"
    real = files.os.replace

    def full(src, dst):
        if str(dst) == str(output):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", full)
    monkeypatch.setattr(files.tempfile, "gettempdir", lambda: str(tmp_path / "spare"))
    (tmp_path / "spare").mkdir()
    out, err = error_line(capsys, main(["bench", "--model", str(tiny_model_dir), *BENCH, "-o", str(output)]),
                          f"could not write {output} (No space left on device); the results are in ")
    assert not output.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".bench")]
    kept = list((tmp_path / "spare").glob("bench-*.json"))
    assert len(kept) == 1 and str(kept[0]) in err
    result = json.loads(kept[0].read_text())
    assert len(result["runs"]) == 2 and result["verdicts"]  # plain mlx-lm and mlxspec none, one repeat each
    assert "Verdict" in out


def test_bench_prints_the_json_when_no_file_can_be_written(tmp_path, tiny_model_dir, capsys, monkeypatch):
    import mlxspec.commands.files as files

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(files.os, "replace", full)
    out, err = error_line(capsys, main(["bench", "--model", str(tiny_model_dir), *BENCH, "-o",
                                        str(tmp_path / "b.json")]), "the results are printed above")
    start = out.index("{\n")
    result = json.JSONDecoder().raw_decode(out[start:])[0]
    assert len(result["runs"]) == 2


def test_bench_drafters_empty_is_refused(capsys, monkeypatch):
    no_measuring(monkeypatch)
    for empty in ("", " , "):
        error_line(capsys, main(["bench", "--drafters", empty, "--blas", "keep"]), "--drafters is empty")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path, _ = gf.write_typed_gguf(tmp_path_factory.mktemp("convert") / "tiny.gguf", gf.train_tokenizer(),
                                  {}, arch="qwen2", tied=False, seed=5)
    return path


def full_disk_after(monkeypatch, nbytes: int):
    """``mx.save_safetensors`` writes ``nbytes`` of the file, then fails as MLX does on a full disk."""
    import mlx.core as mx

    real = mx.save_safetensors

    def save(path, arrays, metadata=None):
        real(path, arrays, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(nbytes)
        raise RuntimeError(f"[write] Unable to write {os.path.getsize(path) + 1000} bytes to file.")

    monkeypatch.setattr(mx, "save_safetensors", save)


def test_convert_onto_a_full_disk_leaves_nothing_truncated_and_says_so_in_one_line(
    gguf_path, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "out"
    full_disk_after(monkeypatch, 100)
    error_line(capsys, main(["convert", str(gguf_path), str(out)]), f"could not write {out}")
    assert not out.exists() and not (tmp_path / "out.partial").exists()  # no truncated model.safetensors
    monkeypatch.undo()
    assert main(["convert", str(gguf_path), str(out)]) == 0  # the rerun converts
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()


def test_convert_os_errors_are_one_line(gguf_path, tmp_path, capsys, monkeypatch):
    """A read-only folder (EACCES) or a full disk raised as an OSError by the writer:
    one line, no traceback."""
    import mlx_lm.utils

    for code, text in ((errno.EACCES, "Permission denied"), (errno.ENOSPC, "No space left on device"),
                       (errno.EROFS, "Read-only file system")):
        def save(path, *a, **k):
            raise OSError(code, text, str(path))  # noqa: B023 (used in this iteration)

        monkeypatch.setattr(mlx_lm.utils, "save_model", save)
        error_line(capsys, main(["convert", str(gguf_path), str(tmp_path / f"o{code}")]), text)
        assert not (tmp_path / f"o{code}").exists()


def test_a_rerun_replaces_an_unfinished_output_with_a_clear_message(gguf_path, tmp_path, capsys):
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"  # a conversion killed mid-write (SIGKILL, power loss) leaves this
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x10\x00")
    assert main(["convert", str(gguf_path), str(out)]) == 0
    err = capsys.readouterr().err
    assert f"replacing {partial}, the unfinished output of an earlier run" in err
    assert not partial.exists() and (out / "config.json").exists()
    older = tmp_path / "older"  # what an older mlxspec left on a full disk: a truncated model, no config
    older.mkdir()
    (older / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:200])
    assert main(["convert", str(gguf_path), str(older)]) == 0
    err = capsys.readouterr().err
    assert f"{older} holds an unfinished conversion" in err and "replacing it" in err
    assert (older / "config.json").exists()
    busy = tmp_path / "busy"  # anything else is still refused, never deleted
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["convert", str(gguf_path), str(busy)]) == 2
    assert (busy / "notes.txt").read_text() == "mine"
