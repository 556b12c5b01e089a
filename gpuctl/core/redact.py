"""Redact secrets from command lines and log lines before gpuctl shows, logs or stores them.

Other people's processes carry secrets on their command lines (``--ServerApp.token=…``,
``--api-key sk-…``, ``curl -H 'Authorization: Bearer …'``, ``HF_TOKEN=… vllm serve``),
and ``/status`` shows those lines to every token holder. Only the *values* of
secret-looking arguments are replaced, by ``***``; the words around them stay, so a
reader still sees which program runs and which model it serves.

A name is secret-looking when one of its words (split at ``-``, ``_``, ``.``, ``:``, ``/``
and case changes) is token, key, secret, password, passwd, pwd, passphrase, pass, pat,
jwt, cred, credential(s), creds, auth, oauth, dbpass, cookie or signature, or ends in
token, secret, password, passwd or passphrase, or its last word is pass, pw or sig
(``--pass``, ``DB_PASS``, ``?sig=``, not ``--pass-count``) (``PGPASSWORD``, ``accesstoken``): ``--api-key``,
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

An option's name ends at its first ``:``, ``=`` or ``/``; what follows is its value, so a
secret word inside a value names nothing and a value glued on is masked:
``-HX-Auth-Token:X`` (``-H`` and a header), ``-HAuthorization:X``, ``--api-key:X``,
``-Dtoken:X``. A value glued on by ``-`` (``--token-Xy3``) is one when it is no flag word
of lowercase letters (``--api-key-file``, ``--use-auth-token`` stay flags). ``-u`` and
``--user`` give ``user:password`` (curl): the password goes, ``uid:gid`` stays. After
``redis-cli``, ``-a X`` is a password.

``-k`` is not one: it is curl's ``--insecure`` and many tools' "keep" or "count"; a
secret given as ``-k X`` is not recognised.

Forms covered (also inside one argument that holds a whole command line)::

    --name=VALUE  --name VALUE  -name VALUE  NAME=VALUE  name: VALUE  -p VALUE  -pVALUE
    {"name": "VALUE"}  'name':'VALUE'  (JSON or a dict inside an argument)
    X-Api-Key:VALUE (also inside another option's value: --header=X-Api-Key:VALUE)
    https://h/x?name=VALUE&a=1 (a URL's query; ?name%3DVALUE decoded first)
    -HName:VALUE  --name:VALUE  --name-VALUE  -u user:VALUE  --user=user:VALUE
    os.environ['NAME']='VALUE'  name = 'VALUE' (code inside an argument)
    Authorization: Bearer VALUE / Basic VALUE   bearer VALUE
    scheme://user:VALUE@host   scheme://VALUE@host (a user alone is a token: ghp_…@github.com)
"""

from __future__ import annotations

import functools
import re
from urllib.parse import unquote as _unquote
from urllib.parse import urlsplit, urlunsplit

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
        "cred",
        "oauth",
        "dbpass",
    }
)
# Words that look like a secret's but name a count or a kind of thing.
_NOT_SECRET = frozenset({"max_tokens", "tokens", "keys"})
# Words that name a secret only as a name's last word: ``--pass``, ``DB_PASS``, ``-pw``,
# never ``--pass-count``.
_SECRET_LAST = frozenset({"pass", "pw", "sig"})
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
# name=value and name: value inside one argument, and a secret-looking name assigned in code
# (``os.environ['HF_TOKEN']='X'``, ``key = "X"``: a subscript's ``']`` and spaces may sit
# between the name and ``=``; ``==`` is a comparison, no assignment), (also several per argument, e.g. a query),
# the name and the value each maybe quoted (JSON: ``{"token":"X"}``). The name is the last
# word before the separator (``--ServerApp.token=`` gives ``token``, ``--api-key=`` gives
# ``key``), and starts only where a word starts. Only the name and separator are matched:
# the value of a name that is not a secret's is scanned again, so what it holds is seen
# (``https://h/x?api_key=X``, where ``https:`` is a name; ``--header=X-Api-Key:X``). The
# value is matched only after a secret's name, once, so the scan stays linear.
_ASSIGN = re.compile(
    r"(?<![A-Za-z0-9_])(?P<name>[A-Za-z_][A-Za-z0-9_]{0,63})[\"']?\]?\s{0,8}"
    r"(?:=(?!=)|:)\s{0,8}[\"']?"
)
_VALUE = re.compile(r"[^\s&;,'\"]+")


def show_url(url: str) -> str:
    """A configured URL as gpuctl prints it: ``http://u:PW@h/m`` → ``http://u:***@h/m``
    (a user alone, ``http://TOKEN@h``, may be the secret: ``http://***@h``)."""
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
    """One argument or one line with the secret values replaced by ``***``.

    A percent-encoded secret (``?token%3DX``, ``access%5Ftoken=X``,
    ``authorization%3A%20Bearer%20X``) is found in the decoded text, and the argument is
    then shown decoded with its mask: the encoding only hid the name from the patterns.
    """
    # Every pattern below needs a ":" or "=" or one of the schemes' words: most arguments
    # (``--port``, ``8000``, a model name) have none, and this runs on every process line.
    if "%" in text:
        decoded = _unquote(text)
        if decoded != text:
            red = _redact_plain(decoded)
            if red != decoded:
                return red
    return _redact_plain(text)


def _redact_plain(text: str) -> str:
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
# What ``-p``'s value is when it is no password: a port or port mapping (numbers of at most
# five digits: ``-p 00000000`` is a PIN, not a port), a path, a word of
# lowercase letters (a folder for ``mkdir -p``; ``-pthread``, ``-print``), an option.
_NOT_A_PASSWORD = re.compile(
    r"[0-9]{1,5}(?:[.:-][0-9]{1,5}){0,8}(?:/(?:tcp|udp|sctp))?|[/~.].*|[a-z_.:-]{1,64}|-.*",
    re.DOTALL,
)
# A trailing name before ``:`` or ``=`` at the end of an argument (``{"api_key":``).
_QUOTED = re.compile(r"(['\"]*)(.*?)(['\"}\]),]*)", re.DOTALL)
_TRAILING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}\Z")


# Where an option's name ends: ``-HX-Auth-Token:X``, ``--api-key:X``, ``-Dtoken=X``,
# ``-v/a:/b`` (a secret word after the first of these is part of a value, not the name).
_NAME_END = re.compile(r"[:=/]")
# The words of a flag after a secret's word (``--api-key-file``, ``--use-auth-token``):
# lowercase letters only, so what follows ``--token-`` with a capital or a digit
# (``--token-Xy3…``) is a value glued on, not more of the name.
_FLAG_TAIL = re.compile(r"[a-z]{1,24}(?:[-_][a-z]{1,24}){0,5}")
# ``-u``/``--user`` give ``user:password`` (curl, wget, httpie); ``uid:gid`` (docker) is no
# password.
_USER_OPTIONS = frozenset({"-u", "--user"})
# An argument without these holds nothing any pattern here looks for (unless it is an
# option, or a scheme's word alone).
_INERT = re.compile(r"[^:=%\s]*")
_UID_GID = re.compile(r"[0-9]{1,10}(?::[0-9]{1,10})?")


def _secret_option(bare: str) -> int | None:
    """Where the value glued to a secret option starts in ``bare`` (``len(bare)`` when
    none is glued on: the next argument is its value), or None for any other argument.

    The name ends at the first ``:``, ``=`` or ``/``: ``-HX-Auth-Token:X`` is the option
    ``-H`` with a header, ``--api-key:X`` a key with its value, and a secret word inside
    the value (``--user=admin:token9``) names nothing. A short option's letter may be
    glued to a secret's name (``-HAuthorization:X``, ``-Dtoken:X``).
    """
    cut = _NAME_END.search(bare)
    name = bare[: cut.start()] if cut else bare
    secret = is_secret_name(name)
    if "-" in name[2:]:
        # Each prefix: ``--pass`` is a secret's name where ``--pass-0000`` is none.
        body = name.lstrip("-")
        lead = len(name) - len(body)
        i = body.find("-")
        while i != -1:
            if is_secret_name(body[:i]) and not _FLAG_TAIL.fullmatch(body[i + 1 :]):
                return lead + i + 1  # --token-Xy3…, -token-Xy3…
            # A short option's value glued on by ``-`` only after its first word: in
            # ``-HX-Auth-Token:X`` the words after ``-H`` are a header's name.
            i = body.find("-", i + 1) if lead > 1 else -1
    if cut is None:
        return len(bare) if secret else None
    short = not name.startswith("--") and len(name) > 2 and is_secret_name(name[2:])
    if cut.group() == "=" and not short:
        return None  # ``--name=X``: ``redact_text`` judges it by the name's last word
    return cut.end() if short or secret else None


def _user_password(value: str) -> str | None:
    """``user:password`` (``-u``/``--user``'s value) with the password masked; None when
    there is none to mask."""
    user, colon, pw = value.partition(":")
    if not colon or not pw or pw == MASK or _UID_GID.fullmatch(value):
        return None
    return f"{user}:{MASK}"


def _is_password(value: str) -> bool:
    """Whether ``-p``'s value is taken for a password (the module docstring says why)."""
    return bool(value) and value != MASK and not _NOT_A_PASSWORD.fullmatch(value)


def _ends_in_secret_name(bare: str) -> bool:
    """``TOKEN=``, ``key:``, ``"api_key":`` (JSON split at its spaces): a secret's value follows."""
    if not bare.endswith((":", "=")):
        return False
    name = _TRAILING_NAME.search(bare[-80:].rstrip(":= ").rstrip("\"'[]"))
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
    user_next = False
    redis = False
    prev = ""
    for arg in argv:
        bare = arg.strip("'\"")
        before, prev = prev, bare
        if user_next:
            user_next = False
            shown = _user_password(bare)
            if shown is not None:
                out.append(arg.replace(bare, shown))  # curl -u admin:X
                continue
        if port_or_password:
            port_or_password = False
            if _is_password(bare):
                out.append(arg.replace(bare, MASK))
                continue
        if hide_next:
            hide_next = False
            if bare.lower() in _SCHEMES:
                # "Authorization:" "Bearer" "X": the scheme stays, what follows goes.
                out.append(arg)
                hide_next = True
                continue
            if bare and bare != "-" and not _LONG_OPTION.fullmatch(bare):
                out.append(_mask_value(arg))
                continue
        dash = bare[:1] == "-"
        if not dash and _INERT.fullmatch(arg):
            # Most arguments (a program, a model, a number): no pattern can match in them.
            low = bare.lower()
            if low in {"bearer", "basic"}:
                hide_next = True
            elif low.endswith("redis-cli"):
                redis = True  # its -a is the password
            out.append(arg)
            continue
        if dash:
            if bare == "-p":
                port_or_password = True  # mysql -p X; docker -p 8000:80
                out.append(arg)
                continue
            if bare[1:2] == "p" and _is_password(bare[2:]):
                out.append(arg.replace(bare, "-p" + MASK))  # mysql -pX
                continue
            if bare in _USER_OPTIONS or (redis and bare == "-a"):
                user_next = bare != "-a"
                hide_next = bare == "-a"
                out.append(arg)
                continue
            if bare.startswith("--user="):
                shown = _user_password(bare[7:])
                if shown is not None:
                    out.append(arg.replace(bare, bare[:7] + shown))  # curl --user=admin:X
                    continue
            at = None if _SPACE.search(bare) else _secret_option(bare)
            if at is not None:
                value = bare[at:]
                if not value or value.lower() in _SCHEMES:
                    hide_next = True  # --api-key X; -HAuthorization: Bearer X
                    out.append(arg)
                else:
                    out.append(arg.replace(bare, bare[:at] + MASK))  # --api-key:X, --token-X
                continue
        if _ends_in_secret_name(bare) or (
            bare in ("=", ":") and _ends_in_secret_name(before + bare)
        ):
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
