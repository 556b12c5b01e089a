"""``gpuctl proxy``: an OpenAI-compatible front that starts the right server on demand.

Modules: ``routes`` (which service a request is for: its ``model``, a JSON field or a
multipart form field, or ``/services/<name>/``), ``errors`` (OpenAI's error shape),
``ready`` (one ensure per service at a time, in a worker thread), ``metrics``
(Prometheus text), ``app`` (the raw ASGI application), ``server`` (uvicorn).
"""
