"""The chat's side of the runner (``mlxspec.engine.runner.Runner``): loads models, asks for answers, posts
results.

The runner owns the one MLX thread (loading happens there too, through ``Runner.call``, so no array or stream
crosses threads) and runs the conversation's answers one at a time on the same code path as the server.
Results go back with ``post`` (the app's thread-safe ``post_message``) as plain values, batched (``Relay``),
and the runner never waits for the UI. An answer is cancelled by setting its ``threading.Event``; the runner
checks it between rounds, and the caches end at the committed length.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields, replace
from collections.abc import Callable


from mlxspec.core.cache import PromptCache
from mlxspec.drafters import DRAFTERS, DrafterSpec
from mlxspec.drafters.draft_model import PYTHON_DRAFT_ADVICE
from mlxspec.pacing import AUTO, load_or_calibrate, make_pacer, tree_summary
from mlxspec.engine.generate import DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS, encode_prompt
from mlxspec.engine.output import Committed
from mlxspec.engine.runner import Done, Failed, Request, Runner, Setup
from mlxspec.core.metrics import GenerationStats
from mlxspec.core.sampling import SamplingParams
from mlxspec.engine.session import (
    USER_ERRORS,
    LoadedModel,
    ModelSpec,
    build_drafter,
    check_fits,
    default_drafter,
    load_model,
)
from mlxspec.loading.models import DEFAULT_MODEL
from mlxspec.core.stops import check_stops

from .messages import (
    EngineInfo,
    EngineReady,
    GenerationDone,
    GenerationFailed,
    LoadFailed,
    LoadProgress,
    StatsSnapshot,
    StatsUpdated,
    TokensCommitted,
)

#: Shortest time between two token batches, seconds (the UI needs no more than ~30 frames/s).
FLUSH_S = 1 / 30
#: The dtype word that loads a model as stored (``app.screens.drafter.AS_STORED``).
AS_STORED = "as stored"
#: Rounds kept for the τ sparkline.
SPARKLINE_ROUNDS = 120

Post = Callable[[object], object]


@dataclass(frozen=True)
class EngineConfig:
    """What to load and how to generate; the ``mlxspec chat`` flags.

    Attributes:
        model: The target (a ``ModelSpec``, or the text of one).
        draft_model: The draft model, or ``None``.
        drafter: The drafter (a ``DrafterSpec`` or spec string); ``None`` = ``"draft"`` with a draft
            model, else ``"ngram"``.
        num_draft_tokens: γ, tokens drafted per round, ``"auto"`` or ``"scheduled"`` (``pacing.make_pacer``).
        sampling: Temperature and filters.
        max_tokens: Most tokens per answer.
        seed: Seed for ``mx.random`` before each answer, or ``None``.
        typical: ``(threshold, alpha)`` for the LOSSY typical acceptance, or ``None``.
        draft_dtype: The dtype of a draft model loaded later from the chat (F2). Default: as stored.
        stop: Stop strings that end an answer (``stops.StopStrings``; one ``str`` is one stop string).
            Default: none.
        recalibrate: With ``num_draft_tokens="auto"``, measure this machine's costs again the first time each
            target and drafter pair is used, instead of using the cached ones (``mlxspec generate
            --recalibrate``). Default: ``False``.
    """

    model: ModelSpec | str = DEFAULT_MODEL
    draft_model: ModelSpec | str | None = None
    drafter: DrafterSpec | str | None = None
    num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int | None = None
    typical: tuple[float, float] | None = None
    draft_dtype: str | None = None
    stop: tuple[str, ...] = ()
    recalibrate: bool = False

    def __post_init__(self):
        if isinstance(self.model, str):
            object.__setattr__(self, "model", ModelSpec(self.model))
        if isinstance(self.draft_model, str):
            object.__setattr__(self, "draft_model", ModelSpec(self.draft_model))
        if isinstance(self.drafter, str):
            object.__setattr__(self, "drafter", DrafterSpec.parse(self.drafter))
        if self.drafter is None:
            object.__setattr__(self, "drafter", default_drafter(self.draft_model))
        object.__setattr__(
            self, "stop", check_stops(self.stop)
        )  # one str is one stop string, not its characters


class Relay:
    """A request's sink: turns the runner's records into batched UI messages (called on the runner thread).

    Token texts are buffered and posted at most every ``flush_s`` (always after the last round and on a
    cancel); each flush also posts the running stats. Empty texts (a token that only starts a multi-byte
    character, or a stop token) make no span: the completing token's span carries the text.

    Args:
        request_id: The answer these records belong to.
        post: Thread-safe sink for messages (``App.post_message``).
        cancelled: Set by the UI to stop the answer.
        drafter, num_draft_tokens: Shown in the stats until the first round's totals arrive.
        policy: ``"auto"`` or ``"scheduled"`` when γ is picked each round (the panel then shows each round's
            ``RoundStats.gamma``); ``None`` for a fixed γ. Default: ``None``.
        shape: What a tree drafter proposes each round (``pacing.tree_summary``), or ``None``.
        flush_s: Shortest time between two batches, seconds. Default: ``1/30``.
        on_end: Called with the final record (``Done`` or ``Failed``) after it was posted. Default: none.
    """

    def __init__(self, request_id: int, post: Post, cancelled: threading.Event, *, drafter: str,
                 num_draft_tokens: int, policy: str | None = None, shape: str | None = None,
                 flush_s: float = FLUSH_S, on_end: Callable[[object], None] | None = None):
        self.request_id, self.post, self.cancelled = request_id, post, cancelled
        self.policy, self.shape, self.flush_s, self.on_end = policy, shape, flush_s, on_end
        self.totals = GenerationStats(drafter=drafter, num_draft_tokens=num_draft_tokens)
        self.taus: deque[int] = deque(maxlen=SPARKLINE_ROUNDS)
        self.spans: list[tuple[str, str]] = []
        self.last_flush, self.gamma_now = 0.0, 0

    def view(self) -> StatsSnapshot:
        return snapshot(
            self.totals, self.taus, policy=self.policy, shape=self.shape, gamma_now=self.gamma_now
        )

    def _spans(self) -> None:
        if self.spans:
            self.post(TokensCommitted(self.request_id, tuple(self.spans)))
            self.spans = []

    def __call__(self, item) -> None:
        if isinstance(item, Committed):
            self.spans += [(event.text, event.kind) for event in item.events if event.text]
            self.totals = item.totals
            self.taus.append(item.round.num_emitted)
            if self.policy is not None:
                self.gamma_now = item.round.gamma
            if self.cancelled.is_set() or time.monotonic() - self.last_flush >= self.flush_s:
                self._spans()
                self.post(StatsUpdated(self.request_id, self.view()))
                self.last_flush = time.monotonic()
            return
        self._spans()
        if isinstance(item, Done):
            if item.stats.rounds:
                self.totals = item.stats
            self.post(
                GenerationDone(
                    self.request_id, item.finish_reason == "cancelled", self.totals.finish_reason, self.view()
                )
            )
        elif isinstance(item, Failed):
            self.post(GenerationFailed(self.request_id, chat_words(item.message)))
        if self.on_end is not None:
            self.on_end(item)


def snapshot(stats: GenerationStats, taus: deque[int] | tuple[int, ...], *, policy: str | None = None,
             shape: str | None = None, gamma_now: int = 0) -> StatsSnapshot:
    """The panel's view of running totals; timing-based speed counts rounds only (no prefill)."""
    busy_s = stats.draft_s + stats.verify_s
    return StatsSnapshot(
        drafter=stats.drafter,
        num_draft_tokens=stats.num_draft_tokens,
        rounds=stats.rounds,
        tokens=stats.generation_tokens,
        tau=stats.tau,
        tau_round=taus[-1] if taus else 0,
        alpha=stats.alpha,
        tokens_per_s=stats.generation_tps or (stats.generation_tokens / busy_s if busy_s > 0 else 0.0),
        draft_s=stats.draft_s,
        verify_s=stats.verify_s,
        taus=tuple(taus),
        drafted=stats.drafted,
        policy=policy,
        gamma_now=gamma_now,
        gamma_mean=stats.gamma_mean,
        shape=shape,
    )


def chat_prompt(tokenizer, messages: list[dict]) -> str | list[int]:
    """The whole conversation through the tokenizer's chat template (plain text without one)."""
    if getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


#: Command-line advice in library errors, as it reads in the chat (where F2 switches drafters and models).
CHAT_WORDING = (
    (PYTHON_DRAFT_ADVICE, ""),
    ("pass --draft-model PATH_OR_REPO", "give a draft model in F2 (or start the chat with --draft-model)"),
    ("pass --medusa-heads PATH_OR_REPO", "start the chat with --medusa-heads PATH_OR_REPO"),
    ("pass --eagle-heads PATH_OR_REPO", "start the chat with --eagle-heads PATH_OR_REPO"),
    ("or --drafter none", "or choose the none drafter in F2"),
    ("use --drafter none", "choose the none drafter in F2"),
)


def chat_words(text: str) -> str:
    """Command-line advice in a message reworded for the chat (``CHAT_WORDING``)."""
    for flag_advice, chat_advice in CHAT_WORDING:
        text = text.replace(flag_advice, chat_advice)
    return text


def one_line(error: BaseException) -> str:
    """An exception as one line for the chat; the type is named unless it is a user error, and
    command-line advice is reworded for the chat (``CHAT_WORDING``)."""
    text = chat_words(" ".join(str(error).split()) or type(error).__name__)
    if isinstance(error, USER_ERRORS):
        return text
    return f"{type(error).__name__}: {text}"


@dataclass
class _Loaded:
    target: LoadedModel | None = None
    draft: LoadedModel | None = None
    drafter: object = None
    spec: DrafterSpec | None = None  # the drafter's spec: its settings, shown in F2
    specs: dict = field(default_factory=dict)  # the last settings of every drafter used, by name
    num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS
    policy: object = None  # the γ policy of every answer until the next configure (auto learns across turns)
    prompt_cache: PromptCache | None = None  # the target's cache, reused across the turns of the conversation


@dataclass(frozen=True)
class _Generate:
    request_id: int
    messages: list[dict]
    cancelled: threading.Event


@dataclass(frozen=True)
class _Configure:
    drafter: DrafterSpec | str | None
    num_draft_tokens: int | str | None
    model: str | ModelSpec | None
    draft_model: str | ModelSpec | None
    dtype: str | None = None  # a dtype to reload the target in ("as stored" = none), or None to keep it
    draft_dtype: str | None = None


class Engine:
    """The chat's models and answers on a ``Runner`` (one answer at a time). The UI calls ``start``,
    ``generate``, ``cancel``, ``configure`` and ``close``; all of them return at once.

    Args:
        config: Models and generation settings.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self._cancels: dict[int, threading.Event] = {}
        self._runner = Runner(max_batch=1, name="mlxspec-engine")
        self._post: Post | None = None
        self._state = _Loaded()  # touched on the runner thread only
        self._recalibrated: set[tuple] = set()  # (target, drafter, draft model) that --recalibrate measured

    def start(self, post: Post) -> None:
        """Start the runner thread; it loads the configured models first."""
        self._post = post
        self._runner.start()
        self._queue(_Configure(self.config.drafter, self.config.num_draft_tokens, self.config.model,
                               self.config.draft_model))

    def generate(self, request_id: int, messages: list[dict]) -> None:
        """Queue an answer to ``messages`` (``role``/``content`` dicts, system prompt included)."""
        self._cancels[request_id] = event = threading.Event()
        self._runner.call(self._generate, _Generate(request_id, list(messages), event), wait=False)

    def cancel(self, request_id: int) -> None:
        """Stop answer ``request_id`` after its current round (or before it starts)."""
        event = self._cancels.get(request_id)
        if event is not None:
            event.set()

    def configure(self, drafter: DrafterSpec | str | None = None, num_draft_tokens: int | str | None = None,
                  model: str | None = None, draft_model: str | None = None, *, dtype: str | None = None,
                  draft_dtype: str | None = None) -> None:
        """Queue a switch of drafter (a name, or a ``DrafterSpec`` with its settings), γ (an integer,
        ``"auto"`` or ``"scheduled"``), target or draft model, or their dtypes (``float32``, ``float16``,
        ``bfloat16`` or ``"as stored"``; a change reloads that model). ``None`` keeps what is in use; a new
        model is loaded in the dtype of the one it replaces unless a dtype is given."""
        self._queue(_Configure(drafter, num_draft_tokens, model, draft_model, dtype, draft_dtype))

    def close(self, timeout_s: float = 30.0) -> bool:
        """Cancel everything, stop the thread and wait up to ``timeout_s`` for it (an answer stops after its
        current round) to release the models and the device. Returns whether it stopped; the process can then
        exit normally, with status 0 (``mlxspec.runtime.threads``)."""
        for event in list(self._cancels.values()):
            event.set()
        self._runner.call(self._release, wait=False)
        return self._runner.close(timeout_s)

    @property
    def running(self) -> bool:
        """Whether the runner thread is still alive (after ``close``: it did not stop in time)."""
        return self._runner.is_alive()

    def _queue(self, request: _Configure) -> None:
        self._runner.call(self._configure_safely, request, wait=False)

    # Everything below runs on the runner thread.

    def _release(self) -> None:
        self._state = _Loaded()  # the models and caches are released here, on the thread that made them

    def _configure_safely(self, request: _Configure) -> None:
        try:
            self._configure(self._post, request)
        except Exception as e:  # a bug must not kill the thread: the UI would wait forever
            self._post(LoadFailed(f"Engine error: {one_line(e)}"))

    def _generate(self, request: _Generate) -> None:
        state, config, rid, post = self._state, self.config, request.request_id, self._post
        try:
            if state.target is None:
                raise ValueError("no target model is loaded; press F2 and give one to load")
            gamma = state.policy.max_gamma
            if request.cancelled.is_set():  # stopped while queued: skip the prefill
                self._cancels.pop(rid, None)
                return post(GenerationDone(rid, True, None, StatsSnapshot(state.drafter.name, gamma)))
            tokenizer = state.target.tokenizer
            prompt = encode_prompt(tokenizer, chat_prompt(tokenizer, request.messages))
            relay = Relay(
                rid,
                post,
                request.cancelled,
                drafter=state.drafter.name,
                num_draft_tokens=gamma,
                policy=state.num_draft_tokens if state.policy.adaptive else None,
                shape=_shape(state.drafter, state.policy),
                on_end=lambda end: self._ended(rid, end, state),
            )
            self._runner.submit(
                Request(
                    prompt,
                    config.max_tokens,
                    config.sampling,
                    config.seed,
                    config.stop,
                    relay,
                    cancelled=request.cancelled,
                    cache=state.prompt_cache,
                    typical=config.typical,
                )
            )
        except Exception as e:  # the thread must survive any failure; the UI shows it
            self._cancels.pop(rid, None)
            post(GenerationFailed(rid, one_line(e)))

    def _ended(self, rid: int, end, state: _Loaded) -> None:
        self._cancels.pop(rid, None)
        if (
            isinstance(end, Failed) and state.target is not None
        ):  # a round may have stopped half-way: start afresh
            state.prompt_cache = PromptCache(state.target.model)

    def _configure(self, post: Post, request: _Configure) -> None:
        state = replace(self._state)
        if request.num_draft_tokens is not None:
            state.num_draft_tokens = request.num_draft_tokens
        loads = [
            (role, spec)
            for role, spec in (
                ("target model", self._model_spec(request, draft=False)),
                ("draft model", self._model_spec(request, draft=True)),
            )
            if spec
        ]
        total = len(loads) + 1
        for step, (role, spec) in enumerate(loads, 1):
            post(LoadProgress(f"Loading the {role} {spec.spec}", step, total))
            try:
                loaded = load_model(spec)
            except Exception as e:  # keep what was loaded before; the UI shows the error
                post(LoadFailed(f"Could not load the {role} {spec.spec}: {one_line(e)}"))
                if role == "target model":
                    return
                continue
            if role == "target model":
                state.target, state.prompt_cache = loaded, PromptCache(loaded.model)
            else:
                state.draft = loaded
        if state.target is None:
            return
        spec = self._spec(request.drafter, state)
        name = spec.name
        post(LoadProgress(f"Building the {name} drafter", total, total))

        def note(what: str) -> None:
            post(LoadProgress(f"Measuring {what} on this machine (once; cached)", total, total))

        try:
            state.drafter, state.spec = self._make_drafter(spec, state, note), spec
            check_fits(state.target, state.drafter)
            state.specs = {**state.specs, name: spec}
        except Exception as e:
            keep = state.drafter if state.drafter is not None and not request.model else None
            state.drafter = keep or self._fallback(state, note)  # an old drafter may not fit a new target
            state.spec = self._state.spec if keep is not None else DrafterSpec(state.drafter.name)
            post(
                LoadFailed(
                    f"Cannot use the {name} drafter: {one_line(e)}; keeping the {state.drafter.name} drafter"
                )
            )
        try:
            costs = self._fresh_costs(state, note)
            state.policy = make_pacer(state.num_draft_tokens, state.target.model, state.drafter, costs=costs,
                                        on_measure=note)
        except Exception as e:
            state.num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS
            state.policy = make_pacer(state.num_draft_tokens, state.target.model, state.drafter)
            post(LoadFailed(f"Cannot use γ {request.num_draft_tokens}: {one_line(e)}; using "
                            f"{DEFAULT_NUM_DRAFT_TOKENS}"))
        self._state = state
        self._runner.use(Setup(state.target.model, state.target.tokenizer, state.drafter, state.policy))
        post(EngineReady(self._info()))

    def _fresh_costs(self, state: _Loaded, on_measure):
        """With ``recalibrate`` and γ auto, the costs measured again (as ``mlxspec generate --recalibrate``),
        once per target and drafter pair; else ``None``: ``make_pacer`` uses the cached ones."""
        key = (state.target.spec, state.drafter.name, state.draft.spec if state.draft else None)
        if not self.config.recalibrate or state.num_draft_tokens != AUTO or state.drafter.profile.plain \
                or key in self._recalibrated:
            return None
        self._recalibrated.add(key)
        return load_or_calibrate(state.target.model, state.drafter, refresh=True, on_measure=on_measure)

    def _fallback(self, state: _Loaded, on_measure):
        """The n-gram drafter, or plain decoding on a target whose cache cannot be rewound."""
        drafter = self._make_drafter("ngram", state, on_measure)
        try:
            check_fits(state.target, drafter)
        except ValueError:
            drafter = self._make_drafter("none", state, on_measure)
        return drafter

    def _spec(self, drafter: DrafterSpec | str | None, state: _Loaded) -> DrafterSpec:
        """A drafter by name gets the settings it has now (or was started with), else its defaults."""
        if isinstance(drafter, DrafterSpec):
            return drafter
        name = drafter or (state.spec.name if state.spec else "ngram")
        for known in (state.spec, state.specs.get(name), self.config.drafter):
            if known is not None and known.name == name:
                return known
        return DrafterSpec(name)

    def _model_spec(self, request: _Configure, draft: bool) -> ModelSpec | None:
        """The model a request loads: a new spec, or the loaded one again in a new dtype (``None``:
        nothing)."""
        spec, dtype = (request.draft_model, request.draft_dtype) if draft else (request.model, request.dtype)
        if isinstance(spec, ModelSpec):
            return spec
        loaded = self._state.draft if draft else self._state.target
        if spec is None and (dtype is None or loaded is None):
            return None
        keep = (
            loaded.spec.dtype
            if loaded is not None
            else (self.config.draft_dtype if draft else self.config.model.dtype)
        )
        dtype = keep if dtype is None else None if dtype == AS_STORED else dtype
        return ModelSpec(spec or loaded.spec.spec, dtype)

    def _make_drafter(self, spec: DrafterSpec | str, state: _Loaded, on_measure=None):
        """Build ``spec`` (a name: see ``_spec``) for the loaded models."""
        return build_drafter(self._spec(spec, state), state.target, state.draft, on_measure)

    def _info(self) -> EngineInfo:
        s = self._state
        options = tuple((f.name, str(getattr(s.spec.options, f.name))) for f in fields(s.spec.options)
                        if getattr(s.spec.options, f.name) != f.default) if s.spec else ()
        return EngineInfo(
            s.target.display,
            s.target.quantized,
            s.draft.display if s.draft else None,
            s.drafter.name,
            s.num_draft_tokens,
            DRAFTERS,
            options,
            s.target.spec.dtype,
            s.draft.spec.dtype if s.draft else None,
            _shape(s.drafter, s.policy),
        )


def _shape(drafter, policy=None) -> str | None:
    """What a tree drafter proposes each round, as ``mlxspec generate`` says it (``pacing.tree_summary``,
    which also says when the costs ruled the drafter out); ``None`` for a chain that drafts."""
    return tree_summary(drafter, policy)
