"""Which service a request is for, and where its server answers.

A request names its model in its body: a JSON object's ``model`` (chat, completions,
embeddings), or a multipart form field ``model`` (whisper's
``/v1/audio/transcriptions``). ``/services/<name>/<path>`` names the service itself and
passes ``/<path>`` through, for servers that do not speak OpenAI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from gpuctl.config import Config, ServiceConfig
from gpuctl.errors import ConfigError

# The OpenAI paths whose body names the model.
MODEL_IN_BODY = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/rerank",
        "/v1/score",
    }
)
SERVICES_PREFIX = "/services/"
_MAX_PART_HEADERS = 8192


@dataclass(frozen=True, slots=True)
class Upstream:
    """A routable service: its config and the origin its server answers at."""

    service: ServiceConfig
    origin: str  # scheme://host:port, no trailing slash


def origin_of(url: str) -> str:
    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}"


def upstream_origin(conf: Config, svc: ServiceConfig) -> str | None:
    """``url``, else the origin of ``health``, else (an Ollama model) the host's Ollama."""
    if svc.url:
        return svc.url
    if svc.health:
        return origin_of(svc.health)
    if svc.launcher == "ollama":
        ollama = conf.host(svc.host).ollama
        return ollama  # Ollama serves its OpenAI-compatible API under /v1
    return None


def model_names(svc: ServiceConfig) -> tuple[str, ...]:
    """The model names that route to ``svc``: ``models``, else an Ollama model's name."""
    if svc.models:
        return svc.models
    if svc.launcher == "ollama" and svc.model:
        return (svc.model,)
    return ()


class RouteTable:
    """Model names and service names to upstreams, built once from the config."""

    def __init__(self, conf: Config, host: str | None = None) -> None:
        self.by_model: dict[str, Upstream] = {}
        self.by_name: dict[str, Upstream] = {}
        if host is not None:
            conf.host(host)  # an unknown --host is a usage error (with a did-you-mean)
        for svc in conf.services.values():
            if host is not None and svc.host != host:
                continue
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

    def models(self) -> list[tuple[str, Upstream]]:
        return sorted(self.by_model.items())


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
    part's content up to the next boundary; a file part is never decoded.
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
            if line.lower().startswith(b"content-disposition:") and _has_param(line, want):
                value = body[head_end + 4 : nxt]
                if len(value) > 1024:
                    return None
                try:
                    return value.decode("utf-8").strip()
                except UnicodeDecodeError:
                    return None
        pos = nxt + 2
    return None


def _has_param(line: bytes, want: bytes) -> bool:
    # `name="model"` as a parameter of its own, not the tail of `filename="model"`.
    return any(part.strip() == want for part in line.split(b";"))
