"""Which service a request is for, and where its server answers (and its body, read
within the cap: ``read_body``).

A request names its model in its body: a JSON object's ``model`` (chat, completions,
embeddings), or a multipart form field ``model`` (whisper's
``/v1/audio/transcriptions``). ``/services/<name>/<path>`` names the service itself and
passes ``/<path>`` through, for servers that do not speak OpenAI.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal
from urllib.parse import quote, unquote_to_bytes, urlsplit

import msgspec

from gpuctl.config import Config, ServiceConfig
from gpuctl.config.slurm_fields import NODE
from gpuctl.core.json_kind import json_kind
from gpuctl.errors import ConfigError
from gpuctl.proxy.errors import ClientGone, Refusal
from gpuctl.proxy.relay import Receive, Scope

# The OpenAI paths whose body names the model, and where: a JSON object's "model", or
# a multipart form field "model" (whisper's uploads).
MODEL_IN_BODY: Mapping[str, Literal["json", "form"]] = MappingProxyType(
    {
        "/v1/chat/completions": "json",
        "/v1/completions": "json",
        "/v1/embeddings": "json",
        "/v1/audio/transcriptions": "form",
        "/v1/audio/translations": "form",
        "/v1/rerank": "json",
        "/v1/score": "json",
    }
)
SERVICES_PREFIX = "/services/"
# Every path the proxy answers, as an OpenAPI template, with the methods it documents
# (HEAD rides on GET; /services/ passes any method through). ``app.ProxyApp._route``
# serves these and ``openapi.openapi_document`` documents exactly these, so a route
# cannot be served undocumented (tests/test_proxy_units.py holds the two together).
ROUTES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "/healthz": ("GET",),
        "/openapi.json": ("GET",),
        "/metrics": ("GET",),
        "/v1/models": ("GET",),
        "/v1/models/{model}": ("GET",),
        **{path: ("POST",) for path in MODEL_IN_BODY},
        SERVICES_PREFIX + "{name}/{path}": ("GET", "POST"),
    }
)
_MAX_PART_HEADERS = 8192
# What a client-sent name may show of itself in an error message or the access log.
_SHOWN_CHARS = 120
# Characters a URL path or query keeps as they are (RFC 3986's pchar plus '/' and '?');
# '%' too, so the client's own escapes go upstream unchanged.
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"
_QUERY_SAFE = _PATH_SAFE + "?"


class Upstream(msgspec.Struct, frozen=True):
    """A routable service: its config and the origin its server answers at."""

    service: ServiceConfig
    origin: str  # scheme://host:port, no trailing slash


def origin_of(url: str) -> str:
    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}"


def upstream_origin(conf: Config, svc: ServiceConfig) -> str | None:
    """``url``, else the origin of ``health`` (not a Slurm job's ``{node}``), else (an Ollama model) the host's Ollama."""
    if svc.url:
        return svc.url
    if svc.health and NODE not in svc.health:  # `{node}`: no fixed address to forward to
        return origin_of(svc.health)
    if svc.launcher == "ollama":
        ollama = conf.host(svc.host).ollama
        return ollama  # Ollama serves its OpenAI-compatible API under /v1
    return None


# The Ollama endpoints that load a model (a POST): every other one (its model list,
# what is loaded, a model's details, a pull) answers without, so through an Ollama
# service's /services/<name>/ it is passed on without starting anything.
OLLAMA_LOADING = frozenset(
    {
        "/api/generate",
        "/api/chat",
        "/api/embed",
        "/api/embeddings",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
    }
)


def loads_a_model(svc: ServiceConfig, method: str, path: str) -> bool:
    """Whether a request on ``/services/<svc>/<path>`` needs the service ready: always,
    but for an Ollama model's endpoints that load nothing (``OLLAMA_LOADING``)."""
    if svc.launcher != "ollama":
        return True
    return method == "POST" and path.rstrip("/") in OLLAMA_LOADING


def model_names(svc: ServiceConfig) -> tuple[str, ...]:
    """The model names that route to ``svc``: ``models``, else an Ollama model's name."""
    if svc.models:
        return svc.models
    if svc.launcher == "ollama" and svc.model:
        return (svc.model,)
    return ()


class RouteTable:
    """Model names and service names to upstreams, built once from the config.

    A pooled service (``hosts = [...]``) is listed placed on its first host; ``on``
    places it on the host of its pool where its copy runs, with that host's ``{host}``.
    With ``host`` (``gpuctl proxy --host``) only the services that may run there are
    listed, placed there, a pooled one too: that proxy fronts that host's copy alone.
    """

    def __init__(self, conf: Config, host: str | None = None) -> None:
        self.by_model: dict[str, Upstream] = {}
        self.by_name: dict[str, Upstream] = {}
        self.only = host
        self._conf = conf
        self._placed: dict[tuple[str, str], Upstream] = {}
        if host is not None:
            conf.host(host)  # an unknown --host is a usage error (with a did-you-mean)
        services = conf.services.values() if host is None else conf.services_on(host)
        for svc in services:
            origin = upstream_origin(conf, svc)
            if origin is None:
                continue  # no HTTP server to forward to (a batch job)
            up = Upstream(svc, origin)
            self.by_name[svc.name] = up
            for m in model_names(svc):
                if m in self.by_model:
                    other = self.by_model[m].service.name
                    raise ConfigError(
                        f"services.{svc.name}.models: {m!r} is already a model of services.{other}"
                    )
                self.by_model[m] = up

    def on(self, up: Upstream, host: str) -> Upstream:
        """``up``'s service on ``host`` (one of its pool): its config there and the origin
        its server answers at there (made once per service and host)."""
        if host == up.service.host:
            return up
        listed = self.by_name.get(up.service.name)
        if listed is not None and host == listed.service.host:
            return listed
        key = (up.service.name, host)
        placed = self._placed.get(key)
        if placed is None:
            svc = self._conf.placed(up.service.name, host)
            origin = upstream_origin(self._conf, svc)
            placed = self._placed[key] = Upstream(svc, up.origin if origin is None else origin)
        return placed

    def models(self) -> list[tuple[str, Upstream]]:
        return sorted(self.by_model.items())

    def https(self) -> bool:
        """Whether any upstream (or its health URL) speaks https: TLS is set up only then."""
        return any(
            up.origin.startswith("https:") or (up.service.health or "").startswith("https:")
            for up in self.by_name.values()
        )


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request's body, whole: 413 past ``limit`` bytes (declared or sent), 400 for
    a bad ``Content-Length``; ``ClientGone`` when the client leaves mid-body."""
    for k, v in scope["headers"]:
        if k == b"content-length":
            try:
                declared = int(v)
            except ValueError:
                raise Refusal(
                    400, "bad Content-Length", "invalid_request_error", "bad_request"
                ) from None
            if declared > limit:
                raise Refusal(
                    413,
                    f"request body over {limit} bytes (the proxy's max_body)",
                    "invalid_request_error",
                    "request_too_large",
                )
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone  # mid-body: nobody to answer (499 in the log)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Refusal(
                413,
                f"request body over {limit} bytes (the proxy's max_body)",
                "invalid_request_error",
                "request_too_large",
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def split_services_path(raw_path: bytes) -> tuple[str, str] | None:
    """(service name, path to pass through) of a raw ``/services/<name>/<path>``.

    Works on the path as the client sent it (``raw_path``), so an escaped slash stays in
    its segment (``/services/a%2Fb/x`` names the service ``a/b``, which is unknown) and
    the upstream gets the client's own escapes (``%23`` stays a ``#`` of the path, never a
    fragment). None when the pass-through path climbs with a dot segment (``..``, ``.``,
    escaped or not): the proxy does not resolve them and will not forward them.
    """
    prefix = SERVICES_PREFIX.encode()
    if not raw_path.startswith(prefix):
        return None
    name_raw, _, rest = raw_path[len(prefix) :].partition(b"/")
    name = unquote_to_bytes(name_raw).decode("utf-8", "replace")
    for seg in rest.split(b"/"):
        if unquote_to_bytes(seg) in (b".", b".."):
            return None
    return name, "/" + quote(rest, safe=_PATH_SAFE)


def safe_query(query: bytes) -> str:
    """A raw query string as URL text (bytes outside the URL's own characters escaped)."""
    return quote(query, safe=_QUERY_SAFE)


def shown(name: str) -> str:
    """A client-sent name as it may appear in a message or a log line: printable, short.

    A model of a megabyte, a newline (a forged access-log line) or a lone surrogate
    comes back escaped and cut, never as sent.
    """
    if len(name) <= _SHOWN_CHARS and name.isprintable():
        return name  # the common case, checked in C (this runs on every access line)
    text = "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
        for c in name[:_SHOWN_CHARS]
    )
    if len(name) > _SHOWN_CHARS:
        text += f"... ({len(name)} characters)"
    return text


def model_from_json(body: bytes) -> tuple[str | None, bool]:
    """(model, stream) from a JSON body; (None, False) when it is not a JSON object."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None, False
    if not isinstance(obj, dict):
        return None, False
    model = obj.get("model")
    return (model if isinstance(model, str) else None), obj.get("stream") is True


def why_no_model(content_type: str, body: bytes) -> tuple[str, str]:
    """For the 400 of a request that routes to no model: (message, code), saying which
    it is: a form without a ``model`` field, no body, a body that is not JSON or not an
    object, no ``model``, or a ``model`` that is not a string. Called on that refusal
    only, so a routed request parses its body once."""
    if multipart_boundary(content_type) is not None:
        return (
            "the form names no model: a text field 'model' (not a file part; UTF-8, at most 1 KiB)"
        ), "model_missing"
    if not body.strip():
        return "the request has no body: send a JSON object with a 'model'", "model_missing"
    try:
        obj = json.loads(body)
    except RecursionError:
        return "the request body is JSON nested too deep to read", "invalid_request"
    except ValueError as err:  # a UnicodeDecodeError too
        return (
            f"the request body is not JSON ({shown(str(err))}): send a JSON object with a 'model'",
            "invalid_request",
        )
    if not isinstance(obj, dict):
        return (
            f"the request body is {json_kind(obj, integers=False)}, not a JSON object",
            "invalid_request",
        )
    if "model" not in obj:
        return "the request names no model ('model' in the JSON body)", "model_missing"
    return (
        f"'model' must be a string, not {json_kind(obj['model'], integers=False)}",
        "invalid_request",
    )


def multipart_boundary(content_type: str) -> bytes | None:
    """The boundary of a ``multipart/form-data`` content type, or None."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        return None
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.strip().lower() == "boundary":
            value = value.strip().strip('"')
            if 0 < len(value) <= 200:
                return value.encode("latin-1", "replace")
    return None


def form_field(body: bytes, boundary: bytes, name: str) -> str | None:
    """The value of the multipart form field ``name`` (a small text field), or None.

    Only what routing needs: it scans part headers for ``name="…"`` and takes that
    part's content up to the next boundary; a file part (one with a filename) is never
    read, even when it is named ``name``.
    """
    delimiter = b"--" + boundary
    want = f'name="{name}"'.encode()
    pos = body.find(delimiter)
    while pos != -1:
        start = pos + len(delimiter)
        if body[start : start + 2] == b"--":
            return None  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", start)
        if head_end == -1 or head_end - start > _MAX_PART_HEADERS:
            return None
        headers = body[start:head_end]
        nxt = body.find(b"\r\n" + delimiter, head_end + 4)
        if nxt == -1:
            return None
        for line in headers.split(b"\r\n"):
            if (
                line.lower().startswith(b"content-disposition:")
                and _has_param(line, want)
                and not _is_file(line)
            ):
                value = body[head_end + 4 : nxt]
                if len(value) > 1024:
                    return None
                try:
                    return value.decode("utf-8").strip()
                except UnicodeDecodeError:
                    return None
        pos = nxt + 2
    return None


def _is_file(line: bytes) -> bool:
    # A part with a filename is an upload, never the text field routing reads (a file
    # named "model" must not pick the service).
    return any(part.strip().lower().startswith(b"filename") for part in line.split(b";"))


def _has_param(line: bytes, want: bytes) -> bool:
    # `name="model"` as a parameter of its own, not the tail of `filename="model"`.
    return any(part.strip() == want for part in line.split(b";"))


def header_of(scope: Scope, name: bytes) -> bytes:
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v)
    return b""


def wants_stream(scope: Scope, body: bytes) -> bool:
    if b"text/event-stream" in header_of(scope, b"accept"):
        return True
    if body[:1] == b"{" and b'"stream"' in body:
        return model_from_json(body)[1]
    return False
