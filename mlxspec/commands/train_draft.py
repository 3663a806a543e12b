"""``mlxspec train draft``: distil a small independent draft model from a target's corpus.

``mlxspec train draft --model default --corpus CORPUS --layers 4 --hidden 256 --output DIR`` loads the
target in float32 (only its config, embeddings and tokenizer are used: the soft labels come from the
corpus built by ``mlxspec train corpus``), measures one decode step of the draft against one of the
target, trains with a progress bar and prints the held-out KL, expected α and top-1 agreement after
every epoch. ``DIR/epoch-N`` is an mlx-lm model folder for ``--draft-model``. Running the same command
again resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RUN_INFO = "run.json"


def draft_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train draft`` flags."""
    from ..train.draft import DraftTrainConfig

    d = DraftTrainConfig()
    p.add_argument("--model", default="default",
                   help="target: an mlx-lm folder, a Hugging Face repo id, a .gguf file or 'default'; "
                        "loaded in float32. Default: default")
    p.add_argument("--corpus", required=True,
                   help="a corpus from 'mlxspec train corpus' (its train/ part is trained on, its validation/ "
                        "part scores each epoch), or one corpus folder (the last --heldout-examples are held out)")
    p.add_argument("--output", "-o", required=True,
                   help="folder for checkpoints (itself an mlx-lm model folder, float32), epoch-N/ copies "
                        "and run info")
    p.add_argument("--layers", type=int, default=d.layers, help=f"decoder layers of the draft. Default: {d.layers}")
    p.add_argument("--hidden", type=int, default=d.hidden,
                   help="hidden size of the draft; the target's embeddings are projected to it (SVD). "
                        f"Default: {d.hidden}")
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads. Default: hidden / the target's head size")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads. Default: the target's query/KV ratio where it divides")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="MLP width. Default: the target's ratio to the hidden size, a multiple of 64")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"passes over the corpus. Default: {d.epochs}")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens,
                   help=f"tokens per step, padding included. Default: {d.batch_tokens}")
    p.add_argument("--max-seq-length", type=int, default=d.max_seq_length,
                   help=f"cut examples (prompt + answer) to this many tokens. Default: {d.max_seq_length}")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate,
                   help=f"peak AdamW learning rate (cosine decay to 0). Default: {d.learning_rate:g}")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help=f"linear warm-up steps. Default: {d.warmup_steps}")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help=f"AdamW weight decay. Default: {d.weight_decay:g}")
    p.add_argument("--max-steps", type=int, default=d.max_steps,
                   help="stop after this many steps in all; the learning rate decays over them (0: the "
                        "epochs decide). Default: 0")
    p.add_argument("--time-budget", type=float, default=None,
                   help="minutes of training after which no new step starts (the epoch is then scored and "
                        "saved). Default: none")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="also checkpoint every N steps (0: after each epoch only). Default: 0")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed of the batch order and the draft's initial layers. Default: {d.seed}")
    p.add_argument("--eval-positions", type=int, default=d.max_eval_positions,
                   help=f"held-out answer positions scored per evaluation. Default: {d.max_eval_positions}")
    p.add_argument("--heldout-examples", type=int, default=d.heldout_examples,
                   help="with no validation corpus, hold out this many examples from the end of the corpus. "
                        f"Default: {d.heldout_examples}")
    p.add_argument("--train-vocab", type=int, default=d.train_vocab,
                   help="normalise the training loss over only the N tokens most frequent among the soft labels "
                        "(0: the full vocabulary); the 49k-wide LM head and softmax dominate a CPU step. The draft "
                        "keeps its full LM head and the held-out scores use it. Default: 0")
    p.add_argument("--negatives", type=int, default=d.negatives,
                   help="with --train-vocab: tokens sampled from the rest of the vocabulary each step, whose "
                        f"logits stand for the rest in the softmax (sampled softmax). Default: {d.negatives}")
    p.add_argument("--save-dtype", choices=("float16", "bfloat16", "float32"), default=d.save_dtype,
                   help=f"dtype of the per-epoch draft models in OUTPUT/epoch-N. Default: {d.save_dtype}")


def _config(args):
    from ..train.draft import DraftTrainConfig

    if args.time_budget is not None and args.time_budget <= 0:
        raise ValueError(f"--time-budget must be > 0 minutes, got {args.time_budget}")
    return DraftTrainConfig(
        layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
        intermediate_size=args.intermediate_size, epochs=args.epochs, batch_tokens=args.batch_tokens,
        max_seq_length=args.max_seq_length, learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, seed=args.seed, save_every=args.save_every, max_steps=args.max_steps,
        time_budget_s=args.time_budget * 60 if args.time_budget is not None else None,
        max_eval_positions=args.eval_positions, heldout_examples=args.heldout_examples, save_dtype=args.save_dtype,
        train_vocab=args.train_vocab, negatives=args.negatives)


def open_draft_corpus(path: str):
    """``(train, held-out or None)`` caches: a ``mlxspec train corpus`` folder (``train/`` and
    ``validation/``) or a single corpus folder.

    Raises:
        FileNotFoundError: no corpus there.
    """
    from ..train.features import MANIFEST, FeatureCache
    from .corpus import TRAIN, VALIDATION

    root = Path(path).expanduser()
    if (root / MANIFEST).is_file():
        return FeatureCache(root), None
    if not (root / TRAIN / MANIFEST).is_file():
        raise FileNotFoundError(f"no corpus in {root}; build one with: mlxspec train corpus --output {root}")
    validation = root / VALIDATION
    return FeatureCache(root / TRAIN), FeatureCache(validation) if (validation / MANIFEST).is_file() else None


def run_draft(args: argparse.Namespace) -> int:
    """``mlxspec train draft``: corpus → draft model folder."""
    from mlx.utils import tree_flatten

    from ..loading import describe, load
    from ..taps import model_body
    from ..train.draft import draft_step_ms, init_draft

    config = _config(args)
    train, heldout = open_draft_corpus(args.corpus)
    output = Path(args.output).expanduser()
    model, tokenizer = load(args.model, dtype="float32")
    draft, model_config = init_draft(model, config)
    draft_ms, target_ms = draft_step_ms(draft), draft_step_ms(model)
    params = sum(v.size for _, v in tree_flatten(draft.parameters()))
    embed = model_body(draft).embed_tokens.weight.size
    _say(f"draft: {args.layers} layers, hidden {args.hidden}, {model_config['num_attention_heads']} heads "
         f"({model_config['num_key_value_heads']} KV), MLP {model_config['intermediate_size']}; "
         f"{params / 1e6:.1f}M parameters ({embed / 1e6:.1f}M in the tied embedding/LM head)")
    _say(f"decode step, float32: draft {draft_ms:.1f} ms, target {target_ms:.1f} ms "
         f"(ratio 1/{target_ms / max(draft_ms, 1e-9):.1f})")
    del draft
    info = {"command": args.command, "args": vars(args), "target": describe(args.model, model),
            "corpus": {"train": str(train.directory), "heldout": str(heldout.directory) if heldout else None},
            "draft_config": model_config, "parameters": int(params),
            "step_ms": {"draft": round(draft_ms, 2), "target": round(target_ms, 2)}}
    t0 = time.perf_counter()
    history = _train(model, tokenizer, train, heldout, output, config)
    info["train_s"] = round(time.perf_counter() - t0, 1)
    info["history"] = history
    (output / RUN_INFO).write_text(json.dumps(info, indent=2, default=str) + "\n")
    last = next((h for h in reversed(history) if h.get("checkpoint")), None)
    if last:
        _say(f"draft model in {last['checkpoint']} ({config.save_dtype}); try: mlxspec generate --model "
             f"{args.model} --draft-model {last['checkpoint']} --prompt ...")
    return 0


def _train(model, tokenizer, train, heldout, output: Path, config) -> list[dict]:
    from dataclasses import asdict

    from tqdm import tqdm

    from ..train.draft import EvalRecord, train_draft

    bar, history = None, []
    for record in train_draft(model, tokenizer, train, heldout, output, config):
        if isinstance(record, EvalRecord):
            if bar is not None:
                bar.close()
                bar = None
            history.append(asdict(record))
            print(eval_line(record), flush=True)
            continue
        if bar is None:
            bar = tqdm(total=record.steps_per_epoch, initial=record.step - 1, desc=f"epoch {record.epoch + 1}",
                       unit="step", file=sys.stderr)
        bar.update(1)
        bar.set_postfix(kl=f"{record.loss:.3f}", pos_s=f"{record.positions / record.step_s:.0f}",
                        tok_s=f"{record.tokens / record.step_s:.0f}")
    if bar is not None:
        bar.close()
    return history


def eval_line(record) -> str:
    """One line per evaluation: held-out KL, top-K α estimate and top-1 agreement."""
    when = "before training" if record.epoch == 0 else f"epoch {record.epoch}"
    loss = f"train KL {record.train_loss:.3f}; " if record.train_loss is not None else ""
    return (f"{when}: {loss}held-out KL {record.kl:.3f}, expected α {record.alpha:.3f} (temperature 1, top-K "
            f"lower bound), top-1 agreement {record.top1:.3f} (α at temperature 0) [{record.positions} positions]")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
