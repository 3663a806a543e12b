"""Tiny models for the server's tests, saved as mlx-lm folders with a Qwen-style chat template that
renders tools, and a running ``mlxspec serve`` on 127.0.0.1 (a free port) in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx

from mlxspec.bench.measure import free_port

from conftest import byte_tokenizer, save_tiny_model, tiny_llama

#: Qwen2.5's template, cut down: tools go in the system message, calls come back in <tool_call> blocks.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant."
    "{% endif %}\n\n# Tools\n\nYou may call functions. Their signatures are within <tools></tools>:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each call, return "
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}<tool_call>\n{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: What the tool-calling model answers (three added tokens, then EOS).
TOOL_CALL = ["<tool_call>", '{"name":"get_weather","arguments":{"city":"Paris"}}', "</tool_call>"]
#: The same call as a small model answers it instead (Qwen2.5-Coder-1.5B): a fenced JSON block.
FENCED_CALL = ["```json\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n```"]


def tools_tokenizer():
    """The byte tokenizer with the tools template and both answers' pieces as added tokens (ids 259-264)."""
    tokenizer = byte_tokenizer()
    tokenizer._tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer._tokenizer.add_tokens(TOOL_CALL + FENCED_CALL)
    return tokenizer


def save_chat_model(path: Path) -> Path:
    """``tiny_llama(seed=0, sharpen=4)`` with the tools template."""
    return save_tiny_model(path, tiny_llama(seed=0, sharpen=4.0), tools_tokenizer())


def save_tool_model(path: Path, answer: list[str] = TOOL_CALL) -> Path:
    """A model whose next token depends on the current one only (attention and MLP outputs zeroed), made so
    that after the prompt's last token ("\\n") it answers ``answer`` (added tokens) and then EOS."""
    tokenizer = tools_tokenizer()
    model = tiny_llama(seed=1, vocab_size=272)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    ids = [tokenizer.encode("\n", add_special_tokens=False)[0]]
    ids += [tokenizer._tokenizer.convert_tokens_to_ids(t) for t in answer] + [tokenizer.eos_token_id]
    embed = model.model.embed_tokens.weight
    head = mx.zeros_like(model.lm_head.weight)
    for current, following in zip(ids, ids[1:]):
        row = embed[current] / mx.linalg.norm(embed[current])
        head[following] = 50.0 * row
    model.lm_head.weight = head
    mx.eval(model.parameters())
    return save_tiny_model(path, model, tokenizer)


class ServerProcess:
    """``mlxspec serve ARGS`` on 127.0.0.1 and a free port, waited for until ``/health`` answers."""

    def __init__(self, args: list[str], timeout_s: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "mlxspec",
            "serve",
            "--port",
            str(self.port),
            "--blas",
            "keep",
            *args,
        ]
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited ({self.process.returncode}): {self.process.stdout.read()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not answer /health in time")

    def stop(self, sig: int | None = None, timeout_s: float = 30.0) -> tuple[int, str]:
        """Stop it (SIGTERM by default); returns its exit status and output."""
        import signal

        if self.process.poll() is None:
            self.process.send_signal(sig or signal.SIGTERM)
        try:
            out, _ = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return self.process.returncode, out

    def rss_kb(self) -> int:
        """Resident memory of the server process, KB (``ps``: Linux and macOS)."""
        out = subprocess.run(
            ["ps", "-o", "rss=", "-p", str(self.process.pid)], capture_output=True, text=True
        )
        return int(out.stdout.strip())
