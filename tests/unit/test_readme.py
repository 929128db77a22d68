"""CI runs the README's two commands, as written."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:3]
    return [b.split("\n```")[0].strip() for b in blocks]


def test_readme_starts_with_install_run_and_install_test():
    run, test = readme_commands()
    assert "pip install -e ." in run and "scripts/simulate.sh" in run
    script = (ROOT / "scripts" / "simulate.sh").read_text() + (ROOT / "scripts" / "submit_run.sh").read_text()
    assert "num-supernodes=$clients" in script and "--stream" in script
    assert 'pip install -e ".[test]"' in test and "pytest" in test


def test_ci_calls_exactly_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in readme_commands():
        assert command in ci, command


def test_requires_python_admits_no_interpreter_the_dependencies_refuse():
    """`requires-python` was ">=3.10" while flwr 1.42 needs 3.11: Flower's `uv sync` before a run
    then failed (code 608). The floor is at least every pinned dependency's own."""
    import importlib.metadata
    import re
    import tomllib

    def floor(spec: str) -> tuple[int, ...]:
        found = re.search(r">=\s*(\d+(?:\.\d+)*)", spec)
        return tuple(int(x) for x in found.group(1).split(".")) if found else (0,)

    ours = floor(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    for dist in ("flwr", "torch", "hydra-core", "safetensors"):
        theirs = importlib.metadata.metadata(dist).get("Requires-Python") or ""
        assert ours >= floor(theirs), f"requires-python >= {ours} admits what {dist} ({theirs}) refuses"
