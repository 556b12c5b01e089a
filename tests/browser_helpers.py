"""A real headless Chromium (Debian's ``chromium`` and ``chromium-driver``) driven by
Selenium, for the web view's tests. ``scripts/test`` installs both; a test skips, saying
so, only where they are truly missing."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

AXE = Path(__file__).with_name("vendor") / "axe-core" / "axe.min.js"
OUTPUT = Path(__file__).with_name("output")  # git-ignored: screenshots kept as artefacts


def _binaries() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def needs_chromium() -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        _binaries() is None,
        reason="no chromium and chromedriver on PATH (scripts/test installs Debian's "
        "chromium and chromium-driver with apt-get)",
    )


@contextmanager
def chromium(width: int = 1440, height: int = 1000) -> Iterator[Any]:
    """A headless Chromium with its console log kept (``driver.get_log('browser')``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = _binaries()
    assert found is not None
    browser, driver_path = found
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Paths given: Selenium Manager never looks for a driver on the network.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def axe_violations(driver: Any) -> list[dict[str, Any]]:
    """axe-core's violations on the page as it is now."""
    driver.execute_script(AXE.read_text(encoding="utf-8"))
    result: dict[str, Any] = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "axe.run(document).then((r) => done(r.violations), (e) => done([{id: String(e), impact: 'critical'}]));"
    )
    return list(result)
