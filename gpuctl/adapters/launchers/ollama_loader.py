"""The Ollama launcher's detached loader: one empty ``/api/generate`` request.

``python -m gpuctl.adapters.launchers.ollama_loader URL MODEL KEEP_ALIVE TIMEOUT_S``

A process of its own, in its own session, so the load goes on when the ``ensure`` that
started it is interrupted or does not wait: Ollama drops a load whose client went away
before it began. Standard library only, so it starts in a few tens of milliseconds; its
output is the service's loader log.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request


def load(url: str, model: str, keep_alive: int, timeout_s: float) -> int:
    """One empty generate request; 0 when the model loaded."""
    body = json.dumps(
        {"model": model, "prompt": "", "keep_alive": keep_alive, "stream": False}
    ).encode()
    req = urllib.request.Request(  # noqa: S310 - the host's configured Ollama URL
        url.rstrip("/") + "/api/generate",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"--- gpuctl: loading {model} into Ollama at {url} ({stamp})", flush=True)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310
            reply = json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        print(f"error: Ollama answered HTTP {e.code}: {detail}", flush=True)
        return 1
    except (OSError, ValueError) as e:
        print(f"error: {e}", flush=True)
        return 1
    print(f"loaded: {reply.get('done_reason', 'done') if isinstance(reply, dict) else reply}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gpuctl.adapters.launchers.ollama_loader URL MODEL KEEP_ALIVE TIMEOUT_S``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        print(main.__doc__, file=sys.stderr)
        return 2
    try:
        return load(args[0], args[1], int(args[2]), float(args[3]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
