"""Read the one-line attribute docstrings of config dataclasses (for --help and error messages)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the string literal written right below it} for a dataclass."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(obj: Any, prefix: str = "") -> list[str]:
    """'key=default  # doc' lines for every leaf field of a (nested) dataclass instance."""
    lines = []
    docs = field_docs(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            lines.append(f"{key}:  # {docs.get(f.name, '')}")
            lines.extend("  " + line for line in describe(value, key + "."))
        else:
            lines.append(f"{key}={value!r}  # {docs.get(f.name, '')}")
    return lines
