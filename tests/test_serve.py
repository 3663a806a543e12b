"""``mlxspec serve`` end to end: the real server on 127.0.0.1 driven by the official openai and anthropic
clients (chat, completions, messages; streaming and not; stop strings; tools; the stats object; the
prefix cache), bad input, cancellation and a clean stop."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

import mlxspec
from mlxspec.commands import generate as generate_command
from serve_fixtures import FENCED_CALL, TOOL_CALL, ServerProcess, save_chat_model, save_tool_model

GAMMA = ["--drafter", "ngram", "--num-draft-tokens", "3"]
SPECULATIVE_KEYS = {"drafter", "gamma", "rounds", "drafted", "accepted", "alpha", "tau", "per_position"}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("serve-chat"))


@pytest.fixture(scope="module")
def server(chat_model):
    process = ServerProcess(["--model", str(chat_model), *GAMMA, "--body-timeout", "1"])
    yield process
    process.stop()


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    process = ServerProcess(
        [
            "--model",
            str(save_tool_model(tmp_path_factory.mktemp("serve-tool"))),
            *GAMMA,
            "--api-key",
            "sekret",
        ]
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def fenced_server(tmp_path_factory):
    process = ServerProcess(
        ["--model", str(save_tool_model(tmp_path_factory.mktemp("serve-fenced"), FENCED_CALL)), *GAMMA]
    )
    yield process
    process.stop()


def openai_client(server, key="none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def anthropic_client(server, key="none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def model_id(server) -> str:
    return openai_client(server).models.list().data[0].id


def post(server, path: str, body: bytes | dict, method: str = "POST", headers: dict | None = None):
    """``(status, JSON body)`` of a raw request."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        server.url + path,
        data=data if method == "POST" else None,
        method=method,
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def generate_json(model_dir, prompt: str, max_tokens: int, capsys) -> dict:
    """``mlxspec generate --json`` for the same model, prompt and drafter, in this process."""
    capsys.readouterr()
    status = generate_command.main(
        [
            "--model",
            str(model_dir),
            "--prompt",
            prompt,
            *GAMMA,
            "--max-tokens",
            str(max_tokens),
            "--json",
            "--blas",
            "keep",
        ]
    )
    assert status == 0
    return json.loads(capsys.readouterr().out)


def test_chat_matches_generate_with_stats(server, chat_model, capsys):
    reply = openai_client(server).chat.completions.create(
        model=model_id(server),
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=24,
        temperature=0,
    )
    expected = generate_json(chat_model, "Hello there", 24, capsys)
    assert reply.choices[0].message.content == expected["text"]
    assert reply.choices[0].finish_reason == ("length" if expected["finish_reason"] == "length" else "stop")
    assert reply.usage.prompt_tokens == expected["prompt_tokens"]
    assert reply.usage.completion_tokens == expected["generation_tokens"]
    stats = reply.model_extra["speculative"]
    assert SPECULATIVE_KEYS <= set(stats)
    assert stats["drafter"] == "ngram" and stats["gamma"] == 3
    assert (stats["drafted"], stats["accepted"], stats["rounds"]) == (
        expected["drafted"],
        expected["accepted"],
        expected["rounds"],
    )


def test_streaming_chat_equals_non_streaming(server):
    client, messages = openai_client(server), [{"role": "user", "content": "Stream me"}]
    whole = client.chat.completions.create(model=model_id(server), messages=messages, max_tokens=30)
    chunks = list(
        client.chat.completions.create(
            model=model_id(server),
            messages=messages,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert SPECULATIVE_KEYS <= set(finals[0].model_extra["speculative"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_second_turn_reuses_the_cache_and_answers_as_without_it(server, chat_model):
    client, name = openai_client(server), model_id(server)
    first = [{"role": "user", "content": "First turn of a conversation"}]
    answer = (
        client.chat.completions.create(model=name, messages=first, max_tokens=20).choices[0].message.content
    )
    second = first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And the second turn"},
    ]
    reply = client.chat.completions.create(model=name, messages=second, max_tokens=20)
    assert reply.usage.prompt_tokens_details.cached_tokens > len("First turn of a conversation")
    model, tokenizer = mlxspec.load(str(chat_model))  # the same prompt without any cache
    fresh = mlxspec.generate(
        model,
        tokenizer,
        tokenizer.apply_chat_template(second, add_generation_prompt=True),
        drafter="ngram",
        num_draft_tokens=3,
        max_tokens=20,
    )
    assert reply.choices[0].message.content == fresh.text


def test_stop_strings(server):
    client, name = openai_client(server), model_id(server)
    messages = [{"role": "user", "content": "Say something long"}]
    text = (
        client.chat.completions.create(model=name, messages=messages, max_tokens=40)
        .choices[0]
        .message.content
    )
    stop = text[10:13]
    cut = text[: text.index(stop)]
    for given in (stop, [stop, "never-appears"]):  # one string, or a list
        reply = client.chat.completions.create(model=name, messages=messages, max_tokens=40, stop=given)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (cut, "stop")
    streamed = client.chat.completions.create(
        model=name, messages=messages, max_tokens=40, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut
    message = anthropic_client(server).messages.create(
        model=name, max_tokens=40, messages=messages, stop_sequences=[stop]
    )
    assert (message.content[0].text, message.stop_reason, message.stop_sequence) == (
        cut,
        "stop_sequence",
        stop,
    )


def test_completions(server, chat_model, capsys):
    client = openai_client(server)
    whole = client.completions.create(model=model_id(server), prompt="Once upon a time", max_tokens=16)
    streamed = client.completions.create(
        model=model_id(server), prompt="Once upon a time", max_tokens=16, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    model, tokenizer = mlxspec.load(str(chat_model))
    assert whole.choices[0].text == mlxspec.generate(model, tokenizer, "Once upon a time", max_tokens=16).text
    assert SPECULATIVE_KEYS <= set(whole.model_extra["speculative"])


def test_anthropic_messages(server):
    client, name = anthropic_client(server), model_id(server)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi from Anthropic"}]}]
    message = client.messages.create(model=name, max_tokens=20, system="Be brief", messages=messages)
    with client.messages.stream(model=name, max_tokens=20, system="Be brief", messages=messages) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert message.content[0].type == "text" and streamed == message.content[0].text
    assert message.stop_reason == final.stop_reason == "max_tokens"
    assert message.usage.output_tokens == final.usage.output_tokens == 20
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: all but its last token was cached
    assert SPECULATIVE_KEYS <= set(message.model_extra["speculative"])
    counted = client.messages.count_tokens(model=name, system="Be brief", messages=messages)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_tool_calls(tool_server):
    client, name = openai_client(tool_server, "sekret"), model_id_with_key(tool_server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model=name, messages=messages, tools=[WEATHER_TOOL], max_tokens=10)
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and not reply.choices[0].message.content
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    chunks = list(
        client.chat.completions.create(
            model=name, messages=messages, tools=[WEATHER_TOOL], max_tokens=10, stream=True
        )
    )
    calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the call and its result go back into the next prompt through the template
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    assert client.chat.completions.create(
        model=name, messages=follow, tools=[WEATHER_TOOL], max_tokens=4
    ).usage
    # without tools the same answer is plain text
    plain = client.chat.completions.create(model=name, messages=messages, max_tokens=10)
    assert plain.choices[0].message.content == "".join(TOOL_CALL) and not plain.choices[0].message.tool_calls

    claude = anthropic_client(tool_server, "sekret")
    tools = [{"name": "get_weather", "description": "The weather", "input_schema": {"type": "object"}}]
    message = claude.messages.create(model=name, max_tokens=10, messages=messages, tools=tools)
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})
    ]
    with claude.messages.stream(model=name, max_tokens=10, messages=messages, tools=tools) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})
    ]


def test_a_fenced_json_call_to_an_offered_tool_is_a_tool_call(fenced_server):
    """What Qwen2.5-Coder-1.5B answers to the docs' tools example: a ```json block, not <tool_call>."""
    client, name = openai_client(fenced_server), model_id(fenced_server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model=name, messages=messages, tools=[WEATHER_TOOL], max_tokens=10)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and not reply.choices[0].message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    chunks = list(
        client.chat.completions.create(
            model=name, messages=messages, tools=[WEATHER_TOOL], max_tokens=10, stream=True
        )
    )
    streamed = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in streamed] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]
    claude = anthropic_client(fenced_server)
    tools = [{"name": "get_weather", "description": "The weather", "input_schema": {"type": "object"}}]
    message = claude.messages.create(model=name, max_tokens=10, messages=messages, tools=tools)
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})
    ]
    with claude.messages.stream(model=name, max_tokens=10, messages=messages, tools=tools) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})
    ]
    # a block naming a tool that was not offered, or no tools at all: the text as the model wrote it
    other = dict(WEATHER_TOOL, function=dict(WEATHER_TOOL["function"], name="get_time"))
    for tools_ in ([other], None):
        kwargs = {"tools": tools_} if tools_ else {}
        reply = client.chat.completions.create(model=name, messages=messages, max_tokens=10, **kwargs)
        assert (
            reply.choices[0].message.content == "".join(FENCED_CALL)
            and not reply.choices[0].message.tool_calls
        )
        assert reply.choices[0].finish_reason == "stop"


def model_id_with_key(server) -> str:
    return openai_client(server, "sekret").models.list().data[0].id


def test_api_key(tool_server):
    with pytest.raises(openai.AuthenticationError):
        openai_client(tool_server, "wrong").models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(tool_server, "wrong").messages.create(
            model="x", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        )
    assert post(tool_server, "/health", b"", method="GET")[0] == 200  # health needs no key
    assert post(tool_server, "/openapi.json", b"", method="GET")[0] == 200  # nor the API's description
    assert post(tool_server, "/metrics", b"", method="GET")[0] == 401


def test_openapi_lists_every_body_with_its_fields(server):
    spec = json.loads(urllib.request.urlopen(server.url + "/openapi.json", timeout=10).read())
    schemas = spec["components"]["schemas"]
    for path, request, reply in (
        ("/v1/chat/completions", "ChatRequest", "ChatCompletion"),
        ("/v1/completions", "CompletionRequest", "Completion"),
        ("/v1/messages", "MessagesRequest", "Message"),
        ("/v1/responses", "ResponsesRequest", "Response"),
    ):
        post_ = spec["paths"][path]["post"]
        assert post_["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request)
        assert post_["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/" + reply
        )
        assert "text/event-stream" in post_["responses"]["200"]["content"]
        assert schemas[reply]["properties"]["speculative"]
    assert {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "tools",
        "tool_choice",
    } <= set(schemas["ChatRequest"]["properties"])
    assert {"prompt", "max_tokens", "temperature", "stream"} <= set(
        schemas["CompletionRequest"]["properties"]
    )
    assert {"system", "messages", "max_tokens", "stop_sequences", "tools", "stream"} <= set(
        schemas["MessagesRequest"]["properties"]
    )
    assert SPECULATIVE_KEYS <= set(schemas["Speculative"]["properties"])
    assert all(field.get("description") for field in schemas["Speculative"]["properties"].values())
    with urllib.request.urlopen(server.url + "/docs", timeout=10) as page:
        assert page.status == 200 and b"/openapi.json" in page.read()


def test_a_body_sent_as_a_form_is_refused_naming_the_content_type(server):
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hi"}]}).encode()
    got, answer = post(
        server, "/v1/chat/completions", body, headers={"content-type": "application/x-www-form-urlencoded"}
    )  # curl -d without -H
    assert got == 400 and "Content-Type: application/json" in answer["error"]["message"], answer
    got, answer = post(server, "/v1/messages", body, headers={"content-type": "text/plain"})
    assert got == 400 and answer["type"] == "error" and "Content-Type" in answer["error"]["message"], answer


BAD_CHAT = [  # (what, body, status, param or None)
    ("malformed JSON", b'{"model": "m", "messages": [', 400, None),
    ("a JSON list, not an object", b"[1, 2]", 400, None),
    ("an empty body", b"", 400, None),
    ("no messages", {"model": "M"}, 400, "messages"),
    ("an empty message list", {"model": "M", "messages": []}, 400, "messages"),
    (
        "max_tokens of the wrong type",
        {"model": "M", "messages": "USER", "max_tokens": "ten"},
        400,
        "max_tokens",
    ),
    ("max_tokens 0", {"model": "M", "messages": "USER", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {"model": "M", "messages": "USER", "max_tokens": -5}, 400, "max_tokens"),
    ("temperature below 0", {"model": "M", "messages": "USER", "temperature": -1}, 400, "temperature"),
    ("top_p above 1", {"model": "M", "messages": "USER", "top_p": 1.5}, 400, "top_p"),
    ("top_k negative", {"model": "M", "messages": "USER", "top_k": -1}, 400, "top_k"),
    ("a negative seed", {"model": "M", "messages": "USER", "seed": -3}, 400, "seed"),
    ("an empty stop string", {"model": "M", "messages": "USER", "stop": ""}, 400, "stop"),
    (
        "an unknown role",
        {"model": "M", "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages.0.role",
    ),
    ("content of the wrong type", {"model": "M", "messages": [{"role": "user", "content": 5}]}, 400, None),
    (
        "an image part",
        {
            "model": "M",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
            ],
        },
        400,
        "messages.0.content.0.type",
    ),
    ("logprobs asked for", {"model": "M", "messages": "USER", "logprobs": True}, 400, "logprobs"),
    ("n > 1", {"model": "M", "messages": "USER", "n": 2}, 400, "n"),
    ("top_logprobs asked for", {"model": "M", "messages": "USER", "top_logprobs": 3}, 400, "top_logprobs"),
    ("an unknown model", {"model": "gpt-17", "messages": "USER"}, 404, "model"),
    (
        "a prompt longer than the context",
        {"model": "M", "messages": [{"role": "user", "content": "x" * 5000}]},
        400,
        "messages",
    ),
]


def test_fields_sent_as_null_read_as_left_out(server):
    """Clients that send every field, the unset ones as null (a tester's trial: n, stream, presence_penalty
    and frequency_penalty as null got 400s); a required field stays required."""
    name, user = model_id(server), [{"role": "user", "content": "hi"}]
    plain = {"model": name, "messages": user, "max_tokens": 4, "temperature": 0}
    nulls = dict.fromkeys(["n", "stream", "stream_options", "presence_penalty", "frequency_penalty", "stop",
                           "seed", "top_p", "tools", "tool_choice", "logprobs", "max_completion_tokens"])
    got, answer = post(server, "/v1/chat/completions", {**plain, **nulls})
    assert got == 200, answer
    text = answer["choices"][0]["message"]["content"]
    assert text == post(server, "/v1/chat/completions", plain)[1]["choices"][0]["message"]["content"]
    messages = {"model": name, "max_tokens": 4, "messages": user, "temperature": 0}
    got, answer = post(server, "/v1/messages", {**messages, "stream": None, "system": None, "tools": None,
                                                "stop_sequences": None})
    assert got == 200 and answer["type"] == "message", answer
    got, answer = post(server, "/v1/messages", {**messages, "max_tokens": None})
    assert got == 400 and answer["error"]["type"] == "invalid_request_error", answer


def test_bad_input_gets_the_api_error_shape_and_the_server_goes_on(server):
    name = model_id(server)
    user = [{"role": "user", "content": "hi"}]
    for what, body, status, param in BAD_CHAT:
        if isinstance(body, dict):
            body = {k: name if v == "M" else user if v == "USER" else v for k, v in body.items()}
        got, answer = post(server, "/v1/chat/completions", body)
        assert got == status, what
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], what
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), what
        if param:
            assert error["param"] == param, (what, error)
    got, answer = post(
        server, "/v1/chat/completions", {"model": name, "messages": user, "temperature": float("nan")}
    )
    assert (
        got == 400 and "finite" in answer["error"]["message"] and answer["error"]["param"] == "temperature"
    ), answer
    assert (
        post(server, "/v1/completions", {"model": name, "prompt": [10**7]})[0] == 400
    )  # a token id past the vocabulary
    assert post(server, "/v1/completions", {"model": name, "prompt": ""})[0] == 400  # an empty prompt
    got, answer = post(server, "/v1/completions", {"model": name, "prompt": [5, -1]})  # a negative token id
    assert got == 400 and "token id -1" in answer["error"]["message"], answer
    got, answer = post(server, "/v1/completions", {"model": name, "prompt": "hi", "best_of": 3})
    assert got == 400 and answer["error"]["param"] == "best_of", answer
    assert post(server, "/v1/nowhere", {})[0] == 404
    assert post(server, "/v1/chat/completions", b"", method="GET")[0] == 405
    # Anthropic's shape on /v1/messages
    for body in (
        {"model": name, "messages": user},
        {
            "model": name,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
    ):
        got, answer = post(server, "/v1/messages", body)
        assert got == 400 and answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert "'image'" in answer["error"]["message"], (
        answer
    )  # names the block refused, not "should be a string"
    assert (
        post(server, "/v1/messages", {"model": name, "max_tokens": 5, "messages": user, "temperature": 1.5})[
            0
        ]
        == 400
    )
    # an oversized body (refused on its Content-Length before it is read)
    assert raw(server, b"Content-Length: %d\r\n\r\n{" % (16 * 2**20 + 1)).startswith("HTTP/1.1 413")
    # half a request, then silence: 408 after --body-timeout (1 s here), not a wedged server
    assert raw(server, b'Content-Length: 500\r\n\r\n{"model": ').startswith("HTTP/1.1 408")
    reply = openai_client(server).chat.completions.create(model=name, messages=user, max_tokens=5)
    assert reply.usage.completion_tokens == 5


def raw(server, rest: bytes) -> str:
    """The start of the answer to a chat request sent as raw bytes (headers, then ``rest``)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + rest
        )
        return s.recv(4096).decode()


def test_disconnect_cancels_and_metrics(server):
    name = model_id(server)
    client = openai_client(server)
    stream = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "long"}], max_tokens=3000, stream=True
    )
    for _ in zip(range(3), stream):
        pass
    stream.close()  # the client goes away mid-answer
    assert anthropic_client(server).messages.count_tokens(
        model=name, messages=[{"role": "user", "content": "hi"}]
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
        if 'mlxspec_cancelled_total{why="client"}' in metrics:
            break
        time.sleep(0.2)
    assert 'mlxspec_cancelled_total{why="client"} 1.0' in metrics
    for name_ in (
        "mlxspec_requests_total",
        "mlxspec_time_to_first_token_seconds_bucket",
        "mlxspec_queue_length",
        "mlxspec_accepted_tokens_total",
        "mlxspec_drafted_tokens_total",
        'path="/v1/messages/count_tokens",status="200"',
    ):  # a documented endpoint, not "other"
        assert name_ in metrics
    health = json.loads(urllib.request.urlopen(server.url + "/health", timeout=10).read())
    assert health["status"] == "ok" and health["busy"] is False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stops_cleanly_on_a_signal(chat_model, sig):
    """A signal mid-answer ends the answer after its round (the stream finishes properly), then exit 0."""
    process = ServerProcess(["--model", str(chat_model), *GAMMA])
    stream = openai_client(process).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "x"}], max_tokens=3000, stream=True
    )
    next(iter(stream))
    process.process.send_signal(sig)
    # read while it stops: an unread stream's full socket buffer would hold the server up
    chunks = list(stream)
    out, _ = process.process.communicate(timeout=300)  # a generous ceiling: it exits once the stream ended
    status = process.process.returncode
    assert status == 0 and "Traceback" not in out, out
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(bool(c.choices[0].delta.content) for c in chunks) < 3000


@pytest.mark.slow  # over 5 s: several server processes
def test_a_model_that_does_not_load_is_one_line_and_exit_2_every_time(tmp_path):
    """The worker thread fails to load: one line, exit 2, never MLX's abort at exit ('terminate called ...'),
    which raced the main thread's exit in about half the runs before the worker's failure was awaited."""
    import subprocess
    import sys

    for _ in range(4):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlxspec",
                "serve",
                "--model",
                str(tmp_path / "missing"),
                "--blas",
                "keep",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("mlxspec: error:"), (
            done.stderr
        )


def test_a_port_in_use_is_one_line_and_exit_2(server, chat_model):
    """A second server on a taken port says so in one line (no 'listening' line, no uvicorn log), exit 2."""
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxspec",
            "serve",
            "--model",
            str(chat_model),
            *GAMMA,
            "--blas",
            "keep",
            "--port",
            str(server.port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert (
        lines[0].startswith("mlxspec: error:")
        and f"127.0.0.1:{server.port}" in lines[0]
        and "--port" in lines[0]
    )
    assert post(server, "/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 2})[0] == 200


SLOW_LOAD = """
import signal
import sys
import mlx.core as mx
# Ctrl+C as at a terminal: a suite started in the background by a non-interactive shell hands its children
# SIGINT ignored, and then Python installs no KeyboardInterrupt handler (this test hung in such a run)
signal.signal(signal.SIGINT, signal.default_int_handler)
import mlxspec.commands.serve as command
from mlxspec.commands.cli import main

def loader(args):
    def load():
        print("loading", flush=True)
        x = mx.random.normal((256, 256))
        while True:  # MLX work on the worker thread, as a model load is
            x = mx.tanh(x @ x)
            mx.eval(x)
    return load

command.loader = loader
sys.exit(main(["serve", "--port", "0", "--blas", "keep"]))
"""


def test_ctrl_c_while_the_model_loads_is_one_line_and_exit_130():
    """Ctrl+C while the worker thread loads: one line, exit 130 (not an abort tearing MLX down under it)."""
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_LOAD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline() == "loading\n"
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()  # a child that ignored the signal would otherwise spin on after the test
    assert process.returncode == 130 and "Traceback" not in err and "terminate" not in err, (
        process.returncode,
        err,
    )
    assert err.strip().splitlines() == [
        "mlxspec: interrupted (Ctrl+C) while loading the model; nothing was served"
    ]


def test_api_edges_are_refused_or_honoured_as_the_apis_do(server, chat_model):
    name, user = model_id(server), [{"role": "user", "content": "hi"}]
    for path, body in (
        ("/v1/chat/completions", {"messages": user}),
        ("/v1/messages", {"messages": user, "max_tokens": 4}),
    ):
        got, answer = post(server, path, {"model": name, "temperature": 1e-30, **body})
        message = answer["error"]["message"]
        assert got == 400 and message.startswith("temperature: must be 0") and "--temp" not in message, answer
    got, answer = post(
        server,
        "/v1/chat/completions",
        {"model": name, "messages": user, "max_tokens": 5, "max_completion_tokens": 6},
    )
    assert got == 400 and answer["error"]["param"] == "max_completion_tokens", answer
    assert (
        post(
            server,
            "/v1/chat/completions",
            {"model": name, "messages": user, "max_tokens": 2, "max_completion_tokens": 2},
        )[0]
        == 200
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": "{city: Paris"},
    }
    history = [
        user[0],
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    got, answer = post(server, "/v1/chat/completions", {"model": name, "messages": history})
    assert got == 400 and answer["error"]["param"] == "messages.1.tool_calls.0.function.arguments", answer
    history[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    del history[2]["tool_call_id"]
    got, answer = post(server, "/v1/chat/completions", {"model": name, "messages": history})
    assert got == 400 and answer["error"]["param"] == "messages.2.tool_call_id", answer
    # an Anthropic prefill: the answer continues the assistant's text, from the prompt that ends with it
    turns = [{"role": "user", "content": "Write a list"}, {"role": "assistant", "content": "Sure, here"}]
    message = anthropic_client(server).messages.create(model=name, max_tokens=12, messages=turns)
    model, tokenizer = mlxspec.load(str(chat_model))
    prompt = tokenizer.apply_chat_template(turns, continue_final_message=True)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt)
    expected = mlxspec.generate(model, tokenizer, prompt, drafter="ngram", num_draft_tokens=3, max_tokens=12)
    assert message.content[0].text == expected.text
    got, answer = post(
        server,
        "/v1/messages",
        {"model": name, "max_tokens": 4, "messages": [turns[0], {"role": "assistant", "content": "Sure "}]},
    )
    assert got == 400 and "whitespace" in answer["error"]["message"], answer


def test_responses_api_answers_as_generate_streamed_and_not(server, chat_model, capsys):
    client, name = openai_client(server), model_id(server)
    reply = client.responses.create(model=name, input="Hello there", max_output_tokens=24, temperature=0)
    expected = generate_json(chat_model, "Hello there", 24, capsys)
    assert reply.output_text == expected["text"]
    assert reply.status == ("incomplete" if expected["finish_reason"] == "length" else "completed")
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (
        expected["prompt_tokens"],
        expected["generation_tokens"],
    )
    stats = reply.model_extra["speculative"]
    assert (stats["drafted"], stats["accepted"], stats["rounds"]) == (
        expected["drafted"],
        expected["accepted"],
        expected["rounds"],
    )
    events = list(
        client.responses.create(
            model=name, input="Hello there", max_output_tokens=24, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{reply.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    assert events[-1].response.output_text == reply.output_text
    assert SPECULATIVE_KEYS <= set(events[-1].response.model_extra["speculative"])
    # instructions and input items render as the chat's system and user messages
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]
    instructed = client.responses.create(
        model=name, instructions="Be brief", input=items, max_output_tokens=12
    )
    chat = client.chat.completions.create(
        model=name,
        max_tokens=12,
        messages=[{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello there"}],
    )
    assert instructed.output_text == chat.choices[0].message.content


def test_responses_api_function_tools(tool_server):
    client, name = openai_client(tool_server, "sekret"), model_id_with_key(tool_server)
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    question = "What is the weather in Paris?"
    reply = client.responses.create(model=name, input=question, tools=[tool], max_output_tokens=10)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert reply.status == "completed" and reply.output_text == ""
    events = list(
        client.responses.create(model=name, input=question, tools=[tool], max_output_tokens=10, stream=True)
    )
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.name, json.loads(i.arguments)) for i in done] == [
        ("function_call", "get_weather", {"city": "Paris"})
    ]
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [
        done[0].arguments
    ]
    assert (
        events[-1].type == "response.completed" and events[-1].response.output[0].call_id == done[0].call_id
    )
    # the call and its output go back as input items
    follow = [
        {"role": "user", "content": question},
        calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
    ]
    assert client.responses.create(
        model=name, input=follow, tools=[tool], max_output_tokens=4
    ).usage.input_tokens


RESPONSES_REFUSED = [  # (what, extra body, param)
    ("store true", {"store": True}, "store"),
    ("a previous response", {"previous_response_id": "resp_1"}, "previous_response_id"),
    (
        "an image",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input.0.content.0.type",
    ),
    ("a built-in tool", {"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ("an unknown item", {"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    (
        "arguments that are not JSON",
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
        "input.0.arguments",
    ),
    ("a tiny temperature", {"temperature": 1e-30}, "temperature"),
    ("a forced tool", {"tool_choice": "required"}, "tool_choice"),
    ("no input", {"input": None}, "input"),
]


def test_responses_api_refuses_state_and_bad_input_in_openais_shape(server):
    name = model_id(server)
    for what, extra, param in RESPONSES_REFUSED:
        got, answer = post(server, "/v1/responses", {"model": name, "input": "hi", **extra})
        assert got == 400 and set(answer["error"]) == {"message", "type", "param", "code"}, (what, answer)
        assert answer["error"]["param"] == param, (what, answer)
    assert (
        post(server, "/v1/responses", {"model": name, "input": "hi", "store": False, "max_output_tokens": 2})[
            0
        ]
        == 200
    )
