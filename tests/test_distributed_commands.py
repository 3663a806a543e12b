"""``serve``, ``chat`` and ``bench`` under ``mlx.launch`` (issue 45): a sharded server answers exactly as one
process does (rank 0 serves HTTP and shares each request with the other ranks), stops cleanly, and a
killed rank stops it with one error line and a non-zero status; ``chat`` and ``bench`` refuse to
start under the launcher.

Every 2-rank launch is slow and has a hard timeout, so a hang fails the test instead of wedging the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import byte_tokenizer, save_tiny_model, tiny_qwen2
from serve_fixtures import ServerProcess
from test_distributed import TIMEOUT_S, _rank_pid, launch_command, run_launch
from mlxspec.bench.measure import free_port

# greedy; sampled with a seed; the greedy one again (the prefix cache holds it: every rank reuses it)
REQUESTS = [
    {"prompt": "abcabcabcabc", "max_tokens": 24, "temperature": 0},
    {"prompt": "abcabcabcabc", "max_tokens": 24, "temperature": 0.8, "seed": 7},
    {"prompt": "abcabcabcabc", "max_tokens": 24, "temperature": 0},
]
ARGS = ["--drafter", "ngram", "--num-draft-tokens", "3", "--blas", "keep"]


class LaunchedServer:
    """``mlx.launch`` 2 ranks of ``mlxspec serve --shard KIND`` on 127.0.0.1, waited for
    until ``/health`` answers."""

    def __init__(self, model, kind: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = launch_command("-m", "mlxspec", "serve", "--model", str(model), "--port", str(self.port),
                                 "--shard", kind, *ARGS)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the launched server exited: {self.process.stdout.read()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        self.kill()
        pytest.fail("the launched server did not answer /health in time")

    def wait(self, timeout_s: float = 60.0) -> str:
        try:
            out, _ = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout_s} s (a hang)")
        return out

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.communicate()


def complete(url: str, request: dict) -> dict:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, **request}).encode()
    post = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=TIMEOUT_S) as r:
        answer = json.load(r)
    return {"text": answer["choices"][0]["text"], "tokens": answer["usage"]["completion_tokens"]}


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory):
    """A tiny qwen2 (mlx-lm gives qwen2 pipeline stages; llama has none) with the byte tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), tiny_qwen2(seed=0, sharpen=4.0),
                           byte_tokenizer())


@pytest.mark.slow  # two processes under mlx.launch, and a one-process server to compare with
@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_sharded_server_answers_as_one_process_and_stops_cleanly(tiny_model_dir, tiny_qwen2_dir, kind):
    model = tiny_model_dir if kind == "tensor" else tiny_qwen2_dir
    # a sharded server runs one request at a time; a seed draws alike only on the same path (docs/serve.md)
    whole = ServerProcess(["--model", str(model), *ARGS, "--max-batch", "1"], timeout_s=TIMEOUT_S)
    try:
        expected = [complete(whole.url, r) for r in REQUESTS]
    finally:
        whole.stop()
    assert expected[0]["tokens"] > 0
    sharded = LaunchedServer(model, kind)
    try:
        answers = [complete(sharded.url, r) for r in REQUESTS]
        time.sleep(2.5)  # idle: rank 0 tells the other rank so (IDLE_TICK_S) and still serves after it
        answers.append(complete(sharded.url, REQUESTS[0]))
        assert answers == [*expected, expected[0]]
    except BaseException:
        sharded.kill()
        raise
    os.kill(_rank_pid(sharded.process.pid, 0), signal.SIGTERM)  # the user stops the server (rank 0)
    out = sharded.wait()
    assert "mlxspec: error" not in out and "exited with code" not in out, out
    assert "mlxspec serve: stopped" in out


@pytest.mark.slow  # two processes under mlx.launch
def test_a_killed_rank_stops_the_sharded_server_with_one_error(tiny_model_dir):
    sharded = LaunchedServer(tiny_model_dir, "tensor")
    complete(sharded.url, REQUESTS[0])
    os.kill(_rank_pid(sharded.process.pid, 1), signal.SIGKILL)
    out = sharded.wait()
    errors = [line for line in out.splitlines() if line.startswith("mlxspec: error")]
    assert len(errors) == 1, out
    assert "Node with rank 0 exited with code" in out and "exited with code 0" not in out, out


@pytest.mark.parametrize("command", ["chat", "bench"])
def test_chat_and_bench_refuse_to_run_under_the_launcher(command):
    """One line naming what to use instead, before anything loads (a stand-in MLX_RANK: no launch needed)."""
    done = subprocess.run([sys.executable, "-m", "mlxspec", command, "--blas", "keep"],
                          capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={**os.environ, "MLX_RANK": "0"})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"mlxspec: error: mlxspec {command} does not run under mlx.launch"), \
        done.stderr
    assert "--shard" in lines[0]




@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_rank_0_says_it_reruns_with_a_fast_blas(monkeypatch, capsys, rank):
    from mlxspec.commands import common

    monkeypatch.delenv(common.REEXEC_ENV, raising=False)
    monkeypatch.setenv("MLX_RANK", rank)
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setattr(common, "blas_in_use", lambda: {"name": "reference BLAS"})
    monkeypatch.setattr(common, "find_fast_blas", lambda: "/opt/openblas/libblas.so.3")
    reruns = []
    monkeypatch.setattr("os.execve", lambda exe, argv, env: reruns.append(env["LD_PRELOAD"]))
    common.use_fast_blas("generate", ["--prompt", "hi"], "auto", quiet=False)
    assert reruns == ["/opt/openblas/libblas.so.3"]  # every rank re-runs itself
    said = capsys.readouterr().err
    assert ("re-running with a fast BLAS" in said) == (rank == "0"), said


@pytest.mark.slow  # two processes under mlx.launch
def test_plain_decoding_in_pipeline_stages_ends_and_matches_one_process(tiny_qwen2_dir):
    """--drafter none under --shard pipeline hung (a queued plain step evaluated
    asynchronously): now it ends."""
    args = ["-m", "mlxspec", "generate", "--model", str(tiny_qwen2_dir), "--drafter", "none", "--temp", "0",
            "--max-tokens", "20", "--prompt", "abcabcabc", "--no-chat-template", "--json", "--blas", "keep"]
    whole = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert whole.returncode == 0, whole.stderr
    sharded = run_launch(*args, "--shard", "pipeline", timeout=120)
    records = [json.loads(line) for line in sharded.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1, sharded.stderr
    assert records[0]["text"] == json.loads(whole.stdout)["text"]
