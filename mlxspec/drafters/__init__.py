"""Drafters behind one small interface (``Drafter``), registered by name (``registry``).

Every module of this package is imported here, and a drafter module registers its type on
import, so adding a drafter is adding one file (see ``registry`` for what the file holds).
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Draft, Drafter, DraftProfile, Plan
from .registry import (
    DrafterContext,
    DrafterSpec,
    DrafterType,
    drafter_type,
    drafter_types,
    make_drafter,
    parse_specs,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from .draft_model import DraftModelDrafter, check_same_tokenizer  # noqa: E402
from .eagle import EagleDrafter  # noqa: E402
from .medusa import MedusaDrafter  # noqa: E402
from .ngram import NgramDrafter  # noqa: E402
from .none import NoDrafter  # noqa: E402

#: The registered drafter names, in listing order.
DRAFTERS = tuple(drafter_types())

__all__ = [
    "DRAFTERS",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "DrafterContext",
    "DrafterSpec",
    "DrafterType",
    "DraftProfile",
    "EagleDrafter",
    "MedusaDrafter",
    "NgramDrafter",
    "NoDrafter",
    "check_same_tokenizer",
    "drafter_type",
    "drafter_types",
    "make_drafter",
    "parse_specs",
    "Plan",
]
