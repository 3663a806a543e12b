"""The speculative decoding loop: propose → verify → accept → commit → emit.

Leviathan et al. 2023 (arXiv 2211.17192) and Chen et al. 2023 (arXiv 2302.01318).
Each round the drafter proposes up to γ tokens after the root (the last committed
token); the target scores ``[root, *draft]`` in one forward; the acceptance rule
keeps a prefix of the draft and adds one token (resampled on a rejection, bonus
when every draft survived); the target cache is rewound to the committed tokens.
A round makes one blocking host sync. With nothing drafted a round is a plain
decoding step, so ``--drafter none`` runs through the same loop; consecutive plain
steps are pipelined as in ``mlx_lm.generate_step`` (the next step's forward is queued
with ``mx.async_eval`` before the current token is read).

Cache invariant: the target cache holds every committed token except the last,
which is the next round's root (as in ``mlx_lm.generate_step``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from .arguments import check_ids, check_prompt, check_types, check_typical
from ..core.cache import (
    DEFAULT_PREFILL_STEP_SIZE,
    PromptCache,
    as_prompt_cache,
    check_compactable,
    check_rewindable,
    commit_path,
    prefill,
    tree_attention,
)
from ..drafters import Draft, Drafter, DrafterSpec, Plan, make_drafter
from ..core.metrics import RoundStats, GenerationStats, TokenEvent
from ..pacing import Fixed, Pacer, make_pacer
from .plain_steps import PlainSteps
from ..core.sampling import SamplingParams, process_logits, warp
from ..core.taps import HiddenTap
from ..core.stops import StopStrings, check_stops
from .output import Committed, Output
from ..core.verify import verify_deterministic, verify_greedy, verify_sampled, verify_typical

DEFAULT_NUM_DRAFT_TOKENS = 4
DEFAULT_MAX_TOKENS = 256
#: With ``time_split``, a lazy drafter is timed exactly (one extra sync) on every this-many rounds.
TIMING_EVERY = 8


@dataclass(frozen=True)
class GenerationResult:
    """What ``generate`` returns.

    Attributes:
        text: The generated text (stop token excluded).
        tokens: Committed token ids, including a final stop token.
        stats: Run totals.
    """

    text: str
    tokens: list[int]
    stats: GenerationStats


@dataclass
class _Round:
    tokens: list[int]
    kinds: list[str]
    stats: RoundStats
    finish_reason: str | None
    prefill_s: float = 0.0
    cached_tokens: int = 0


def encode_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    """Token ids for a prompt: ids (a list, or a 1-D integer array) pass through as Python ints; text is
    encoded as ``mlx_lm.generate`` does.

    Raises:
        ValueError: if the prompt is empty.
    """
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    if len(prompt) == 0:
        raise ValueError("the prompt is empty; give at least one token of text")
    return [int(i) for i in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]


def context_length(model: nn.Module) -> int | None:
    """The model's context window in tokens (``max_position_embeddings``), or ``None`` if it names none."""
    return getattr(getattr(model, "args", None), "max_position_embeddings", None)


def check_context(model: nn.Module, num_prompt_tokens: int) -> None:
    """Refuse a prompt that does not fit the model's context window.

    Raises:
        ValueError: naming both lengths.
    """
    limit = context_length(model)
    if limit and num_prompt_tokens >= limit:
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens but the model's context is {limit}; "
            "shorten the prompt"
        )


def make_verifier(sampling: SamplingParams, typical: tuple[float, float] | None = None) -> Callable:
    """The acceptance rule of one generation, chosen once (as ``make_sampler`` chooses a sampler).

    Greedy (``temp == 0``): the target's argmax path (``verify.verify_greedy``). Otherwise the exact
    rule for the draft's q: one-hot (``verify_deterministic``) when a draft has no ``logprobs``, the
    Leviathan/Chen residual rule (``verify_sampled``) when it has; or, only when ``typical`` is
    given, Medusa's LOSSY typical acceptance (``verify_typical``).

    Args:
        sampling: The target's sampling settings.
        typical: ``(threshold, alpha)`` for typical acceptance, or ``None`` (exact).

    Returns:
        Callable: ``rule(tokens [N + 1], tree, logits [N + 1, V], draft) -> (choice, next_tokens)``, lazy.
    """
    if sampling.greedy:
        return lambda tokens, tree, logits, draft: verify_greedy(tokens, tree, logits)
    if typical is not None:
        return lambda tokens, tree, logits, draft: verify_typical(
            tokens, tree, logits, sampling.temp, *typical
        )

    def exact(tokens, tree, logits, draft):
        target_logprobs = warp(logits, sampling)
        if draft.logprobs is None:
            return verify_deterministic(tokens, tree, target_logprobs)
        return verify_sampled(tokens, tree, draft.logprobs, target_logprobs)

    return exact


def _verify(model, cache, history: list[int], draft: Draft, sampling: SamplingParams, rule: Callable):
    """One target forward over [root, *draft] (tree mask, per-node positions) and the
    acceptance rule; returns lazy ``(choice, next_tokens)`` over root-first nodes."""
    tokens = mx.concatenate([mx.array(history[-1:], dtype=mx.int32), draft.tokens])  # [N + 1]
    with tree_attention(model, cache, draft.tree):
        logits = model(tokens[None], cache=cache)[0]  # [N + 1, V]
    return judge(history, tokens, draft, logits, sampling, rule)


def judge(history: list[int], tokens: mx.array, draft: Draft, logits: mx.array, sampling: SamplingParams,
          rule: Callable) -> tuple[mx.array, mx.array]:
    """The acceptance rule on one row's verify logits (after its logits processors), lazy.

    Args:
        history: The committed tokens (the last is the root).
        tokens: ``[root, *draft.tokens]``, int32 [N + 1].
        draft: The verified draft.
        logits: The target's logits at those nodes, [N + 1, V].
        sampling, rule: The row's sampling settings and acceptance rule (``make_verifier``).

    Returns:
        ``(choice, next_tokens)`` over root-first nodes, as the rule returns them.
    """
    processors = sampling.processors()
    if processors:
        paths = [draft.tree.path_to(node) for node in range(draft.tree.size + 1)]
        logits = process_logits(logits, mx.array(history, dtype=mx.int32), processors, draft.tokens, paths)
    return rule(tokens, draft.tree, logits, draft)


def cut_round(tokens: list[int], stop_tokens: set[int], room: int, stop_strings: StopStrings | None):
    """How many of a round's tokens to keep (a stop token, ``room`` tokens left, a stop string), and why
    generation ends with it (``"stop"``, ``"length"`` or ``None``)."""
    keep, reason = next(
        ((i + 1, "stop") for i, t in enumerate(tokens[:room]) if t in stop_tokens), (None, None)
    )
    if keep is None:
        keep, reason = (room, "length") if len(tokens) >= room else (len(tokens), None)
    if stop_strings is not None and (
        cut := stop_strings.cut([t for t in tokens[:keep] if t not in stop_tokens])
    ):
        return cut, "stop"
    return keep, reason


def speculative_rounds(
    model: nn.Module, prompt: list[int], drafter: Drafter, *, num_draft_tokens: int | Pacer, max_tokens: int,
    sampling: SamplingParams, stop_tokens: set[int], rule: Callable | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE, prompt_cache: PromptCache | list | None = None,
    stop_strings: StopStrings | None = None, time_split: bool = False,
) -> Iterator[_Round]:
    """Prefill, then rounds until a stop token or ``max_tokens``: plan → propose → verify → one sync → commit
    → observe; yields each round's committed tokens (see the module docstring; ``_Rounds`` holds the
    steps)."""
    loop = _Rounds(
        model,
        prompt,
        drafter,
        num_draft_tokens,
        sampling,
        rule or make_verifier(sampling),
        as_prompt_cache(model, prompt_cache),
        prefill_step_size,
        time_split,
    )
    history, generated, upcoming = list(prompt), 0, None
    try:
        for index in range(max_tokens):
            room = max_tokens - generated
            plan, t0 = upcoming or loop.plan(room - 1), time.perf_counter()
            if plan.gamma == 0:  # a plain step: the next one is queued before this token is read if plain too
                upcoming = loop.plan(room - 2) if room > 1 else None
                draft, t1 = Draft.empty(), t0
                path, tokens, kinds, hidden = loop.plain.round(
                    history, queue=upcoming is not None and upcoming.gamma == 0
                )
            else:
                upcoming, draft = None, plan.select(drafter.propose(history, plan.gamma, sampling, plan))
                t1 = loop.clock.drafted(index, draft)
                path, tokens, kinds, hidden = loop.verify(history, draft)
            keep, finish_reason = cut_round(tokens, stop_tokens, room, stop_strings)
            if finish_reason:
                loop.plain.cancel()  # no next step: drop the one queued ahead
            loop.commit(history, path, tokens[:keep], hidden, draft.size)
            stats = RoundStats(
                index,
                draft.size,
                min(len(path), keep),
                keep,
                *loop.clock.split(t0, t1, draft.size),
                int(draft.tree.depths.max()) if draft.size else 0,
                tuple(n - 1 for n in path),
                plan.gamma if plan.keep_above is None else draft.size,
            )
            loop.pacer.observe(stats, draft)
            generated += keep
            if index % 64 == 63:
                mx.clear_cache()
            yield _Round(
                tokens[:keep],
                kinds[:keep],
                stats,
                finish_reason,
                loop.prefill_s if index == 0 else 0.0,
                loop.store.reused,
            )
            if finish_reason:
                return
    finally:
        loop.plain.cancel()  # a step queued ahead wrote the last committed token: drop it (the invariant)


class _Rounds:
    """The steps of ``speculative_rounds``: prefill (made here), plan, verify and commit.

    For a drafter that reads the target's features each plain step keeps the features of its input,
    as a verify does, so fall-back rounds cost what ``--drafter none``'s steps cost.
    """

    def __init__(self, model, prompt, drafter, pacer, sampling, rule, store, prefill_step_size, time_split):
        pacer = Fixed(pacer) if isinstance(pacer, int) else pacer  # an integer is a fixed γ
        self.model, self.drafter, self.pacer, self.sampling, self.rule, self.store = (
            model, drafter, pacer, sampling, rule, store)
        if pacer.max_gamma > 0:
            (check_compactable if drafter.makes_trees else check_rewindable)(store.layers)
        self.tap = HiddenTap(model, layers=drafter.feature_layers) if drafter.needs_hidden else None
        start = time.perf_counter()
        features = _prefill(model, store, prompt, drafter.feature_layers if self.tap else None, self.tap,
                            prefill_step_size)
        drafter.prefill(prompt, features)
        self.prefill_s = time.perf_counter() - start
        self.clock, self.plain = (
            _DraftClock(drafter.lazy and time_split),
            PlainSteps(model, store.layers, sampling, self.tap),
        )

    def plan(self, room: int) -> Plan:
        """The pacer's next plan, never drafting past ``room`` tokens."""
        plan = self.pacer.plan()
        return plan if plan.gamma <= room else Plan(max(room, 0), plan.keep_above, plan.budget, plan.select)

    def verify(self, history: list[int], draft: Draft):
        """One target forward over [root, *draft], the acceptance rule, and the round's one blocking sync."""
        choice, next_tokens = _verify(self.model, self.store.layers, history, draft, self.sampling, self.rule)
        hidden = self.tap.features()[0] if self.tap is not None else None  # [N + 1, F]
        mx.eval(choice, next_tokens, draft.tokens, hidden)
        return (*accepted_path(draft, choice.tolist(), next_tokens.tolist()), hidden)

    def commit(
        self, history: list[int], path: list[int], kept_tokens: list[int], hidden, num_drafted: int
    ) -> None:
        """Rewind the target cache to the committed tokens, extend ``history``, and tell the drafter."""
        kept = ([0] + path)[: len(kept_tokens)]  # root-first nodes whose positions stay in the cache
        commit_path(self.store.layers, len(history) - 1, kept, written=num_drafted + 1)
        features = hidden[mx.array(kept)] if self.store.feature_layers is not None else None
        self.store.add(history[-1:] + kept_tokens[:-1], features)
        history += kept_tokens
        self.drafter.commit(len(history), [node - 1 for node in path[: len(kept_tokens)]], hidden)


def _prefill(model, store: PromptCache, prompt: list[int], feature_layers: tuple[int, ...] | None, tap,
             step_size: int):
    """Prefill what ``store`` does not hold of ``prompt[:-1]``; the features (``feature_layers``, ``None``
    when the drafter reads none) of all of it for the drafter."""
    reused = store.reuse(prompt, feature_layers)
    new = prompt[reused:-1]
    hidden = prefill(model, store.layers, new, step_size, hidden_tap=tap)
    store.add(new, hidden if tap is not None and new else None)
    return store.features if tap is not None else None


def accepted_path(
    draft: Draft, choice: list[int], next_tokens: list[int]
) -> tuple[list[int], list[int], list[str]]:
    """Walk the accepted children from the root: accepted nodes (root-first numbering), the
    round's tokens (accepted drafts + one target token) and their kinds."""
    tree = draft.tree
    path = tree.walk(choice)
    last = path[-1] if path else 0
    drafted = draft.tokens.tolist()
    tokens = [drafted[node - 1] for node in path] + [next_tokens[last]]
    kind = "target" if tree.size == 0 else "bonus" if tree.is_leaf(last) else "resampled"
    return path, tokens, ["accepted"] * len(path) + [kind]


class _DraftClock:
    """Splits a round's time into draft and verify without an extra sync on most rounds.

    A host-side drafter (n-gram) is timed directly. A lazy drafter's work runs on the
    device inside the round's one sync, so every ``TIMING_EVERY``-th round it is
    evaluated on its own (one extra sync) and its measured share is applied to the others.
    """

    def __init__(self, lazy: bool):
        self.lazy, self.share = lazy, None

    def drafted(self, index: int, draft: Draft) -> float:
        """The time drafting ended (after evaluating a lazy draft on timed rounds)."""
        self.timed = self.lazy and draft.size > 0 and (index % TIMING_EVERY == 0 or self.share is None)
        if self.timed:
            mx.eval(draft.tokens)
        return time.perf_counter()

    def split(self, t0: float, t1: float, num_drafted: int) -> tuple[float, float]:
        """(draft_s, verify_s) of a round that started at ``t0`` and ended drafting at ``t1``."""
        t2 = time.perf_counter()
        if not (self.lazy and num_drafted > 0):
            return t1 - t0, t2 - t1
        if self.timed:
            self.share = (t1 - t0) / (t2 - t0)
        return self.share * (t2 - t0), (1 - self.share) * (t2 - t0)


def committed_rounds(
    model: nn.Module,
    tokenizer,
    prompt: str | list[int],
    *,
    drafter: Drafter | DrafterSpec | str = "none",
    num_draft_tokens: int | str | Pacer = DEFAULT_NUM_DRAFT_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    stop_tokens: set[int] | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    prompt_cache: PromptCache | list | None = None,
    typical: tuple[float, float] | None = None,
    stop: list[str] | tuple[str, ...] | None = None,
    time_split: bool = False,
) -> Iterator[Committed]:
    """``stream_generate`` one round at a time: a ``Committed`` per round (its token events, its
    ``RoundStats`` and the running totals), so a consumer that stops early still has the totals. The runner's
    one-at-a-time path and ``stream_generate`` share it. Takes the same arguments and raises the same errors
    as ``stream_generate``."""
    check_prompt(prompt)
    check_types(drafter, num_draft_tokens, max_tokens, sampling, stop_tokens, prefill_step_size, seed)
    typical = check_typical(typical)
    sampling = sampling or SamplingParams()
    stops = check_stops(stop)
    drafter = make_drafter(drafter, model, tokenizer) if isinstance(drafter, (str, DrafterSpec)) else drafter
    ids = encode_prompt(tokenizer, prompt)
    check_context(model, len(ids))
    check_ids(model, ids)
    limit = context_length(model)
    max_tokens = min(max_tokens, limit - len(ids)) if limit else max_tokens  # never past the context
    store = as_prompt_cache(model, prompt_cache)
    if not drafter.profile.plain and num_draft_tokens != 0:  # before any cost measurement for "auto"
        (check_compactable if drafter.makes_trees else check_rewindable)(store.layers)
    pacer = make_pacer(num_draft_tokens, model, drafter)
    stop_tokens = set(tokenizer.eos_token_ids) if stop_tokens is None else set(stop_tokens)
    if seed is not None:
        mx.random.seed(seed)
    mx.reset_peak_memory()
    stats = GenerationStats(drafter=drafter.name, num_draft_tokens=pacer.max_gamma, prompt_tokens=len(ids))
    stopper = StopStrings(tokenizer, stops) if stops else None
    output = Output(tokenizer, stats, stop_tokens, stops, stopper, pacer.adaptive)
    rounds = speculative_rounds(
        model,
        ids,
        drafter,
        num_draft_tokens=pacer,
        max_tokens=max_tokens,
        sampling=sampling,
        stop_tokens=stop_tokens,
        rule=make_verifier(sampling, typical),
        prefill_step_size=prefill_step_size,
        prompt_cache=store,
        stop_strings=stopper,
        time_split=time_split,
    )
    for round_ in rounds:
        if round_.stats.round == 0:
            stats.prompt_s, stats.cached_tokens = round_.prefill_s, round_.cached_tokens
        events = output.round(round_.tokens, round_.kinds, round_.stats, round_.finish_reason)
        if round_.finish_reason:
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        yield Committed(tuple(events), round_.stats, output.snapshot(), round_.finish_reason)


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: str | list[int],
    *,
    drafter: Drafter | DrafterSpec | str = "none",
    num_draft_tokens: int | str | Pacer = DEFAULT_NUM_DRAFT_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    stop_tokens: set[int] | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    prompt_cache: PromptCache | list | None = None,
    typical: tuple[float, float] | None = None,
    stop: list[str] | tuple[str, ...] | None = None,
    time_split: bool = False,
) -> Iterator[TokenEvent | RoundStats | GenerationStats]:
    """Generate with speculative decoding, streaming what each round commits.

    The output is distributed exactly as plain sampling from the target with the
    same ``sampling`` (and equals plain greedy decoding at ``temp == 0``).

    Args:
        model: The target, an mlx-lm model.
        tokenizer: Its ``mlx_lm`` ``TokenizerWrapper``.
        prompt: Text (encoded as-is; apply a chat template first if wanted) or ids.
        drafter: A ``Drafter``, or a ``DrafterSpec`` or spec string (``"ngram"``,
            ``"eagle:depth=4"``; built with ``make_drafter(spec, model, tokenizer)``).
            Default: ``"none"``.
        num_draft_tokens: γ, tokens drafted per round; ``0`` = plain decoding; ``"auto"``:
            the pacer ``pacing.make_pacer`` makes for this drafter, exactly as
            ``mlxspec generate`` does (a tree drafter's own depth, else γ per round from this
            machine's measured costs and the running acceptance, falling back to plain decoding
            when speculation is predicted to lose; costs are measured once and cached); or a
            pacer to reuse (``make_pacer``'s ``Auto`` keeps its acceptance estimate). Default: ``4``.
        max_tokens: Most tokens to generate. Default: ``256``.
        sampling: Temperature, filters and logits processors. Default: greedy.
        seed: Seed for ``mx.random`` (drafting and acceptance draws), or ``None``.
        stop_tokens: Ids that end generation. Default: the tokenizer's EOS ids.
        prefill_step_size: Prompt tokens per prefill forward. Default: ``2048``.
        prompt_cache: A ``cache.PromptCache`` to reuse across requests (the common prefix of
            what it holds and this prompt is kept, only the rest is prefilled; afterwards it holds
            prompt + output except the last token); or an empty mlx-lm cache list to fill in
            place; or ``None`` (a fresh cache). Either must be made for ``model`` (``cache.check_layers``).
        typical: ``(threshold, alpha)`` turns on Medusa's typical acceptance at
            ``temp > 0`` — LOSSY, the output is no longer distributed as the target's
            (``verify.verify_typical``). Default: ``None`` (exact).
        stop: Stop strings: generation ends at the first one in the output text, which ends just
            before it (``stops.StopStrings``; exact across tokens accepted in one round, and the
            cache holds exactly what was emitted); one ``str`` is one stop string. Default: none.
        time_split: Measure a lazy drafter's (draft model, heads) device time apart from the
            verify, with one extra sync every ``TIMING_EVERY`` rounds (``mlxspec bench`` does).
            Without it no round pays a sync for timing, and the stats' ``draft_s`` of a lazy
            drafter is only the host time to build its graph. Default: ``False``.

    Yields:
        ``TokenEvent`` per committed token (text deltas never split a multi-byte
        character), a ``RoundStats`` after each round's tokens, and finally the
        ``GenerationStats``.

    Raises:
        TypeError: an argument of the wrong kind (a prompt that is neither text nor token ids, a float γ or
            ``max_tokens``, ``sampling`` that is not a ``SamplingParams``, a drafter that is not one, a
            ``stop`` that is not text or a list of texts, a ``prompt_cache`` that is not a cache).
        ValueError: on an empty or too-long prompt, a token id outside the vocabulary, a seed outside
            [0, 2**64), ``num_draft_tokens < 0``
            or a string other than ``"auto"``, ``max_tokens < 1``, a bad drafter spec, a target
            cache that cannot be rewound while drafting, a cache list that already holds tokens, a cache made
            for another model, or an empty stop string.
    """
    rounds = committed_rounds(
        model, tokenizer, prompt, drafter=drafter, num_draft_tokens=num_draft_tokens, max_tokens=max_tokens,
        sampling=sampling, seed=seed, stop_tokens=stop_tokens, prefill_step_size=prefill_step_size,
        prompt_cache=prompt_cache, typical=typical, stop=stop, time_split=time_split)
    totals = None
    try:
        for committed in rounds:
            yield from committed.events
            yield committed.round
            totals = committed.totals
    finally:
        rounds.close()
    yield totals


def generate(model: nn.Module, tokenizer, prompt: str | list[int], **kwargs) -> GenerationResult:
    """Run ``stream_generate`` to the end and collect its text, tokens and stats.

    Takes the same keyword arguments as ``stream_generate`` and raises the same errors.
    """
    text, tokens, stats = [], [], None
    for event in stream_generate(model, tokenizer, prompt, **kwargs):
        if isinstance(event, TokenEvent):
            text.append(event.text)
            tokens.append(event.token)
        elif isinstance(event, GenerationStats):
            stats = event
    return GenerationResult("".join(text), tokens, stats)
