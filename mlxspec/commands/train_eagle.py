"""``mlxspec train eagle``: an EAGLE-1 or EAGLE-3 head for a target, from a self-distillation corpus.

``mlxspec train eagle --model default --corpus CORPUS --version 3 --output DIR`` loads the target
in float32, trains the head on ``CORPUS/train`` (built by ``mlxspec train corpus``) with a
progress bar, prints the held-out agreement on ``CORPUS/validation`` after every epoch and
writes ``DIR/training.json``. Running the same command again resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TRAINING_RECORD = "training.json"


def eagle_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train eagle`` flags."""
    from ..train.eagle import EagleTrainConfig

    d = EagleTrainConfig()
    p.add_argument("--model", default="default",
                   help="target: an mlx-lm folder, a Hugging Face repo id, a .gguf file or 'default'; "
                        "always loaded in float32. Default: default")
    p.add_argument("--corpus", required=True,
                   help="corpus folder from 'mlxspec train corpus' (the target's own answers with its features, "
                        "EAGLE-3 layer inputs and top-k log-probabilities); its validation part scores each epoch")
    p.add_argument("--output", "-o", required=True,
                   help="folder for the head (config.json + model.safetensors, EAGLE layout), checkpoints "
                        "and training.json")
    p.add_argument("--version", type=int, choices=(1, 3), default=d.version,
                   help="1: EAGLE-1 (final-norm feature, target LM head, feature regression + 0.1 soft CE); "
                        f"3: EAGLE-3 (three target layers, reduced vocabulary, training-time test). Default: {d.version}")
    p.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size,
                   help="EAGLE-3 draft vocabulary: the most frequent answer tokens of the corpus (0: the whole "
                        f"target vocabulary). Default: {d.draft_vocab_size}")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps,
                   help=f"EAGLE-3 training-time-test steps (the head's own outputs fed back). Default: {d.ttt_steps}")
    p.add_argument("--step-decay", type=float, default=d.step_decay,
                   help=f"weight of unrolled step k is DECAY**k. Default: {d.step_decay:g}")
    p.add_argument("--eval-steps", type=int, default=d.eval_steps,
                   help=f"unrolled steps scored on the held-out corpus. Default: {d.eval_steps}")
    p.add_argument("--ce-weight", type=float, default=d.ce_weight,
                   help=f"EAGLE-1: weight of the soft cross-entropy next to the regression. Default: {d.ce_weight:g}")
    p.add_argument("--noise", type=float, default=d.noise,
                   help=f"EAGLE-1: uniform feature noise scale (0: none). Default: {d.noise:g}")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"passes over the corpus. Default: {d.epochs}")
    p.add_argument("--max-steps", type=int, default=d.max_steps,
                   help="stop after this many steps in all (the last epoch ends early; the learning-rate "
                        "schedule spans these steps); 0: no cap. Default: 0")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens,
                   help=f"padded tokens per step (whole examples of similar length). Default: {d.batch_tokens}")
    p.add_argument("--max-seq-length", type=int, default=d.max_seq_length,
                   help=f"cut examples to this many tokens. Default: {d.max_seq_length}")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate,
                   help=f"peak AdamW learning rate (cosine decay to 0). Default: {d.learning_rate:g}")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help=f"linear warm-up steps. Default: {d.warmup_steps}")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help=f"AdamW weight decay. Default: {d.weight_decay:g}")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip,
                   help=f"clip the gradient's global norm (0: off). Default: {d.grad_clip:g}")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of the batch order. Default: {d.seed}")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="also checkpoint every N steps (0: after each epoch only). Default: 0")
    p.add_argument("--eval-positions", type=int, default=d.max_eval_positions,
                   help=f"held-out positions scored per evaluation (about). Default: {d.max_eval_positions}")
    p.add_argument("--save-dtype", choices=("float16", "bfloat16", "float32"), default=d.save_dtype,
                   help=f"dtype of the per-epoch heads in OUTPUT/epoch-N. Default: {d.save_dtype}")


def _config(args):
    from ..train.eagle import EagleTrainConfig

    return EagleTrainConfig(
        version=args.version, draft_vocab_size=args.draft_vocab_size, ttt_steps=args.ttt_steps,
        eval_steps=args.eval_steps, step_decay=args.step_decay, ce_weight=args.ce_weight, noise=args.noise,
        epochs=args.epochs, max_steps=args.max_steps, batch_tokens=args.batch_tokens, max_seq_length=args.max_seq_length,
        learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, seed=args.seed, save_every=args.save_every,
        max_eval_positions=args.eval_positions, save_dtype=args.save_dtype)


def run_eagle(args: argparse.Namespace) -> int:
    """``mlxspec train eagle``: corpus → head; writes ``OUTPUT/training.json``."""
    from dataclasses import asdict

    from ..loading import load
    from .train import open_corpus

    config = _config(args)
    train_cache, heldout_cache = open_corpus(args.corpus)
    output = Path(args.output).expanduser()
    model, _ = load(args.model, dtype="float32")
    t0 = time.perf_counter()
    history = _train(model, train_cache, heldout_cache, output, config)
    record = {
        "command": args.command, "target": args.model, "version": config.version, "config": asdict(config),
        "corpus": {"train": str(train_cache.directory), "heldout": str(heldout_cache.directory)
                   if heldout_cache else None, "train_tokens": train_cache.num_tokens,
                   "train_answer_tokens": train_cache.manifest.get("masked_tokens")},
        "train_s": round(time.perf_counter() - t0, 1), "heldout": history,
    }
    (output / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    last = next((h["checkpoint"] for h in reversed(history) if h["checkpoint"]), None)
    copy = f" and {last} ({config.save_dtype})" if last else ""
    _say(f"head in {output} (float32, resumable){copy}; record in {output / TRAINING_RECORD}")
    return 0


def _train(model, train_cache, heldout_cache, output: Path, config) -> list[dict]:
    """Run ``train_eagle`` with a progress bar per epoch; returns the held-out records."""
    from dataclasses import asdict

    from tqdm import tqdm

    from ..train.eagle import EagleEvalRecord, train_eagle

    bar, history = None, []
    for record in train_eagle(model, train_cache, heldout_cache, output, config):
        if isinstance(record, EagleEvalRecord):
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
        bar.set_postfix(loss=f"{record.loss:.3f}", tok_s=f"{record.tokens / record.step_s:.0f}")
    if bar is not None:
        bar.close()
    return history


def eval_line(record) -> str:
    """One line per held-out evaluation."""
    def fmt(values):
        return " ".join(f"{v:.3f}" for v in values)

    when = "before training" if record.epoch == 0 else f"epoch {record.epoch}"
    loss = f"train loss {record.train_loss:.3f}; " if record.train_loss is not None else ""
    return (f"{when}: {loss}held-out agreement with the target's greedy token per step: {fmt(record.acceptance)}; "
            f"chain {fmt(record.chain_acceptance)}; τ ≈ {record.tau:.2f} [{record.positions} positions]")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
