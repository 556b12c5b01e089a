"""Small file helpers of the simulated GPU: atomic JSON writes, tolerant reads and deletes."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, data: dict[str, Any], *, durable: bool = True) -> None:
    """Write ``data`` so a reader sees the old file or the new one, never half of one.

    ``durable=False`` skips the fsync, for a figure that is stale as soon as it is written
    (a claim's utilisation, rewritten on every request) and that nobody needs after a crash.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            # mkstemp makes 0600; the host and a container may run as different users.
            os.fchmod(f.fileno(), 0o644)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink(Path(tmp))
        raise


def unlink(path: Path) -> bool:
    """Delete ``path``; True when it existed. Other errors are ignored (another reader won)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError:
        return False
    return True


def age_s(entry: os.DirEntry[str]) -> float:
    return time.time() - entry.stat(follow_symlinks=False).st_mtime
