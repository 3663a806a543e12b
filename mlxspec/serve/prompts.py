"""Messages of every API → the token ids of one prompt, through the model's chat template.

Each API's messages become the ``role``/``content`` dicts Hugging Face chat templates take (OpenAI's
form: assistant ``tool_calls`` with their arguments as objects, ``tool`` messages for results), so
one template renders them all. Tools are passed to the template as OpenAI function tools.
"""

from __future__ import annotations

import json

from ..engine.generate import encode_prompt
from .errors import ApiError
from .schemas.anthropic import AnthropicTool, MessagesRequest
from .schemas.openai import ChatMessage, Tool
from .schemas.responses import ResponsesRequest


def text_of(content) -> str:
    """A message's text: a string, or the text of its parts (``None`` → ``""``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def arguments(text: str, param: str):
    """A call's ``arguments`` text, parsed (what templates render); empty text is no arguments.

    Raises:
        ApiError: 400 naming ``param`` when the text is not JSON (as OpenAI refuses it).
    """
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except ValueError as e:
        raise ApiError(400, f"{param} is not valid JSON ({e}); send the call's arguments as a JSON object "
                            "in text", param=param, code="invalid_value") from None


def openai_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI chat messages as template dicts (``developer`` is a ``system`` message).

    Raises:
        ApiError: 400 for a call whose arguments are not JSON, or a ``tool`` message without ``tool_call_id``.
    """
    out = []
    for i, m in enumerate(messages):
        item = {"role": "system" if m.role == "developer" else m.role, "content": text_of(m.content)}
        if m.tool_calls:
            item["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": arguments(
                            c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"
                        ),
                    },
                }
                for j, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool" and m.tool_call_id is None:
            raise ApiError(
                400,
                f"messages.{i}.tool_call_id is required: a tool message answers the call of that id",
                param=f"messages.{i}.tool_call_id",
                code="missing_field",
            )
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            item["name"] = m.name
        out.append(item)
    return out


def responses_messages(request: ResponsesRequest) -> list[dict]:
    """A Responses request's ``instructions`` and ``input`` items as template dicts: ``function_call`` items
    become the assistant's ``tool_calls`` (joined to the assistant message before them), their outputs
    ``tool`` messages.

    Raises:
        ApiError: 400 for a call whose arguments are not JSON.
    """
    out = [{"role": "system", "content": request.instructions}] if request.instructions else []
    if isinstance(request.input, str):
        return out + [{"role": "user", "content": request.input}]
    for i, item in enumerate(request.input):
        if item.type == "message":
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": text_of(item.content)})
        elif item.type == "function_call":
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {
                    "name": item.name,
                    "arguments": arguments(item.arguments, f"input.{i}.arguments"),
                },
            }
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
    return out


def anthropic_messages(request: MessagesRequest) -> list[dict]:
    """Anthropic's ``system`` and messages as template dicts: ``tool_use`` blocks become the assistant's
    ``tool_calls``, ``tool_result`` blocks ``tool`` messages."""
    system = text_of(request.system)
    out = [{"role": "system", "content": system}] if system else []
    for m in request.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls = [], []
        for block in m.content:
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "tool_use":
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": block.input},
                    }
                )
            else:
                out.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id, "content": text_of(block.content)}
                )
        if texts or calls or not m.content:
            item = {"role": m.role, "content": "".join(texts)}
            if calls:
                item["tool_calls"] = calls
            out.append(item)
    return out


def openai_tools(tools: list[Tool] | None) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def anthropic_tools(tools: list[AnthropicTool] | None) -> list[dict] | None:
    """Anthropic tools as OpenAI function tools (what chat templates render)."""
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in tools
    ]


def takes_tools(tokenizer) -> bool:
    """Whether the chat template renders ``tools`` at all."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def shows_calls(tokenizer) -> bool:
    """Whether the chat template renders an assistant message's ``tool_calls`` (else it drops them)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tool_calls" in template


def render(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, prefill: bool = False
) -> list[int]:
    """The prompt ids for ``messages``: the chat template with ``add_generation_prompt`` (as ``mlxspec
    generate`` applies it), or the contents joined by blank lines for a model without one. With
    ``prefill``, the last (assistant) message is left open for the answer to continue
    (``continue_final_message``).

    Raises:
        ApiError: 400 when tools are given to a template that takes none, earlier tool calls to one that
            would leave them out of the prompt, or the template refuses the messages (e.g. roles that do not
            alternate).
    """
    if tools and not takes_tools(tokenizer):
        raise ApiError(
            400,
            "this model's chat template takes no tools; leave tools out or serve a model whose "
            "template renders them (Qwen2.5, Hermes-style)",
            param="tools",
        )
    if any(m.get("tool_calls") for m in messages) and not shows_calls(tokenizer):
        raise ApiError(
            400,
            "this model's chat template does not show earlier tool calls, so the model would not see them; "
            "send the calls as text, or serve a model whose template renders them (Qwen2.5, Hermes-style)",
            param="messages",
        )
    if not getattr(tokenizer, "has_chat_template", False):
        text = "\n\n".join(m["content"] for m in messages)
        return encode_prompt(tokenizer, text if prefill else text + "\n\n")
    turn = {"continue_final_message": True} if prefill else {"add_generation_prompt": True}
    try:
        if tools:
            prompt = tokenizer.apply_chat_template(messages, tools=tools, **turn)
        else:
            prompt = tokenizer.apply_chat_template(messages, **turn)
    except Exception as e:  # jinja2's TemplateError, or a template's raise_exception
        raise ApiError(
            400,
            f"the model's chat template refused the messages: {' '.join(str(e).split())}",
            param="messages",
        ) from None
    return encode_prompt(tokenizer, prompt)


def completion_prompt(tokenizer, prompt) -> list[int]:
    """``/v1/completions``' prompt (text, a list of one text, or token ids) as ids, no template.

    Raises:
        ApiError: 400 for an empty prompt.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    try:
        return encode_prompt(tokenizer, prompt)
    except ValueError as e:
        raise ApiError(400, str(e), param="prompt") from None
