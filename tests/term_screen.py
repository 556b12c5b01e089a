"""What a terminal shows after some output: a tiny emulator of the few controls Rich's
live display writes (carriage return, newline, cursor up, erase line, SGR colours) and
of the terminal's wrap past the last column. For tests that run gpuctl in a pty."""

from __future__ import annotations

import re

_TOKEN = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\r|\n|[^\x1b\r\n]")


def screen(data: str, width: int, height: int = 1000) -> list[str]:
    """The lines left on a ``width`` x ``height`` terminal (scrollback included)."""
    lines: list[list[str]] = [[]]
    row = col = 0
    for m in _TOKEN.finditer(data):
        token = m.group(0)
        if m.group(2):
            arg, op = m.group(1), m.group(2)
            if op == "A":  # never above the top of the screen
                row = max(max(0, len(lines) - height), row - int(arg or 1))
            elif op == "K":  # 2: the whole line; else from the cursor on
                lines[row] = [] if arg == "2" else lines[row][:col]
            continue
        if token == "\r":
            col = 0
        elif token == "\n":
            row += 1
        else:
            if col >= width:  # a character past the last column wraps
                row, col = row + 1, 0
            while len(lines) <= row:
                lines.append([])
            line = lines[row]
            line.extend(" " * (col - len(line)))
            if col < len(line):
                line[col] = token
            else:
                line.append(token)
            col += 1
        while len(lines) <= row:
            lines.append([])
    return ["".join(x).rstrip() for x in lines]
