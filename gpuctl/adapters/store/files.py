"""The state folder on disk: its subfolders, their modes whatever the umask, and every
access under it made from a folder's own descriptor, never through a symbolic link.

Group members can write the state folder, so anything in it may be a link planted to
make gpuctl write, chmod or delete elsewhere (a link at ``inflight/<svc>`` had entries
written, and ``.json`` files deleted, in another folder). So every path below the state
folder is reached by an ``openat`` walk with ``O_NOFOLLOW`` from the state folder's own
descriptor (``Folder``), and every file is opened, created, renamed and deleted relative
to its folder's descriptor. A link found where a folder belongs is renamed beside itself
(``<name>.link-<time>``, kept for a person; ``gpuctl locks`` lists it) and a real folder
made in its place. The state folder itself is the administrator's choice and may be a
link.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
import time
from pathlib import Path
from types import TracebackType
from typing import Final

from gpuctl.adapters.store.codec import MAX_RECORD_BYTES
from gpuctl.core.file_kind import file_kind, not_regular
from gpuctl.errors import StoreError

SUBDIRS = ("records", "locks", "logs")
# Made on first use (by a caller that may write there); closed like the others if found.
LATER_SUBDIRS = ("inflight", "queue")
SHARED_GROUP = "gpuctl"
# A link set aside where a folder (or a lock file) belonged: ``<name>.link-<time>``.
LINK_SUFFIX: Final = ".link-"
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

log = logging.getLogger("gpuctl.store")


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


def _close_mode(fd: int, mode: int) -> None:
    """Set a folder of ours to ``mode`` when it differs (mkdir's mode goes through the
    umask, and an older release left folders 0777); another user's is left as it is."""
    st = os.fstat(fd)
    if stat.S_IMODE(st.st_mode) != mode and st.st_uid == os.geteuid():
        os.fchmod(fd, mode)


def make_state_dirs(state_dir: Path, dir_mode: int) -> None:
    """The state folder and its subfolders, with their modes set explicitly. A folder
    of ours found too open (made by an older release) is closed; another user's is left
    as it is. The state folder itself keeps its setgid bit (``folder_modes``)."""
    try:
        if not state_dir.is_dir():
            state_dir.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # another caller made it just now
                state_dir.mkdir(mode=0o700)
        root = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _close_mode(root, dir_mode if dir_mode & stat.S_ISGID else 0o700)
        finally:
            os.close(root)
        for sub in SUBDIRS:
            Folder(state_dir, sub, create=dir_mode).close()
        for sub in LATER_SUBDIRS:
            with contextlib.suppress(FileNotFoundError), Folder(state_dir, sub) as folder:
                _close_mode(folder.fd, dir_mode)
    except OSError as e:
        raise StoreError(
            f"cannot create the state directory {state_dir}: {e.strerror or e}",
            hint=(
                f"{state_dir} and each subfolder must be a folder (not a link) writable by "
                "this user; or set GPUCTL_STATE_DIR to a writable local directory (not NFS)"
            ),
        ) from None


class NotAFile(OSError):
    """A store file that is not a regular file (a FIFO, a folder, a device): never read."""


def _read_fd(fd: int, limit: int) -> bytes:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise NotAFile(errno.EINVAL, f"it is {not_regular(mode)}")
    chunks: list[bytes] = []
    left = limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def read_bounded(path: Path, limit: int = MAX_RECORD_BYTES) -> bytes:
    """At most one byte past ``limit`` (so the schema can say the file is too big), never
    through a symbolic link, and only from a regular file. Inside the state folder, use
    ``Folder.read`` (no link in any folder on the way either).

    Opened non-blocking and checked on the open descriptor: a FIFO named like a record
    would otherwise block the reader (an agent's worker thread) until someone writes to
    it, for ever; ``/dev/zero`` linked in would be read without end.

    Raises:
        NotAFile: it is a FIFO, a folder, a device (``strerror`` says which).
        OSError: it cannot be opened (ELOOP: a symbolic link).
    """
    fd = os.open(path, _READ_FLAGS)
    try:
        return _read_fd(fd, limit)
    finally:
        os.close(fd)


def set_aside_name(name: str, suffix: str, now: float, exists: object) -> str:
    """``<name><suffix><time>``, with ``-1``, ``-2`` … when two land in one second
    (``exists(candidate)`` says whether a name is taken)."""
    base = f"{name}{suffix}{int(now)}"
    out, n = base, 1
    while callable(exists) and exists(out):
        out, n = f"{base}-{n}", n + 1
    return out


class Folder:
    """A folder under the state folder, open by descriptor, reached without following
    any link (see the module docstring). Use it as a context manager, or ``close()``.

    ``create``: the folder mode to make missing folders with (and to close folders of
    ours found more open); None: a missing folder raises ``FileNotFoundError``. A link
    where a folder belongs is set aside (and, with ``create``, replaced by a folder);
    without ``create`` it then raises ``FileNotFoundError`` (there is no such folder).

    Raises:
        NotADirectoryError: a part is a file, not a folder nor a link.
        OSError: anything else the system says.
    """

    def __init__(self, root: Path, *parts: str, create: int | None = None) -> None:
        self.path = Path(root).joinpath(*parts)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts:
                nxt = _open_part(fd, part, create, Path(root))
                root = Path(root) / part
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Folder:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def names(self) -> list[str]:
        """The names in the folder (no order)."""
        return os.listdir(self.fd)

    def exists(self, name: str) -> bool:
        """Whether the name is taken in this folder (a link counts, never followed)."""
        return _exists(self.fd, name)

    def is_link(self, name: str) -> bool:
        try:
            return stat.S_ISLNK(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def read(self, name: str, limit: int = MAX_RECORD_BYTES) -> bytes:
        """As ``read_bounded``, relative to this folder."""
        fd = os.open(name, _READ_FLAGS, dir_fd=self.fd)
        try:
            return _read_fd(fd, limit)
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes, file_mode: int) -> None:
        """Atomically (a temporary file renamed over it): a reader never sees a torn file.
        The temporary file is made with ``O_EXCL | O_NOFOLLOW``: nothing planted under its
        name is opened. No fsync: after a power loss every lease is void anyway."""
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            file_mode,
            dir_fd=self.fd,
        )
        try:
            try:
                os.fchmod(fd, file_mode)  # the creation mode goes through the umask
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def unlink(self, name: str) -> None:
        os.unlink(name, dir_fd=self.fd)

    def rename(self, name: str, new: str) -> None:
        os.rename(name, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def set_aside(self, name: str, suffix: str, now: float) -> str:
        """Rename ``name`` beside itself as ``<name><suffix><time>``; the new name."""
        new = set_aside_name(name, suffix, now, lambda n: _exists(self.fd, n))
        self.rename(name, new)
        return new

    def lock(self, name: str, file_mode: int, timeout_s: float, poll_s: float) -> FolderLock:
        """An exclusive ``flock`` on ``name`` (made if missing, never through a link; a
        link there is set aside first), waiting at most ``timeout_s``.

        Raises:
            TimeoutError: another process held it all that time.
            OSError: it cannot be opened or made.
        """
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(name, flags, file_mode, dir_fd=self.fd)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            kept = self.set_aside(name, LINK_SUFFIX, time.time())
            log.warning("%s is a symbolic link; set aside as %s", self.path / name, kept)
            fd = os.open(name, flags, file_mode, dir_fd=self.fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotAFile(errno.EINVAL, f"it is {file_kind(st.st_mode)}")
            if stat.S_IMODE(st.st_mode) != file_mode and st.st_uid == os.geteuid():
                os.fchmod(fd, file_mode)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return FolderLock(fd)
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(errno.ETIMEDOUT, "held by another process") from None
                    time.sleep(poll_s)
        except BaseException:
            os.close(fd)
            raise


JUNK_SUFFIX: Final = ".corrupt-"


def set_aside_junk(folder: Folder, name: str, now: float, why: object) -> None:
    """A queue or in-flight file that is not a sound entry: renamed beside itself once
    (``<name>.corrupt-<time>``, kept for a person; ``gpuctl locks`` counts it) and logged
    once, so it is never read again (5,000 junk files cost seconds and a log flood on
    every read). A reader that may not rename it just skips it."""
    why_text = getattr(why, "strerror", None) or str(why)
    try:
        kept = folder.set_aside(name, JUNK_SUFFIX, now)
    except OSError:
        return
    log.warning("%s is not a sound entry (%s); set aside as %s", folder.path / name, why_text, kept)


class FolderLock:
    """A held ``flock``; ``release()`` frees it (closing the descriptor)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = -1


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _open_dir(part: str, parent: int) -> int:
    """``part`` as a folder descriptor, never through a link. A folder this user may pass
    through but not list (another user's 0711, say) is opened as a path only: enough to
    reach what is inside, as a plain path walk would."""
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:
        fd = os.open(part, _DIR_FLAGS & ~os.O_RDONLY | os.O_PATH, dir_fd=parent)
        if not stat.S_ISDIR(os.fstat(fd).st_mode):  # O_PATH opens a link itself
            os.close(fd)
            raise NotADirectoryError(errno.ENOTDIR, f"{part} is not a directory") from None
        return fd


def _open_part(parent: int, part: str, create: int | None, where: Path) -> int:
    """One step of the walk: ``part`` in ``parent``, a folder and not a link."""
    for _ in range(3):  # a racing creator or a set-aside: try again, a bounded few times
        try:
            fd = _open_dir(part, parent)
        except FileNotFoundError:
            if create is None:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, create, dir_fd=parent)
            continue
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            if not stat.S_ISLNK(os.stat(part, dir_fd=parent, follow_symlinks=False).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, f"{part} is not a directory") from None
            kept = set_aside_name(part, LINK_SUFFIX, time.time(), lambda n: _exists(parent, n))
            os.rename(part, kept, src_dir_fd=parent, dst_dir_fd=parent)
            log.warning(
                "%s is a symbolic link, never followed; set aside as %s", where / part, kept
            )
            if create is None:
                raise FileNotFoundError(errno.ENOENT, f"{part} was a symbolic link") from None
            continue
        if create is not None:
            try:
                _close_mode(fd, create)
            except BaseException:
                os.close(fd)
                raise
        return fd
    raise OSError(errno.EAGAIN, f"{part} keeps changing under {where}")
