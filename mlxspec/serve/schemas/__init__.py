"""Each API's request and response bodies as pydantic models: FastAPI validates requests with them and
serves them as the OpenAPI schema (``/openapi.json``, ``/docs``).

``base`` (the strict request base, the response base, the ``speculative`` extension object),
``openai`` (chat completions, completions, models), ``anthropic`` (Messages), ``responses`` (the
Responses API).
"""
