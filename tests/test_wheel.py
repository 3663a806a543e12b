"""An installed wheel, not only an editable checkout, finds the shipped heads and drafts.

Builds the wheel from a copy of the tracked files (so the checkout gets no build/ folder), installs
it with ``--no-deps`` into a fresh venv that sees this environment's packages through a ``.pth``
line (fast, offline), and runs ``mlxspec generate --drafter eagle`` from another folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The wheel's size limit: the code plus the shipped heads that pay their way.
MAX_WHEEL_BYTES = 30 * 2**20

# a wheel build; the shipped head is for the real default model
pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{cmd}: {done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv with the mlxspec wheel installed; returns its bin folder."""
    root = tmp_path_factory.mktemp("wheel")
    tracked = _run(["git", "ls-files", "-z"], cwd=ROOT).stdout.split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, root / "src" / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(root / "dist"), str(root / "src")])
    (wheel,) = (root / "dist").glob("mlxspec-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert "mlxspec_models/eagle/SmolLM2-135M-Instruct/model.safetensors" in names
    assert "mlxspec_models/eagle/SmolLM2-135M-Instruct/target.json" in names
    # draft vocabularies
    assert any(n.startswith("mlxspec_models/vocab/") and n.endswith(".safetensors") for n in names)
    # only drafters that pay ship (docs/drafters.md, "What ships"): no dead weight in every install
    assert wheel.stat().st_size <= MAX_WHEEL_BYTES, f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MB"
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    site = Path(_run([str(venv / "bin" / "python"), "-c",
                      "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    (site / "test-env.pth").write_text(sysconfig.get_path("purelib") + "\n")  # mlx, mlx-lm, ... of this env
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
          "--no-index", "-q", str(wheel)])
    return venv / "bin"


def test_an_installed_wheel_runs_the_shipped_eagle_head_from_another_folder(installed, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MLXSPEC_MODELS", "PYTHONPATH")}
    where = _run([str(installed / "python"), "-c",
                  "import mlxspec.loading.assets as a; print(a.__file__, a.models_dir())"],
                 cwd=tmp_path, env=env).stdout.split()
    # the wheel's, not the checkout's
    assert all(Path(p).is_relative_to(installed.parent) for p in where), where
    done = _run([str(installed / "mlxspec"), "generate", "--drafter", "eagle",
                 "--dtype", "float32", "--prompt",
                 "Explain why the sky is blue.", "--max-tokens", "12", "--json"], cwd=tmp_path, env=env)
    record = json.loads(done.stdout)
    assert record["drafter"] == "eagle" and record["drafted"] > 0 and record["text"]
