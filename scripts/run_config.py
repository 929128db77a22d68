"""Run-config strings as `flwr run --run-config` reads them, for the scripts (not installed).

    python scripts/run_config.py check APP STR...   # exit 2 naming each unknown key, with the keys meant,
                                                    # or the first bad value (as the ServerApp would)
    python scripts/run_config.py check --local APP STR...
                                                    # also the output-dir and resume (exit 2: the ServerApp
                                                    # would refuse the run; 4: it would have nothing to do)
    python scripts/run_config.py get KEY STR...     # the merged value of KEY ('' when unset)

Each STR is one `--run-config` value ('k=v k2="x"'); later strings win, as in `flwr run`, which
merges them with Flower's own parser (`flwr.common.config.parse_config_args`, used here too). Why
`check`: Flower refuses an unknown key with only "[code: 15] Invalid run configuration" on the
screen and names the key in the SuperLink's log alone; the scripts check first and name it. A bad
value (`rank=-1`) the ServerApp would refuse only once Flower and its simulation engine had started;
`check` composes the settings as the app does (`lordo_fed.app.config.load_app_config`, when the package
is installed here) and refuses it in a second. `--local`, for a run whose ServerApp writes on this machine
(scripts/simulate.sh): the output-dir and `resume` as the ServerApp checks them (server/records.py, `preflight`):
a new run into another run's output-dir, or a resume of a finished run, is told in a second, not after Flower
and its simulation engine have started.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from flwr.common.config import flatten_dict, parse_config_args


def app_project(app: Path) -> tuple[str, dict]:
    """(the app's project name, its run-config keys with their defaults: `[tool.flwr.app.config]`,
    what Flower accepts and merges the given strings over)."""
    doc = tomllib.loads((app / "pyproject.toml").read_text())
    return doc.get("project", {}).get("name", ""), flatten_dict(doc["tool"]["flwr"]["app"]["config"])


def merged(strings: list[str]) -> dict:
    """The strings' key-value pairs merged as `flwr run` merges its `--run-config` values."""
    return parse_config_args([s for s in strings if s.strip()])


def main(argv: list[str]) -> int:
    local = argv[:2] == ["check", "--local"]
    if local:
        argv = argv[:1] + argv[2:]
    if len(argv) < 2 or argv[0] not in ("check", "get"):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    try:
        config = merged(argv[2:])
    except Exception as err:  # click.ClickException / ValueError: Flower's own message
        print(f"error: run-config {' '.join(argv[2:])!r}: {getattr(err, 'message', err)}", file=sys.stderr)
        return 2
    if argv[0] == "get":
        value = config.get(argv[1], "")
        print(str(value).lower() if isinstance(value, bool) else value)
        return 0
    name, defaults = app_project(Path(argv[1]))
    known = set(defaults)
    unknown = sorted(set(config) - known)
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        print(f"error: unknown run-config key {key!r}{hint} (the keys are in [tool.flwr.app.config] of "
              f"{Path(argv[1]).resolve() / 'pyproject.toml'}; docs/operations.md lists them)", file=sys.stderr)
    if unknown:
        return 2
    return check_values(name, defaults, config, Path(argv[1]).resolve() if local else None)


def check_values(name: str, defaults: dict, config: dict, local: Path | None = None) -> int:
    """Compose the run's settings as the ServerApp does (pyproject.toml's defaults, then `config`,
    the keys given winning over the preset): exit status 2 with the app's own message for a bad value,
    0 when they compose, or when the app is not lordo-fed's or lordo_fed is not installed here (a
    submit host needs Flower only). With `local` (the app directory, whose ServerApp writes here): then
    its output-dir and resume, exit status 2 with the ServerApp's refusal, 4 with its "nothing to do"."""
    if name != "lordo-fed":
        return 0
    try:
        from lordo_fed.app.config import load_app_config
        from lordo_fed.checkpoint import CheckpointError
    except ImportError:
        return 0
    try:
        cfg = load_app_config({**defaults, **config}, explicit=config)
    except ValueError as err:
        print(f"error: run-config: {err}", file=sys.stderr)
        return 2
    if local is None:
        return 0
    sys.path.insert(0, str(local))  # the app's server package, as the ServerApp imports it
    from server.records import preflight

    try:
        done = preflight(cfg, local)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if done:
        print(done)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
