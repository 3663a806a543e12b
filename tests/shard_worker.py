"""One rank of a sharded job, started by tests/test_distributed.py under ``mlx.launch`` (not a test module).

``greedy``: loads a saved target with ``ModelSpec(shard=...)``, generates greedily with each drafter, and
records the prompt's logits; ``sample``: builds a tiny V=8 target and draft model from their seeds
(``SAMPLED``), shards the target, and counts the first two tokens of many sampled generations; ``load``: loads
a saved target with ``ModelSpec(shard=...)`` and records each rank's peak memory beside the whole model's
size. Every rank gathers what every rank produced, so rank 0's JSON (``--out``) says whether the ranks agreed
bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))

from conftest import tiny_llama, tiny_qwen2  # noqa: E402
from mlxspec.loading.sharded import shard  # noqa: E402
from mlxspec.runtime.distributed import init_group  # noqa: E402
from mlxspec.drafters import make_drafter  # noqa: E402
from mlxspec.engine.generate import generate, speculative_rounds  # noqa: E402
from mlxspec.core.sampling import SamplingParams  # noqa: E402
from mlxspec.engine.session import ModelSpec, load_model  # noqa: E402
from mlxspec.loading.models import load  # noqa: E402


#: ``sample``'s V=8 target and draft per architecture: (build, sharpen, target seed, draft seed). qwen2 ties
#: its
#: embeddings, so sharpening counts twice (at 3.0 its p is one-hot: every sample is the same pair and no
#: verifier could
#: fail); the draft seeds make rejections common, so that a verifier without the residual fails the chi-square
#: of
#: tests/test_distributed.py at its sample count (the power is checked there).
SAMPLED = {"llama": (tiny_llama, 3.0, 0, 9), "qwen2": (tiny_qwen2, 1.0, 1, 8)}


def sampled_models(arch: str) -> tuple:
    """``sample``'s target and draft model for ``arch`` (``SAMPLED``), float32."""
    build, sharpen, seed, draft_seed = SAMPLED[arch]
    return build(seed=seed, vocab_size=8, sharpen=sharpen), build(
        seed=draft_seed, vocab_size=8, sharpen=sharpen
    )


def same_on_every_rank(group, values: mx.array) -> bool:
    """Whether every rank holds exactly these values (all-gathered, compared bit for bit)."""
    gathered = mx.distributed.all_gather(values[None], group=group, stream=mx.cpu)
    return bool(mx.all(gathered == gathered[0:1]).item())


def greedy(args) -> dict:
    target = load_model(ModelSpec(args.model, shard=args.shard))
    group = target.model.sharding.group
    draft = load_model(args.draft_model) if args.draft_model else None
    logits = target.model(mx.array(args.prompt)[None])[0, -1].astype(mx.float32)
    record = {
        "logits": np.array(logits).tolist(),
        "logits_agree": same_on_every_rank(group, logits),
        "runs": {},
    }
    for spec in args.drafters:
        given = {"draft_model": draft.model, "draft_tokenizer": draft.tokenizer} if spec == "draft" else {}
        drafter = make_drafter(spec, target.model, target.tokenizer, **given)
        trees, propose = [], drafter.propose
        # called within this iteration only (generate below)
        drafter.propose = lambda *a, **k: trees.append(not (d := propose(*a, **k)).tree.is_chain) or d  # noqa: B023
        result = generate(
            target.model,
            target.tokenizer,
            args.prompt,
            drafter=drafter,
            max_tokens=args.max_tokens,
            num_draft_tokens=args.gamma,
            stop_tokens=set(),
        )
        tokens = mx.array(result.tokens, dtype=mx.int32)
        record["runs"][spec] = {"tokens": result.tokens, "agree": same_on_every_rank(group, tokens),
                                "drafted": result.stats.drafted, "accepted": result.stats.accepted,
                                "trees": sum(trees)}
    return record


def peak_memory(args) -> dict:
    # shapes: nothing read
    whole = sum(w.nbytes for _, w in tree_flatten(load(args.model, lazy=True)[0].parameters()))
    mx.reset_peak_memory()
    target = load_model(ModelSpec(args.model, shard=args.shard))
    share = sum(w.nbytes for _, w in tree_flatten(target.model.parameters()))
    peaks = mx.distributed.all_gather(mx.array([mx.get_peak_memory()], dtype=mx.int64),
                                      group=target.model.sharding.group, stream=mx.cpu)
    return {"whole_bytes": whole, "share_bytes": share, "peaks": peaks.tolist()}


def sample(args) -> dict:
    target, draft = sampled_models(args.arch)
    group = init_group()
    shard(target, args.shard, group)
    drafter = make_drafter(args.drafters[0], target, list(range(8)), draft_model=draft)
    if args.broken:  # the classic mistake: after a rejection, draw from p instead of the residual
        # the round loop's module (mlxspec.generate is the function)
        engine = sys.modules["mlxspec.engine.generate"]
        rule = engine.verify_sampled

        def without_residual(*a):
            choice, _ = rule(*a)
            return choice, mx.random.categorical(a[-1], axis=-1).astype(mx.int32)

        engine.verify_sampled = without_residual
    mx.random.seed(1234)
    params, pairs = SamplingParams(temp=args.temp), []
    for _ in range(args.samples):
        tokens = []
        rounds = speculative_rounds(target, args.prompt, drafter, num_draft_tokens=args.gamma, max_tokens=2,
                                    sampling=params, stop_tokens=set())
        for round_ in rounds:
            tokens += round_.tokens
        pairs.append(tokens[:2])
    counts = Counter(f"{a},{b}" for a, b in pairs)
    return {"counts": counts, "agree": same_on_every_rank(group, mx.array(pairs, dtype=mx.int32))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("greedy", "sample", "load"))
    parser.add_argument("--model")
    parser.add_argument("--draft-model")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--shard", required=True)
    parser.add_argument("--drafters", nargs="+", default=["ngram"])
    parser.add_argument("--prompt", type=lambda s: [int(t) for t in s.split(",")], required=True)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--temp", type=float, default=0.8)
    parser.add_argument(
        "--samples", type=int, help="sample: how many generations (tests/test_distributed.SAMPLES)"
    )
    parser.add_argument("--broken", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    record = {"greedy": greedy, "sample": sample, "load": peak_memory}[args.mode](args)
    if mx.distributed.init().rank() == 0:
        Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
