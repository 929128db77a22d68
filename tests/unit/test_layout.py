"""The layout holds (docs/architecture.md): imports run one way down the layers, Flower stays in
its adapter, no module reaches into another's private names (imports or attributes), no module grows past ~600 lines,
nothing cites a file outside the repository, and no downloaded wheel sits in the checkout."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("basics", ("lordo_fed", "lordo_fed.config", "lordo_fed.device", "lordo_fed.model", "lordo_fed.checkpoint",
                "lordo_fed.metrics", "lordo_fed.evaluation", "lordo_fed.v1")),
    ("optim/wire/data", ("lordo_fed.optim", "lordo_fed.wire", "lordo_fed.data")),
    ("rounds", ("lordo_fed.rounds",)),
    ("app", ("lordo_fed.app",)),
    ("node/transport/wan", ("lordo_fed.node", "lordo_fed.transport", "lordo_fed.wan")),
    ("apps", ("lordo_fed.trainer", "server", "client")),
]
"""Top to bottom in docs/architecture.md: a module may import its own layer and the layers above
in this list (lower floors), never one below it."""
FLOWER = ("server", "client", "lordo_fed.app.records")
"""The only modules that import flwr."""
MAX_LINES = 600


def product_modules() -> dict[str, Path]:
    """Every hand-written module of the library and the Flower app, by dotted name."""
    found = {}
    for top in ("lordo_fed", "server", "client"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer_of(module: str) -> int:
    """The index in LAYERS of the deepest prefix that names `module`'s package."""
    best, depth = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = i, prefix.count(".")
    return best


def imports_of(path: Path, module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) for every import in `path`, nested ones included."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.append((base, [a.name for a in node.names], node.lineno))
    return found


MODULES = product_modules()


def test_every_module_has_a_layer():
    assert {m: layer_of(m) for m in MODULES if layer_of(m) < 0} == {}


def test_imports_run_down_the_layers():
    upward = []
    for module, path in MODULES.items():
        mine = layer_of(module)
        for target, names, line in imports_of(path, module):
            if not target.startswith(("lordo_fed", "server", "client")):
                continue
            targets = [f"{target}.{n}" if f"{target}.{n}" in MODULES else target for n in names] or [target]
            for t in targets:
                if layer_of(t) > mine:
                    upward.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[mine][0]}) imports {t} "
                                  f"({LAYERS[layer_of(t)][0]})")
    assert upward == []


def test_flower_is_imported_only_by_its_adapter():
    outside = [f"{path.relative_to(ROOT)}:{line}" for module, path in MODULES.items()
               for target, _, line in imports_of(path, module)
               if target.split(".")[0] == "flwr" and not module.startswith(FLOWER)]
    assert outside == []


def test_no_module_imports_another_modules_private_names():
    private = [f"{path.relative_to(ROOT)}:{line} imports {name} from {target}"
               for module, path in MODULES.items() for target, names, line in imports_of(path, module)
               for name in names if name.startswith("_") and not name.startswith("__") and target != module]
    assert private == []


def defined_names(path: Path) -> set[str]:
    """Every name `path` defines: its functions, classes and methods, the attributes it assigns (on
    any object) and its variables."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


DEFINED = {module: defined_names(path) for module, path in MODULES.items()}


def test_no_module_reads_another_modules_private_attributes():
    """`x._name` where `_name` is another module's and not this one's, on anything but `self` or
    `cls` (a method of a class and its base classes share its state). Torch's and the standard
    library's private names (`torch._foreach_mul_`, `Tensor._version`) are not the project's."""
    ours = {name for names in DEFINED.values() for name in names if name.startswith("_") and not name.startswith("__")}
    reaching = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in ours and node.attr not in DEFINED[module]
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                reaching.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {ast.unparse(node)}")
    assert reaching == []


@pytest.mark.parametrize("top", ["lordo_fed", "server", "client", "harness"])
def test_no_module_is_over_600_lines(top):
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / top).rglob("*.py"))
            if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")) and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_nothing_cites_a_file_outside_the_repository():
    citing = [str(p.relative_to(ROOT)) for top in ("lordo_fed", "server", "client", "harness", "tests", "benchmarks",
                                                   "scripts", "docs", "examples", "proto")
              for p in sorted((ROOT / top).rglob("*")) if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".sh",
                                                                                      ".proto", ".toml")
              and "shared/docs" in p.read_text(errors="replace") and p.name != "test_layout.py"]
    assert citing == []


def test_no_wheel_in_the_repository_root_and_gitignore_keeps_them_out():
    """A wheel downloaded into the checkout (a pyflakes wheel once was committed) is never
    tracked: .gitignore matches `*.whl` (scripts/device_wheels.sh's .whl/ is carried explicitly)."""
    assert sorted(p.name for p in ROOT.glob("*.whl") if p.is_file()) == []  # (.whl/ is device_wheels.sh's folder)
    patterns = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert any(fnmatch.fnmatch("pyflakes-4.1.0-py2.py3-none-any.whl", p) for p in patterns), patterns


def test_the_data_plane_and_the_node_workers_channel_load_without_torch():
    """lordo_fed/transport says it imports without torch, and a node-worker ClientApp hands its job over
    the channel without loading torch (docs/architecture.md): in a fresh interpreter, importing them
    leaves torch unloaded (a checksum constant once pulled in AppConfig's whole tree, torch with it)."""
    import subprocess
    import sys

    code = ("import sys; import lordo_fed.transport.server, lordo_fed.transport.client, lordo_fed.transport.handlers, "
            "lordo_fed.node.channel; print(sorted(m for m in ('torch', 'flwr') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
