"""A server's log file: never a symbolic link nor anything but a regular file, reached
from its folder's descriptor, private whatever the umask, and rotated by size.

Group members can write the state folder, so anything in ``logs/`` may be planted:

- a symbolic link at the log would make the server write into another file, and its
  tail be copied into the record: ``O_NOFOLLOW`` refuses it;
- a link at ``logs`` itself, swapped in after a check, would be followed by a path
  open (``O_NOFOLLOW`` covers only the last part): a log under the state folder is
  opened by an ``openat`` walk from the state folder (``store.files.Folder``), which
  sets such a link aside;
- a FIFO would block an open (or a read) until someone opens its other end, wedging
  ``ensure`` and ``reclaim`` for ever: every open here is ``O_NONBLOCK`` and checked to
  be a regular file on the open descriptor (``open_regular``). A log that is not one is
  refused with an error naming it (never renamed: it may be the owner's own plumbing,
  and moving it would silently change where the output goes);
- a file with setuid bits, made big enough to rotate: the rotated copy gets a fixed
  mode, never the source's, or a root ``gpuctl reclaim`` would hand out a setuid-root
  copy.

The mode is set with ``fchmod``, which the umask does not narrow or widen: 0600, or 0640
in a setgid folder (one shared through a group, as a shared state folder is: the group
reads logs, only the server writes them, so not the store's 0660).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from gpuctl.adapters.store.files import Folder, NotAFile, folder_modes
from gpuctl.core.file_kind import file_kind
from gpuctl.errors import StartFailed

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_APPEND = os.O_WRONLY | os.O_CREAT | os.O_APPEND | _NOFOLLOW
# A server that runs for weeks must not fill the disk: past this size its log is rotated
# (at its next start, and by each `gpuctl reclaim` on the host), keeping this many old ones.
LOG_MAX_BYTES = 64 * 2**20
LOG_KEEP = 3


def log_mode(folder: Path | int) -> int:
    """0640 where the folder (a path or a descriptor) is shared through its group
    (setgid), else 0600."""
    try:
        shared = bool(os.stat(folder).st_mode & stat.S_ISGID)
    except OSError:
        shared = False
    return 0o640 if shared else 0o600


def open_regular(name: str | Path, flags: int, dir_fd: int | None = None, mode: int = 0o600) -> int:
    """Open a regular file, never blocking: ``O_NONBLOCK | O_NOFOLLOW``, then the open
    descriptor must be a regular file, then ``O_NONBLOCK`` is cleared (a FIFO never gets
    this far, and a writer handed the descriptor must not see EAGAIN).

    Raises:
        NotAFile: it is a FIFO, a folder, a socket or a device (``strerror`` says which).
        OSError: it cannot be opened (ELOOP: a symbolic link).
    """
    try:
        fd = os.open(name, flags | _NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as e:
        # A FIFO without a reader, or a socket, refuses a non-blocking write open
        # (ENXIO); a folder refuses a write open (EISDIR). Say what it is.
        if e.errno not in (errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):
            raise
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        raise NotAFile(errno.EINVAL, f"it is {file_kind(st.st_mode)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(errno.EINVAL, f"it is {file_kind(st.st_mode)}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _folder(path: Path, root: Path | None, create: bool) -> Iterator[Folder]:
    """The folder ``path`` is in, open by descriptor. Under ``root`` (the state folder),
    reached by the store's ``openat`` walk, which never follows a link (and sets one
    aside, as it does for ``records`` and ``locks``); elsewhere (a ``log`` the config
    names) by path: that folder is the config author's choice, as the state folder is."""
    parts: tuple[str, ...] | None = None
    if root is not None:
        with contextlib.suppress(ValueError):
            parts = path.parent.relative_to(root).parts
        if parts is not None and any(p in ("..", ".") for p in parts):
            parts = None
    if root is not None and parts is not None:
        if create:  # the state folder itself may be missing yet (the store makes it too)
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder = Folder(root, *parts, create=folder_modes(root)[0] if create else None)
    else:
        if create:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder = Folder(path.parent)
    with folder:
        yield folder


def open_log(path: Path, service: str, root: Path | None = None) -> int:
    """Open (create) ``path`` for appending, rotating it first when it is big; return the
    descriptor. ``root``: the state folder, when ``path`` may lie under it.

    Raises:
        StartFailed: the log is a symbolic link, not a regular file, or cannot be created.
    """
    try:
        with _folder(path, root, create=True) as folder:
            _rotate(folder, path.name, LOG_MAX_BYTES, LOG_KEEP)
            fd = open_regular(path.name, _APPEND, dir_fd=folder.fd)
            try:
                if os.fstat(fd).st_uid == os.geteuid():
                    os.fchmod(fd, log_mode(folder.fd))
            except OSError:
                os.close(fd)
                raise
            return fd
    except NotAFile as e:
        raise StartFailed(
            f"the log {path} of {service} is not a regular file ({e.strerror}); "
            "gpuctl does not write to it",
            hint=f"remove {path}, or set services.{service}.log to a plain file",
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StartFailed(
                f"the log {path} of {service} is a symbolic link; gpuctl does not follow it",
                hint=f"remove the link, or set services.{service}.log to a plain file",
            ) from None
        raise StartFailed(f"cannot open the log {path}: {e.strerror or e}") from None


def tail_file(path: Path, lines: int, limit: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a regular file, reading at most its last ``limit``
    bytes ('' for a symbolic link, a FIFO, anything else)."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        try:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read(limit)
        except OSError:
            return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def rotate(
    path: Path, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP, root: Path | None = None
) -> bool:
    """Rotate ``path`` when it is larger than ``max_bytes``: ``.1`` … ``.{keep}``.
    ``root``: the state folder, when ``path`` may lie under it. Returns whether it
    rotated; never raises (a log it cannot rotate is left as it is)."""
    try:
        with _folder(path, root, create=False) as folder:
            return _rotate(folder, path.name, max_bytes, keep)
    except OSError:
        return False


def _rotate(folder: Folder, name: str, max_bytes: int, keep: int) -> bool:
    """Copy, then truncate (logrotate's ``copytruncate``): the running server keeps its
    descriptor, opened with ``O_APPEND`` (``>>`` in a shell), so its next line lands at
    the start of the emptied file. Never raises.

    Only a regular file with one name, owned by this user, is rotated. Owner: a log is
    rotated by whoever started its server (at the next start) or by a reclaim run as the
    same user; a root ``reclaim`` leaves other users' logs alone rather than copy and
    truncate files a neighbour chose (the shipped timer runs as ``gpuctl``, which can
    write only its own logs anyway). One name: a hard link's other name is some other
    file, which truncating would empty too. The copy ``.1`` is made afresh (``O_EXCL``,
    after unlinking any old one, all through the folder's descriptor) with the log mode
    (``log_mode``), never the source's bits: a setuid log must not yield a setuid copy.
    """
    try:
        fd = open_regular(name, os.O_RDWR, dir_fd=folder.fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_nlink != 1 or st.st_size <= max_bytes:
            return False
        for n in range(keep - 1, 0, -1):
            older = f"{name}.{n}"
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(folder.lstat(older).st_mode):
                    folder.rename(older, f"{name}.{n + 1}")
        first = f"{name}.1"
        with contextlib.suppress(FileNotFoundError):
            folder.unlink(first)  # whatever it is (a link, a FIFO): the name, never a target
        mode = log_mode(folder.fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
        out = os.open(first, flags, mode, dir_fd=folder.fd)
        try:
            os.fchmod(out, mode)  # the creation mode goes through the umask
            os.lseek(fd, 0, os.SEEK_SET)
            while chunk := os.read(fd, 1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
        finally:
            os.close(out)
        os.ftruncate(fd, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def rotate_all(folder: Path, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP) -> list[str]:
    """Rotate every ``*.log`` in ``folder`` over ``max_bytes``; returns the ones rotated.
    ``folder`` itself is opened from its parent without following a link (a link at
    ``logs`` is set aside, as the store does), and each log from ``folder``'s descriptor."""
    try:
        with Folder(folder.parent, folder.name) as logs:
            names = sorted(n for n in logs.names() if n.endswith(".log"))
            return [n for n in names if _rotate(logs, n, max_bytes, keep)]
    except OSError:
        return []
