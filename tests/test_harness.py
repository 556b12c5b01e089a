"""The harness keeps its own promises: what the suite's speed and safety rest on."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("heavy")
def test_the_heavy_group_reaches_xdist_as_a_group(request: pytest.FixtureRequest) -> None:
    """``--dist loadgroup`` sends a group to one worker only because xdist writes the
    group into each test's node id on the worker; a pytest that drops that suffix
    (9.2 did: pytest-xdist#1386) spreads the heavy races over every worker, beside each
    other, and nothing else says so. pyproject.toml's test extra names versions that
    work together; this fails where they do not."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("only an xdist worker under --dist loadgroup groups tests")
    assert request.node.nodeid.endswith("@heavy"), (
        f"{request.node.nodeid}: no @heavy suffix, so the heavy group is not kept on one "
        "worker; install the pytest and pytest-xdist versions the test extra names"
    )
