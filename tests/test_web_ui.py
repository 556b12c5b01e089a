"""The web view at ``/ui`` in a real headless Chromium, against a real agent on a
simulated GPU host: sign-in with each token, the live update from the event stream while
a service started from the CLI loads, a stop from the page, its CSP and accessibility.
Screenshots at 390 px and 1440 px go to tests/output/ (git-ignored artefacts)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuctl.sim.host import SimHost, free_port
from tests.browser_helpers import OUTPUT, axe_violations, chromium, needs_chromium
from tests.conftest import gpuctl
from tests.ensure_helpers import kill_servers, model_server_command, server_pids, unique_name

pytestmark = [needs_chromium(), pytest.mark.browser, pytest.mark.e2e, pytest.mark.slow]
WAIT_S = 60


@dataclass
class Host:
    sim: SimHost
    name: str
    cli_config: Path
    read_token: str

    @property
    def url(self) -> str:
        return self.sim.agent_url


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    root = tmp_path_factory.mktemp("webui")
    read_token = secrets.token_urlsafe(16)
    read_file = root / "read.token"
    read_file.write_text(read_token + "\n")
    read_file.chmod(0o600)
    name = unique_name("web")
    port = free_port()
    service = (
        f"[services.{name}]\n"
        'launcher = "process"\n'
        f"command = {json.dumps(model_server_command(name, port, load_time='4s'))}\n"
        f'health = "http://127.0.0.1:{port}/health"\n'
        f'match = ["{name}"]\nmemory = "20GiB"\nhealth_timeout = "60s"\n'
    )
    # The agent's own config: the GPU host's services (no agent URL: it is the agent).
    agent_config = root / "agent.toml"
    agent_config.write_text(f"[hosts.sim]\n\n{service}")
    with SimHost(root=root / "simhost") as sim:
        sim.start_agent(args=["--config", str(agent_config), "--read-token-file", str(read_file)])
        try:
            yield Host(sim, name, sim.write_config(service), read_token)
        finally:
            kill_servers(name)


def _wait(driver: Any, what: str, check: Any) -> Any:
    """Poll ``check`` until it is truthy. The page redraws a row on every update, so an
    element found a moment ago may be gone when it is read: that poll is tried again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(
        driver,
        WAIT_S,
        poll_frequency=0.1,
        ignored_exceptions=(StaleElementReferenceException,),
    )
    return wait.until(check, what)


def _sign_in(driver: Any, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(f"{url}/ui")
    field = _wait(driver, "the token field", lambda d: d.find_element(By.ID, "token"))
    assert field.get_attribute("type") == "password"
    field.send_keys(token, Keys.ENTER)  # the form submits on Enter


def _decision(driver: Any, service: str) -> str:
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.CSS_SELECTOR, f'tr[data-service="{service}"] .decision')
    return rows[0].text if rows else ""


def _csp_errors(driver: Any) -> list[str]:
    return [
        e["message"]
        for e in driver.get_log("browser")
        if "Content Security Policy" in e["message"] or "Refused to" in e["message"]
    ]


def test_the_page_and_its_files_need_no_token_and_carry_a_strict_csp(host: Host) -> None:
    r = httpx.get(f"{host.url}/ui")
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "<script>" not in r.text and " on" not in r.text.split("<body>", 1)[1].split(">")[0]
    assert host.sim.token not in r.text and host.read_token not in r.text
    for path in ("/ui/app.js", "/ui/app.css", "/ui/icon.svg"):
        assert httpx.get(f"{host.url}{path}").status_code == 200, path
    # The data needs the token.
    assert httpx.get(f"{host.url}/ui/state").status_code == 401


def test_a_wrong_token_gets_a_clear_message(host: Host) -> None:
    from selenium.webdriver.common.by import By

    with chromium() as driver:
        _sign_in(driver, host.url, "not-the-token")
        error = _wait(
            driver,
            "the refusal",
            lambda d: d.find_element(By.ID, "login-error").text or False,
        )
        assert "refused this token" in error and "401" in error
        assert driver.find_element(By.ID, "view").is_displayed() is False
        assert driver.execute_script("return sessionStorage.getItem('gpuctl.token')") is None
        assert "token" not in driver.current_url


def test_read_only_watches_a_cli_start_live_without_buttons(host: Host) -> None:
    from selenium.webdriver.common.by import By

    with chromium() as driver:
        _sign_in(driver, host.url, host.read_token)
        _wait(driver, "the service row", lambda d: _decision(d, host.name) == "IDLE")
        assert driver.find_elements(By.CSS_SELECTOR, ".gpu .bar")
        assert "free" in driver.find_element(By.CSS_SELECTOR, ".gpu .legend").text
        assert driver.find_elements(By.CSS_SELECTOR, "button[data-op]") == []
        assert "token" not in driver.current_url
        # No reload from here on: a reload would drop this mark.
        driver.execute_script("window.__same_page = 1")

        r = gpuctl(host.cli_config, "ensure", host.name, "--no-wait")
        assert r.returncode == 0, r.stdout + r.stderr
        _wait(driver, "LOADING", lambda d: _decision(d, host.name) == "LOADING")
        OUTPUT.mkdir(exist_ok=True)
        driver.save_screenshot(str(OUTPUT / "web-view-loading-1440.png"))
        _wait(driver, "READY", lambda d: _decision(d, host.name) == "READY")
        assert driver.execute_script("return window.__same_page") == 1
        events = driver.find_element(By.ID, "events").text
        assert "launch" in events

        # The page at a phone's width and at a desktop's, kept as artefacts.
        for width in (390, 1440):
            driver.set_window_size(width, 1000)
            driver.save_screenshot(str(OUTPUT / f"web-view-{width}.png"))
            assert driver.execute_script(
                "return document.documentElement.scrollWidth <= window.innerWidth + 1"
            ), f"the page scrolls sideways at {width} px"

        # CSP: nothing the page does is refused, and axe finds nothing serious.
        assert _csp_errors(driver) == []
        bad = [v for v in axe_violations(driver) if v.get("impact") in ("serious", "critical")]
        assert bad == [], [(v["id"], v.get("help")) for v in bad]


def test_write_token_stops_from_the_page(host: Host) -> None:
    from selenium.webdriver.common.by import By

    r = gpuctl(host.cli_config, "ensure", host.name, "--timeout", "60s")
    assert r.returncode == 0, r.stdout + r.stderr
    with chromium() as driver:
        _sign_in(driver, host.url, host.sim.token)
        _wait(driver, "READY", lambda d: _decision(d, host.name) == "READY")
        ops = {
            b.get_attribute("data-op")
            for b in driver.find_elements(By.CSS_SELECTOR, "button[data-op]")
        }
        assert ops == {"ensure", "stop", "resume"}
        driver.find_element(
            By.CSS_SELECTOR, f'button[data-op="stop"][data-service="{host.name}"]'
        ).click()
        alert = _wait(driver, "the confirm", lambda d: d.switch_to.alert)
        assert host.name in alert.text
        alert.accept()
        _wait(driver, "IDLE after the stop", lambda d: _decision(d, host.name) == "IDLE")
        assert "stopped" in driver.find_element(By.ID, "notice").text
        assert _csp_errors(driver) == []
    assert server_pids(host.name) == []
    events = httpx.get(
        f"{host.url}/events",
        params={"since": "1h"},
        headers={"Authorization": f"Bearer {host.sim.token}"},
    ).json()["events"]
    stops = [e for e in events if e["kind"] == "stop" and e["service"] == host.name]
    assert stops and stops[-1]["who"]["entry"] == "ui"
