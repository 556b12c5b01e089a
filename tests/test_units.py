import pytest

from gpuctl.core.units import format_duration, format_mib, parse_duration_s, parse_size_mib


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("80GiB", 81920),
        ("80G", 81920),
        ("80gb", 81920),
        ("30 GiB", 30720),
        ("512MiB", 512),
        ("1.5T", 1572864),
        ("1024KiB", 1),
        ("128GiB", 131072),
    ],
)
def test_parse_size(text: str | int, mib: int) -> None:
    assert parse_size_mib(text) == mib


@pytest.mark.parametrize("text", ["", "GiB", "80XB", "-1G", "eighty", True, -5])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ValueError, match=r"size|negative"):
        parse_size_mib(text)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        (20, '"20GiB" or "20MiB"'),
        ("20", '"20GiB" or "20MiB"'),
        (512, '"512GiB" or "512MiB"'),
        (80.0, '"80GiB" or "80MiB"'),
        (80.5, '"80.5GiB" or "81MiB"'),
        ("80.5", '"80.5GiB" or "81MiB"'),
        (" 1.25 ", '"1.25GiB" or "2MiB"'),
        (0.5, '"0.5GiB" or "1MiB"'),
    ],
)
def test_a_bare_number_is_refused_naming_both_readings(text: str | float, fix: str) -> None:
    """A bare number was MiB: ``memory = 20`` a 20 MiB budget, when 20 GiB was meant."""
    with pytest.raises(ValueError, match=r"^a size needs its unit, got ") as e:
        parse_size_mib(text)
    assert str(e.value).endswith(f": write {fix}")


@pytest.mark.parametrize("text", [1e-300, 10**30, "0", 0])
def test_a_bare_number_with_no_gib_form_is_refused_too(text: object) -> None:
    with pytest.raises(ValueError, match=r"^a size needs its unit"):
        parse_size_mib(text, allow_zero=True)  # type: ignore[arg-type]


def test_fractions_with_a_unit_still_parse() -> None:
    assert parse_size_mib("80.5GiB") == 82432 and parse_size_mib("0.5G") == 512


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30m", 1800),
        ("600s", 600),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("10", 10),
        (5, 5),
        ("2d", 172800),
        ("1h 5m", 3900),
    ],
)
def test_parse_duration(text: str | int, seconds: float) -> None:
    assert parse_duration_s(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "m", "30x", "5m garbage", "-3", "soon"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration_s(text)


def test_format() -> None:
    assert format_mib(81920) == "80.0 GiB"
    assert format_mib(512) == "512 MiB"
    assert format_mib(None) == "n/a"
    assert format_duration(42) == "42s"
    assert format_duration(3725) == "1h02m"
    assert format_duration(125) == "2m05s"
    assert format_duration(None) == "-"
