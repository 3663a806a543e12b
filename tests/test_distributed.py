"""A target sharded over 2 processes (MLX's ring backend on 127.0.0.1, started by ``mlx.launch``) decodes
exactly as one process does: greedy tokens equal for the draft model, n-gram and EAGLE drafters, tensor-
and pipeline-parallel; sampled output passes the chi-square test of test_lossless (and a broken verifier
fails it); every rank commits the same tokens; a rank killed mid-answer ends the job with one error line.

Every launch has a hard timeout, so a hang fails the test instead of wedging the run.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import byte_tokenizer, save_tiny_model, tiny_llama, tiny_qwen2
from mlxspec.runtime.distributed import Sharding, _ErrorsOnly, mark_sharded
from mlxspec.sharding import check_drafter
from mlxspec.drafters import make_drafter
from mlxspec.engine.generate import generate
from mlxspec.heads.eagle import save_eagle
from mlxspec.core.sampling import SamplingParams
from mlxspec.engine.session import load_model
from shard_worker import SAMPLED, sampled_models
from stats import chi_square, rejection_rate
from test_eagle import random_head
from test_lossless import PROMPT as SAMPLE_PROMPT, V, exact_joint, reference_probs

WORKER = Path(__file__).parent / "shard_worker.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
TIMEOUT_S = 240  # one launch: two interpreters importing mlx-lm on a loaded 2-core machine, then the work
PROMPT = [10, 20, 30, 40, 10, 20, 30, 41, 50, 60, 10, 20, 30]
#: Sampled generations per 2-rank chi-square run: enough that a verifier without the residual fails it with
#: probability over 0.999 on either target (test_the_sampled_runs_can_fail_a_verifier_without_residual:
#: 0.9999 for llama, 0.9997 for qwen2 at 400; 0.997 and 0.985 at 300); each costs a prefill and a verify
#: across the ranks (about 50 ms a generation tensor-parallel, 20 ms in pipeline stages, on 2 loaded cores).
SAMPLES = 400
SAMPLED_PARAMS = SamplingParams(temp=0.8)


def free_ports() -> int:
    """A starting port whose next port is free too (the ring backend listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


def launch_command(*command: str) -> list[str]:
    return [
        str(LAUNCH),
        "--backend",
        "ring",
        "--hosts",
        "127.0.0.1,127.0.0.1",
        "--starting-port",
        str(free_ports()),
        "--",
        sys.executable,
        *command,
    ]


def run_launch(*command: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``mlx.launch`` 2 ranks of ``command`` (Python arguments) and wait, failing after ``timeout``
    seconds."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    job = subprocess.Popen(
        launch_command(*command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # the ranks too: they are in the launcher's process group
        stdout, stderr = job.communicate()
        pytest.fail(f"the 2-rank job did not end within {timeout} s (a hang): {stderr}")
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def worker(tmp_path, *args: str) -> dict:
    out = tmp_path / f"out-{time.monotonic_ns()}.json"
    done = run_launch(str(WORKER), *args, "--out", str(out))
    assert out.is_file(), f"rank 0 wrote nothing:\n{done.stdout}\n{done.stderr}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny llama and qwen2 targets (byte tokenizer), a draft model and an EAGLE-2 head for each, saved."""
    root, tokenizer = tmp_path_factory.mktemp("sharded"), byte_tokenizer()
    made = {}
    for arch, build in (("llama", tiny_llama), ("qwen2", tiny_qwen2)):
        (root / arch).mkdir()
        (root / f"{arch}-draft").mkdir()
        made[arch] = save_tiny_model(root / arch, build(seed=0, sharpen=4.0), tokenizer)
        made[f"{arch}-draft"] = save_tiny_model(root / f"{arch}-draft", build(seed=3, sharpen=4.0), tokenizer)
        save_eagle(random_head(1), root / f"{arch}-eagle")
        made[f"{arch}-eagle"] = root / f"{arch}-eagle"
    return made


def drafter_specs(folders, arch: str) -> list[str]:
    return ["ngram", "draft", f"eagle:heads={folders[arch + '-eagle']},depth=4,top_k=4,total_tokens=16"]


def single_process(folders, arch: str) -> dict:
    """What one process produces for ``check_greedy``: each drafter's greedy tokens, the prompt's last
    logits."""
    target, draft = load_model(str(folders[arch])), load_model(str(folders[arch + "-draft"]))
    runs = {}
    for spec in drafter_specs(folders, arch):
        given = {"draft_model": draft.model, "draft_tokenizer": draft.tokenizer} if spec == "draft" else {}
        drafter = make_drafter(spec, target.model, target.tokenizer, **given)
        runs[spec] = generate(target.model, target.tokenizer, PROMPT, drafter=drafter, max_tokens=40,
                              num_draft_tokens=4, stop_tokens=set()).tokens
    logits = target.model(mx.array(PROMPT)[None])[0, -1]
    return {"runs": runs, "logits": np.array(logits)}


def check_greedy(folders, tmp_path, arch: str, kind: str) -> None:
    specs = drafter_specs(folders, arch)
    sharded = worker(
        tmp_path,
        "greedy",
        "--model",
        str(folders[arch]),
        "--draft-model",
        str(folders[arch + "-draft"]),
        "--shard",
        kind,
        "--prompt",
        ",".join(map(str, PROMPT)),
        "--drafters",
        *specs,
    )
    whole = single_process(folders, arch)
    assert sharded["logits_agree"], "the ranks' logits differ after the collectives"
    np.testing.assert_allclose(sharded["logits"], whole["logits"], rtol=1e-4, atol=1e-4)
    for spec in specs:
        run = sharded["runs"][spec]
        assert run["agree"], f"{spec}: the ranks committed different tokens"
        assert run["drafted"] > 0, f"{spec}: nothing was drafted, so nothing was verified"
        assert run["tokens"] == whole["runs"][spec], f"{spec}: the sharded output differs from one process's"
    assert sharded["runs"][specs[-1]]["trees"] > 0, (
        "EAGLE verified no tree: the tree mask and RoPE went untested"
    )


@pytest.mark.slow  # a sweep over drafters, one 2-rank launch per case
@pytest.mark.parametrize("arch,kind", [("llama", "tensor"), ("qwen2", "tensor"), ("qwen2", "pipeline")])
def test_greedy_sharded_equals_one_process(folders, tmp_path, arch, kind):
    check_greedy(folders, tmp_path, arch, kind)


@pytest.mark.slow  # a 2-rank launch and a one-process run
def test_generate_command_tensor_parallel_prints_once_and_matches(tiny_model_dir):
    """The CLI under mlx.launch: rank 0 alone prints, and prints what one process prints."""
    args = [
        "-m",
        "mlxspec",
        "generate",
        "--model",
        str(tiny_model_dir),
        "--drafter",
        "ngram",
        "--temp",
        "0",
        "--max-tokens",
        "30",
        "--prompt",
        "abcabcabcabc",
        "--no-chat-template",
        "--json",
        "--blas",
        "keep",
    ]
    whole = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert whole.returncode == 0, whole.stderr
    sharded = run_launch(*args, "--shard", "tensor")
    records = [json.loads(line) for line in sharded.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1, f"expected one record (rank 0's), got:\n{sharded.stdout}\n{sharded.stderr}"
    expected = json.loads(whole.stdout)
    assert records[0]["text"] == expected["text"]
    assert records[0]["generation_tokens"] == expected["generation_tokens"]
    assert records[0]["num_draft_tokens"] == 4  # γ auto is the fixed default in a sharded job
    assert records[0]["drafted"] > 0


@pytest.mark.slow  # a 2-rank launch
def test_llama_pipeline_is_refused_once_before_loading(tiny_model_dir, tmp_path):
    """mlx-lm 0.32's llama has no pipeline stages: refused from its config, before any rank reads a weight
    (this copy has none to read), in one line from rank 0 naming the way that works (issue 50)."""
    bare = tmp_path / "no-weights"
    bare.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (bare / f.name).write_bytes(f.read_bytes())
    done = run_launch("-m", "mlxspec", "generate", "--model", str(bare), "--prompt", "hi", "--shard",
                      "pipeline", "--drafter", "ngram", "--blas", "keep")
    errors = [line for line in done.stderr.splitlines() if line.startswith("mlxspec: error")]
    assert errors == [
        "mlxspec: error: mlx-lm cannot split a llama model into pipeline stages; use --shard tensor"
    ], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # a 2-rank launch
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "--port", "0"]])
def test_a_command_under_the_launcher_without_shard_is_refused_once(tiny_model_dir, command):
    """Without --shard each rank would run the whole model and print (or serve) the answer: refused, one line
    from rank 0 (issue 50)."""
    done = run_launch("-m", "mlxspec", *command, "--model", str(tiny_model_dir), "--drafter", "ngram",
                      "--blas", "keep")
    errors = [line for line in done.stderr.splitlines() if line.startswith("mlxspec: error")]
    assert len(errors) == 1 and "needs --shard tensor or --shard pipeline" in errors[0], done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr


def test_shard_without_launch_is_refused():
    done = subprocess.run([sys.executable, "-m", "mlxspec", "generate", "--prompt", "hi", "--shard", "tensor",
                           "--blas", "keep"], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MLX_")})
    assert done.returncode == 2
    assert done.stderr.strip().startswith(
        "mlxspec: error: --shard needs several processes: start the command with mlx.launch"
    ), done.stderr


@pytest.mark.slow  # a 2-rank launch
def test_a_killed_rank_ends_the_job_with_one_error(tiny_model_dir):
    """Rank 1 is killed mid-answer; rank 0 ends within the timeout with one ``mlxspec: error`` line."""
    args = ["-m", "mlxspec", "generate", "--model", str(tiny_model_dir), "--drafter", "ngram", "--temp", "0",
            "--max-tokens", "4000", "--prompt", "abcabcabcabc", "--no-chat-template", "--blas", "keep",
            "--shard", "tensor"]
    job = subprocess.Popen(launch_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        assert job.stdout.read(8), "rank 0 printed nothing"  # generation is under way
        rank1 = _rank_pid(job.pid, 1)
        os.kill(rank1, signal.SIGKILL)
        _, stderr = job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail("rank 0 still runs 60 s after rank 1 was killed (a hang)")
    errors = [line for line in stderr.splitlines() if line.startswith("mlxspec: error")]
    assert len(errors) == 1, stderr
    assert "rank 0" in errors[0] or "connection to a peer was lost" in errors[0], errors[0]
    # non-zero
    assert "Node with rank 0 exited with code" in stderr and "exited with code 0" not in stderr, stderr


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of the launcher's child process that runs ``rank`` (its MLX_RANK)."""
    for _ in range(100):
        children = [
            c
            for task in Path(f"/proc/{launcher}/task").iterdir()
            for c in (task / "children").read_text().split()
        ]
        for child in children:
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"MLX_RANK={rank}".encode() in env:
                return int(child)
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} process under the launcher")


def check_sampled(tmp_path, arch: str, kind: str, broken: bool = False) -> tuple[float, float]:
    result = worker(
        tmp_path,
        "sample",
        "--arch",
        arch,
        "--shard",
        kind,
        "--drafters",
        "draft",
        "--gamma",
        "3",
        "--temp",
        str(SAMPLED_PARAMS.temp),
        "--samples",
        str(SAMPLES),
        "--prompt",
        ",".join(map(str, SAMPLE_PROMPT)),
        *(["--broken"] if broken else []),
    )
    assert result["agree"], "the ranks sampled different tokens"
    counts = Counter({tuple(int(t) for t in k.split(",")): n for k, n in result["counts"].items()})
    return chi_square(counts, exact_joint(sampled_models(arch)[0], SAMPLED_PARAMS))


@pytest.mark.slow  # statistical
@pytest.mark.parametrize("arch,kind", [("llama", "tensor"), ("qwen2", "pipeline")])
def test_sampled_sharded_follows_the_target(tmp_path, arch, kind):
    stat, critical = check_sampled(tmp_path, arch, kind)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_a_sharded_verifier_without_residual(tmp_path):
    """In pipeline stages, the cheaper of the two sharded runs (a tensor-parallel forward waits on 4
    all-sums): the broken rule is the same on either, and its power on each target is computed exactly
    below."""
    stat, critical = check_sampled(tmp_path, "qwen2", "pipeline", broken=True)
    assert stat > critical


def without_residual_joint(target, draft, params: SamplingParams) -> dict:
    """The exact joint of the first two tokens the sampled runs emit when a rejection draws from p instead of
    the residual: with 2 tokens to generate the first round drafts one token x ~ q, kept with probability
    min(1, p/q), so the first token is min(p, q) + (1 - sum min(p, q)) p; the second is a bonus token or a
    plain step, from p."""
    def probs(model, prefix):
        return reference_probs(np.array(model(mx.array(prefix)[None])[0, -1]), prefix, params)

    p, q = probs(target, SAMPLE_PROMPT), probs(draft, SAMPLE_PROMPT)
    first = np.minimum(p, q) + (1 - np.minimum(p, q).sum()) * p
    return {
        (a, b): first[a] * pb for a in range(V) for b, pb in enumerate(probs(target, SAMPLE_PROMPT + [a]))
    }


def test_the_sampled_runs_can_fail_a_verifier_without_residual():
    """The power behind SAMPLES, from exact distributions: the chi-square rejects a verifier without the
    residual in over 99.9% of seeded multinomial draws of SAMPLES, on each target (never, for qwen2 at sharpen
    3: its p is one-hot; 96% for llama with the draft seed 7 at 500 samples)."""
    for arch in SAMPLED:
        target, draft = sampled_models(arch)
        expected = exact_joint(target, SAMPLED_PARAMS)
        assert (
            rejection_rate(without_residual_joint(target, draft, SAMPLED_PARAMS), expected, SAMPLES) > 0.999
        ), arch


# --- in one process: what a sharded target refuses (a one-rank group stands in; only the kind is read) ---


def _marked(model, kind: str):
    mark_sharded(model, Sharding(kind, mx.distributed.init()))
    return model


def test_pipeline_refuses_a_drafter_that_reads_layers_and_tensor_serves_it(tmp_path):
    save_eagle(random_head(3), tmp_path / "eagle3")
    spec = f"eagle:heads={tmp_path / 'eagle3'},total_tokens=8"
    pipeline, tensor = _marked(tiny_llama(), "pipeline"), _marked(tiny_llama(), "tensor")
    with pytest.raises(ValueError, match=r"reads the target's layers \[0, 1, 1\], which --shard pipeline "):
        check_drafter(pipeline, make_drafter(spec, pipeline, byte_tokenizer()))
    check_drafter(tensor, make_drafter(spec, tensor, byte_tokenizer()))
    check_drafter(pipeline, make_drafter("ngram", pipeline, byte_tokenizer()))


def test_a_sharded_target_measures_no_costs():
    """γ auto, or a tree the measured cost prunes, would let each rank choose its own: refused in one line."""
    target = _marked(tiny_llama(), "tensor")
    with pytest.raises(ValueError, match="does not measure costs per machine"):
        generate(target, byte_tokenizer(), PROMPT, drafter="ngram", num_draft_tokens="auto", max_tokens=4)
    assert generate(
        target, byte_tokenizer(), PROMPT, drafter="ngram", num_draft_tokens=3, max_tokens=4
    ).tokens


def test_other_ranks_print_only_errors():
    seen = io.StringIO()
    out = _ErrorsOnly(seen)
    print("mlxspec: note: measuring", file=out)
    out.write("mlxspec: error: the model")
    out.write(" is missing\nanswer text\n")
    assert seen.getvalue() == "mlxspec: error: the model is missing\n"
