"""One training loop for every head and draft: Medusa, EAGLE-1/3, draft distillation and those to come.

Shaped like mlx-lm's ``tuner/trainer.py`` (``train(model, optimizer, train_dataset, ..., loss=...,
iterate_batches=...)``): ``fit`` owns what every method shares and a small ``Task`` supplies what differs.

- The loop: the training state and its checkpoint (``trainer_state.json``, ``optimizer.safetensors``
  beside the task's own float32 weights), the resume checks (same settings, same data; otherwise one
  clear error), AdamW with linear warm-up and cosine decay (``warmup_cosine``) and optional gradient
  clipping, the resume-skip (a resumed epoch replays the same seeded batch order from the next step),
  ``save_every``, ``max_steps``, the time budget, held-out evaluation before training and after every
  epoch, the ``epoch-<n>/`` copies in ``save_dtype``, and the records it yields.
- The task: its model (fresh or loaded), how to save it, its batches for an epoch, the step loss and
  the held-out evaluation.

Resuming is exact: the batch order is a function of (seed, epoch), the optimiser state (moments, step
count) is restored, and per-step randomness is keyed by the global step, so a run killed after a
checkpoint and started again ends with the same weights, bit for bit, as one that never stopped. A
checkpoint is written whole beside the live one and then swapped in, so a kill while saving loses nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .store import write_json

STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"
PARTIAL, READY = "checkpoint.partial", "checkpoint.ready"
SAVE_DTYPES = ("float16", "bfloat16", "float32")
#: Loop settings that must match to resume a run: the batch order and per-step randomness follow the seed.
RESUME_KEYS = ("seed",)


@dataclass(frozen=True)
class TrainConfig:
    """Settings every method shares; each method's config extends it (and may change defaults).

    Attributes:
        epochs: Passes over the training data.
        max_steps: Stop after this many optimiser steps in all (the last epoch ends early, is scored and
            saved as usual; the learning-rate schedule spans these steps); 0 = no cap.
        time_budget_s: Start no new step after this many seconds of training in this call (the epoch
            then ends early, is scored and saved, and counts as done); ``None``: no limit.
        learning_rate: Peak AdamW learning rate.
        warmup_steps: Linear warm-up steps before the cosine decay to 0.
        weight_decay: AdamW weight decay.
        grad_clip: Clip the gradient to this global norm (0: no clipping).
        betas: AdamW's moment decay rates.
        seed: Seed of the batch order, per-step randomness and (where a method has any) the initial weights.
        save_every: Also checkpoint every this many steps of an epoch (0: only after each epoch).
        max_eval_positions: Held-out positions scored per evaluation.
        save_dtype: dtype of the per-epoch copies in ``epoch-<n>/`` (the resume checkpoint is float32).
    """

    epochs: int = 1
    max_steps: int = 0
    time_budget_s: float | None = None
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 0
    save_every: int = 0
    max_eval_positions: int = 4096
    save_dtype: str = "float16"

    def __post_init__(self):
        for name in ("epochs", "max_eval_positions"):
            _at_least(self, name, 1)
        for name in ("max_steps", "warmup_steps", "save_every"):
            _at_least(self, name, 0)
        if self.learning_rate <= 0:
            raise ValueError(f"learning-rate must be > 0, got {self.learning_rate}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(
                f"weight-decay and grad-clip must be >= 0, got {self.weight_decay}, {self.grad_clip}"
            )
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time budget must be > 0 seconds, got {self.time_budget_s}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save-dtype must be float16, bfloat16 or float32, got {self.save_dtype!r}")


def _at_least(config, name: str, low: int) -> None:
    """Raise the one-line error of a field below ``low`` (named as its flag)."""
    if getattr(config, name) < low:
        raise ValueError(f"{name.replace('_', '-')} must be >= {low}, got {getattr(config, name)}")


@dataclass(frozen=True)
class StepRecord:
    """One optimiser step.

    Attributes:
        epoch: Epoch index, from 0.
        step: Steps done in this epoch (1-based).
        steps_per_epoch: Steps this epoch will take (``max_steps`` included).
        loss: The task's training loss (nats).
        parts: The loss's parts as the task defines them (Medusa: per head; EAGLE: per unrolled step,
            EAGLE-1 then its feature regression; a draft: none).
        positions: Positions in the batch that carry a loss.
        tokens: Tokens the model ran over, padding included.
        step_s: Wall time of the step, seconds.
    """

    epoch: int
    step: int
    steps_per_epoch: int
    loss: float
    parts: list[float]
    positions: int
    tokens: int
    step_s: float


@dataclass(frozen=True, kw_only=True)
class EvalRecord:
    """Held-out scores after ``epoch`` epochs (0 = before training); each task extends it with its scores.

    A bare ``EvalRecord`` ends an epoch of a task that has no held-out data.

    Attributes:
        epoch: Epochs finished.
        train_loss: Mean training loss over the epoch (``None`` before training).
        checkpoint: Folder of this epoch's copy (``None`` before training).
    """

    epoch: int = 0
    train_loss: float | None = None
    checkpoint: str | None = None


class Task(Protocol):
    """What one training method supplies to ``fit``.

    Attributes:
        data: The training data's folder (resolved): a run resumes only on the same data.
        resume_keys: The method's settings that must match to resume (the loop adds ``RESUME_KEYS``).
        compile: Whether ``loss`` may be ``mx.compile``d with the optimiser step (fixed batch shapes).
        learning_rate_scales: Optional: top-level submodule name → multiplier of the learning rate for
            its parameters (their own AdamW on the same schedule), e.g. a small read-out head that would
            otherwise learn too slowly; absent or empty: one AdamW for everything.
    """

    data: str
    resume_keys: tuple[str, ...]
    compile: bool

    def init(self) -> nn.Module:
        """A fresh model (float32, evaluated), seeded by the task's settings."""

    def load(self, folder: Path) -> nn.Module:
        """The model ``save(model, folder, None)`` wrote."""

    def save(self, model: nn.Module, folder: Path, dtype: str | None) -> None:
        """Write the model to ``folder`` in its published layout; ``dtype`` ``None`` keeps float32."""

    def steps_in_epoch(self, epoch: int) -> int:
        """Batches in epoch ``epoch`` (a function of the settings and the data only)."""

    def batches(self, model: nn.Module, epoch: int, start: int) -> Iterator[Any]:
        """Epoch ``epoch``'s batches from index ``start`` on, in the seeded order."""

    def loss(self, model: nn.Module) -> Callable[..., tuple[mx.array, mx.array]]:
        """The loss over ``inputs(batch, ...)``: returns the scalar loss and its parts [P]."""

    def inputs(self, batch: Any, global_step: int) -> tuple:
        """The arguments of ``loss`` for one batch (``global_step`` keys any per-step randomness)."""

    def counts(self, batch: Any) -> tuple[int, int]:
        """``(positions with a loss, tokens run)`` of a batch."""

    def evaluate(self, model: nn.Module) -> EvalRecord | None:
        """Held-out scores with ``epoch`` 0 (the loop sets it), or ``None`` without held-out data."""


def cast_copy(model: nn.Module, make: Callable[[], nn.Module], dtype: str | None) -> nn.Module:
    """What a task's ``save`` writes: ``model`` itself for ``dtype`` ``None``, else ``make()`` (an empty
    module of the same shape) holding ``model``'s parameters with the floating ones cast to ``dtype``
    (``"float16"``, ...)."""
    if dtype is None:
        return model
    cast, copy = getattr(mx, dtype), make()
    copy.update(
        tree_map(lambda a: a.astype(cast) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters())
    )
    return copy


class EpochPlans:
    """A task whose epochs are planned ahead by ``plan_epoch(train, config, epoch=...)`` (a list of batches):
    each epoch's plan is made once, and ``steps_in_epoch`` is its length.

    A subclass sets ``plan_epoch`` (a static method) and has ``train`` and ``config``.
    """

    plan_epoch: Callable[..., list]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self._plan(epoch))

    def _plan(self, epoch: int) -> list:
        plans = self.__dict__.setdefault("_plans", {})
        if epoch not in plans:
            plans[epoch] = self.plan_epoch(self.train, self.config, epoch=epoch)
        return plans[epoch]


@dataclass
class _State:
    config: dict
    data: str
    epoch: int = 0
    step: int = 0
    global_step: int = 0
    loss_sum: float = 0.0  # over this epoch's steps so far, so a resumed epoch reports the same mean
    history: list[dict] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> _State:
        raw = json.loads(path.read_text())
        for legacy in ("features", "corpus"):  # the name of ``data`` before the shared loop
            if legacy in raw:
                raw.setdefault("data", raw.pop(legacy))
        return cls(**raw)


def warmup_cosine(learning_rate: float, warmup_steps: int, total_steps: int):
    """Linear warm-up from 0 over ``warmup_steps`` (capped below ``total_steps``), then cosine decay to 0
    over the remaining steps: the schedule every trainer here uses."""
    warmup = min(warmup_steps, max(total_steps - 1, 0))
    decay = optim.cosine_decay(learning_rate, max(total_steps - warmup, 1))
    if warmup == 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(0.0, learning_rate, warmup), decay], [warmup])


def make_optimizer(config: TrainConfig, total_steps: int, scales: dict[str, float] | None = None):
    """AdamW on ``warmup_cosine`` over ``total_steps``; the parameters of each top-level submodule named in
    ``scales`` get their own AdamW whose schedule is multiplied by its scale (an ``optim.MultiOptimizer``)."""
    def adamw(scale: float):
        return optim.AdamW(
            learning_rate=warmup_cosine(config.learning_rate * scale, config.warmup_steps, total_steps),
            betas=list(config.betas),
            weight_decay=config.weight_decay,
        )

    if not scales:
        return adamw(1.0)
    filters = [lambda path, _, name=name: path.split(".")[0] == name for name in scales]
    return optim.MultiOptimizer([adamw(scale) for scale in scales.values()] + [adamw(1.0)], filters)


def fit(task: Task, output: str | Path, config: TrainConfig, *, resume: bool = True
        ) -> Iterator[StepRecord | EvalRecord]:
    """Train ``task``'s model, checkpointing into ``output`` and resuming from there.

    Args:
        task: The method (see ``Task``); it holds its training and held-out data.
        output: Checkpoint folder: the task's float32 model, ``optimizer.safetensors``,
            ``trainer_state.json`` and ``epoch-<n>/`` per epoch in ``config.save_dtype``.
        config: Settings (a ``TrainConfig`` or a method's extension of it).
        resume: Continue from the checkpoint in ``output`` if there is one. Default: ``True``.

    Yields:
        The task's ``EvalRecord`` before training (fresh runs with held-out data) and after each
        epoch; a ``StepRecord`` per step.

    Raises:
        ValueError: the data has no batches; ``output`` holds a run with other settings or data (when
            resuming), or ``resume`` is false and ``output`` already holds a run.
    """
    output = Path(output)
    per_epoch = [task.steps_in_epoch(epoch) for epoch in range(config.epochs)]
    total = min(sum(per_epoch), config.max_steps) if config.max_steps else sum(per_epoch)
    if total == 0:
        raise ValueError(f"{task.data} has no training batches; check the data and --max-seq-length")
    optimizer = make_optimizer(config, total, getattr(task, "learning_rate_scales", None))
    state, model = _start(task, output, config, optimizer, resume)
    if state.global_step == 0 and not state.history:
        record = task.evaluate(model)
        if record is not None:
            state.history.append(asdict(record))
            yield record
    step = _step_function(task, model, optimizer, config.grad_clip)
    started = time.perf_counter()
    for epoch in range(state.epoch, config.epochs):
        if state.global_step >= total:
            break
        steps = min(per_epoch[epoch], total - (state.global_step - state.step))
        yield from _epoch(task, model, optimizer, step, output, config, state, epoch, steps, started)
        yield _end_epoch(task, model, optimizer, output, config, state, epoch)
        if _over_budget(config, started):
            break


def _epoch(task, model, optimizer, step, output: Path, config: TrainConfig, state: _State, epoch: int,
           steps: int, started: float):
    """The steps of one epoch from ``state.step`` on."""
    for batch in task.batches(model, epoch, state.step):
        if state.step >= steps or _over_budget(config, started):
            break
        t0 = time.perf_counter()
        loss, parts = step(*task.inputs(batch, state.global_step))
        mx.eval(loss, parts, model.parameters(), optimizer.state)
        state.step, state.global_step = state.step + 1, state.global_step + 1
        state.loss_sum += loss.item()
        if config.save_every and state.step % config.save_every == 0:
            _checkpoint(task, model, optimizer, output, state)
        positions, tokens = task.counts(batch)
        yield StepRecord(epoch, state.step, steps, loss.item(), parts.tolist(), positions, tokens,
                         time.perf_counter() - t0)


def _over_budget(config: TrainConfig, started: float) -> bool:
    return config.time_budget_s is not None and time.perf_counter() - started > config.time_budget_s


def _step_function(task, model: nn.Module, optimizer, grad_clip: float):
    """One AdamW step (clipped gradient) on ``task.inputs``; returns the lazy (loss, parts)."""
    loss_and_grad = nn.value_and_grad(model, task.loss(model))

    def step(*inputs):
        (loss, parts), grads = loss_and_grad(*inputs)
        if grad_clip > 0:
            grads, _ = optim.clip_grad_norm(grads, grad_clip)
        optimizer.update(model, grads)
        return loss, parts

    if not task.compile:
        return step
    state = [model.state, optimizer.state]
    return partial(mx.compile, inputs=state, outputs=state)(step)


def _end_epoch(
    task, model, optimizer, output: Path, config: TrainConfig, state: _State, epoch: int
) -> EvalRecord:
    """Save ``epoch-<n>/``, score the held-out data, checkpoint; the epoch's record."""
    train_loss = state.loss_sum / state.step if state.step else None
    state.epoch, state.step, state.loss_sum = epoch + 1, 0, 0.0
    folder = output / f"epoch-{epoch + 1}"
    task.save(model, folder, config.save_dtype)
    record = task.evaluate(model) or EvalRecord()
    record = dataclasses.replace(record, epoch=epoch + 1, checkpoint=str(folder),
                                 train_loss=train_loss)
    state.history.append(asdict(record))
    _checkpoint(task, model, optimizer, output, state)
    return record


def _start(task, output: Path, config: TrainConfig, optimizer, resume: bool) -> tuple[_State, nn.Module]:
    """A fresh model and optimiser, or the ones checkpointed in ``output`` (same settings and data only)."""
    fresh = _State(asdict(config), task.data)
    _publish(output)  # a checkpoint committed just before a kill
    shutil.rmtree(output / PARTIAL, ignore_errors=True)  # one a kill interrupted: the live one is whole
    path = output / STATE
    if not path.is_file():
        model = task.init()
        optimizer.init(model.trainable_parameters())
        return fresh, model
    if not resume:
        raise ValueError(f"{output} already holds a training run; resume it or pass a fresh --output")
    state = _State.read(path)
    _check_resume(output, state, fresh, config, task.resume_keys + RESUME_KEYS)
    state.config = fresh.config
    model = task.load(output)
    optimizer.init(model.trainable_parameters())
    optimizer.state = tree_unflatten(list(mx.load(str(output / OPTIMIZER)).items()))
    return state, model


def _check_resume(
    output: Path, state: _State, fresh: _State, config: TrainConfig, keys: tuple[str, ...]
) -> None:
    """Refuse to continue a run under other settings or on other data (one line naming what differs)."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}  # keys added since the run began
    changed = [k for k in keys if state.config.get(k, defaults.get(k)) != fresh.config[k]]
    if state.data != fresh.data:
        changed.append(f"training data ({state.data})")
    if changed:
        raise ValueError(f"{output} holds a run with different {', '.join(changed)}; use the same settings "
                         "to resume, or pass a fresh --output")


def _checkpoint(task, model: nn.Module, optimizer, output: Path, state: _State) -> None:
    """Write a whole checkpoint beside the live one, then swap it in, so a kill at any moment leaves one
    complete checkpoint: an unfinished ``checkpoint.partial/`` is discarded at the next start, and a
    committed ``checkpoint.ready/`` is published (the state file last)."""
    partial = output / PARTIAL
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    task.save(model, partial, None)
    mx.save_safetensors(str(partial / OPTIMIZER), dict(tree_flatten(optimizer.state)))
    write_json(partial / STATE, asdict(state))
    os.replace(partial, output / READY)  # the commit point
    _publish(output)


def _publish(output: Path) -> None:
    """Move a committed checkpoint's files over the live ones (the state file last); a no-op without one."""
    ready = output / READY
    if not ready.is_dir():
        return
    for path in sorted(ready.iterdir(), key=lambda p: p.name == STATE):
        os.replace(path, output / path.name)
    ready.rmdir()
