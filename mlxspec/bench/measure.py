"""Measure ``mlxspec serve`` as editors and agents use it (docs/archive/serve.md's tables come from here).

    python -m mlxspec.bench.measure --model default
    python -m mlxspec.bench.measure --model qwen2.5-coder-1.5b --dtype float32

Two scenarios, each against a server this script starts on 127.0.0.1 (and stops):

- **conversation**: a conversation of ``--turns`` turns (one server); the time to first token of
  every turn, streamed, and the prompt tokens the prefix cache held; then turn ``--turns`` again
  with its first message changed by one character (a cache miss: what every turn would cost
  without the prefix cache).
- **agent**: ``--requests`` requests that each re-send a 60-line file with one edit asked (the
  next request sends the file with that edit made), as a coding agent does; once with
  ``--drafter suffix`` and once with ``--drafter none``: decode tokens/s of each request (the
  server's ``speculative.decode_tokens_per_s``) side by side.
- **concurrency** (``--scenario concurrency``): 8 prompts (4 code edits that copy from the prompt, 4 open
  questions) sent by 1, 2, 4 and 8 clients at once (``--clients``), each client taking the next prompt; the
  aggregate tokens/s (all answers' tokens over the wall time) of ``mlxspec serve`` batching (``--max-batch
  8``), of the same server one request at a time (``--max-batch 1``) and, with ``--mlx-lm FOLDER``, of
  ``mlx_lm.server`` on that mlx-lm folder, plain (it batches) and with ``--mlx-lm-draft FOLDER``. At
  temperature 0 every server's answers are compared.
- **long prompt** (``--scenario long-prompt``): while 3 short answers stream, a prompt of ``--long-tokens``
  tokens arrives; the largest gap between two chunks of the short answers, beside the one before it arrived;
  then the long request again, dropped by its client mid-prefill: seconds until ``/health`` shows no row left.

Greedy (temperature 0). Prints Markdown tables and the machine's load average; ``--json`` writes
every number.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mlxspec serve`` (or another server's ``module``, e.g. ``mlx_lm.server``) in a subprocess until
    ``stop``."""

    def __init__(self, args: list[str], timeout_s: float = 900.0, module: str = "mlxspec serve"):
        self.port = free_port()
        self.model = (
            "default_model" if module == "mlx_lm.server" else "default"
        )  # each server's name for its model
        command = [sys.executable, "-m", *module.split(), "--port", str(self.port), *args]
        self.process = subprocess.Popen(command, stderr=sys.stderr)
        try:
            self._wait(timeout_s)
        except BaseException:  # Ctrl+C while it loads, or it never answered: do not leave it running
            self.stop()
            raise

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited with status {self.process.returncode}")
            try:
                self.get("/health")
                return
            except OSError:
                time.sleep(0.5)
        raise SystemExit("the server did not start in time")

    def get(self, path: str) -> dict:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        connection.request("GET", path)
        return json.loads(connection.getresponse().read())

    def chat(self, messages: list[dict], max_tokens: int) -> dict:
        """Stream one chat answer; returns its text, time to first token, total time and final stats."""
        body = json.dumps({"model": "default", "messages": messages, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise SystemExit(f"the server answered {response.status}: {response.read().decode()}")
        text, first, usage, stats = [], None, None, None
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage, stats = chunk["usage"], chunk["speculative"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    first = first or time.perf_counter() - start
                    text.append(choice["delta"]["content"])
        return {"text": "".join(text), "ttft_s": first, "total_s": time.perf_counter() - start,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "completion_tokens": usage["completion_tokens"], "speculative": stats}

    def answer(self, messages: list[dict], max_tokens: int, temperature: float) -> dict:
        """One chat answer, not streamed: its text and completion tokens."""
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": max_tokens,
                           "temperature": temperature, "seed": 0})
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        response = connection.getresponse()
        reply = json.loads(response.read())
        if response.status != 200:
            raise SystemExit(f"the server answered {response.status}: {reply}")
        return {
            "text": reply["choices"][0]["message"]["content"],
            "tokens": reply["usage"]["completion_tokens"],
        }

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


TOPICS = ["rivers", "bread", "bridges", "owls", "glass", "tides", "maps", "bees", "clocks", "salt", "moss",
          "kites", "iron", "coral", "ink", "wind", "paper", "wolves", "rain", "copper", "sand", "comets"]


def conversation(serve_args: list[str], turns: int, max_tokens: int, repeats: int = 1) -> dict:
    """``repeats`` conversations on one server, interleaved turn by turn (so each turn's samples meet
    the same machine load); then the last turn of the first one with its system prompt changed (a
    miss)."""
    server = Server(serve_args)
    try:
        system = {"role": "system", "content": "You are a concise, friendly assistant."}
        talks = [[dict(system)] for _ in range(repeats)]
        rows = []
        for turn in range(1, turns + 1):
            samples = []
            for r, messages in enumerate(talks):
                topic = TOPICS[(turn + 7 * r) % len(TOPICS)]
                messages.append({"role": "user", "content": f"Tell me one surprising fact about {topic}."})
                reply = server.chat(messages, max_tokens)
                messages.append({"role": "assistant", "content": reply.pop("text")})
                samples.append(reply)
            ttfts = sorted(s["ttft_s"] for s in samples)
            rows.append({"turn": turn, **samples[0], "ttft_s": ttfts[len(ttfts) // 2], "ttft_samples": ttfts})
        cold = [dict(talks[0][0], content="You are a concise, friendly assistant!")] + talks[0][1:-1]
        miss = server.chat(cold, max_tokens)
        miss.pop("text")
    finally:
        server.stop()
    return {"turns": rows, "miss": miss}


FUNCTIONS = ["parse_line", "load_rows", "mean", "median", "spread", "report"]


def source_file() -> str:
    """A 60-line Python module (6 functions of 10 lines)."""
    lines = []
    for name in FUNCTIONS:
        lines += [f"def {name}(values, scale=1.0):",
                  f'    """{name.replace("_", " ").capitalize()} of the values, scaled."""',
                  "    total = 0.0",
                  "    count = 0",
                  "    for value in values:",
                  "        total += float(value) * scale",
                  "        count += 1",
                  "    if count == 0:",
                  "        return 0.0",
                  "    return total / count"]
    return "\n".join(lines) + "\n"


def agent(serve_args: list[str], requests: int, max_tokens: int) -> list[dict]:
    server = Server(serve_args)
    try:
        code, rows = source_file(), []
        for i in range(requests):
            old, new = FUNCTIONS[i % len(FUNCTIONS)], FUNCTIONS[i % len(FUNCTIONS)] + "_v2"
            system = "You are a coding agent. Reply with the whole updated file and nothing else."
            user = f"Here is stats.py:\n```python\n{code}```\nRename the function `{old}` to `{new}`."
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            reply = server.chat(messages, max_tokens)
            s = reply["speculative"]
            rows.append({"request": i + 1, "decode_tokens_per_s": s["decode_tokens_per_s"], "tau": s["tau"],
                         "alpha": s["alpha"], "completion_tokens": reply["completion_tokens"],
                         "cached_tokens": reply["cached_tokens"], "prompt_tokens": reply["prompt_tokens"],
                         "ttft_s": reply["ttft_s"]})
            code = code.replace(f"def {old}(", f"def {new}(")  # the agent applies the edit
    finally:
        server.stop()
    return rows


GROUNDED = [
    ("rename", "total", "acc"),
    ("rename", "count", "n"),
    ("comment", "mean", ""),
    ("rename", "value", "v"),
]
OPEN = ["Explain what a hash map is in three sentences.", "Write a haiku about compilers.",
        "Why is the sky blue? Answer briefly.", "Give three tips for writing readable Python."]


def stream_times(server: Server, messages: list[dict], max_tokens: int, times: list[float]) -> None:
    """Stream one answer, appending each content chunk's arrival time (``time.perf_counter()``) to
    ``times``."""
    body = json.dumps({"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True})
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
    connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    for line in connection.getresponse():
        line = line.decode().strip()
        if (
            line.startswith("data: {")
            and '"content"' in line
            and json.loads(line[6:])["choices"][0]["delta"].get("content")
        ):
            times.append(time.perf_counter())


def long_prompt(serve_args: list[str], long_tokens: int, max_tokens: int) -> dict:
    """Short answers' largest gap between chunks while a long prompt is prefilled; how soon a dropped one
    frees."""
    import threading

    server = Server(serve_args)
    try:
        long_chat = [
            {"role": "user", "content": source_file() * (long_tokens // 500) + "Summarize this file."}
        ]
        shorts = [[{"role": "user", "content": text}] for text in OPEN[:3]]
        times = [[] for _ in shorts]
        threads = [threading.Thread(target=stream_times, args=(server, chat, max_tokens, t))
                   for chat, t in zip(shorts, times)]
        for thread in threads:
            thread.start()
        while not all(times):
            time.sleep(0.05)
        arrived = time.perf_counter()
        long_times: list[float] = []
        long_thread = threading.Thread(
            target=stream_times, args=(server, long_chat, 4, long_times), daemon=True
        )
        long_thread.start()
        for thread in threads:
            thread.join()
        gaps = [(b - a, b) for t in times for a, b in zip(t, t[1:])]
        before = max((g for g, at in gaps if at < arrived), default=0.0)
        during = max((g for g, at in gaps if at >= arrived), default=0.0)
        long_thread.join()
        body = json.dumps({"model": "default", "messages": long_chat, "max_tokens": 4, "stream": True})
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=3600)
        connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        time.sleep(3.0)  # mid-prefill
        connection.sock.close()
        dropped = time.perf_counter()
        while server.get("/health")["rows"]:
            time.sleep(0.05)
        freed = time.perf_counter() - dropped
    finally:
        server.stop()
    return {"gap_before_s": before, "gap_during_s": during, "long_first_token_s": long_times[0] - arrived
            if long_times else None, "freed_after_drop_s": freed, "load": os.getloadavg()[0]}


def concurrency_prompts(n: int = 8) -> list[list[dict]]:
    """``n`` (<= 8) single-turn chats: n/2 code edits whose answers copy the prompt's code (grounded), then
    n/2 open ones."""
    code = source_file().split("def median")[0]  # two functions, 20 lines
    chats = []
    for kind, old, new in GROUNDED:
        ask = (f"Rename the variable `{old}` to `{new}`" if kind == "rename"
               else "Add a one-line comment above every statement of `mean`")
        chats.append([{"role": "user", "content": f"```python\n{code}```\n{ask}. Reply with the code only."}])
    return chats[: n // 2] + [[{"role": "user", "content": text}] for text in OPEN][: n - n // 2]


def concurrency(module: str, serve_args: list[str], clients: list[int], temps: list[float],
                max_tokens: int, prompts: int = 8) -> list[dict]:
    """Aggregate tokens/s of the prompts sent by each number of concurrent clients, at each temperature."""
    from concurrent.futures import ThreadPoolExecutor

    server, rows, chats = Server(serve_args, module=module), [], concurrency_prompts(prompts)
    try:
        server.answer(chats[0], 4, 0.0)  # warm-up
        for temperature in temps:
            for n in clients:
                start = time.perf_counter()
                with ThreadPoolExecutor(n) as pool:
                    replies = list(pool.map(server.answer, chats, [max_tokens] * len(chats),
                                            [temperature] * len(chats)))
                seconds = time.perf_counter() - start
                tokens = sum(r["tokens"] for r in replies)
                rows.append({"temperature": temperature, "clients": n, "tokens": tokens, "seconds": seconds,
                             "tokens_per_s": tokens / seconds, "texts": [r["text"] for r in replies],
                             "load": os.getloadavg()[0]})
                print(
                    f"{module} {' '.join(serve_args)} T {temperature} clients {n}: "
                    f"{tokens / seconds:.2f} tok/s "
                    f"({tokens} tokens, {seconds:.0f} s, load {rows[-1]['load']:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        server.stop()
    return rows


def concurrency_table(results: dict, clients: list[int], temps: list[float]) -> str:
    """Markdown: aggregate tokens/s per server (rows) and clients (columns), per temperature."""
    lines = []
    for temperature in temps:
        lines += [f"\nT {temperature}: aggregate tokens/s\n",
                  "| server | " + " | ".join(f"{n} client{'s' if n > 1 else ''}" for n in clients) + " |",
                  "| --- |" + " ---: |" * len(clients)]
        for name, rows in results.items():
            speed = {r["clients"]: r["tokens_per_s"] for r in rows if r["temperature"] == temperature}
            if speed:
                lines.append(
                    f"| {name} | " + " | ".join(f"{speed.get(n, float('nan')):.2f}" for n in clients) + " |"
                )
        if temperature == 0:
            texts = {
                name: [r["texts"] for r in rows if r["temperature"] == 0] for name, rows in results.items()
            }
            reference = next(iter(texts.values()))[0]
            differ = {name: sum(a != b for run in runs for a, b in zip(run, reference))
                      for name, runs in texts.items()}
            lines.append("\nanswers at T 0 that differ from the first server's first run: "
                         + ", ".join(f"{name} {n}" for name, n in differ.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxspec.bench.measure",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=40, help="max_tokens of each turn. Default: 40")
    parser.add_argument("--repeats", type=int, default=1,
                        help="conversations run interleaved; each turn's TTFT is their median. Default: 1")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--edit-tokens", type=int, default=400,
                        help="max_tokens of each agent request. Default: 400")
    parser.add_argument("--scenario", choices=("both", "conversation", "agent", "concurrency", "long-prompt"),
                        default="both")
    parser.add_argument(
        "--long-tokens", type=int, default=8000, help="long-prompt: its tokens. Default: 8000"
    )
    parser.add_argument("--draft-model", default=None, help="concurrency: the draft model mlxspec serve uses")
    parser.add_argument("--clients", default="1,2,4,8", help="concurrency: client counts. Default: 1,2,4,8")
    parser.add_argument("--temps", default="0,0.7", help="concurrency: temperatures. Default: 0,0.7")
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="concurrency: tokens an answer. Default: 64"
    )
    parser.add_argument(
        "--prompts", type=int, default=8, help="concurrency: prompts (half grounded), <= 8. Default: 8"
    )
    parser.add_argument("--servers", default="batched,serial,mlx-lm,mlx-lm-draft",
                        help="concurrency: which servers to run. Default: all four")
    parser.add_argument(
        "--mlx-lm", default=None, help="concurrency: the target as an mlx-lm folder for mlx_lm.server"
    )
    parser.add_argument(
        "--mlx-lm-draft", default=None, help="concurrency: the draft model as an mlx-lm folder"
    )
    parser.add_argument("--json", default=None, help="write every number to this file")
    args = parser.parse_args(argv)
    base = ["--model", args.model] + (["--dtype", args.dtype] if args.dtype else [])
    out = {"model": args.model, "dtype": args.dtype, "load_before": os.getloadavg()}
    if args.scenario == "concurrency":
        clients, temps = [int(n) for n in args.clients.split(",")], [float(t) for t in args.temps.split(",")]
        drafting = ["--draft-model", args.draft_model] if args.draft_model else []
        runs = {"batched": ("mlxspec serve", base + drafting + ["--max-batch", "8"]),
                "serial": ("mlxspec serve", base + drafting + ["--max-batch", "1"]),
                "mlx-lm": ("mlx_lm.server", ["--model", str(args.mlx_lm)]),
                "mlx-lm-draft": ("mlx_lm.server", ["--model", str(args.mlx_lm), "--draft-model",
                                                   str(args.mlx_lm_draft), "--num-draft-tokens", "4"])}
        chosen = [name for name in args.servers.split(",") if args.mlx_lm or not name.startswith("mlx-lm")]
        out["concurrency"] = {name: concurrency(*runs[name], clients, temps, args.max_tokens, args.prompts)
                              for name in chosen}
        print(concurrency_table(out["concurrency"], clients, temps))
    if args.scenario == "long-prompt":
        out["long_prompt"] = r = long_prompt(base + ["--drafter", "ngram"], args.long_tokens, args.max_tokens)
        print(
            f"\nLong prompt ({args.long_tokens} tokens) beside 3 streaming answers: largest gap between "
            f"chunks {r['gap_during_s']:.2f} s (before it arrived {r['gap_before_s']:.2f} s); dropped "
            f"mid-prefill, the runner was free {r['freed_after_drop_s']:.2f} s later (load {r['load']:.1f})"
        )
    if args.scenario in ("both", "conversation"):
        out["conversation"] = result = conversation(base, args.turns, args.turn_tokens, args.repeats)
        print(f"\nConversation, {args.model} ({args.dtype or 'as stored'}), {args.turn_tokens} tokens a "
              f"turn, TTFT the median of {args.repeats} interleaved conversations\n")
        print("| turn | prompt tokens | cached | TTFT s |\n| ---: | ---: | ---: | ---: |")
        for row in result["turns"]:
            print(f"| {row['turn']} | {row['prompt_tokens']} | {row['cached_tokens']} "
                  f"| {row['ttft_s']:.3f} |")
        miss = result["miss"]
        print(f"| {args.turns}, cache miss | {miss['prompt_tokens']} | {miss['cached_tokens']} "
              f"| {miss['ttft_s']:.3f} |")
        t = {row["turn"]: row["ttft_s"] for row in result["turns"]}
        print(f"\nTTFT turn {args.turns} / turn 2: {t[args.turns] / t[2]:.2f}")
    if args.scenario in ("both", "agent"):
        out["agent"] = {name: agent(base + ["--drafter", name], args.requests, args.edit_tokens)
                        for name in ("suffix", "none")}
        print(f"\nAgent edits, {args.model} ({args.dtype or 'as stored'}), up to {args.edit_tokens} tokens "
              "a request\n")
        print("| request | prompt (cached) | suffix tok/s | τ | none tok/s | speed-up |\n"
              "| ---: | ---: | ---: | ---: | ---: | ---: |")
        for s, n in zip(out["agent"]["suffix"], out["agent"]["none"]):
            speed_up = s["decode_tokens_per_s"] / n["decode_tokens_per_s"]
            print(f"| {s['request']} | {s['prompt_tokens']} ({s['cached_tokens']}) | "
                  f"{s['decode_tokens_per_s']:.1f} | {s['tau']:.2f} | {n['decode_tokens_per_s']:.1f} | "
                  f"{speed_up:.2f}x |")
    out["load_after"] = os.getloadavg()
    print(f"\nload average before {out['load_before'][0]:.2f}, after {out['load_after'][0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
