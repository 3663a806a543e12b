"""``mlxspec serve``: an OpenAI- and Anthropic-compatible local HTTP server (optional extra ``serve``).

One model runs on one worker thread (``worker``), which takes requests first come, first served
from a bounded queue and keeps a prefix cache of KV caches across requests (``prefix_cache``). The
HTTP side (``app``, ``openai_api``, ``anthropic_api``) validates requests (``schemas``), renders
prompts (``prompts``), turns ``<tool_call>`` blocks into tool calls (``tools``) and counts what it
serves (``metrics``). The library core never imports this package.
"""
