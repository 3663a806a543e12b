"""DSpark drafting: greedy identity, losslessness with and without scheduled verification (and a q
that forgets the Markov bias, which fails), the serial head, the published layout, refusals."""

from __future__ import annotations

import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate
from mlxspec.drafters import dspark as dspark_drafter
from mlxspec.drafters import make_drafter
from mlxspec.drafters.dspark import DSparkDrafter
from mlxspec.engine.generate import speculative_rounds
from mlxspec.heads.dflash import DFlashConfig
from mlxspec.heads.dspark import DSparkConfig, DSparkNet, load_dspark, save_dspark
from mlxspec.core.sampling import SamplingParams, warp
from mlxspec.pacing import Scheduled
from stats import chi_square
from test_dflash import write_published
from test_lossless import PROMPT as SHORT_PROMPT, V, exact_joint
from test_schedule import linear_costs

PROMPT = [10, 20, 30, 40, 10, 20, 30, 41, 50, 60]


def random_dspark(vocab=264, block_size=5, rank=8, confidence=True, seed=1, markov_scale=4.0) -> DSparkNet:
    """A random DSpark drafter for the tiny targets (2 layers, hidden 64); a strong Markov bias."""
    backbone = DFlashConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        num_target_layers=2,
        mask_token_id=vocab - 1,
        block_size=block_size,
        target_layer_ids=(0, 1),
        rope_theta=10000.0,
    )
    mx.random.seed(seed)
    net = DSparkNet(DSparkConfig(backbone, rank, confidence))
    net.markov_head.markov_w2.weight = markov_scale * net.markov_head.markov_w2.weight
    mx.eval(net.parameters())
    return net


def test_greedy_dspark_equals_plain_greedy_over_300_tokens():
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    plain = generate(target, tokenizer, PROMPT, drafter="none", max_tokens=300, stop_tokens=set())
    drafter = DSparkDrafter(random_dspark(), target)
    sizes = []
    propose = drafter.propose
    drafter.propose = lambda *a: sizes.append((d := propose(*a)).size) or d
    spec = generate(
        target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=5, max_tokens=300, stop_tokens=set()
    )
    assert spec.tokens == plain.tokens
    assert max(sizes) == 5  # P = block_size proposals with sample_from_anchor


def test_the_serial_head_conditions_each_position_on_the_previous_token():
    """Greedy drafts follow argmax(b_j + W2 W1[x_{j-1}]), and that differs from the backbone's own argmax."""
    target = tiny_llama(seed=0, sharpen=4.0)
    net = random_dspark()
    drafter = DSparkDrafter(net, target)
    drafter.prefill(PROMPT, _features(target, net, PROMPT[:-1]))
    draft = drafter.propose(PROMPT, 5, SamplingParams())
    drafter.prefill(PROMPT, _features(target, net, PROMPT[:-1]))
    hidden, base = net.proposal_rows(*drafter.block_logits(PROMPT[-1], len(PROMPT) - 1))
    previous, expected = PROMPT[-1], []
    for j in range(5):
        bias, markov = net.markov_head(mx.array([previous]))
        previous = int(mx.argmax(base[j] + bias[0]))
        expected.append(previous)
    assert draft.tokens.tolist() == expected
    assert expected != mx.argmax(base, axis=-1).tolist()
    c = [float(net.confidence_head(hidden[j : j + 1], net.markov_head(mx.array([t]))[1])[0])
         for j, t in enumerate([PROMPT[-1]] + expected[:-1])]
    assert np.allclose(np.array(draft.survival), np.cumprod(c), rtol=1e-5)


def _features(target, net, tokens):
    from mlxspec.core.taps import HiddenTap

    tap = HiddenTap(target, layers=net.config.feature_layers)
    target(mx.array(tokens)[None])
    return tap.features()[0]


@pytest.fixture(scope="module")
def target8():
    return tiny_llama(seed=0, vocab_size=V, sharpen=3.0)


#: Generations per chi-square run: at 1,500 the broken control (no Markov bias in q) scored 280 against a
#: critical 55.6 (27 degrees of freedom); its noncentrality scaled to 800 rejects with probability 0.99999
#: (0.9999 from its 2-sigma lower bound).
SAMPLES = 800


def _sample(target, drafter, gamma, n=SAMPLES) -> Counter:
    """The first two tokens after SHORT_PROMPT, n times (2 drafted per first round)."""
    mx.random.seed(4321)
    counts = Counter()
    for _ in range(n):
        tokens = []
        for round_ in speculative_rounds(target, SHORT_PROMPT, drafter, num_draft_tokens=gamma, max_tokens=3,
                                         sampling=SamplingParams(temp=1.0), stop_tokens=set()):
            tokens += round_.tokens
        counts[tuple(tokens[:2])] += 1
    return counts


@pytest.mark.slow  # statistical
@pytest.mark.parametrize("scheduled", [False, True], ids=["fixed", "scheduled"])
def test_sampled_dspark_is_lossless(target8, scheduled):
    drafter = DSparkDrafter(random_dspark(vocab=V, block_size=4), target8)
    gamma = Scheduled(linear_costs(1.0), max_gamma=2, probe_every=0) if scheduled else 2
    stat, critical = chi_square(
        _sample(target8, drafter, gamma), exact_joint(target8, SamplingParams(temp=1.0))
    )
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


class _Recorder:
    """Wraps the Markov head and remembers the last bias it added."""

    def __init__(self, head):
        self.head, self.bias = head, None

    def __call__(self, previous):
        self.bias, markov = self.head(previous)
        return self.bias, markov


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_a_q_without_the_markov_bias(target8, monkeypatch):
    """Sample x_j from the biased logits but hand the verifier the backbone's q (the bias forgotten)."""
    net = random_dspark(vocab=V, block_size=4)
    recorder = _Recorder(net.markov_head)
    net.markov_head = recorder

    def sample_with_unbiased_q(logits, sampling):
        q = warp(logits, sampling)
        return mx.random.categorical(q, axis=-1).astype(mx.int32), warp(logits - recorder.bias, sampling)

    monkeypatch.setattr(dspark_drafter, "sample", sample_with_unbiased_q)
    stat, critical = chi_square(_sample(target8, DSparkDrafter(net, target8), 2),
                                exact_joint(target8, SamplingParams(temp=1.0)))
    assert stat > critical


# --- checkpoints -------------------------------------------------------------------------------


def write_dspark(folder, rank=8, confidence=True, seed=5, **dflash) -> dict:
    """A synthetic checkpoint in the published DSpark layout: z-lab's DFlash tensors plus the heads,
    ``dflash_config.projector_type = "dspark"``, ``model.`` prefixes as DeepSpec writes them."""
    weights = write_published(folder, **dflash)
    vocab, hidden = dflash.get("vocab", 264), dflash.get("hidden", 64)
    rng = np.random.default_rng(seed)
    heads = {"markov_head.markov_w1.weight": (vocab, rank), "markov_head.markov_w2.weight": (vocab, rank)}
    if confidence:
        heads.update({"confidence_head.proj.weight": (1, hidden + rank), "confidence_head.proj.bias": (1,)})
    weights.update({k: mx.array(0.3 * rng.standard_normal(s), dtype=mx.bfloat16) for k, s in heads.items()})
    mx.save_safetensors(str(folder / "model.safetensors"), {"model." + k: v for k, v in weights.items()})
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["DSparkDraftModel"]
    config["dflash_config"].update(
        {
            "projector_type": "dspark",
            "markov_rank": rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": confidence,
            "confidence_head_with_markov": True,
            "sample_from_anchor": True,
        }
    )
    (folder / "config.json").write_text(json.dumps(config))
    return weights


def test_a_published_layout_checkpoint_loads_drafts_and_saves(tmp_path):
    weights = write_dspark(tmp_path / "dspark")
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    drafter = make_drafter(f"dspark:heads={tmp_path / 'dspark'}", target, tokenizer)
    assert drafter.net.dspark.markov_rank == 8 and drafter.max_draft_tokens == 8
    assert mx.array_equal(drafter.net.markov_head.markov_w2.weight,
                          weights["markov_head.markov_w2.weight"].astype(mx.float32))
    result = generate(
        target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=8, max_tokens=60, stop_tokens=set()
    )
    assert result.tokens == generate(target, tokenizer, PROMPT, max_tokens=60, stop_tokens=set()).tokens
    assert result.stats.drafted >= 8 * 2
    save_dspark(drafter.net, tmp_path / "saved")
    again = load_dspark(tmp_path / "saved", target)
    assert again.dspark == drafter.net.dspark
    assert mx.array_equal(again.confidence_head.proj.weight, drafter.net.confidence_head.proj.weight)


def test_bad_dspark_checkpoints_are_refused_at_load(tmp_path):
    write_dspark(tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    config["dflash_config"]["markov_head_type"] = "gated"
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Markov head 'gated' is not supported"):
        load_dspark(tmp_path / "other")
    write_dspark(tmp_path / "rank")
    config = json.loads((tmp_path / "rank" / "config.json").read_text())
    config["dflash_config"]["markov_rank"] = 16
    (tmp_path / "rank" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"markov_head.markov_w\d.weight has shape \(264, 8\).*\(264, 16\)"):
        load_dspark(tmp_path / "rank")
    write_published(tmp_path / "plain")
    with pytest.raises(ValueError, match="not a DSpark drafter's.*--drafter dflash"):
        load_dspark(tmp_path / "plain")
    write_dspark(tmp_path / "wide", hidden=32)
    with pytest.raises(ValueError, match="hidden size 32 but the target's is 64"):
        make_drafter(f"dspark:heads={tmp_path / 'wide'}", tiny_llama(seed=0), byte_tokenizer())


def test_scheduled_drafts_a_whole_block():
    from mlxspec.drafters.dflash import DFlashDrafter
    from mlxspec.pacing import make_pacer
    from test_dflash import random_dflash

    target = tiny_llama(seed=0)
    policy = make_pacer("scheduled", target, DSparkDrafter(random_dspark(), target), costs=linear_costs(1.0))
    assert isinstance(policy, Scheduled) and policy.max_gamma == 5
    dflash = DFlashDrafter(random_dflash(layer_ids=(0, 1)), target)
    assert make_pacer("scheduled", target, dflash, costs=linear_costs(1.0)).max_gamma == 5  # B − 1
