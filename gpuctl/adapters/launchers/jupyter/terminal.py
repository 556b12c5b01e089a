"""One websocket to a terminado terminal: type a line, wait for the markers it prints."""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import TYPE_CHECKING, Any

from gpuctl.adapters.launchers.jupyter.errors import JupyterUnreachable
from gpuctl.errors import LauncherError

if TYPE_CHECKING:
    from websockets.sync.client import ClientConnection


class Terminal:
    """A connected terminal named ``name`` of the Jupyter server at ``where``."""

    def __init__(self, ws: ClientConnection, name: str, where: str, timeout_s: float) -> None:
        self.ws = ws
        self.name = name
        self.where = where
        self.timeout_s = timeout_s
        self.buf = ""

    def run(
        self, line: str, keys: tuple[str, ...], timeout_s: float | None = None
    ) -> dict[str, str]:
        """Type ``line`` (``{M}`` stands for a fresh marker prefix); return each key's value.

        Waits until the marker of every key in ``keys`` has been printed in full.
        """
        nonce = secrets.token_hex(6)
        typed = line.replace("{M}", f"GPUCTL_{nonce}_$((0+1))_")
        # A leading space keeps our lines out of the shell's history (HISTCONTROL).
        self.send(["stdin", " " + typed + "\r"])
        patterns = {k: re.compile(rf"GPUCTL_{nonce}_1_{k}=([^\r\n]*)\r?\n") for k in keys}
        found: dict[str, str] = {}
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        while True:
            for k, pat in patterns.items():
                if k not in found and (m := pat.search(self.buf)):
                    found[k] = m.group(1)
            if len(found) == len(keys):
                return found
            self._read(deadline)

    def block(self, line: str, timeout_s: float | None = None) -> str:
        """Type ``line`` between a begin and an end marker; return what it printed."""
        nonce = secrets.token_hex(6)
        mark = f"GPUCTL_{nonce}_$((0+1))_"
        self.send(["stdin", f" echo {mark}BEGIN=; {line}; echo {mark}END=\r"])
        pat = re.compile(rf"GPUCTL_{nonce}_1_BEGIN=\r?\n(.*?)GPUCTL_{nonce}_1_END=\r?\n", re.S)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        while not (m := pat.search(self.buf)):
            self._read(deadline)
        return m.group(1).replace("\r\n", "\n")

    def send(self, msg: list[Any]) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            self.ws.send(json.dumps(msg))
        except ConnectionClosed as e:
            raise self._lost(e) from None

    def _read(self, deadline: float) -> None:
        from websockets.exceptions import ConnectionClosed

        left = deadline - time.monotonic()
        if left <= 0:
            raise self._timeout()
        try:
            raw = self.ws.recv(timeout=left)
        except TimeoutError:
            raise self._timeout() from None
        except ConnectionClosed as e:
            raise self._lost(e) from None
        try:
            kind, *rest = json.loads(raw)
        except (ValueError, TypeError):
            return
        if kind == "stdout" and rest and isinstance(rest[0], str):
            self.buf += rest[0]
        elif kind == "disconnect":  # the pty died: its shell exited
            raise LauncherError(
                f"Jupyter terminal {self.name!r} at {self.where} closed (its shell exited)",
                hint="try again: gpuctl opens a new terminal of that name",
            )

    def _timeout(self) -> LauncherError:
        return LauncherError(
            f"no answer from Jupyter terminal {self.name!r} at {self.where} in time",
            hint="something may run in its foreground: open it in JupyterLab, or delete it "
            "(gpuctl creates it again)",
        )

    def _lost(self, e: Exception) -> JupyterUnreachable:
        return JupyterUnreachable(
            f"lost the connection to Jupyter at {self.where} (terminal {self.name!r}: {e})",
            hint="is the Jupyter server still running? try again",
        )
