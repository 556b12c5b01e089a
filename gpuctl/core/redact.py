"""Redact secrets from command lines and log lines before gpuctl shows, logs or stores them.

Other people's processes carry secrets on their command lines (``--ServerApp.token=…``,
``--api-key sk-…``, ``curl -H 'Authorization: Bearer …'``, ``HF_TOKEN=… vllm serve``),
and ``/status`` shows those lines to every token holder. Only the *values* of
secret-looking arguments are replaced, by ``***``; the words around them stay, so a
reader still sees which program runs and which model it serves.

A name is secret-looking when one of its words (split at ``-``, ``_``, ``.``, ``:``, ``/``
and case changes) is token, key, secret, password, passwd, pwd, passphrase, pass, pat,
jwt, credential(s), creds, auth, cookie or signature, or ends in token, secret, password,
passwd or passphrase, or its last word is pass or pw (``--pass``, ``DB_PASS``, not
``--pass-count``) (``PGPASSWORD``, ``accesstoken``): ``--api-key``,
``--ServerApp.token``, ``HF_TOKEN``, ``GITHUB_PAT``, ``MYSQL_PWD``. Names that merely
contain such letters (``--tokenizer``, ``--max-tokens``, ``--keyword``, ``--pattern``)
are not, and neither are the shell's ``PWD`` and ``OLDPWD`` (directories).

The value of a secret option is the next argument even when it starts with ``-``
(``--api-key -Xy…``: generated keys do), unless it is a long option (``--port``): a
flag that takes no value is then followed by the next option, not by a secret.

``-p`` is a password for mysql, mariadb, sshpass, 7z and unrar (``-p X``, ``-pX``) but a
port or a parents flag for docker, ssh and mkdir, so its value is masked unless it reads
as one of those: a port or port mapping (``8000``, ``8000:80/tcp``), a path (``/x``,
``./x``, ``~/x``), or a word of lowercase letters, ``_``, ``.``, ``:`` and ``-``
(``logs``, ``-pthread``, ``-print``, ``-p no:cacheprovider``). A password of lowercase
letters alone, given as ``-p``, is therefore shown: readability of every ``mkdir -p`` and
compiler line against a password that weak.

``-k`` is not one: it is curl's ``--insecure`` and many tools' "keep" or "count"; a
secret given as ``-k X`` is not recognised.

Forms covered (also inside one argument that holds a whole command line)::

    --name=VALUE  --name VALUE  -name VALUE  NAME=VALUE  name: VALUE  -p VALUE  -pVALUE
    {"name": "VALUE"}  'name':'VALUE'  (JSON or a dict inside an argument)
    X-Api-Key:VALUE (also inside another option's value: --header=X-Api-Key:VALUE)
    https://h/x?name=VALUE&a=1 (a URL's query)
    Authorization: Bearer VALUE / Basic VALUE   bearer VALUE
    scheme://user:VALUE@host   scheme://VALUE@host (a user alone is a token: ghp_…@github.com)
"""

from __future__ import annotations

import functools
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
        "pwd",
        "passphrase",
        "pat",
        "jwt",
        "creds",
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
# Words that name a secret only as a name's last word: ``--pass``, ``DB_PASS``, ``-pw``,
# never ``--pass-count``.
_SECRET_LAST = frozenset({"pass", "pw"})
# The shell's working directories, not MySQL's ``MYSQL_PWD``.
_SHELL_DIRS = frozenset({"PWD", "OLDPWD"})
# One word that ends in a secret's word: ``PGPASSWORD``, ``accesstoken``, ``hftoken``.
_SECRET_SUFFIXES = ("token", "secret", "password", "passwd", "passphrase")

_WORD_SPLIT = re.compile(r"[-_.:/]+|(?<=[a-z0-9])(?=[A-Z])")

# "Authorization: <scheme> X" (GitHub's "token X" too): the credentials go, the scheme stays.
# Every repetition that a failed match could retry from each position is bounded, so a
# hostile command line or log (64 KiB of one character) costs linear time, not
# quadratic: these run on other people's command lines.
_AUTH_HEADER = re.compile(
    r"(?i)\b((?:proxy-)?authorization\s*[:=]\s*)(?:([a-z][a-z0-9-]*)(\s+|%20))?([^\s'\"]+)"
)
_SCHEME_WORD = re.compile(r"(?i)bearer|basic")
# "Bearer X", "Basic X" on their own (a header split over arguments, a log line).
_AUTH_SCHEME = re.compile(r"(?i)\b(bearer|basic)(\s+|%20)([^\s'\"]+)")
# user:password@ in URLs.
_URL_PASSWORD = re.compile(
    r"(?i)(?<![a-z0-9+.-])([a-z][a-z0-9+.-]{0,31}://[^\s/:@'\"]{0,256}:)([^\s@/'\"]{1,1024})(@)"
)
# A user alone before ``@`` (no ``:``) is a token: ``https://ghp_X@github.com``. A plain
# user name (``ssh://git@host``) goes too: a rule that tells the two apart would guess.
_URL_USER = re.compile(r"(?i)(?<![a-z0-9+.-])([a-z][a-z0-9+.-]{0,31}://)([^\s/:@'\"]{1,1024})(@)")
# name=value and name: value inside one argument (also several per argument, e.g. a query),
# the name and the value each maybe quoted (JSON: ``{"token":"X"}``). The name is the last
# word before the separator (``--ServerApp.token=`` gives ``token``, ``--api-key=`` gives
# ``key``), and starts only where a word starts. Only the name and separator are matched:
# the value of a name that is not a secret's is scanned again, so what it holds is seen
# (``https://h/x?api_key=X``, where ``https:`` is a name; ``--header=X-Api-Key:X``). The
# value is matched only after a secret's name, once, so the scan stays linear.
_ASSIGN = re.compile(
    r"(?<![A-Za-z0-9_])(?P<name>[A-Za-z_][A-Za-z0-9_]{0,63})[\"']?(?:=|:\s{0,8})[\"']?"
)
_VALUE = re.compile(r"[^\s&;,'\"]+")


def show_url(url: str) -> str:
    """A configured URL as gpuctl prints it: ``http://u:PW@h/m`` → ``http://u:***@h/m``
    (a user alone, ``http://TOKEN@h``, may be the secret: ``http://***@h``)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    if "@" in parts.netloc:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        user, colon, _pw = userinfo.partition(":")
        shown = f"{user}:{MASK}" if colon else MASK
        parts = parts._replace(netloc=f"{shown}@{hostport}")
    # ``?token=X`` and ``#access_token=X`` (OAuth's implicit grant): the name stays.
    parts = parts._replace(
        query=_redact_assignments(parts.query), fragment=_redact_assignments(parts.fragment)
    )
    return urlunsplit(parts)


def mask_url_passwords(text: str) -> str:
    """Every ``scheme://user:PW@`` in ``text`` as ``scheme://user:***@`` (an error
    message or a JSON document gpuctl prints: the last guard for a configured URL)."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}{m.group(3)}", text)


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """True for option or variable names whose value is a secret (see the module docstring)."""
    bare = name.lstrip("-").strip()
    if not bare or bare in _SHELL_DIRS:
        return False
    words = [w.lower() for w in _WORD_SPLIT.split(bare) if w]
    if not words:
        return False
    if "_".join(words) in _NOT_SECRET:
        return False
    return (
        any(w in _SECRET_WORDS or w.endswith(_SECRET_SUFFIXES) for w in words)
        or words[-1] in _SECRET_LAST
        or "_".join(words[-2:]) in {"api_key"}
    )


def _redact_assignments(text: str) -> str:
    out: list[str] = []
    pos = 0
    for m in _ASSIGN.finditer(text):
        if m.start() < pos or not is_secret_name(m.group("name")):
            continue  # inside a value already masked; or not a secret's: look inside
        v = _VALUE.match(text, m.end())
        if v is None or v.group() == MASK or v.group().lower() in _SCHEMES:
            continue
        out.append(text[pos : v.start()])
        out.append(MASK)
        pos = v.end()
    if not out:
        return text
    out.append(text[pos:])
    return "".join(out)


def redact_text(text: str) -> str:
    """One argument or one line with the secret values replaced by ``***``."""
    # Every pattern below needs a ":" or "=" or one of the schemes' words: most arguments
    # (``--port``, ``8000``, a model name) have none, and this runs on every process line.
    if "=" not in text and ":" not in text and not _SCHEME_WORD.search(text):
        return text
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
    out = _URL_USER.sub(
        lambda m: m.group(0) if m.group(2) == MASK else f"{m.group(1)}{MASK}{m.group(3)}", out
    )
    return _redact_assignments(out)


_SCHEMES = frozenset({"bearer", "basic", "token", "digest"})
_SPACE = re.compile(r"\s")
_ENDS_IN_SCHEME = re.compile(
    r"(?<![A-Za-z0-9_])(?P<name>[A-Za-z_][A-Za-z0-9_]{0,63})\s{0,8}[:=]\s{0,8}"
    r"(?:bearer|basic|token|digest)$",
    re.IGNORECASE,
)
# A long option after a secret option is the next option, not its value (a flag such as
# ``--use-auth-token`` takes none); anything else, ``-Xy…`` too, is the value.
_LONG_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]{0,63}")
# What ``-p``'s value is when it is no password: a port or port mapping, a path, a word of
# lowercase letters (a folder for ``mkdir -p``; ``-pthread``, ``-print``), an option.
_NOT_A_PASSWORD = re.compile(
    r"[0-9][0-9.:-]{0,63}(?:/(?:tcp|udp|sctp))?|[/~.].*|[a-z_.:-]{1,64}|-.*", re.DOTALL
)
# A trailing name before ``:`` or ``=`` at the end of an argument (``{"api_key":``).
_QUOTED = re.compile(r"(['\"]*)(.*?)(['\"}\]),]*)", re.DOTALL)
_TRAILING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}\Z")


def _is_password(value: str) -> bool:
    """Whether ``-p``'s value is taken for a password (the module docstring says why)."""
    return bool(value) and value != MASK and not _NOT_A_PASSWORD.fullmatch(value)


def _ends_in_secret_name(bare: str) -> bool:
    """``TOKEN=``, ``key:``, ``"api_key":`` (JSON split at its spaces): a secret's value follows."""
    if not bare.endswith((":", "=")):
        return False
    name = _TRAILING_NAME.search(bare[-80:].rstrip(":=").rstrip("\"'"))
    return name is not None and is_secret_name(name.group())


def _mask_value(arg: str) -> str:
    """``arg`` with its value masked and the quotes and brackets around it kept
    (``"sk-1"}`` → ``"***"}``)."""
    m = _QUOTED.fullmatch(arg)
    assert m is not None  # every part may be empty
    head, core, rest = m.groups()
    if not core or core == MASK:
        return arg
    return f"{head}{MASK}{rest}"


def redact_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """A command's arguments with secret values replaced: ``--api-key X`` hides ``X``."""
    out: list[str] = []
    hide_next = False
    port_or_password = False
    for arg in argv:
        bare = arg.strip("'\"")
        low = bare.lower()
        if port_or_password:
            port_or_password = False
            if _is_password(bare):
                out.append(arg.replace(bare, MASK))
                continue
        if hide_next:
            hide_next = False
            if low in _SCHEMES:
                # "Authorization:" "Bearer" "X": the scheme stays, what follows goes.
                out.append(arg)
                hide_next = True
                continue
            if bare and bare != "-" and not _LONG_OPTION.fullmatch(bare):
                out.append(_mask_value(arg))
                continue
        if bare == "-p":
            port_or_password = True  # mysql -p X; docker -p 8000:80
            out.append(arg)
            continue
        if bare.startswith("-p") and not bare.startswith("--") and _is_password(bare[2:]):
            out.append(arg.replace(bare, "-p" + MASK))  # mysql -pX
            continue
        if low in ("bearer", "basic"):
            hide_next = True
            out.append(arg)
            continue
        if bare.startswith("-") and "=" not in bare and is_secret_name(bare):
            hide_next = True  # --api-key X
            out.append(arg)
            continue
        if _ends_in_secret_name(bare):
            hide_next = True  # "Authorization:" X, TOKEN= X, key: X, {"api_key": X
            out.append(arg)
            continue
        # One argument that is itself a command line (``sh -c "… --api-key X …"``, a
        # process that rewrote its title, ``exec -a``) is redacted as one: its words are
        # then arguments (no recursion past that: they hold no whitespace). It is first
        # redacted whole, for what spans its spaces (``{"api_key": "X"}``).
        red = redact_command(redact_text(arg)) if _SPACE.search(arg) else redact_text(arg)
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
