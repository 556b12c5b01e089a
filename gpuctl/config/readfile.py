"""Reading a small file a person named (the config, a token file), never blocking.

``token_file = "/dev/zero"`` used to be read to the end (8.6 GB and counting) and a FIFO
blocked ``gpuctl`` in ``open``. The file is opened non-blocking, checked on the open
descriptor to be a regular file, and read up to a bound.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from gpuctl.core.file_kind import not_regular

TOKEN_LIMIT = 64 * 1024
CONFIG_LIMIT = 1024 * 1024


class NotSmallFile(ValueError):
    """The file is not a regular file, or larger than its bound (the message says which)."""


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes.

    Raises:
        NotSmallFile: it is a FIFO, a device, a folder, or larger than ``limit``.
        OSError: it cannot be opened (FileNotFoundError: it is not there;
            IsADirectoryError: it is a folder).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):  # callers say "a folder" in their own words
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise NotSmallFile(f"{path} is {not_regular(mode)}")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise NotSmallFile(f"{path} is larger than {limit // 1024} KiB")
        return b"".join(chunks)
    finally:
        os.close(fd)
