"""``mlxspec serve``: an OpenAI- and Anthropic-compatible local HTTP server (optional extra ``serve``).

One model runs on one worker thread (``worker``), which takes requests first come, first served
from a bounded queue and keeps a prefix cache of KV caches across requests (``prefix_cache``). The
HTTP side: ``routes`` (every path, its body and answer, validated by FastAPI against ``schemas``),
``openai_api``, ``anthropic_api`` and ``responses_api`` (a request → a job → the answer, streamed or
not), ``jobs`` (what they share: the server's state, queueing and waiting on the worker), ``prompts``
(messages → template → ids), ``tools`` (tool calls in the answer), ``errors`` (each API's error shape,
the body guard), ``metrics`` (Prometheus) and ``app``. The library core never imports this package.
"""
