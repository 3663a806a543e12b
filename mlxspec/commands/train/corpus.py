"""``mlxspec train corpus``: the target's own greedy answers to training prompts, with its features.

With ``--answers data`` the target reads the dataset's own first answers instead of writing its own
(one forward per example: several times cheaper on a CPU; the labels are still the target's top-k).

The prompts are the first user turns of the training conversations (the held-out split of
``mlxspec train medusa`` is left out, so the 50 held-out prompts are never answered here),
deduplicated, at most ``--max-prompt-tokens`` long. A second, small corpus from other prompts
goes to ``OUTPUT/validation`` for the trainers' per-epoch scores. ``mlxspec train medusa |
eagle | draft --corpus OUTPUT`` train on it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ...loading.models import load
from ...train import dataset
from ...train.corpus import DEFAULT_TOPK, build_corpus
from .shared import TRAIN, VALIDATION, add_data_flag, add_model_flag, heldout_split, say

HELP = "the target's own greedy answers + features, for training heads and drafts"
DESCRIPTION = (
    "Answer training prompts greedily with the target (batched) -- or, with --answers data, read the "
    "dataset's own answers -- and store its hidden states, layer features and top-k log-probabilities; run "
    "again to resume."
)


def add_flags(p: argparse.ArgumentParser) -> None:
    """The ``mlxspec train corpus`` flags."""
    add_model_flag(p)
    add_data_flag(p)
    p.add_argument("--output", "-o", required=True, help="corpus folder (resumable)")
    p.add_argument(
        "--answers",
        choices=("target", "data"),
        default="target",
        help="'target': the target answers each prompt greedily (self-distillation); 'data': the target "
        "reads the dataset's own first answer in one forward, several times cheaper on a CPU (for large "
        "targets). Default: target",
    )
    p.add_argument("--max-new-tokens", type=int, default=192,
                   help="longest answer, tokens (--answers data: answers are cut there). Default: 192")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=256,
        help="skip training prompts longer than this (tokens, chat template included). Default: 256",
    )
    p.add_argument(
        "--max-prompts", type=int, default=2000, help="training prompts to answer at most. Default: 2000"
    )
    p.add_argument("--validation-prompts", type=int, default=32,
                   help="prompts (not trained on) answered into OUTPUT/validation. Default: 32")
    p.add_argument("--batch-size", type=int, default=32, help="prompts decoded together. Default: 32")
    p.add_argument("--topk", type=int, default=DEFAULT_TOPK,
                   help=f"soft labels (target log-probabilities) kept per position. Default: {DEFAULT_TOPK}")
    p.add_argument("--time-budget", type=float, default=None,
                   help="minutes after which no new batch starts (the corpus is usable as it is then; the "
                        "same command resumes it). Default: none")
    p.add_argument(
        "--num-heldout",
        type=int,
        default=50,
        help="conversations held out exactly as mlxspec train medusa does (same seed). Default: 50",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the split and of the prompt order. Default: 0"
    )


def run(args: argparse.Namespace) -> int:
    """Build the training and validation corpora; prints where they are."""
    for flag in ("max_new_tokens", "max_prompt_tokens", "max_prompts", "batch_size", "topk"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    output = Path(args.output).expanduser()
    model, tokenizer = load(args.model, dtype="float32")
    conversations, note = dataset.read_conversations(args.data)
    say(note)
    train_convs, heldout = heldout_split(conversations, tokenizer, args.data, args.num_heldout, args.seed)
    held = {dataset.first_prompt(c) for c in heldout}
    with_answers = args.answers == "data"
    pairs = training_prompts(
        tokenizer, train_convs, args.data, args.max_prompt_tokens, held, with_answers=with_answers
    )
    random.Random(args.seed).shuffle(pairs)
    validation = pairs[: args.validation_prompts]
    train = order_for_batching(pairs[args.validation_prompts :][: args.max_prompts], args.batch_size)
    verb = "reading the dataset's answers to" if with_answers else "answering"
    say(f"{len(pairs)} distinct training prompts of at most {args.max_prompt_tokens} tokens; "
        f"{verb} {len(train)} (+ {len(validation)} for validation)")
    budget = args.time_budget * 60 if args.time_budget is not None else None
    info = {"command": args.command, "answers": args.answers, "prompts": len(train),
            "validation_prompts": len(validation)}
    t0 = time.perf_counter()
    for name, chosen, limit in ((VALIDATION, validation, None), (TRAIN, train, budget)):
        if not chosen:
            continue
        with tqdm(total=len(chosen), desc=f"corpus ({name})", unit="prompt", file=sys.stderr) as bar:
            prompts = [p for p, _ in chosen] if with_answers else chosen
            answers = [a for _, a in chosen] if with_answers else None
            for progress in build_corpus(model, tokenizer, prompts, output / name, answers=answers,
                                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                         topk=args.topk, time_budget_s=limit):
                bar.update(progress.done - bar.n)
                bar.set_postfix(tok_s=f"{progress.tokens_per_s:.0f}")
    manifest = json.loads((output / TRAIN / "manifest.json").read_text())
    info.update(wall_s=round(time.perf_counter() - t0, 1), answered=manifest["examples"],
                tokens=manifest["tokens"], answer_tokens=manifest["masked_tokens"])
    (output / "corpus.json").write_text(json.dumps(info, indent=2) + "\n")
    say(f"corpus in {output}: {manifest['examples']} examples, {manifest['masked_tokens']} answer tokens "
        f"({manifest['tokens']} with prompts)")
    return 0


def training_prompts(tokenizer, conversations, data: str, max_tokens: int, exclude: set, *,
                     with_answers: bool = False) -> list:
    """Distinct first prompts (chat template + generation prompt) of at most ``max_tokens`` tokens.

    With ``with_answers``, ``(prompt ids, answer ids)`` pairs instead: the answer is the conversation's
    first assistant turn as the template renders it, up to and including its end-of-turn token
    (conversations whose template renders prefixes differently are skipped).
    """
    seen, out = set(exclude), []
    for conversation in conversations:
        text = dataset.first_prompt(conversation)
        if not text or text in seen:
            continue
        if data == dataset.SHAREGPT and not dataset.starts_a_conversation(conversation):
            continue
        seen.add(text)
        ids = list(
            tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        )
        if len(ids) > max_tokens:
            continue
        if not with_answers:
            out.append(ids)
            continue
        answer = dataset.first_answer(conversation)
        try:
            tokens, mask = dataset.assistant_mask(tokenizer, [{"role": "user", "content": text},
                                                              {"role": "assistant", "content": answer}])
        except ValueError:
            continue
        end = int(np.flatnonzero(mask)[-1]) + 1 if mask.any() else 0
        if list(tokens[: len(ids)]) == ids and end > len(ids):
            out.append((ids, list(tokens[len(ids) : end])))
    return out


def order_for_batching(prompts: list, batch_size: int, group: int = 8) -> list:
    """Sort each run of ``group`` batches by length, so a batch pads little but a time budget
    still stops after a random sample of prompts, not after the shortest ones (``(prompt, answer)``
    pairs sort by their prompt)."""
    out, span = [], batch_size * group
    key = (lambda pair: len(pair[0])) if prompts and isinstance(prompts[0], tuple) else len
    for i in range(0, len(prompts), span):
        out.extend(sorted(prompts[i : i + span], key=key))
    return out
