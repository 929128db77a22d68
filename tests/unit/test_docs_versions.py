"""The deployment guide says which Flower versions its facts were checked against: every minor
version pyproject.toml lets `pip install` pick (a fresh install got 1.42 while the guide still named
1.41 only)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def allowed_flwr_minors() -> list[str]:
    """'1.41', '1.42' for pyproject's `flwr[simulation]>=1.41,<1.43`."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if d.startswith("flwr"))
    match = re.fullmatch(r"flwr(\[[^\]]*\])?>=(\d+)\.(\d+),<(\d+)\.(\d+)", pin.replace(" ", ""))
    assert match, f"expected a '>=X.Y,<X.Z' pin, got {pin!r}"
    major, low, high_major, high = (int(match.group(i)) for i in (2, 3, 4, 5))
    assert major == high_major, pin
    return [f"{major}.{minor}" for minor in range(low, high)]


def test_the_deployment_guide_names_every_flower_version_the_pin_allows():
    intro = (ROOT / "docs" / "deployment.md").read_text().split("\n\n")[1]  # the paragraph after the title
    minors = allowed_flwr_minors()
    assert minors == ["1.41", "1.42"]
    for minor in minors:
        assert re.search(rf"\b{re.escape(minor)}(\.\d+)?\b", intro), (minor, intro)


def test_the_installed_flower_is_one_the_pin_allows():
    installed = ".".join(metadata.version("flwr").split(".")[:2])
    assert installed in allowed_flwr_minors()
