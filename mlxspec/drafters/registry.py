"""Drafters as data: a registry of drafter types, their options dataclasses, and drafter specs.

One name → one module → one frozen options dataclass → one build function (as mlx-lm maps
``model_type`` to a module, and vLLM's ``SpeculativeConfig.method`` to a proposer). A module in
``mlxspec/drafters/`` registers its type with ``register``; ``mlxspec.drafters`` imports every
module of the package, so a new drafter is one new file. A ``DrafterSpec`` names a type and holds
its options; it is built from a spec string such as ``"eagle:depth=4,top_k=1,ngram=6"``, from CLI
flags (``--eagle-depth 4``, generated from the dataclass fields) or in Python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..loading.identity import require_shipped_for
from .base import AUTO, Drafter


def option(default: Any, help: str, *, parse: Callable[[str], Any] = str, default_help: str | None = None):
    """A field of a drafter's options dataclass: its default, its help text and how to read it from text.

    Args:
        default: The value when the option is not given.
        help: One sentence for ``--help`` (the ``Default: ...`` part is added).
        parse: Turns the text of a flag or a spec string value into the value (raises ``ValueError``).
        default_help: What the default means when it is not a plain value (e.g. ``None`` = the head's
            setting).
    """
    return field(default=default, metadata={"help": help, "parse": parse, "default_help": default_help})


#: What a plain parser expects, in words (Python's own message names int() and a base).
_WORDS = {int: "an integer", float: "a number"}


def int_or_auto(text: str) -> int | str:
    """An integer, or the word ``auto``.

    Raises:
        ValueError: anything else.
    """
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer or 'auto', got {text!r}") from None


def at_least(least: int, value, flag: str) -> None:
    """Refuse an integer option below ``least`` (``"auto"`` and ``None`` pass).

    Raises:
        ValueError: ``"<flag> must be >= <least>, got <value>"``.
    """
    if value is not None and value != AUTO and value < least:
        raise ValueError(f"{flag} must be >= {least}, got {value}")


@dataclass
class DrafterContext:
    """What a build function may use besides its options.

    Attributes:
        target: The target, an mlx-lm model (its width, embedding, LM head, layers).
        tokenizer: The target's tokenizer, or ``None``.
        target_name: The target's name (``loading.models.model_name``), or ``None``; the suffix drafter keys
            its store by it.
        draft_model, draft_tokenizer: A loaded draft model and its tokenizer, or ``None``.
        on_measure: Called with a short description before a cost measurement that was not cached
            (the CLI prints it). Default: none.
        target_path: The target's own folder (where built-in MTP layers live), or ``None``.
    """

    target: Any = None
    tokenizer: Any = None
    target_name: str | None = None
    draft_model: Any = None
    draft_tokenizer: Any = None
    on_measure: Callable[[str], None] | None = None
    target_path: str | None = None

    def asset(self, kind: str, given: str | None) -> str:
        """``given`` (a path or repo id), else the ``kind`` head shipped for this target (matched by what
        the model is, ``identity.shipped_for``, not by its name).

        Raises:
            ValueError: nothing given and no head ships for this model.
        """
        if given:
            return given
        if self.target is None:
            raise ValueError(f"no {kind} weights given and no target; pass --{kind}-heads PATH_OR_REPO")
        return str(require_shipped_for(kind, self.target))


@dataclass(frozen=True)
class DrafterType:
    """One kind of drafter.

    Attributes:
        name: What ``--drafter`` and spec strings call it, e.g. ``"eagle"``.
        options: Its frozen options dataclass (every field made with ``option``); validates in
            ``__post_init__``, raising ``ValueError`` that names the flag.
        build: ``build(options, context) -> Drafter``.
        summary: One line for ``--help`` and the README's table.
        order: Position in listings (``--drafter`` choices, the chat's list). Default: ``100``.
        plain: Whether it never drafts (plain decoding through the round loop; its drafters'
            ``profile.plain``): γ flags do not apply to it. Default: ``False``.
        needs_draft_model: Whether it drafts with a second, smaller LM that is loaded before it is built
            (``--draft-model``, ``DrafterContext.draft_model``). Default: ``False``.
    """

    name: str
    options: type
    build: Callable[[Any, DrafterContext], Drafter]
    summary: str
    order: int = 100
    plain: bool = False
    needs_draft_model: bool = False


_TYPES: dict[str, DrafterType] = {}


def register(kind: DrafterType) -> DrafterType:
    """Add a drafter type to the registry (a module's last line: ``DRAFTER = register(...)``).

    Raises:
        ValueError: another type already has that name.
    """
    known = _TYPES.get(kind.name)
    if known is not None and known is not kind:
        raise ValueError(f"a drafter named {kind.name!r} is already registered")
    _TYPES[kind.name] = kind
    return kind


def drafter_types() -> dict[str, DrafterType]:
    """Every registered drafter type by name, in listing order."""
    return dict(sorted(_TYPES.items(), key=lambda item: (item[1].order, item[0])))


def drafter_type(name: str) -> DrafterType:
    """The registered type called ``name``.

    Raises:
        ValueError: no such drafter, listing the known ones.
    """
    kind = _TYPES.get(name)
    if kind is None:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(drafter_types())}")
    return kind


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter by name with its options: plain data, built into a ``Drafter`` by ``make_drafter``.

    Attributes:
        name: A registered drafter name.
        options: An instance of that type's options dataclass; ``None`` = its defaults.

    Raises:
        ValueError: an unknown name, or options of another type.
    """

    name: str
    options: Any = None

    def __post_init__(self):
        kind = drafter_type(self.name)
        if self.options is None:
            object.__setattr__(self, "options", kind.options())
        elif not isinstance(self.options, kind.options):
            raise ValueError(
                f"the {self.name} drafter takes {kind.options.__name__}, got {type(self.options).__name__}"
            )

    @classmethod
    def parse(cls, text: str) -> DrafterSpec:
        """``"eagle:depth=4,top_k=1"`` (or just ``"eagle"``) → a spec; ``-`` may stand for ``_`` in keys.

        Raises:
            ValueError: an unknown drafter or option, a missing ``=``, or a value the option refuses.
        """
        name, _, rest = text.strip().partition(":")
        kind = drafter_type(name.strip())
        known = {f.name: f for f in dataclasses.fields(kind.options)}
        values = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in known:
                takes = ", ".join(known) or "no options"
                raise ValueError(f"drafter spec {text!r}: {item!r} is not KEY=VALUE with a known key "
                                 f"(the {kind.name} drafter takes {takes})")
            if key in values:
                raise ValueError(f"drafter spec {text!r}: {key} is given twice; keep one")
            parse = known[key].metadata["parse"]
            try:
                values[key] = parse(value.strip())
            except ValueError as e:
                message = (f"expected {_WORDS[parse]}, got {value.strip()!r}" if parse in _WORDS
                           else _keys(str(e), kind.name, known))
                message = message if message.startswith(key) else f"{key}: {message}"
                raise ValueError(f"drafter spec {text!r}: {message}") from None
        try:
            return cls(kind.name, kind.options(**values))
        except ValueError as e:
            raise ValueError(f"drafter spec {text!r}: {_keys(str(e), kind.name, known)}") from None

    @property
    def kind(self) -> DrafterType:
        """Its registered type: what it declares (``plain``, ``needs_draft_model``)."""
        return drafter_type(self.name)

    def __str__(self) -> str:
        """The spec string (only options that differ from their defaults)."""
        changed = [f"{f.name}={getattr(self.options, f.name)}" for f in dataclasses.fields(self.options)
                   if getattr(self.options, f.name) != f.default]
        return self.name + (":" + ",".join(changed) if changed else "")

    def replace(self, **changes) -> DrafterSpec:
        """This spec with some options changed (validated again)."""
        return DrafterSpec(self.name, dataclasses.replace(self.options, **changes))


def _keys(message: str, name: str, keys) -> str:
    """An option's error as a spec's user reads it: its flags (``--draft-vocab``) named by their keys
    (``vocab``)."""
    for key in keys:
        message = message.replace(f"--{name}-{key.replace('_', '-')}", key)
    return message


def parse_specs(text: str) -> list[DrafterSpec]:
    """A comma-separated list of specs: ``"eagle,medusa:tree=small_15,ngram,none"``.

    A ``KEY=VALUE`` item without a ``:`` continues the spec before it, so
    ``"eagle:depth=4,top_k=1,ngram"`` is two specs: EAGLE with two options, then n-gram.

    Raises:
        ValueError: an empty list, or a spec ``DrafterSpec.parse`` refuses.
    """
    pieces: list[str] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if pieces and "=" in item and ":" not in item:
            pieces[-1] += "," + item
        else:
            pieces.append(item)
    if not pieces:
        raise ValueError("no drafter named; give e.g. 'ngram' or 'eagle:depth=4,none'")
    return [DrafterSpec.parse(piece) for piece in pieces]


def make_drafter(
    spec: str | DrafterSpec = "none",
    target=None,
    tokenizer=None,
    *,
    target_name: str | None = None,
    draft_model=None,
    draft_tokenizer=None,
    on_measure: Callable[[str], None] | None = None,
    target_path: str | None = None,
) -> Drafter:
    """Build a drafter from a spec.

    Args:
        spec: A ``DrafterSpec`` or a spec string (``"ngram"``, ``"medusa:tree=small_15"``,
            ``"eagle:heads=PATH,depth=4"``). Default: ``"none"`` (plain decoding).
        target: The target model (needed by every drafter but ``ngram`` and ``none``).
        tokenizer: The target's tokenizer (``draft``: checked against the draft model's).
        target_name: The target's name (``loading.models.model_name``); the suffix drafter keys its store by
            it (heads are found by what the target is).
        draft_model, draft_tokenizer: A loaded draft model and its tokenizer (``draft``).
        on_measure: Told before a cost measurement that was not cached. Default: none.
        target_path: The target's folder, where ``mtp`` finds the model's own MTP layers. Default: none.

    Returns:
        Drafter: Ready for ``stream_generate``.

    Raises:
        TypeError: ``spec`` is neither a string nor a ``DrafterSpec``.
        ValueError, FileNotFoundError: an unknown drafter or option, a missing draft model or
            heads, heads that do not fit the target, a draft model with another tokenizer, a
            ``draft_model`` given to another drafter than ``draft`` (it would be ignored).
    """
    if not isinstance(spec, (str, DrafterSpec)):
        raise TypeError(
            f"spec must be a drafter spec string such as 'ngram' or 'eagle:depth=4', or a DrafterSpec, got "
            f"{type(spec).__name__}"
        )
    spec = DrafterSpec.parse(spec) if isinstance(spec, str) else spec
    if draft_model is not None and not spec.kind.needs_draft_model:
        takes = " or ".join(k.name for k in drafter_types().values() if k.needs_draft_model)
        raise ValueError(
            f"draft_model is used by the {takes} drafter only, but the drafter is {spec.name}; pass "
            f"'{takes}', or leave draft_model out"
        )
    context = DrafterContext(
        target, tokenizer, target_name, draft_model, draft_tokenizer, on_measure, target_path
    )
    return drafter_type(spec.name).build(spec.options, context)
