"""Redact secrets from command lines and log lines before gpuctl shows, logs or stores them.

Other people's processes carry secrets on their command lines (``--ServerApp.token=…``,
``--api-key sk-…``, ``curl -H 'Authorization: Bearer …'``, ``HF_TOKEN=… vllm serve``),
and ``/status`` shows those lines to every token holder. Only the *values* of
secret-looking arguments are replaced, by ``***``; the words around them stay, so a
reader still sees which program runs and which model it serves.

A name is secret-looking when one of its words (split at ``-``, ``_``, ``.`` and case
changes) is token, key, secret, password, passwd, pwd, credential(s) or auth: ``--api-key``,
``--ServerApp.token``, ``HF_TOKEN``, ``--hf-token``, ``AWS_SECRET_ACCESS_KEY``. Names
that merely contain such letters (``--tokenizer``, ``--max-tokens``, ``--keyword``)
are not.

``-k`` is not one: it is curl's ``--insecure`` and many tools' "keep" or "count"; a
secret given as ``-k X`` is not recognised.

Forms covered (also inside one argument that holds a whole command line)::

    --name=VALUE  --name VALUE  -name VALUE  NAME=VALUE  name: VALUE
    Authorization: Bearer VALUE / Basic VALUE   bearer VALUE   scheme://user:VALUE@host
"""

from __future__ import annotations

import re

MASK = "***"

_SECRET_WORDS = frozenset(
    {
        "token",
        "tokens_secret",
        "key",
        "apikey",
        "secret",
        "secrets",
        "password",
        "passwd",
        "credential",
        "credentials",
        "auth",
        "authorization",
        "bearer",
        "cookie",
        "signature",
    }
)
# Words that look like a secret's but name a count or a kind of thing.
_NOT_SECRET = frozenset({"max_tokens", "tokens", "keys"})

_WORD_SPLIT = re.compile(r"[-_.:/]+|(?<=[a-z0-9])(?=[A-Z])")

# "Authorization: <scheme> X" (GitHub's "token X" too): the credentials go, the scheme stays.
# Every repetition that a failed match could retry from each position is bounded, so a
# hostile command line or log (64 KiB of one character) costs linear time, not
# quadratic: these run on other people's command lines.
_AUTH_HEADER = re.compile(
    r"(?i)\b((?:proxy-)?authorization\s*[:=]\s*)(?:([a-z][a-z0-9-]*)(\s+|%20))?([^\s'\"]+)"
)
# "Bearer X", "Basic X" on their own (a header split over arguments, a log line).
_AUTH_SCHEME = re.compile(r"(?i)\b(bearer|basic)(\s+|%20)([^\s'\"]+)")
# user:password@ in URLs.
_URL_PASSWORD = re.compile(
    r"(?i)(?<![a-z0-9+.-])([a-z][a-z0-9+.-]{0,31}://[^\s/:@'\"]{0,256}:)([^\s@/'\"]{1,1024})(@)"
)
# name=value and name: value inside one argument (also several per argument, e.g. a query).
# The name is the last word before the separator (``--ServerApp.token=`` gives ``token``,
# ``--api-key=`` gives ``key``), and starts only where a word starts.
_ASSIGN = re.compile(
    r"(?<![A-Za-z0-9_])(?P<name>[A-Za-z_][A-Za-z0-9_]{0,63})(?P<sep>=|:\s{0,8})"
    r"(?P<value>[^\s&;,'\"]+)"
)


def show_url(url: str) -> str:
    """A configured URL as gpuctl prints it: ``http://u:PW@h/m`` → ``http://u:***@h/m``
    (a user alone, ``http://TOKEN@h``, may be the secret: ``http://***@h``)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, colon, _pw = userinfo.partition(":")
    shown = f"{user}:{MASK}" if colon else MASK
    return urlunsplit(parts._replace(netloc=f"{shown}@{hostport}"))


def mask_url_passwords(text: str) -> str:
    """Every ``scheme://user:PW@`` in ``text`` as ``scheme://user:***@`` (an error
    message or a JSON document gpuctl prints: the last guard for a configured URL)."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}{m.group(3)}", text)


def is_secret_name(name: str) -> bool:
    """True for option or variable names whose value is a secret (see the module docstring)."""
    bare = name.lstrip("-").strip()
    if not bare:
        return False
    words = [w.lower() for w in _WORD_SPLIT.split(bare) if w]
    if not words:
        return False
    if "_".join(words) in _NOT_SECRET:
        return False
    return any(w in _SECRET_WORDS for w in words) or "_".join(words[-2:]) in {"api_key"}


def _redact_assignments(text: str) -> str:
    def sub(m: re.Match[str]) -> str:
        value = m.group("value")
        if value == MASK or value.lower() in _SCHEMES or not is_secret_name(m.group("name")):
            return m.group(0)
        return f"{m.group('name')}{m.group('sep')}{MASK}"

    return _ASSIGN.sub(sub, text)


def redact_text(text: str) -> str:
    """One argument or one line with the secret values replaced by ``***``."""
    out = _AUTH_HEADER.sub(
        lambda m: (
            f"{m.group(1)}{m.group(2) or ''}{m.group(3) or ''}{MASK}"
            if m.group(2) is not None
            else f"{m.group(1)}{MASK}"
        ),
        text,
    )
    out = _AUTH_SCHEME.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", out)
    out = _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}{m.group(3)}", out)
    return _redact_assignments(out)


_SCHEMES = frozenset({"bearer", "basic", "token", "digest"})
_SPACE = re.compile(r"\s")
_ENDS_IN_SCHEME = re.compile(
    r"(?<![A-Za-z0-9_])(?P<name>[A-Za-z_][A-Za-z0-9_]{0,63})\s{0,8}[:=]\s{0,8}"
    r"(?:bearer|basic|token|digest)$",
    re.IGNORECASE,
)


def redact_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """A command's arguments with secret values replaced: ``--api-key X`` hides ``X``."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        bare = arg.strip("'\"")
        low = bare.lower()
        if hide_next:
            hide_next = False
            if low in _SCHEMES:
                # "Authorization:" "Bearer" "X": the scheme stays, what follows goes.
                out.append(arg)
                hide_next = True
                continue
            if bare and (not bare.startswith("-") or bare == "-"):
                out.append(arg.replace(bare, MASK) if bare != MASK else arg)
                continue
        if low in ("bearer", "basic"):
            hide_next = True
            out.append(arg)
            continue
        if bare.startswith("-") and "=" not in bare and is_secret_name(bare):
            hide_next = True  # --api-key X
            out.append(arg)
            continue
        if bare.endswith((":", "=")) and is_secret_name(bare.rstrip(":=")):
            hide_next = True  # "Authorization:" X, TOKEN= X, key: X
            out.append(arg)
            continue
        # One argument that is itself a command line (``sh -c "… --api-key X …"``, a
        # process that rewrote its title, ``exec -a``) is redacted as one: its words are
        # then arguments (no recursion past that: they hold no whitespace).
        red = redact_command(arg) if _SPACE.search(arg) else redact_text(arg)
        tail = _ENDS_IN_SCHEME.search(bare)
        if tail and is_secret_name(tail.group("name")):
            hide_next = True  # --auth=Basic X
        out.append(red)
    return out


def redact_command(command: str) -> str:
    """A command line (arguments joined by spaces) with secret values replaced.

    Splits at whitespace, which is how gpuctl joins ``/proc/<pid>/cmdline``; an argument
    that itself holds spaces (``-H 'Authorization: Bearer X'``) is covered by
    ``redact_text`` on the pieces.
    """
    if not command:
        return command
    parts = re.split(r"(\s+)", command)
    words = parts[0::2]
    seps = parts[1::2]
    red = redact_argv(words)
    joined: list[str] = []
    for i, word in enumerate(red):
        joined.append(word)
        if i < len(seps):
            joined.append(seps[i])
    return "".join(joined)


def redact_lines(text: str) -> str:
    """Text of many lines (a log tail, an error message), each line redacted as a command."""
    if not text:
        return text
    return "\n".join(redact_command(line) for line in text.split("\n"))
