"""The state folder on disk: its subfolders, their modes whatever the umask, and reads
that never follow a symbolic link nor read past a record's size limit."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from gpuctl.adapters.store.codec import MAX_RECORD_BYTES
from gpuctl.errors import StoreError

SUBDIRS = ("records", "locks", "logs")
SHARED_GROUP = "gpuctl"


def shared_by_group(state_dir: Path) -> bool:
    """Is the state folder meant for a group of users (see the module docstring)?"""
    try:
        st = state_dir.stat()
    except OSError:
        return False
    if st.st_mode & stat.S_ISGID:
        return True
    try:
        import grp

        return grp.getgrgid(st.st_gid).gr_name == SHARED_GROUP
    except (ImportError, KeyError):
        return False


def folder_modes(state_dir: Path) -> tuple[int, int]:
    """(folder mode, file mode): 2770/0660 for a folder shared by a group, else 0700/0600."""
    return (0o2770, 0o660) if shared_by_group(state_dir) else (0o700, 0o600)


def make_state_dirs(state_dir: Path, dir_mode: int) -> None:
    """The subfolders, with their modes set explicitly (mkdir's mode goes through the
    umask: under ``umask 000`` they came out 0777). A folder of ours found too open
    (made by an older release) is closed; another user's is left as it is."""
    try:
        if not state_dir.is_dir():
            state_dir.parent.mkdir(parents=True, exist_ok=True)
            try:
                state_dir.mkdir(mode=0o700)
            except FileExistsError:
                pass  # another caller made it a moment ago
            else:
                os.chmod(state_dir, 0o700)
        for sub in SUBDIRS:
            path = state_dir / sub
            try:
                path.mkdir(mode=dir_mode)
            except FileExistsError:
                st = path.stat()
                if stat.S_IMODE(st.st_mode) != dir_mode and st.st_uid == os.geteuid():
                    os.chmod(path, dir_mode)
            else:
                os.chmod(path, dir_mode)
    except OSError as e:
        raise StoreError(
            f"cannot create the state directory {state_dir}: {e.strerror or e}",
            hint="set GPUCTL_STATE_DIR to a writable local directory (not NFS)",
        ) from None


class NotAFile(OSError):
    """A store file that is not a regular file (a FIFO, a folder, a device): never read."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def read_bounded(path: Path, limit: int = MAX_RECORD_BYTES) -> bytes:
    """At most one byte past ``limit`` (so the schema can say the file is too big), never
    through a symbolic link, and only from a regular file.

    Opened non-blocking and checked on the open descriptor: a FIFO named like a record
    would otherwise block the reader (an agent's worker thread) until someone writes to
    it, for ever; ``/dev/zero`` linked in would be read without end.

    Raises:
        NotAFile: it is a FIFO, a folder, a device (``strerror`` says which).
        OSError: it cannot be opened (ELOOP: a symbolic link).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _kind(mode)
            raise NotAFile(
                errno.EINVAL,
                f"it is {kind}, not a regular file" if kind[0] == "a" else f"it is {kind}",
            )
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
