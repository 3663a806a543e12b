"""Bad input at every CLI entry point ends in one ``mlxspec: error:`` line (exit 2), never a
traceback; and a fuzz run of random bytes, random GGUF headers and random flag values proves it."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys

import pytest

from conftest import byte_tokenizer, save_tiny_model, tiny_llama
from mlxspec import SamplingParams, generate
from mlxspec.commands.cli import main


def one_line_error(capsys, argv, expect: str | None = None) -> str:
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse
        code = stop.code
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert err.startswith("mlxspec: error: ") and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    if expect is not None:
        assert expect in err, (argv, err)
    return err


@pytest.mark.parametrize("temp", ["1e-45", "5e-324", "1e-9"])
def test_temperatures_too_small_for_float32_are_refused(capsys, tiny_model_dir, temp):
    one_line_error(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--temp", temp],
                   "temp must be 0 (greedy) or at least 1e-06")
    with pytest.raises(ValueError, match="at least 1e-06"):
        SamplingParams(temp=float(temp))
    assert SamplingParams(temp=1e-6).temp == 1e-6


@pytest.mark.parametrize("prompt", ["", "   \n\t "])
def test_an_empty_prompt_is_refused_with_or_without_the_chat_template(capsys, tiny_model_dir, prompt):
    for extra in ([], ["--no-chat-template"]):
        one_line_error(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", prompt, *extra],
                       "the prompt is empty")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_an_empty_stop_string_names_the_flag_and_the_fix(capsys, command):
    one_line_error(capsys, [command, "--stop", "###", "--stop", ""],
                   "argument --stop: the stop text is empty; give the text that ends the answer "
                   "(e.g. --stop '###') or leave --stop out")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_another_drafters_flag_is_refused_not_ignored(capsys, tiny_model_dir, command):
    """``--eagle-heads`` with the default n-gram drafter used to be dropped silently: a user testing a
    head got n-gram numbers."""
    base = [command, "--model", str(tiny_model_dir), "--prompt", "hi"][: 5 if command == "generate" else 3]
    one_line_error(capsys, [*base, "--eagle-heads", "/tmp/nope"],
                   "--eagle-heads is an option of the eagle drafter, but the drafter is ngram; "
                   "add --drafter eagle")
    one_line_error(capsys, [*base, "--drafter", "eagle", "--medusa-tree", "small_15"],
                   "--medusa-tree is an option of the medusa drafter, but the drafter is eagle; "
                   "add --drafter medusa")


def run_cli(args, **kwargs):
    return subprocess.run([sys.executable, "-m", "mlxspec", *args], capture_output=True, **kwargs)


@pytest.mark.slow  # over 5 s: several CLI processes, each loading a model
def test_standard_input_that_is_closed_or_not_utf8(tiny_model_dir):
    base = ["generate", "--model", str(tiny_model_dir), "--max-tokens", "4"]
    closed = run_cli(base, stdin=subprocess.DEVNULL, text=True)  # empty: refused as empty
    assert closed.returncode == 2 and "the prompt is empty" in closed.stderr
    shut = subprocess.run(f"{sys.executable} -m mlxspec {' '.join(base)} <&-",
                          shell=True, capture_output=True, text=True)
    assert (shut.returncode == 2 and "standard input is closed" in shut.stderr
            and "Traceback" not in shut.stderr)
    bad = run_cli(base, input=b"caf\xe9 \xff\xfe")
    assert bad.returncode == 2 and b"not UTF-8 text" in bad.stderr and b"Traceback" not in bad.stderr
    argv = run_cli([*base, "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")])
    assert argv.returncode == 2 and b"not valid UTF-8" in argv.stderr


def test_output_piped_into_head_ends_quietly(tiny_model_dir):
    command = (f"{sys.executable} -m mlxspec generate --model {tiny_model_dir} --prompt abcabc "
               "--max-tokens 200 --drafter none --no-chat-template | head -c 1")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr


def test_a_prompt_near_the_context_stops_at_the_context(capsys, tmp_path):
    model = tiny_llama(seed=0)
    model.args.max_position_embeddings = 40
    folder = save_tiny_model(tmp_path / "short", model, byte_tokenizer())
    prompt = list(range(30, 60))
    result = generate(model, byte_tokenizer(), prompt, max_tokens=50, stop_tokens=set())
    assert result.stats.generation_tokens == 10 and result.stats.finish_reason == "length"
    assert main(["generate", "--model", str(folder), "--prompt", "x" * 20, "--max-tokens", "50",
                 "--no-chat-template"]) == 0
    assert "the answer stops after" in capsys.readouterr().err


def test_a_one_token_prompt_reports_no_prefill_speed():
    result = generate(tiny_llama(seed=0), byte_tokenizer(), [65], max_tokens=3)
    assert result.stats.prompt_tps == 0.0


def test_chat_without_a_terminal_is_refused(tiny_model_dir):
    done = run_cli(["chat", "--model", str(tiny_model_dir)], stdin=subprocess.DEVNULL, text=True, timeout=60)
    assert done.returncode == 2 and "needs a terminal" in done.stderr


@pytest.mark.parametrize("argv,expect", [
    (["bench", "--from-json", "README.md", "--blas", "keep"], None),
    (["bench", "--drafters", "nope", "--blas", "keep"], "unknown drafter"),
    (["convert", "/nonexistent/model", "/tmp/out-never"], None),
    (["train", "medusa", "--model", "/nonexistent/model", "--output", "/tmp/x"], None),
    (["train", "measure", "--prompts", "/nonexistent.jsonl"], None),
])
def test_other_entry_points_give_one_line_errors(capsys, argv, expect):
    one_line_error(capsys, argv, expect)


def test_a_corrupt_safetensors_file_is_one_line(capsys, tmp_path, tiny_model_dir):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    one_line_error(capsys, ["generate", "--model", str(broken), "--prompt", "hi"])
    one_line_error(capsys, ["generate", "--model", str(tiny_model_dir), "--draft-model",
                            str(broken), "--prompt", "hi"],
                   "draft model")


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_a_head_file_that_is_damaged_or_no_head_says_what_to_pass(capsys, tmp_path, tiny_model_dir, kind):
    cut = tmp_path / ("medusa_lm_head.safetensors" if kind == "medusa" else "model.safetensors")
    cut.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":")  # a header cut off
    text = tmp_path / "notes.txt"
    text.write_text("not weights")
    fix = {"medusa": "pass Medusa heads instead: a folder with medusa_lm_head.safetensors "
                     "(as 'mlxspec train medusa' writes), that file, or a Hugging Face repo id",
           "eagle": "pass an EAGLE head instead: a folder with config.json and model.safetensors "
                    "(as 'mlxspec train eagle' writes), that file, or a Hugging Face repo id"}[kind]
    problems = {cut: f"{cut} is not a readable safetensors file: it is cut off or another kind of file",
                tmp_path: f"{cut} is not a readable safetensors file",
                text: f"cannot read {text}: not a torch checkpoint",
                tiny_model_dir: str(tiny_model_dir)}  # a model, not heads
    for given, problem in problems.items():
        err = one_line_error(capsys, ["generate", "--model", str(tiny_model_dir),
                                      "--prompt", "hi", "--drafter", kind,
                                      f"--{kind}-heads", str(given)], fix)
        assert problem in err, err


def _block_or_mtp_checkpoint(kind: str, folder):
    """A good checkpoint of ``kind`` for the tiny target (random weights), written by our own savers."""
    from test_dflash import random_dflash
    from test_dspark import random_dspark

    from mlxspec.heads.dflash import save_dflash
    from mlxspec.heads.dspark import save_dspark
    from mlxspec.heads.mtp import init_mtp, save_mtp

    if kind == "dflash":
        save_dflash(random_dflash(), folder)
    elif kind == "dspark":
        save_dspark(random_dspark(), folder)
    else:
        target = tiny_llama(seed=0, sharpen=4.0)
        save_mtp(init_mtp(target), folder, target)
    return folder


@pytest.mark.parametrize("kind,flag,fix", [
    ("dflash", "--dflash-heads",
     "pass a DFlash drafter instead: a folder with config.json and model.safetensors"),
    ("dspark", "--dspark-heads",
     "pass a DSpark drafter instead: a folder with config.json and model.safetensors"),
    ("mtp", "--mtp-weights", "pass --mtp-weights with the folder of a model that ships MTP layers"),
])
def test_a_damaged_block_drafter_or_mtp_checkpoint_is_one_line(
    capsys, tmp_path, tiny_model_dir, kind, flag, fix
):
    import shutil

    good = _block_or_mtp_checkpoint(kind, tmp_path / "good")
    weights, config = "model.safetensors", "config.json"
    damage = {  # what is done to a copy -> the file the error names, and what it says
        "cut": (lambda d: (d / weights).write_bytes((d / weights).read_bytes()[:100]), weights,
                "is not a readable safetensors file: it is cut off or another kind of file"),
        "text": (lambda d: (d / weights).write_text("not weights"), weights,
                 "is not a readable safetensors file"),
        "garbage": (lambda d: (d / config).write_text("garbage{"), config, "is not valid JSON"),
        "list": (lambda d: (d / config).write_text("[1, 2]"), config, "holds a JSON list, not a JSON object"),
    }
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi",
            "--max-tokens", "2", "--drafter", kind]
    for name, (spoil, named, problem) in damage.items():
        broken = tmp_path / name
        shutil.copytree(good, broken)
        spoil(broken)
        err = one_line_error(capsys, [*argv, flag, str(broken)], fix)
        assert f"{broken / named} {problem}" in err, err
    wrong = tmp_path / "wrong"
    shutil.copytree(good, wrong)
    settings = json.loads((wrong / config).read_text())
    (wrong / config).write_text(json.dumps({**settings, "num_hidden_layers": "two"}))
    one_line_error(capsys, [*argv, flag, str(wrong)], "num_hidden_layers = 'two', not a whole number")


# --- fuzz ---------------------------------------------------------------------------------------


def test_fuzz_random_files_headers_and_flags(capsys, tmp_path, tiny_model_dir):
    rng = random.Random(1234)
    for i in range(12):  # random bytes as a .gguf
        path = tmp_path / f"random{i}.gguf"
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 400))))
        one_line_error(capsys, ["generate", "--model", str(path), "--prompt", "hi"])
    for i in range(12):  # a GGUF magic and version, then random counts and bytes
        path = tmp_path / f"header{i}.gguf"
        counts = struct.pack("<QQ", rng.randrange(0, 1 << 64), rng.randrange(0, 1 << 64))
        tail = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
        path.write_bytes(b"GGUF" + struct.pack("<I", rng.choice([1, 2, 3, 4, 99])) + counts + tail)
        one_line_error(capsys, ["generate", "--model", str(path), "--prompt", "hi"])
    flags = {"--temp": ["-1", "nan", "inf", "1e-40", "x"], "--top-p": ["0", "2", "-0.5", "nan"],
             "--top-k": ["-3", "1.5", "z"], "--min-p": ["1", "-1"], "--max-tokens": ["0", "-7", "q"],
             "--num-draft-tokens": ["-2", "many", "1.5"], "--seed": ["-1", str(2**64), "s"],
             "--drafter": ["nope", "eagle:depth=0", "ngram:min=0", "medusa:tree=zzz", ":"],
             "--ngram-max": ["0", "-1"], "--eagle-top-k": ["0"], "--dtype": ["int4"], "--stop": [""],
             "--repetition-penalty": ["0", "-1"]}
    for _ in range(40):
        name = rng.choice(sorted(flags))
        one_line_error(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", name,
                                rng.choice(flags[name])])


def test_messages_name_what_is_missing_and_the_fix(tmp_path):
    import mlx.core as mx

    from mlxspec.loading.models import load

    folder = save_tiny_model(tmp_path / "m", tiny_llama(), byte_tokenizer())
    weights = next(folder.glob("*.safetensors"))
    arrays = mx.load(str(weights))
    missing = sorted(arrays)[0]
    arrays.pop(missing)
    mx.save_safetensors(str(weights), arrays)
    with pytest.raises(ValueError, match=f"Missing 1 parameters: {missing}.*download it again"):
        load(str(folder))
    other = save_tiny_model(tmp_path / "t", tiny_llama(), byte_tokenizer())
    (other / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="Cannot load the tokenizer.*needs the model's tokenizer files"):
        load(str(other))
    for path in other.glob("*.safetensors"):
        path.unlink()
    with pytest.raises(ValueError, match="No safetensors found.*mlxspec convert"):
        load(str(other))
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="cut off: 4 bytes, shorter than a GGUF header"):
        load(str(short))


def test_no_shipped_asset_points_at_the_command_that_makes_one():
    """What ``require_shipped_for`` says when nothing ships: the flag, and a command that exists."""
    from mlxspec.loading.assets import PUBLISHED, SHIPPED_MARKERS, WHAT
    from mlxspec.commands.train import METHODS

    assert set(WHAT) == set(SHIPPED_MARKERS) == set(PUBLISHED)
    for kind, (_, flag, make) in WHAT.items():
        assert flag.startswith(f"--{kind}-") or kind == "draft", kind
        assert make == f"mlxspec train {kind}" and kind in METHODS, kind


@pytest.mark.parametrize("kind", ["dflash", "dspark", "mtp", "draft"])
def test_a_drafter_without_weights_says_how_to_train_one_or_where_published_ones_are(
    capsys, tiny_model_dir, tmp_path, monkeypatch, kind
):
    """Trained drafters ship only when they pay (docs/drafters.md): without one, one line says what to do."""
    from mlxspec.loading.assets import PUBLISHED

    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path))  # nothing ships
    err = one_line_error(capsys, ["generate", "--model", str(tiny_model_dir),
                                  "--drafter", kind, "--prompt", "hi"])
    assert f"mlxspec train {kind}" in err and PUBLISHED[kind] in err, err


@pytest.mark.slow  # over 5 s: a CLI process that loads a model and generates
def test_closing_the_engine_mid_answer_exits_cleanly(tiny_model_dir):
    """What Ctrl+Q does: close() mid-answer stops the engine thread after its round, then the process exits
    (a plain exit here aborted in about 1 run of 3 on this machine: MLX's stream threads were torn down)."""
    script = f"""
import threading, time
from mlxspec_app.engine import Engine, EngineConfig
from mlxspec_app.messages import EngineReady, TokensCommitted
ready, streaming = threading.Event(), threading.Event()
def post(message):
    if isinstance(message, EngineReady): ready.set()
    if isinstance(message, TokensCommitted): streaming.set()
engine = Engine(EngineConfig(model={str(tiny_model_dir)!r}, drafter="ngram", max_tokens=3000))
engine.start(post)
assert ready.wait(60)
engine.generate(1, [{{"role": "user", "content": "go on and on"}}])
assert streaming.wait(60)
assert engine.close() and not engine.running
print("closed")
from mlxspec.commands.chat import exit_now
exit_now(0)  # what mlxspec chat does once the app has closed the engine
"""
    for _ in range(4):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "closed", done.stderr
        assert "terminate called" not in done.stderr
