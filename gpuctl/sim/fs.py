"""Small file helpers of the simulated GPU: atomic JSON writes, tolerant reads and deletes."""

from __future__ import annotations

import contextlib
import json
import os
import stat
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


# Explicit modes, whatever the umask (under umask 000 the folders came out 0777 and
# sim.lock 0666: anyone could drop claims or hold the lock). Readable by all, as the
# claim files are (a container may run as another user and read them); writable only by
# the owner.
DIR_MODE = 0o755
FILE_MODE = 0o644


def make_dirs(path: Path) -> None:
    """``mkdir -p`` with ``DIR_MODE`` on every folder it creates (mkdir's mode goes
    through the umask; ``chmod`` does not)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    for p in reversed(missing):
        with contextlib.suppress(OSError):
            os.chmod(p, DIR_MODE)


def own_mode(fd: int) -> None:
    """A file of ours that others may write (made under a lax umask): ``FILE_MODE``."""
    with contextlib.suppress(OSError):
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
