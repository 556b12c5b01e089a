"""What the simulated servers answer beside chat: embeddings, and the multipart form a
whisper-like transcription takes. Standard library only.

An embedding is a pure function of its text (a hash spread over ``DIMS`` floats, unit
length), so the same input always gets the same vector, and different inputs differ.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from email.parser import BytesParser
from email.policy import HTTP

DIMS = 16
TRANSCRIPT = "This is a simulated transcription of {name}, {size} bytes of audio."


def finish_reason(n_tokens: int, sentence_tokens: int) -> str:
    """Why an answer of ``n_tokens`` ended. A simulated answer is its reply sentence,
    said again as often as ``max_tokens`` asks (the way to make a request last): it ends
    with ``stop`` at a sentence's end, and ``length`` only when ``max_tokens`` cut one."""
    return "stop" if n_tokens and n_tokens % sentence_tokens == 0 else "length"


def embedding(text: str, dims: int = DIMS) -> list[float]:
    """A unit vector of ``dims`` floats derived from ``text``."""
    raw = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    while len(raw) < dims:
        raw += hashlib.sha256(raw).digest()
    vec = [(b - 127.5) / 127.5 for b in raw[:dims]]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [round(v / norm, 6) for v in vec]


def encoded(vec: list[float], encoding_format: object) -> list[float] | str:
    """As OpenAI sends it: floats, or with ``base64`` little-endian float32s in base64
    (what the openai client asks for unless told otherwise)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
    return vec


def inputs(value: object) -> list[str] | None:
    """An embeddings request's ``input``: a string or a list of strings (None: neither).
    Token lists are read as their numbers' text."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [str(v) for v in value]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [" ".join(str(v) for v in value)]
        if all(isinstance(v, list) for v in value):
            return [" ".join(str(t) for t in v) for v in value]
    return None


def form_fields(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """The parts of a ``multipart/form-data`` body: name -> (file name, content).
    Empty when the body is not one."""
    if not content_type.lower().startswith("multipart/form-data"):
        return {}
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    msg = BytesParser(policy=HTTP).parsebytes(head + body)
    if not msg.is_multipart():
        return {}
    out: dict[str, tuple[str | None, bytes]] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        payload = part.get_payload(decode=True)
        out[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return out
