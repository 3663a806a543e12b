"""From specs to a ready target, draft model and drafter: what ``generate``, ``chat`` and ``bench`` share.

A model is named by a ``ModelSpec`` (what ``loading.models.load`` takes, plus a dtype), a drafter by a
``DrafterSpec``. ``load_model`` keeps a model's name (for shipped heads and drafts) apart from
its display string; ``draft_model_spec`` finds the draft model a draft drafter needs (given, or
shipped for the target); ``build_drafter`` builds the drafter for loaded models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..loading.assets import PUBLISHED, shipped
from ..loading.sharded import SHARD_KINDS, shard
from ..runtime.distributed import init_group
from ..core.cache import check_compactable, check_rewindable, speculative_cache
from ..drafters import Drafter, DrafterSpec, make_drafter
from ..loading.models import DEFAULT_MODEL, DTYPES, describe, is_quantized, load, model_name

#: Errors a user can cause (bad files, bad flags): shown as one line, never a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)


@dataclass(frozen=True)
class ModelSpec:
    """A model to load.

    Attributes:
        spec: What ``loading.models.load`` takes: an mlx-lm folder, a Hugging Face repo id, a ``.gguf``
            file or ``"default"``.
        dtype: ``None`` keeps the stored dtypes; ``"float32"``/``"float16"``/``"bfloat16"`` dequantizes.
        shard: ``None`` loads the whole model; ``"tensor"`` or ``"pipeline"`` splits it over the ranks of a
            job started by ``mlx.launch`` (``loading.sharded.shard``, docs/distributed.md).

    Raises:
        ValueError: an empty spec, an unknown dtype or an unknown shard kind.
    """

    spec: str = DEFAULT_MODEL
    dtype: str | None = None
    shard: str | None = None

    def __post_init__(self):
        if not self.spec:
            raise ValueError("the model spec is empty; pass a folder, a .gguf file, a repo id or 'default'")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.shard is not None and self.shard not in SHARD_KINDS:
            raise ValueError(f"unknown shard kind {self.shard!r}; choose one of {', '.join(SHARD_KINDS)}")

    @property
    def name(self) -> str:
        """The model's name without format or quantization (``loading.models.model_name``)."""
        return model_name(self.spec)


@dataclass
class LoadedModel:
    """A loaded model with its identity.

    Attributes:
        model, tokenizer: From ``loading.models.load``.
        spec: What it was loaded from.
        name: Its name for shipped assets, e.g. ``"SmolLM2-135M-Instruct"``.
        display: Its name with format and weights, e.g. ``"SmolLM2-135M-Instruct (GGUF Q4_1, quantized)"``.
        quantized: Whether any layer is quantized.
    """

    model: object
    tokenizer: object
    spec: ModelSpec
    name: str
    display: str
    quantized: bool


def load_model(spec: ModelSpec | str, role: str | None = None) -> LoadedModel:
    """Load a model named by ``spec``.

    Args:
        spec: A ``ModelSpec`` or the text of one (stored dtypes).
        role: Prefixes errors, e.g. ``"draft model"`` → ``"draft model: No such file ..."``.

    With ``spec.shard``, every rank of the ``mlx.launch`` job builds the whole model with unevaluated
    weights, splits it (``loading.sharded.shard``) and then evaluates only its share, as mlx-lm's
    ``sharded_load`` does: a rank's memory holds its share, not the whole model (a GGUF's stored bytes
    are read whole first; docs/distributed.md gives the numbers).

    Raises:
        ValueError, FileNotFoundError: as ``loading.models.load``; ``distributed.init_group`` and
            ``loading.sharded.shard``.
    """
    spec = ModelSpec(spec) if isinstance(spec, str) else spec
    try:
        model, tokenizer = load(spec.spec, dtype=spec.dtype, lazy=spec.shard is not None)
        if spec.shard is not None:
            shard(model, spec.shard, init_group())
    except USER_ERRORS as e:
        if role is None:
            raise
        raise type(e)(f"{role}: {e}") from e
    return LoadedModel(model, tokenizer, spec, spec.name, describe(spec.spec, model), is_quantized(model))


def default_drafter(draft_model) -> DrafterSpec:
    """The drafter when none is named: the draft model's (``"draft"``) when one is given, else the n-gram
    lookup."""
    return DrafterSpec("draft" if draft_model else "ngram")


def draft_model_spec(drafter: DrafterSpec, given: ModelSpec | None, target: ModelSpec,
                     dtype: str | None = None) -> ModelSpec | None:
    """The draft model to load for ``drafter``: the one given, else (``draft`` drafter only) the one
    shipped in ``models/draft/<target name>/`` (in ``dtype``), else ``None``.

    Raises:
        ValueError: a ``draft`` drafter with no draft model given and none shipped for the target.
    """
    if given is not None:
        return given
    if not drafter.kind.needs_draft_model:
        return None
    path = shipped("draft", target.name)
    if path is None:
        raise ValueError(
            f"--drafter draft needs a draft model: pass --draft-model PATH_OR_REPO ({PUBLISHED['draft']}; "
            f"none ships for {target.name}), or distil one with 'mlxspec train draft'"
        )
    return ModelSpec(str(path), dtype)


def build_drafter(spec: DrafterSpec, target: LoadedModel, draft: LoadedModel | None = None,
                  on_measure: Callable[[str], None] | None = None) -> Drafter:
    """``make_drafter`` for loaded models (the target's name finds shipped heads; its folder, MTP layers).

    Raises:
        ValueError, FileNotFoundError: as ``make_drafter``.
    """
    draft = draft if spec.kind.needs_draft_model else None  # the chat keeps a loaded draft model for F2
    return make_drafter(
        spec,
        target.model,
        target.tokenizer,
        target_name=target.name,
        draft_model=draft.model if draft else None,
        draft_tokenizer=draft.tokenizer if draft else None,
        on_measure=on_measure,
        target_path=target.spec.spec,
    )


def check_fits(target: LoadedModel, drafter: Drafter) -> None:
    """Refuse, at load time, a drafter the target's cache cannot serve (plain decoding always fits).

    Raises:
        ValueError: the target's cache cannot be rewound (or, for a tree drafter, compacted).
    """
    if not drafter.profile.plain:
        (check_compactable if drafter.makes_trees else check_rewindable)(speculative_cache(target.model))


def runnable_drafters(
    specs: list[DrafterSpec],
    target: LoadedModel,
    draft: LoadedModel | None = None,
    on_measure: Callable[[str], None] | None = None,
) -> tuple[dict[str, Drafter], dict[str, str]]:
    """Build each drafter that can run on ``target`` as it is; say why each other one cannot.

    A drafter runs when its weights are given in its spec or ship for this target (heads matched by
    the model's card, ``identity.shipped_for``; drafts by name), its draft model is loaded, and the
    target's cache serves it (``check_fits``).

    Args:
        specs: The drafters to try, e.g. one ``DrafterSpec(name)`` per registered name.
        target: The loaded target.
        draft: The loaded draft model, or ``None`` (then ``draft`` cannot run).
        on_measure: Told before a cost measurement that was not cached. Default: none.

    Returns:
        tuple[dict[str, Drafter], dict[str, str]]: the built drafters by spec string, and for each
        spec that cannot run, the one-line reason (what is missing and the flag that supplies it).
    """
    built, skipped = {}, {}
    for spec in specs:
        try:
            if spec.kind.needs_draft_model and draft is None:
                draft_model_spec(spec, None, target.spec)  # raises, saying what to pass, when none ships
                raise ValueError(
                    f"the draft model shipped for {target.name} was not loaded; load it and pass it"
                )
            drafter = build_drafter(spec, target, draft, on_measure)
            check_fits(target, drafter)
        except USER_ERRORS as e:
            skipped[str(spec)] = str(e)
            continue
        built[str(spec)] = drafter
    return built, skipped
