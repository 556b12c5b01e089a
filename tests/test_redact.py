"""``gpuctl.core.redact``: secret values go, everything else stays (table and property tests)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpuctl.core.record import Record
from gpuctl.core.record_shapes import RecordUpdate, apply_update
from gpuctl.core.redact import MASK, is_secret_name, redact_argv, redact_command, redact_lines

SECRET_OPTIONS = [
    "--token",
    "--api-key",
    "--apikey",
    "--hf-token",
    "--password",
    "--secret",
    "--ServerApp.token",
    "--NotebookApp.password",
    "--client-secret",
    "--auth",
    "-token",
]
SECRET_VARS = ["TOKEN", "HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"]
SAFE_OPTIONS = [
    "--model",
    "--max-tokens",
    "--tokenizer",
    "--keyword",
    "--port",
    "--max-model-len",
    "--gpu-memory-utilization",
    "--served-model-name",
]

# A secret: what real tokens look like (no whitespace, no quotes or separators).
secret_values = st.text(
    alphabet=st.characters(whitelist_categories=("Lu", "Ll", "Nd"), whitelist_characters="-_+/"),
    min_size=12,
    max_size=40,
).filter(lambda s: not s.startswith("-"))
safe_words = st.sampled_from(
    ["vllm", "serve", "Qwen/Qwen2.5-7B", "python", "-m", "8000", "0.9", "--port", "--model"]
)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "jupyter server --ServerApp.token=abc123 --port 8888",
            "jupyter server --ServerApp.token=*** --port 8888",
        ),
        (
            "vllm serve Qwen --api-key sk-123 --max-tokens 5 --tokenizer x",
            "vllm serve Qwen --api-key *** --max-tokens 5 --tokenizer x",
        ),
        (
            "curl -H Authorization: Bearer xyz http://h",
            "curl -H Authorization: Bearer *** http://h",
        ),
        ('curl -H "Authorization: token ghp_1"', 'curl -H "Authorization: token ***"'),
        ("HF_TOKEN=hf_abc vllm serve", "HF_TOKEN=*** vllm serve"),
        ("curl https://user:pa55@host/x", "curl https://user:***@host/x"),
        ("x --auth=Basic abc", "x --auth=Basic ***"),
        ("app --password hunter2 --keyword foo", "app --password *** --keyword foo"),
        ("vllm --token --other", "vllm --token --other"),
        ("python -m vllm.entrypoints.openai.api_server --model Qwen", None),
        ("", None),
    ],
)
def test_table(line: str, expected: str | None) -> None:
    assert redact_command(line) == (line if expected is None else expected)


def test_names() -> None:
    for name in SECRET_OPTIONS + SECRET_VARS:
        assert is_secret_name(name), name
    for name in SAFE_OPTIONS:
        assert not is_secret_name(name), name


@settings(max_examples=300, deadline=None)
@given(
    before=st.lists(safe_words, max_size=5),
    after=st.lists(safe_words, max_size=5),
    option=st.sampled_from(SECRET_OPTIONS),
    var=st.sampled_from(SECRET_VARS),
    secret=secret_values,
    form=st.sampled_from(["eq", "space", "env", "bearer", "header", "url"]),
)
def test_a_secret_never_survives(
    before: list[str], after: list[str], option: str, var: str, secret: str, form: str
) -> None:
    middle = {
        "eq": [f"{option}={secret}"],
        "space": [option, secret],
        "env": [f"{var}={secret}"],
        "bearer": ["-H", "Authorization:", "Bearer", secret],
        "header": ["-H", f"Authorization: Bearer {secret}"],
        # RFC 3986: a password in a URL holds no unescaped "/".
        "url": [f"https://user:{secret.replace('/', '%2F')}@example.invalid/x"],
    }[form]
    argv = [*before, *middle, *after]
    # A value that is also part of the words around it ("Authorizatio" inside the header
    # name) would be found in what must stay: the property is about the value alone.
    scaffold = " ".join([*before, *after, option, var, "-H Authorization: Bearer log: next line"])
    assume(secret not in scaffold + " https://user:@example.invalid/x")
    assert secret not in " ".join(redact_argv(argv))
    assert secret not in redact_command(" ".join(argv))
    assert secret not in redact_lines("log: " + " ".join(argv) + "\nnext line")
    # The words around it stay.
    red = redact_command(" ".join(argv)).split()
    assert red[: len(before)] == before
    assert red[len(red) - len(after) :] == after if after else True


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(safe_words, st.sampled_from(SAFE_OPTIONS)), max_size=12))
def test_lines_without_secrets_are_unchanged(argv: list[str]) -> None:
    line = " ".join(argv)
    assert redact_command(line) == line
    assert redact_argv(argv) == argv


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300))
def test_any_text_is_redacted_once_and_for_all(text: str) -> None:
    once = redact_command(text)
    assert redact_command(once) == once  # idempotent
    assert redact_lines(redact_lines(text)) == redact_lines(text)
    # Only values are replaced: never a longer secret-free line out of nowhere.
    assert len(once.split()) == len(text.split()) or MASK in once


def test_stored_failures_and_attempts_are_redacted() -> None:
    update = {
        "failure": {
            "error": "exited: vllm serve m --api-key sk-live-abcdef123456",
            "log_tail": "INFO args: --hf-token hf_secretsecret\nHF_TOKEN=hf_x2 ready",
        },
        "attempt": {"outcome": "failed", "error": "Authorization: Bearer tok_zzzzzzzz"},
    }
    rec = apply_update(Record(service="x"), RecordUpdate.from_wire(update), 1000.0)
    text = str(rec.to_dict())
    for secret in ("sk-live-abcdef123456", "hf_secretsecret", "hf_x2", "tok_zzzzzzzz"):
        assert secret not in text
    assert rec.failure is not None and "--api-key ***" in rec.failure.error


@pytest.mark.timeout(120)  # a hang guard: quadratic matching would take tens of minutes here
@pytest.mark.parametrize(
    "hostile",
    [
        "x" * 65536,
        "a-" * 32768,
        "a." * 32768,
        "a:" * 32768,
        "a=" * 32768,
        "http://" + "a" * 65536,
        "a://b:" * 10000,
        "Authorization: " * 4000,
        "x:" + " " * 60000,
    ],
    ids=lambda s: f"{s[:8]!r}x{len(s)}",
)
def test_hostile_lines_cost_linear_time(hostile: str) -> None:
    """Other people's command lines are input: every pattern is bounded, so 64 KiB of
    the worst shapes is redacted at once (the first took minutes before they were)."""
    for _ in range(3):
        assert redact_lines(hostile).count(MASK) <= hostile.count(":") + hostile.count("=") + 1
        redact_command(hostile)


@pytest.mark.parametrize(
    "argv",
    [
        ["sh", "-c", "vllm serve m --api-key SEC1 --port 8000"],
        ["python x --api-key SEC1 --password SEC2 --port 8000"],  # a rewritten title
        ["bash", "-c", "exec vllm serve m --api-key\tSEC1 --port 8000 --password SEC2"],
    ],
)
def test_a_whole_command_line_in_one_argument_is_redacted(argv: list[str]) -> None:
    out = " ".join(redact_argv(argv))
    assert "SEC1" not in out and "SEC2" not in out, out
    assert "--api-key ***" in out.replace("\t", " ") and "--port 8000" in out, out


@pytest.mark.timeout(120)  # a hang guard, as above: one argument of 64 KiB of words
@pytest.mark.parametrize("hostile", ["--api-key " * 6500, "a " * 32768, "-x " * 20000])
def test_one_hostile_argument_costs_linear_time(hostile: str) -> None:
    for _ in range(3):
        redact_argv(["sh", "-c", hostile])


def _shown(pid: int, marker: str) -> str:
    """The process's command line as gpuctl shows it, once it has exec'd (``marker``)."""
    import time

    from gpuctl.adapters.procinfo import command_of

    deadline = time.monotonic() + 30
    shown = command_of(pid) or ""
    while marker not in shown and time.monotonic() < deadline:
        time.sleep(0.05)
        shown = command_of(pid) or ""
    assert marker in shown, shown
    return shown


@pytest.mark.parametrize(
    "argv",
    [
        ["bash", "-c", 'exec -a "python x --api-key S1 --password S6 --port 8000" sleep 60'],
        ["sh", "-c", "sleep 60; : --api-key S1 --password S6 --port 8000"],
    ],
    ids=["exec-a", "sh-c"],
)
def test_a_real_process_with_its_command_line_in_one_argument(argv: list[str]) -> None:
    """/proc shows ``exec -a "…"`` and ``sh -c "…"`` with a whole command line in one
    argument; gpuctl showed its secrets."""
    import subprocess

    p = subprocess.Popen(argv)
    try:
        shown = _shown(p.pid, "--port 8000")
        assert "S1" not in shown and "S6" not in shown, shown
        assert "--api-key ***" in shown and "--password ***" in shown, shown
    finally:
        p.kill()
        p.wait()


# ------------------------------------------------------------- the forms issue 17 found leaking


def leaked_forms(secret: str) -> list[list[str]]:
    """The 12 forms of 40 that leaked through ``/status?match=`` and ``status --wide``
    (issue 17), each as the arguments of one process, ``secret`` in it once."""
    return [
        ["git", "clone", f"https://ghp_{secret}@github.com/org/repo.git"],
        ["app", "--pwd", secret],
        ["mysql", "-u", "root", "-p", secret],
        ["mysql", "-u", "root", f"-p{secret}"],
        ["ssh-keygen", "--passphrase", secret],
        ["gh", "--pat", secret],
        ["app", "--jwt", secret],
        ["vllm", "serve", "m", "--api-key", f"-{secret}"],
        ["curl", "-d", f'{{"api_key": "sk-{secret}"}}', "http://h/v1"],
        ["sh", "-c", f'curl -d {{"token":"{secret}"}} http://h/v1; sleep 1'],
        ["curl", f"--header=X-Api-Key:{secret}", "http://h/v1"],
        ["curl", f"https://h/x?api_key={secret}&a=1"],
    ]


@pytest.mark.parametrize("n", range(12))
def test_the_forms_that_leaked_are_masked(n: int) -> None:
    """Each failed before issue 17's change: the secret was shown whole."""
    argv = leaked_forms("Se7cReT9x")[n]
    for shown in (" ".join(redact_argv(argv)), redact_command(" ".join(argv))):
        assert "Se7cReT9x" not in shown, shown
        assert MASK in shown and shown.split()[0] == argv[0], shown


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('curl -d {"api_key": "sk-1x"} http://h', 'curl -d {"api_key": "***"} http://h'),
        ("curl https://h/x?api_key=k1&a=1", "curl https://h/x?api_key=***&a=1"),
        ("curl --header=X-Api-Key:k1 http://h", "curl --header=X-Api-Key:*** http://h"),
        ("git clone https://ghp_1x@github.com/o/r", "git clone https://***@github.com/o/r"),
        ("x --api-key -Kx1 --port 8000", "x --api-key *** --port 8000"),
        # -p: a port, a folder, a compiler flag stay; a password goes.
        ("docker run -p 8000:8000/tcp img", None),
        ("ssh -p 22 host", None),
        ("sh -c mkdir -p logs && mkdir -p /tmp/x ./y", None),
        ("gcc -pthread -pedantic -pipe a.c", None),
        ("find . -print -perm 644", None),
        ("python -m pytest -p no:cacheprovider", None),
        ("mysql -u root -pHunter2 db", "mysql -u root -p*** db"),
        ("sshpass -p Hunter2 ssh h", "sshpass -p *** ssh h"),
        ("cd $PWD && OLDPWD=/x MYSQL_PWD=s1 app", "cd $PWD && OLDPWD=/x MYSQL_PWD=*** app"),
        ("PGPASSWORD=s1 psql -p 5432", "PGPASSWORD=*** psql -p 5432"),
        ("vllm --use-auth-token --model m", None),
        ("app --pattern x --pass-count 2 --passes 3 --compat 1", None),
        ("app --tokenizer t --max-tokens 5 --num-keys 3", None),
    ],
)
def test_forms_and_words_around_them(line: str, expected: str | None) -> None:
    assert redact_command(line) == (line if expected is None else expected)
    assert " ".join(redact_argv(line.split())) == (line if expected is None else expected)


def leaked_after_17(secret: str) -> list[list[str]]:
    """The forms an attack review found still leaking after issue 17's first change, each
    as one process's arguments with ``secret`` in it once."""
    return [
        ["curl", f"-HAuthorization:{secret}", "http://h"],
        ["curl", f"-HPRIVATE-TOKEN:{secret}", "http://h"],
        ["curl", f"-HX-Auth-Token:{secret}", "http://h"],
        ["app", f"--api-key:{secret}"],
        ["app", f"-token:{secret}"],
        ["java", f"-Dtoken:{secret}", "-jar", "a.jar"],
        ["java", f"-Dtoken={secret}", "-jar", "a.jar"],
        ["app", f"--token-{secret}"],
        ["curl", "-u", f"user:{secret}", "http://h"],
        ["curl", "--user", f"admin:{secret}", "http://h"],
        ["curl", f"--user=admin:{secret}", "http://h"],
        ["python", "-c", f"import os; os.environ['HF_TOKEN']='{secret}'"],
        ["python", "-c", f'os.environ["HF_TOKEN"] = "{secret}"'],
        ["python", "-c", f"key = '{secret}'; run(key)"],
        ["curl", f"https://h/x?token%3D{secret}"],
        ["curl", f"https://h/x?access%5Ftoken={secret}&a=1"],
        ["curl", "-H", f"authorization%3A%20Bearer%20{secret}", "http://h"],
        ["redis-cli", "-a", secret, "ping"],
        ["app", "--cred", secret],
        ["app", "--oauth", secret],
        ["app", "--dbpass", secret],
        ["curl", f"https://h.blob.core.windows.net/c?sv=2022&sig={secret}"],
    ]


@pytest.mark.parametrize("n", range(22))
def test_the_forms_still_leaking_after_17_are_masked(n: int) -> None:
    """Each failed before this change: the secret was shown whole (an option name read
    past its ``:``; ``-u user:X``; assignments in code; percent-encoded names)."""
    argv = leaked_after_17("Se7cReT9x")[n]
    for shown in (" ".join(redact_argv(argv)), redact_command(" ".join(argv))):
        assert "Se7cReT9x" not in shown, shown
        assert MASK in shown and shown.split()[0] == argv[0], shown


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("curl -HX-Auth-Token:k1 http://h", "curl -HX-Auth-Token:*** http://h"),
        ("curl -u admin:pw1 http://h", "curl -u admin:*** http://h"),
        ("app --token-Xy3z9 --port 8000", "app --token-*** --port 8000"),
        # What reads as no secret stays as it was.
        ("vllm serve m --tokenizer t --max-tokens 5 -p 8000", None),
        ("docker run -v /a:/b -v/c:/d -p 8000:80 -u 1000:1000 img", None),
        ("app --host=0.0.0.0 --url http://h:8000/v1 -Dfoo=bar -Dx:y", None),
        ("python -u x.py --key-file=/k --use-auth-token --model m", None),
        ("python -c if token == other: pass", None),
        ("ls -a redis-cli-notes", None),
    ],
)
def test_glued_values_and_what_stays(line: str, expected: str | None) -> None:
    assert redact_command(line) == (line if expected is None else expected)
    assert " ".join(redact_argv(line.split())) == (line if expected is None else expected)


# A secret of many shapes: letters, digits and the punctuation keys and passwords carry.
many_shapes = st.text(
    alphabet=st.characters(
        whitelist_categories=("Lu", "Ll", "Nd"), whitelist_characters="-_+/=.~!%^*@#$"
    ),
    min_size=8,
    max_size=40,
).filter(lambda s: s[0].isalnum() and any(c.isupper() or c.isdigit() for c in s))
# No "/" (a URL's part ends there), nor what ends a query value or a URL's user.
url_safe = many_shapes.map(lambda s: s.translate(str.maketrans("/@#", "xyz")))
SECRET_NAMES = [*SECRET_OPTIONS, "--pwd", "--passphrase", "--pat", "--jwt", "--pass"]
FORMS = {
    "opt": lambda o, s: [o, s],
    "opt-dash": lambda o, s: [o, f"-{s}"],
    "p": lambda o, s: ["-p", s],
    "p-attached": lambda o, s: [f"-p{s}"],
    "json": lambda o, s: ["-d", f'{{"{o.lstrip("-")}": "{s}"}}'],
    "json-tight": lambda o, s: ["sh", "-c", f'curl -d {{"{o.lstrip("-")}":"{s}"}} http://h'],
    "header": lambda o, s: [f"--header=X-Api-Key:{s}"],
    "query": lambda o, s: [f"https://h/x?{o.lstrip('-')}={s}&a=1"],
    "url-user": lambda o, s: [f"https://{s}@github.com/o/r.git"],
    "sh-c": lambda o, s: ["sh", "-c", f"exec app {o} {s} --port 8000"],
    "opt-colon": lambda o, s: [f"{o}:{s}"],
    "opt-glued": lambda o, s: [f"{o}-{s}"],
    "short-glued": lambda o, s: [f"-H{o.lstrip('-')}:{s}"],
    "define": lambda o, s: [f"-D{o.lstrip('-')}:{s}"],
    "user": lambda o, s: ["-u", f"admin:{s}"],
    "user-eq": lambda o, s: [f"--user=admin:{s}"],
    "subscript": lambda o, s: ["-c", f"os.environ['{o.lstrip('-')}']='{s}'"],
    "assign": lambda o, s: ["-c", f"{o.lstrip('-').replace('-', '_').replace('.', '_')} = '{s}'"],
    "query-encoded": lambda o, s: [f"https://h/x?{o.lstrip('-')}%3D{s}&a=1"],
}


@settings(max_examples=1500, deadline=None)
@given(
    before=st.lists(safe_words, max_size=4),
    after=st.lists(safe_words, max_size=4),
    option=st.sampled_from(SECRET_NAMES),
    secret=many_shapes,
    form=st.sampled_from(sorted(FORMS)),
)
def test_a_secret_of_any_shape_never_survives_any_form(
    before: list[str], after: list[str], option: str, secret: str, form: str
) -> None:
    """Issue 17's property: for each form, secrets of many shapes never show (the ``/``
    ``@`` ``#`` a URL gives a meaning to are left out of a URL's secret)."""
    if form in ("query", "url-user", "header", "query-encoded"):
        secret = secret.translate(str.maketrans("/@#&;,=", "xyzxyzx"))
    argv = [*before, *FORMS[form](option, secret), *after]
    for shown in (
        " ".join(redact_argv(argv)),
        redact_command(" ".join(argv)),
        redact_lines("log: " + " ".join(argv)),
    ):
        assert secret not in shown, (form, shown)
    red = redact_command(" ".join(argv)).split()
    assert red[: len(before)] == before
