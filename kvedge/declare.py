"""Each option declared once, on the field of the type that holds it; every surface derived from it.

A field's annotation carries all a surface needs: `Annotated[T, Meta(...), Flag(help=...)]`.
msgspec reads `T` and the `Meta` (bounds; `description` is the "allowed:" text of an error) for
YAML files and the wire (`kvedge.configs.parse`, `kvedge.serve.config`); `click_options` makes the
command-line option of the field from the same type (a `Literal`'s or the Flag's choices, the
Meta's bounds, checked with the same words), the Flag's help and the field's default;
`from_values` builds the type from a command's or a file's values, by field name. A field whose
type is itself a declared dataclass (`RunOptions.policy`, a `HistoryPolicy`) is given as its own
fields' keys (`history_policy`, `n_sink`): `Flag.key` names a field's key where it differs from
the field's name.

`describe` words what a type allows ("an integer in 1..256"), for a file's errors and a flag's
alike. Kept free of kvedge's other modules: every layer reads it, the CLI before anything runs.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import click
import msgspec

T = TypeVar("T")


@dataclass(frozen=True)
class Flag:
    """What a field's option says and takes beyond its type."""

    help: str
    key: str = ""  # its name in files, flags (with "--" and "-" for "_") and the wire; "": the field's
    choices: tuple[Any, ...] = ()  # the values allowed, where the type does not list them
    allowed: str = ""  # what an error says is allowed, where not the list of `choices`
    # what a file or flag gives where the field holds what is read from it (a path, for a loaded
    # config): the surfaces take this type, `from_values` applies `read`
    given_as: Any = None
    read: Callable[[Any], Any] | None = None
    default_text: str = ""  # --help's "[default: ...]" where the default is None or derived
    metavar: str | None = None


@dataclass(frozen=True)
class Declared:
    """One option: its key, where it sits in its owner (`path`, field names), the type the
    surfaces take (`hint`, with its Meta), its Flag and its default."""

    key: str
    path: tuple[str, ...]
    hint: Any
    flag: Flag
    default: Any

    @property
    def flag_name(self) -> str:
        return "--" + self.key.replace("_", "-")


def declared(owner: type) -> dict[str, Declared]:
    """The declared options of the dataclass `owner`, by key, in field order."""
    found: dict[str, Declared] = {}
    for path, hint, flag, default in _walk(owner, ()):
        key = flag.key or path[-1]
        if flag.given_as is not None:
            hint = flag.given_as
        found[key] = Declared(key, path, hint, flag, default)
    return found


def _walk(owner: type, prefix: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, Flag, Any]]:
    hints = get_type_hints(owner, include_extras=True)
    for f in dataclasses.fields(owner):
        hint = hints[f.name]
        flag = flag_of(hint)
        if flag is not None:
            default = f.default
            if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            yield (*prefix, f.name), hint, flag, default
        elif dataclasses.is_dataclass(base := strip(hint)) and any(
            flag_of(h) for h in get_type_hints(base, include_extras=True).values()
        ):
            yield from _walk(base, (*prefix, f.name))


def flag_of(hint: Any) -> Flag | None:
    if get_origin(hint) is Annotated:
        return next((m for m in get_args(hint)[1:] if isinstance(m, Flag)), None)
    return None


def strip(hint: Any) -> Any:
    """The type under `Annotated[...]` and `... | None`."""
    while True:
        if get_origin(hint) is Annotated:
            hint = get_args(hint)[0]
        elif get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint):
            hint = next(a for a in get_args(hint) if a is not type(None))
        else:
            return hint


def describe(hint: Any) -> str:
    """What a type allows, as shown to the user: "an integer in 1..256", "last, all", ..."""
    annotated = get_origin(hint) is Annotated
    metas = [m for m in get_args(hint)[1:] if isinstance(m, msgspec.Meta)] if annotated else []
    for meta in metas:
        if meta.description:
            return meta.description
    base = get_args(hint)[0] if annotated else hint
    bound = {
        k: getattr(m, k)
        for m in metas
        for k in ("ge", "le", "gt", "min_length", "pattern")
        if getattr(m, k) is not None
    }
    args = get_args(base)
    if get_origin(base) in (Union, types.UnionType) and type(None) in args:
        return f"{describe(next(a for a in args if a is not type(None)))}, or null"
    if get_origin(base) is Literal:
        return ", ".join(map(str, args))
    if get_origin(base) in (tuple, list):
        return f"a list of {describe(args[0])}"
    if base is bool:
        return "true, false"
    if base in (int, float):
        noun = "an integer" if base is int else "a number"
        if "ge" in bound and "le" in bound:
            return f"{noun} in {bound['ge']}..{bound['le']}"
        if bound.get("gt") == 0:
            return f"a positive {noun.split()[-1]}"
        return f"{noun} >= {bound['ge']}" if "ge" in bound else noun
    if base is str:
        if "pattern" in bound:
            return f"a string matching {bound['pattern']}"
        return "a non-empty string" if "min_length" in bound else "a string"
    if is_mapping(base):
        return "a mapping of keys"
    return getattr(base, "__name__", str(base))


def is_mapping(hint: Any) -> bool:
    return isinstance(hint, type) and (issubclass(hint, msgspec.Struct) or dataclasses.is_dataclass(hint))


def from_values(owner: type[T], values: Mapping[str, Any], **fixed: Any) -> T:
    """`owner` from the declared keys `values` holds (a command's keyword values, a file's
    section; a key absent or None takes the field's default), and the fields `fixed` sets. A
    field given as another type (`Flag.given_as`) is read (`Flag.read`)."""
    nested: dict[str, Any] = {}
    for option in declared(owner).values():
        value = values.get(option.key)
        if value is None:
            continue
        if option.flag.read is not None:
            value = option.flag.read(value)
        elif isinstance(value, list):
            value = tuple(value)
        where = nested
        for name in option.path[:-1]:
            where = where.setdefault(name, {})
        where[option.path[-1]] = value
    return _build(owner, {**nested, **fixed})


def _build(owner: type[T], values: dict[str, Any]) -> T:
    hints = get_type_hints(owner)
    return owner(
        **{
            name: _build(strip(hints[name]), value) if isinstance(value, dict) else value
            for name, value in values.items()
        }
    )


# --- click -----------------------------------------------------------------------------------


class Checked(click.ParamType):
    """A value of `hint` (a number with `Meta` bounds, or one of `choices`), refused as it is given,
    in the words of the owners' own checks: "key=value is not allowed; allowed: <what the bounds
    allow>" (`SamplingConfig`, a service file), "--flag value is not allowed; allowed: [choices]"
    (`ExportRecipe`)."""

    def __init__(self, key: str, hint: Any, choices: Sequence[Any] = (), allowed: str = "") -> None:
        self.key, self.hint, self.choices = key, hint, tuple(choices)
        self.allowed = allowed or str(list(self.choices))
        self.flag = "--" + key.replace("_", "-")
        self.base = strip(hint)
        self.name = "integer" if self.base is int else "float" if self.base is float else "text"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        base = {int: click.INT, float: click.FLOAT}.get(self.base, click.STRING)
        number = base.convert(value, param, ctx)
        if self.choices:
            if number not in self.choices:
                self.fail(f"{self.flag} {number!r} is not allowed; allowed: {self.allowed}", param, ctx)
            return number
        try:
            return msgspec.convert(number, self.hint)
        except msgspec.ValidationError:
            self.fail(f"{self.key}={number!r} is not allowed; allowed: {describe(self.hint)}", param, ctx)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str | None:
        if self.choices:
            return "[" + "|".join(map(str, self.choices)) + "]"
        return None


class DeclaredOption(click.Option):
    """A command-line option made from a declaration (`click_option`), which it keeps."""

    def __init__(self, *args: Any, declared: Declared, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.declared = declared


def click_type(option: Declared, checked: bool = True) -> Any:
    """The click type that takes what `option`'s type and Flag allow; numbers (their bounds and
    choices) are left to the owner's check unless `checked`."""
    base = strip(option.hint)
    if get_origin(base) is Literal:
        return click.Choice([str(a) for a in get_args(base)])
    if not checked and base in (int, float):
        return {int: click.INT, float: click.FLOAT}[base]
    if option.flag.choices:
        if all(isinstance(c, str) for c in option.flag.choices):
            return click.Choice(list(option.flag.choices))
        return Checked(option.key, option.hint, option.flag.choices, option.flag.allowed)
    if base is Path:
        return click.Path(path_type=Path)
    if get_origin(base) in (tuple, list):
        return click.INT if get_args(base)[0] is int else click.STRING
    if base in (int, float):
        return Checked(option.key, option.hint)
    return click.STRING


def click_option(option: Declared, unset: bool = False, **changes: Any) -> Callable[[T], T]:
    """The command-line option of `option`: its default shown, or (`unset`) None, meaning "not
    given" (a file's value, or what the command derives, stands), the value then checked where
    the file's is; `changes` are click keywords."""
    flag = option.flag
    base = strip(option.hint)
    given_default = None if unset or option.default is None else option.default
    kwargs: dict[str, Any] = {"help": flag.help}
    if base is bool:
        decls = [f"{option.flag_name}/--no-{option.flag_name[2:]}"]
        kwargs["default"] = given_default
    else:
        decls = [option.flag_name]
        kwargs["type"] = click_type(option, checked=not unset)
        if get_origin(base) in (tuple, list):
            kwargs["multiple"] = True
        else:
            kwargs["default"] = given_default
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
    if flag.default_text and not unset:
        kwargs["show_default"] = flag.default_text
    elif given_default is not None and not isinstance(given_default, tuple | bool):
        kwargs["show_default"] = True
    kwargs.update(changes)
    return click.option(*decls, option.key, cls=DeclaredOption, declared=option, **kwargs)


def click_options(
    owner: type, keys: Sequence[str] | None = None, *, unset: bool = False, **changes: dict[str, Any]
) -> Callable[[T], T]:
    """A decorator adding the options of `owner`'s declared `keys` (default: all) to a click
    command, in that order; `changes[key]` are click keywords for one of them."""
    options = declared(owner)
    chosen = [options[k] for k in keys] if keys is not None else list(options.values())

    def decorate(func: T) -> T:
        for option in reversed(chosen):
            func = click_option(option, unset, **changes.get(option.key, {}))(func)
        return func

    return decorate
