"""The server's parts without HTTP: the prefix cache's slots and the tool-call parser."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mlxspec import PromptCache, generate
from mlxspec.serve.prefix_cache import PrefixCache, common_prefix
from mlxspec.serve.tools import ToolCall, ToolCallParser, split, tool_format


def run(target, tokenizer, prompt, cache):
    return generate(
        target, tokenizer, prompt, drafter="ngram", num_draft_tokens=3, max_tokens=12, prompt_cache=cache
    )


def test_a_next_turn_extends_its_slot_in_place(target, tokenizer):
    cache = PrefixCache(target, slots=4)
    first = list(range(40, 90))
    slot = cache.take(first)
    answer = run(target, tokenizer, first, slot)
    cache.release(slot)
    second = first + answer.tokens + list(range(100, 120))
    assert cache.take(second) is slot  # the whole slot is a prefix of the next prompt
    assert common_prefix(slot.tokens, second) == len(slot.tokens) == len(first) + len(answer.tokens) - 1


def test_a_partial_match_copies_and_keeps_the_slot(target, tokenizer):
    cache = PrefixCache(target, slots=4)
    first = list(range(40, 90))
    slot = cache.take(first)
    run(target, tokenizer, first, slot)
    cache.release(slot)
    held, offset = list(slot.tokens), slot.layers[0].offset
    other = first[:30] + list(range(150, 170))  # shares 30 tokens, then goes elsewhere
    copy = cache.take(other)
    assert copy is not slot and copy.tokens == first[:30] and copy.layers[0].offset == 30
    assert (slot.tokens, slot.layers[0].offset) == (held, offset)  # the first conversation keeps its slot
    with_hit = run(target, tokenizer, other, copy)
    assert with_hit.stats.cached_tokens == 30
    assert (
        with_hit.tokens == run(target, tokenizer, other, PromptCache(target)).tokens
    )  # greedy: as without a cache


def test_least_recently_used_slots_go_first_and_bytes_bound_them(target, tokenizer):
    cache = PrefixCache(target, slots=2)
    slots = []
    for start in (10, 60, 110):
        prompt = list(range(start, start + 20))
        slot = cache.take(prompt)
        run(target, tokenizer, prompt, slot)
        cache.release(slot)
        slots.append(slot)
    assert len(cache) == 2 and cache.take(list(range(10, 40))) not in slots  # the first one was dropped
    tight = PrefixCache(target, slots=4, max_bytes=0)
    slot = tight.take(list(range(10, 30)))
    run(target, tokenizer, list(range(10, 30)), slot)
    tight.release(slot)
    assert len(tight) == 0


def test_bounds_are_checked(target):
    with pytest.raises(ValueError, match="--prefix-cache-slots"):
        PrefixCache(target, slots=0)


TEXT = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> Done <tool'
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
JSON_TOOLS = tool_format(SimpleNamespace(chat_template="{{ tool_call.name }} <tool_call>", init_kwargs={}))


def pieces_of(text: str, fmt, size: int = 1) -> tuple[str, list]:
    """``text`` fed to a parser ``size`` characters at a time: its text and its calls as (name, input)."""
    parser, pieces = ToolCallParser(fmt, WEATHER), []
    for i in range(0, len(text), size):
        pieces += parser.feed(text[i : i + size])
    pieces += parser.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [
        (c.name, c.input) for c in pieces if isinstance(c, ToolCall)
    ]


def test_tool_calls_are_found_however_the_text_streams():
    whole = split(TEXT, JSON_TOOLS, WEATHER)
    assert whole[0] == "Sure. Done <tool"
    assert [(c.name, json.loads(c.arguments)) for c in whole[1]] == [("get_weather", {"city": "Paris"})]
    for size in (1, 2, 5, 11):
        parser, pieces = ToolCallParser(JSON_TOOLS, WEATHER), []
        for i in range(0, len(TEXT), size):
            pieces += parser.feed(TEXT[i : i + size])
            assert not any(isinstance(p, str) and "<tool_call" in p for p in pieces)  # never part of the tag
        pieces += parser.finish()
        assert "".join(p for p in pieces if isinstance(p, str)) == whole[0]
        assert [c.name for c in pieces if isinstance(c, ToolCall)] == ["get_weather"]


@pytest.mark.parametrize("body", ["not json", '{"arguments": {}}', '{"name": "f", "arguments": [1]}'])
def test_a_block_that_is_not_a_call_stays_text(body):
    text = f"<tool_call>{body}</tool_call>"
    assert split(text, JSON_TOOLS, WEATHER) == (text, [])


def test_string_arguments_and_an_unclosed_block():
    text, calls = split('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}', JSON_TOOLS, WEATHER)
    assert text == "" and calls[0].input == {"x": 1}


#: One call to get_weather(city="Paris") in each format mlx-lm parses, after "Sure. ".
FORMATS = {
    "json_tools": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    "</tool_call>",
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "pythonic": '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>',
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    "function_gemma": "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>",
    "glm47": "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    "<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    "minimax_m2": '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Paris</parameter>'
    "</invoke>"
    "</minimax:tool_call>",
    "longcat": "<longcat_tool_call>get_weather<longcat_arg_key>city</longcat_arg_key><longcat_arg_value>Paris"
    "</longcat_arg_value></longcat_tool_call>",
}


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_mlx_lm_parses_gives_the_call_streamed(name):
    fmt = tool_format(SimpleNamespace(chat_template=None, init_kwargs={"tool_parser_type": name}))
    for size in (1, 7, 1000):
        assert pieces_of("Sure. " + FORMATS[name], fmt, size) == (
            "Sure. ",
            [("get_weather", {"city": "Paris"})],
        )


@pytest.mark.parametrize(
    "template, name",
    [
        ("{{ tool_call.name }} <tool_call>", "json_tools"),  # Qwen2.5
        ("<tool_call>\n<function=", "qwen3_coder"),
        ("[TOOL_CALLS]", "mistral"),
        ("{{ '<tool_call>' }}{{ call | tojson }}", "json_tools"),  # Hermes-style, named no other way
        ("{{ messages }}", None),
    ],
)
def test_the_format_is_the_one_mlx_lm_infers_from_the_template(template, name):
    tokenizer = SimpleNamespace(chat_template=template, init_kwargs={}, get_vocab=lambda: {})
    fmt = tool_format(tokenizer)
    assert (fmt.name if fmt else None) == name


FENCED = 'Calling it.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'


@pytest.mark.parametrize("fmt", [None, JSON_TOOLS])
def test_a_fenced_json_call_to_an_offered_tool_is_a_call(fmt):
    for size in (1, 3, 1000):
        assert pieces_of(FENCED, fmt, size) == ("Calling it.\n\n", [("get_weather", {"city": "Paris"})])
    listed = '```\n[{"name": "get_weather", "arguments": {"city": "Rome"}}]\n```'
    assert pieces_of(listed, fmt) == ("", [("get_weather", {"city": "Rome"})])


@pytest.mark.parametrize(
    "text",
    [
        FENCED.replace("get_weather", "launch_rocket"),  # a tool that was not offered
        '```json\n{"name": "get_weather", "arguments": [1]}\n```',  # not a call's arguments
        '```json\n{"city": "Paris"}\n```',
        '```python\nprint("```json")\n```\nand ```json\n{"x": 1}\n```',  # code, then JSON that is no call
        'inline ```code``` and an unclosed ```json\n{"name": "get_weather"',
    ],
)
def test_a_fenced_block_that_is_not_a_call_stays_text(text):
    for size in (1, 4, 1000):
        assert pieces_of(text, JSON_TOOLS, size) == (text, [])


def test_a_draft_model_across_alternating_conversations_answers_as_without_a_cache(target, tokenizer):
    from conftest import tiny_llama

    from mlxspec import make_drafter

    drafter = make_drafter(
        "draft", target, tokenizer, draft_model=tiny_llama(seed=3), draft_tokenizer=tokenizer
    )
    cache = PrefixCache(target, slots=4)
    conversations = [list(range(40, 80)), list(range(120, 170))]
    for turn in range(3):  # the draft model's one cache follows whichever conversation runs
        for c, prompt in enumerate(conversations):
            slot = cache.take(prompt)
            hit = generate(
                target,
                tokenizer,
                prompt,
                drafter=drafter,
                num_draft_tokens=3,
                max_tokens=10,
                prompt_cache=slot,
            )
            cache.release(slot)
            assert turn == 0 or hit.stats.cached_tokens >= len(prompt) - 20
            fresh = generate(target, tokenizer, prompt, drafter="none", max_tokens=10)
            assert hit.tokens == fresh.tokens
            conversations[c] = prompt + hit.tokens + [50 + turn, 60 + c]


@pytest.mark.parametrize("max_batch", [1, 2])
def test_the_worker_ends_an_answer_at_its_deadline_and_refuses_a_full_queue(target, tokenizer, max_batch):
    import asyncio
    import time

    from mlxspec import SamplingParams, make_drafter
    from mlxspec.serve.worker import Delta, Done, Job, QueueFull, Served, Worker

    served = Served("tiny", tokenizer, None, "ngram", frozenset(tokenizer.eos_token_ids))
    worker = Worker(
        lambda: (target, tokenizer, make_drafter("ngram"), 3, served), queue_size=1, max_batch=max_batch
    )
    assert worker.start() is served

    async def answer(deadline_s: float, max_tokens: int) -> tuple[int, Done]:
        job = Job(
            list(range(30, 60)),
            max_tokens,
            SamplingParams(),
            None,
            [],
            time.monotonic() + deadline_s,
            asyncio.get_running_loop(),
        )
        worker.submit(job)
        tokens = 0
        while not isinstance(event := await job.events.get(), Done):
            assert isinstance(event, Delta)
            tokens += event.tokens
        return tokens, event

    try:
        tokens, done = asyncio.run(answer(0.3, 100_000))
        assert (
            done.timed_out
            and done.finish_reason == "length"
            and 0 < tokens == done.stats.generation_tokens < 4000
        )
        assert done.stats.generation_tps > 0
        tokens, done = asyncio.run(answer(60, 8))
        assert (tokens, done.finish_reason, done.timed_out) == (8, "length", False)

        async def flood():
            jobs = [
                Job(
                    [1, 2, 3],
                    2000,
                    SamplingParams(),
                    None,
                    [],
                    time.monotonic() + 60,
                    asyncio.get_running_loop(),
                )
                for _ in range(max_batch + 2)
            ]
            with pytest.raises(QueueFull):
                for job in jobs:  # max_batch run, one waits, the next finds the queue full
                    worker.submit(job)
                    await asyncio.sleep(0.2)
            for job in jobs:
                job.cancelled.set()

        asyncio.run(flood())
    finally:
        assert worker.close()


def test_serve_flags(capsys):
    from mlxspec.commands.serve import check_serve_args, main, setup_arg_parser

    check_serve_args(setup_arg_parser().parse_args(["--host", "0.0.0.0"]))
    assert "without --api-key" in capsys.readouterr().err
    check_serve_args(setup_arg_parser().parse_args(["--host", "localhost"]))
    check_serve_args(setup_arg_parser().parse_args(["--host", "::1", "--api-key", "k"]))
    assert capsys.readouterr().err == ""
    for flags, named in (
        (["--queue-size", "0"], "--queue-size"),
        (["--port", "70000"], "--port"),
        (["--request-timeout", "0"], "--request-timeout"),
        (["--api-key", ""], "--api-key"),
        (["--prefix-cache-gb", "-1"], "--prefix-cache-gb"),
    ):
        assert main(flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("mlxspec: error: ") and named in err and err.count("\n") == 1


def test_the_server_benchmark_runs_from_bench():
    """``python -m mlxspec.bench.measure`` (docs/archive/serve.md's tables) is found there and names itself
    so."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "mlxspec.bench.measure", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m mlxspec.bench.measure"), done


def test_earlier_tool_calls_a_template_would_drop_are_refused():
    """A template without ``tool_calls`` renders an assistant turn's calls as nothing: the model would see an
    empty turn and then the result (a tester's trial, SmolLM2's template). Refused in one line; a template
    that shows them renders them."""
    from mlxspec.serve.errors import ApiError
    from mlxspec.serve.prompts import render
    from serve_fixtures import tools_tokenizer

    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
    ]
    shows = tools_tokenizer()
    assert "get_weather" in shows.decode(render(shows, history))
    drops = tools_tokenizer()
    drops._tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ApiError, match="does not show earlier tool calls") as refused:
        render(drops, history)
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert render(drops, [history[0]])  # without calls it renders

