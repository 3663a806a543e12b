"""What every ``mlxspec train`` method shares: the run flags, the config they build, corpora, the progress
loop.

The optimiser and run flags (``--model``, ``--output``, ``--epochs``, ``--max-steps``, ``--time-budget``,
``--learning-rate``, ``--warmup-steps``, ``--weight-decay``, ``--grad-clip``, ``--seed``, ``--save-every``,
``--eval-positions``, ``--save-dtype``) are written once here, with each method's defaults taken from its
config dataclass; ``make_config`` turns parsed flags into that dataclass by field name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from tqdm import tqdm

from ...loading.models import load
from ...train import dataset
from ...train.features import FeatureCache
from ...train.loop import SAVE_DTYPES, EvalRecord, StepRecord, TrainConfig
from ...train.store import MANIFEST

TRAIN, VALIDATION = "train", "validation"
TRAINING_RECORD = "training.json"
HELDOUT_PROMPTS = "heldout_prompts.jsonl"
DEFAULT_MAX_PROMPT_TOKENS = 512
#: Config fields whose flag has another name (the unit or a shorter word).
FLAG_NAMES = {"max_eval_positions": "eval_positions", "time_budget_s": "time_budget"}


def add_model_flag(p: argparse.ArgumentParser) -> None:
    """``--model``: the target, as every method loads it."""
    p.add_argument("--model", default="default",
                   help="target: an mlx-lm folder, a Hugging Face repo id, a .gguf file or 'default'; always "
                        "loaded in float32. Default: default")


def add_data_flag(p: argparse.ArgumentParser) -> None:
    """``--data``: the conversations to train on or to take prompts from."""
    p.add_argument("--data", default="sharegpt",
                   help="'sharegpt' (ShareGPT V3, fetched once) or a JSONL of conversations, one "
                        '{"messages": [{"role", "content"}]} or {"conversations": [{"from", "value"}]} '
                        "per line. Default: sharegpt")


#: The shared run flags: config field → help, or (help, extra ``add_argument`` keywords).
RUN_FLAGS = {
    "epochs": "passes over the training data",
    "max_steps": "stop after this many steps in all (the last epoch ends early, is scored and saved; the "
    "learning-rate schedule spans these steps); 0: the epochs decide",
    "time_budget_s": (
        "minutes of training after which no new step starts (the epoch is then scored and saved; the same "
        "command continues). Default: none",
        {"type": float},
    ),
    "learning_rate": "peak AdamW learning rate (cosine decay to 0)",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "clip the gradient's global norm (0: off)",
    "seed": "seed of the batch order, per-step randomness and initial weights (and of the train/held-out "
    "split where there is one)",
    "save_every": "also checkpoint every N steps of an epoch (0: after each epoch only)",
    "max_eval_positions": "held-out positions scored per evaluation",
    "save_dtype": ("dtype of the per-epoch copies in OUTPUT/epoch-N", {"choices": SAVE_DTYPES}),
}


def add_run_flags(
    p: argparse.ArgumentParser,
    d: TrainConfig,
    flags: dict,
    *,
    output_help: str,
    corpus_help: str,
    corpus_required: bool = True,
) -> None:
    """A training method's flags: the model, output, corpus, the shared run flags, then the method's own.

    Args:
        p: The method's parser.
        d: Its config with its defaults.
        flags: Its own config flags (see ``add_config_flags``).
        output_help, corpus_help: Help of ``--output`` and ``--corpus``.
        corpus_required: Whether ``--corpus`` must be given (else it defaults to ``None``).
    """
    add_model_flag(p)
    p.add_argument("--output", "-o", required=True, help=output_help)
    p.add_argument("--corpus", required=corpus_required, default=None, help=corpus_help)
    add_config_flags(p, d, RUN_FLAGS)
    add_config_flags(p, d, flags)


def add_config_flags(p: argparse.ArgumentParser, d: TrainConfig, flags: dict) -> None:
    """One flag per entry of ``flags``: ``--kebab-name`` of the config field (``FLAG_NAMES`` where it
    differs), its type and default from ``d`` (a bool field is a switch), and its help followed by the
    default.

    Args:
        p: The parser.
        d: The method's config with its defaults.
        flags: Field name → help, or (help, extra ``add_argument`` keywords: ``choices``, a ``type`` for
            fields whose default is ``None``); a help that names its default itself gets none appended.
    """
    for name, spec in flags.items():
        text, extra = (spec, {}) if isinstance(spec, str) else spec
        flag, default = "--" + FLAG_NAMES.get(name, name).replace("_", "-"), getattr(d, name)
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=text)
            continue
        shown = f"{default:g}" if isinstance(default, float) else default
        help_ = text if "Default:" in text else f"{text}. Default: {shown}"
        typed = {} if isinstance(default, str) else {"type": type(default)}  # argparse reads str as it is
        p.add_argument(flag, **{**typed, "default": default, "help": help_, **extra})


def make_config(cls: type[TrainConfig], args: argparse.Namespace) -> TrainConfig:
    """``cls`` built from the flags named like its fields (``FLAG_NAMES`` for the others).

    Raises:
        ValueError: a flag is out of range (the config's own one-line message).
    """
    values = {}
    for f in dataclasses.fields(cls):
        name = FLAG_NAMES.get(f.name, f.name)
        if hasattr(args, name):
            values[f.name] = getattr(args, name)
    if values.get("time_budget_s") is not None:
        if values["time_budget_s"] <= 0:
            raise ValueError(f"--time-budget must be > 0 minutes, got {values['time_budget_s']}")
        values["time_budget_s"] *= 60
    return cls(**values)


def open_corpus(path: str) -> tuple[FeatureCache, FeatureCache | None]:
    """``(train, validation or None)``: a ``mlxspec train corpus`` folder (``train/`` and ``validation/``)
    or a single corpus folder.

    Raises:
        FileNotFoundError: no corpus there.
    """
    root = Path(path).expanduser()
    if (root / MANIFEST).is_file():
        return FeatureCache(root), None
    if not (root / TRAIN / MANIFEST).is_file():
        raise FileNotFoundError(f"no corpus in {root}; build one with: mlxspec train corpus --output {root}")
    validation = root / VALIDATION
    return FeatureCache(root / TRAIN), FeatureCache(validation) if (validation / MANIFEST).is_file() else None


def corpus_help(records: str) -> str:
    """``--corpus`` help of a method that reads a ``mlxspec train corpus`` folder whose chunks hold
    ``records``."""
    return (f"corpus folder from 'mlxspec train corpus' (the target's own answers with its {records}); its "
            "validation part scores each epoch")


def run_on_corpus(args: argparse.Namespace, config_cls: type[TrainConfig], train, scores, what: str,
                  top_fields: tuple[str, ...] = ()) -> int:
    """Run a corpus-trained method (EAGLE, MTP, DFlash, DSpark): load the target in float32, train with
    progress, write ``OUTPUT/training.json`` (command, settings, corpus, time, held-out history), say where.

    Args:
        args: The parsed flags (``--model``, ``--corpus``, ``--output`` and the config's).
        config_cls: The method's config dataclass (``make_config``).
        train: ``train(target, train_cache, heldout_cache, output, config)``, a generator of the loop's
            records.
        scores: The method's held-out line (``train_with_progress``).
        what: What the output folder holds, for the closing note (``"drafter"``).
        top_fields: Config fields also recorded at the top of ``training.json`` (EAGLE's ``version``).

    Returns:
        int: 0.

    Raises:
        ValueError, FileNotFoundError: bad flags, no corpus, or a corpus or run the method refuses.
    """
    config = make_config(config_cls, args)
    train_cache, heldout_cache = open_corpus(args.corpus)
    output = Path(args.output).expanduser()
    model, _ = load(args.model, dtype="float32")
    t0 = time.perf_counter()
    history = train_with_progress(train(model, train_cache, heldout_cache, output, config), scores)
    record = {
        "command": args.command, "target": args.model, **{k: getattr(config, k) for k in top_fields},
        "config": dataclasses.asdict(config),
        "corpus": {"train": str(train_cache.directory), "heldout": str(heldout_cache.directory)
                   if heldout_cache else None, "train_tokens": train_cache.num_tokens,
                   "train_answer_tokens": train_cache.manifest.get("masked_tokens")},
        "train_s": round(time.perf_counter() - t0, 1), "heldout": history,
    }
    (output / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    last = next((h["checkpoint"] for h in reversed(history) if h["checkpoint"]), None)
    copy = f" and {last} ({config.save_dtype})" if last else ""
    say(f"{what} in {output} (float32, resumable){copy}; record in {output / TRAINING_RECORD}")
    return 0


def chain_scores(record, unit: str) -> str:
    """The held-out line of a chain drafter: agreement with the target's greedy token per ``unit``
    (``"step"``, ``"block position"``), the chain acceptance and τ (``record``: ``acceptance``,
    ``chain_acceptance``, ``tau``, ``positions``)."""
    return (f"held-out agreement with the target's greedy token per {unit}: {fmt(record.acceptance)}; "
            f"chain {fmt(record.chain_acceptance)}; τ ≈ {record.tau:.2f} [{record.positions} positions]")


def fmt(values) -> str:
    """Scores per position or head as ``"0.412 0.305 …"``."""
    return " ".join(f"{v:.3f}" for v in values)


def heldout_split(conversations, tokenizer, data: str, num_heldout: int, seed: int,
                  max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS):
    """The (train, held-out) split every method uses for the same data and seed: held-out conversations
    open a conversation (ShareGPT) and have a first prompt of at most ``max_prompt_tokens`` tokens."""

    def heldout_ok(conversation) -> bool:
        if data == dataset.SHAREGPT and not dataset.starts_a_conversation(conversation):
            return False  # a later part's first prompt ("continue") needs context it does not have
        return len(tokenizer.encode(dataset.first_prompt(conversation))) <= max_prompt_tokens

    return dataset.split_conversations(
        conversations, num_heldout=num_heldout, seed=seed, heldout_ok=heldout_ok
    )


def train_with_progress(records: Iterable[StepRecord | EvalRecord], scores: Callable[[EvalRecord], str]
                        ) -> list[dict]:
    """Run a training generator with a progress bar per epoch (stderr) and one ``eval_line`` per
    evaluation (stdout); returns the evaluations as dicts."""
    bar, history = None, []
    for record in records:
        if isinstance(record, EvalRecord):
            if bar is not None:
                bar.close()
                bar = None
            history.append(dataclasses.asdict(record))
            print(eval_line(record, scores), flush=True)
            continue
        if bar is None:
            bar = tqdm(
                total=record.steps_per_epoch,
                initial=record.step - 1,
                desc=f"epoch {record.epoch + 1}",
                unit="step",
                file=sys.stderr,
            )
        bar.update(1)
        bar.set_postfix(loss=f"{record.loss:.3f}", pos_s=f"{record.positions / record.step_s:.0f}",
                        tok_s=f"{record.tokens / record.step_s:.0f}")
    if bar is not None:
        bar.close()
    return history


def eval_line(record: EvalRecord, scores: Callable[[EvalRecord], str]) -> str:
    """``"epoch N: train loss L; <the method's scores>"``; a bare ``EvalRecord`` says there was no held-out
    data."""
    when = "before training" if record.epoch == 0 else f"epoch {record.epoch}"
    loss = f"train loss {record.train_loss:.3f}; " if record.train_loss is not None else ""
    body = "no held-out data" if type(record) is EvalRecord else scores(record)
    return f"{when}: {loss}{body}"


def say(message: str) -> None:
    """A progress note on stderr (stdout carries the scores)."""
    print(message, file=sys.stderr, flush=True)
