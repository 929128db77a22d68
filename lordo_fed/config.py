"""How a setting is declared: once, as a typed dataclass field with its docstring.

Every setting of lordo-fed lives in one dataclass of the component it configures (`InnerConfig`
beside the optimizer, `RoundConfig` beside the rounds, ...), and the entry points compose those
into one tree (`rounds.config.CommonConfig`, `app.config.AppConfig`, `trainer.config.TrainConfig`).
A field users set per Flower run (`flwr run . --run-config "local-steps=16"`) is declared with
`setting(key, default)`, which records its flat run-config key on the field itself; a field that
holds a sub-tree those keys reach into is declared with `section(...)`. `flat_keys(AppConfig)`
then derives the flat keys from the tree, so a key is never listed by hand
(docs/architecture.md, "Where each setting lives").

Nothing here imports the rest of the library: every layer may declare settings.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable

FLAT_KEY = "lordo_fed.flat_key"
"""Field metadata: the flat run-config key of a setting."""
SECTION = "lordo_fed.section"
"""Field metadata: a nested dataclass whose settings have flat keys of their own."""


MAX_LIST_ITEMS = 100_000
"""The most items a list setting written with `value*count` may expand to (a typo such as '2*2560000' is refused
before anything is allocated)."""


class ListSyntaxError(ValueError):
    """An item of a written-out list that is neither a value nor `value*count`."""


def expand_repeats(value: str, parse: Callable[[str], Any]) -> list:
    """A list setting as written, comma-separated, where `value*count` repeats a value: '2*3,4' -> [2, 2, 2, 4]
    with `parse` = int; '' -> []. The Flower app's list keys (`local-steps-ramp='2*256'`) and the reference
    trainer's `${repeat:...}` (`rounds.local_steps_ramp='${repeat:2*256}'`) both read this grammar. Raises
    ListSyntaxError naming the item `parse` or the count does not read, and ValueError for a count below 1 or more
    than `MAX_LIST_ITEMS` items in all."""
    out: list = []
    for item in ([v.strip() for v in value.split(",")] if value.strip() else []):
        number, star, count = item.partition("*")
        try:
            times = int(count) if star else 1
            parsed = parse(number)
        except ValueError:
            raise ListSyntaxError(item) from None
        if times < 1:
            raise ValueError(f"{item!r} repeats {number.strip()} {times} times: expected a count >= 1")
        if len(out) + times > MAX_LIST_ITEMS:
            raise ValueError(f"expected at most {MAX_LIST_ITEMS} items in all")
        out.extend([parsed] * times)
    return out


def _number(text: str) -> int | float:
    """'2' -> 2, '2.5' -> 2.5 (ValueError otherwise)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _repeat(*items: Any) -> list:
    """The `${repeat:...}` resolver: its comma-separated arguments, `value*count` expanded (`expand_repeats`)."""
    text = ",".join(str(i) for i in items)
    try:
        return expand_repeats(text, _number)
    except ListSyntaxError as err:
        raise ValueError(f"${{repeat:{text}}}: {str(err)!r} is neither a number nor value*count; expected e.g. "
                         "${repeat:2*256,4*128}") from None
    except ValueError as err:
        raise ValueError(f"${{repeat:{text}}}: {err}") from None


def register_resolvers() -> None:
    """Register `${repeat:...}` with OmegaConf, for the Hydra configs (the reference trainer's and the app's
    presets): `rounds.local_steps_ramp='${repeat:2*256,4*128}'` is 256 twos then 128 fours, the grammar of the
    Flower app's list keys (`local-steps-ramp='2*256,4*128'`). Registering twice is a no-op."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("repeat"):
        OmegaConf.register_new_resolver("repeat", _repeat)


def setting(key: str, default: Any = MISSING, *, default_factory: Callable[[], Any] | Any = MISSING) -> Any:
    """A dataclass field that users may also set per run with the flat run-config key `key`."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={FLAT_KEY: key})


def section(default_factory: Callable[[], Any]) -> Any:
    """A dataclass field holding a sub-tree of settings, some of them with flat keys (`setting`)."""
    return dataclasses.field(default_factory=default_factory, metadata={SECTION: True})


@dataclass(frozen=True)
class FlatKey:
    """One flat run-config key, as derived from the tree."""

    key: str
    """What users type: `local-steps`."""
    dotted: str
    """The field it sets: `rounds.local_steps`."""
    type: type
    """The field's type: bool, int, float, str, or list (then `item_type`)."""
    item_type: type | None = None
    """A list field's item type: its flat key takes comma-separated values (`'1,1,4'`; '' = [])."""
    optional: bool = False
    """The field may be None (the method's own default): '' in pyproject.toml and the run config."""
    doc: str = ""
    """The field's docstring (one line), for error messages and docs."""


def flat_keys(cls: type) -> dict[str, FlatKey]:
    """Every flat key of the dataclass tree `cls`, by key (ValueError if two fields claim one)."""
    found: dict[str, FlatKey] = {}
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if f.metadata.get(SECTION):
            for key, sub in flat_keys(hint).items():
                _add(found, dataclasses.replace(sub, dotted=f"{f.name}.{sub.dotted}"))
        elif FLAT_KEY in f.metadata:
            origin = typing.get_origin(hint)
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            optional = origin is typing.Union and len(args) == 1
            if origin in (list, typing.List):
                kind, item = list, typing.get_args(hint)[0]
            else:
                kind, item = (args[0] if optional else hint), None
            _add(found, FlatKey(f.metadata[FLAT_KEY], f.name, kind, item, optional=optional, doc=docs.get(f.name, "")))
    return found


def _add(found: dict[str, FlatKey], flat: FlatKey) -> None:
    if flat.key in found:
        raise ValueError(f"flat key {flat.key!r} is declared twice: {found[flat.key].dotted} and {flat.dotted}")
    found[flat.key] = flat


def get_dotted(obj: Any, dotted: str) -> Any:
    """`obj.a.b` for `dotted` 'a.b'."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the string literal written right below it} for a dataclass and its bases."""
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
    """'key=default  # doc' lines for every leaf field of a (nested) dataclass instance (--help)."""
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
