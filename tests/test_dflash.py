"""DFlash block drafting: greedy identity, losslessness (and a wrong q that fails), the context cache
against a from-scratch forward, the published checkpoint layout, and refusals."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate
from mlxspec.drafters import make_drafter
from mlxspec.drafters import dflash as dflash_drafter
from mlxspec.drafters.dflash import DFlashDrafter
from mlxspec.engine.generate import speculative_rounds
from mlxspec.heads.dflash import DFlashConfig, DFlashNet, load_dflash, save_dflash
from mlxspec.core.sampling import SamplingParams, warp
from mlxspec.core.taps import HiddenTap
from stats import chi_square
from test_lossless import V, exact_joint, sample_joint

PROMPT = [10, 20, 30, 40, 10, 20, 30, 41, 50, 60]


def random_dflash(vocab=264, hidden=64, layers=2, block_size=6, target_layers=2, layer_ids=None, seed=1,
                  scale=1.0, context_window=0) -> DFlashNet:
    """A random DFlash drafter for the tiny targets (2 layers, hidden 64)."""
    config = DFlashConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                          num_target_layers=target_layers, mask_token_id=vocab - 1, block_size=block_size,
                          target_layer_ids=layer_ids, rope_theta=10000.0, context_window=context_window)
    mx.random.seed(seed)
    net = DFlashNet(config)
    if scale != 1.0:
        net.norm.weight = scale * net.norm.weight
    mx.eval(net.parameters())
    return net


def test_greedy_dflash_equals_plain_greedy_over_300_tokens():
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    plain = generate(target, tokenizer, PROMPT, drafter="none", max_tokens=300, stop_tokens=set())
    drafter = DFlashDrafter(random_dflash(layer_ids=(0, 1)), target)
    drafts = []
    propose = drafter.propose
    drafter.propose = lambda *a: drafts.append((d := propose(*a)).size) or d
    spec = generate(
        target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=5, max_tokens=300, stop_tokens=set()
    )
    assert spec.tokens == plain.tokens
    assert max(drafts) == 5  # whole blocks drafted


def test_context_cache_equals_a_from_scratch_forward():
    """After rounds with accepted drafts, the block's logits from the cached context equal a forward
    over the target features of the whole committed sequence (no cache), which also checks the
    feature taps (layer N = the last layer's output) and that only committed positions were cached."""
    target = tiny_llama(seed=0, vocab_size=V, sharpen=3.0)
    net = random_dflash(vocab=V, layer_ids=(0, 1), scale=3.0)
    drafter = DFlashDrafter(net, target)
    prompt, accepted = [1, 2, 3, 1, 2], 0
    for round_ in speculative_rounds(target, prompt, drafter, num_draft_tokens=5, max_tokens=60,
                                     sampling=SamplingParams(), stop_tokens=set()):
        prompt, accepted = prompt + round_.tokens, accepted + round_.stats.num_accepted
    assert accepted > 0
    _, cached = drafter.block_logits(prompt[-1], len(prompt) - 1)
    tap = HiddenTap(target, layers=net.config.feature_layers)
    target(mx.array(prompt[:-1])[None])
    features = tap.features()  # [1, L - 1, 2 H]
    # layer 2 of 2: the final norm's input
    assert mx.allclose(target.model.norm(features[..., 64:]), tap.final)
    block = mx.array([[prompt[-1]] + [net.config.mask_token_id] * 5])
    _, fresh = net.block(
        block, features, target.model.embed_tokens, target.lm_head, block_offset=len(prompt) - 1
    )
    assert drafter.cache[0].offset == len(prompt) - 1
    assert mx.allclose(cached, fresh[0], atol=1e-4)


def test_training_blocks_equal_inference_blocks():
    """Many blocks in one batch (context masked to each anchor's prefix, as training runs them) give
    the logits an inference forward over that prefix gives (the backbone DSpark reuses)."""
    target = tiny_llama(seed=0)
    net = random_dflash(layer_ids=(1,), layers=1)
    tap = HiddenTap(target, layers=net.config.feature_layers)
    sequence = list(range(3, 30))
    target(mx.array(sequence)[None])
    features = tap.features()  # [1, S, H]
    anchors, B, S = [4, 11, 20], 6, len(sequence)
    blocks = mx.array([[sequence[a]] + [net.config.mask_token_id] * (B - 1) for a in anchors])
    mask = mx.concatenate(
        [mx.arange(S)[None] < mx.array(anchors)[:, None], mx.ones((3, B), dtype=mx.bool_)], axis=1
    )
    embed, lm_head = target.model.embed_tokens, target.lm_head
    _, batched = net.block(
        blocks, features, embed, lm_head, block_offset=mx.array(anchors), mask=mask[:, None, None]
    )
    for row, a in enumerate(anchors):
        _, alone = net.block(blocks[row : row + 1], features[:, :a], embed, lm_head, block_offset=a)
        assert mx.allclose(batched[row], alone[0], atol=1e-4)


def test_a_context_window_drafts_what_training_masked():
    """A drafter with ``context_window`` 3 drafts from the last 3 committed positions only: its cached
    block logits equal a forward over the whole committed context masked to those 3 (how training
    windows, ``train.dflash.make_batch``) and differ from the unwindowed forward; the window survives
    a save and load."""
    target = tiny_llama(seed=0, vocab_size=V, sharpen=3.0)
    net = random_dflash(vocab=V, layer_ids=(0, 1), scale=3.0, context_window=3)
    drafter = DFlashDrafter(net, target)
    prompt = [1, 2, 3, 1, 2, 4, 5]
    for round_ in speculative_rounds(target, prompt, drafter, num_draft_tokens=5, max_tokens=30,
                                     sampling=SamplingParams(), stop_tokens=set()):
        prompt = prompt + round_.tokens
    _, cached = drafter.block_logits(prompt[-1], len(prompt) - 1)
    tap = HiddenTap(target, layers=net.config.feature_layers)
    target(mx.array(prompt[:-1])[None])
    S, B = len(prompt) - 1, 6
    block = mx.array([[prompt[-1]] + [net.config.mask_token_id] * (B - 1)])
    window = mx.concatenate([mx.arange(S) >= S - 3, mx.ones((B,), dtype=mx.bool_)])[None, None, None]
    embed, head = target.model.embed_tokens, target.lm_head
    _, masked = net.block(block, tap.features(), embed, head, block_offset=S, mask=window)
    _, everything = net.block(block, tap.features(), embed, head, block_offset=S)
    assert mx.allclose(cached, masked[0], atol=1e-4)
    assert not mx.allclose(cached, everything[0], atol=1e-2)


def test_the_context_window_is_saved_and_checked(tmp_path):
    save_dflash(random_dflash(context_window=2), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["context_window"] == 2
    assert load_dflash(tmp_path).config.context_window == 2
    config = json.loads((tmp_path / "config.json").read_text())
    config["dflash_config"]["context_window"] = -1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="context_window = -1, not a whole number of at least 0"):
        load_dflash(tmp_path)


# --- losslessness ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target8():
    return tiny_llama(seed=0, vocab_size=V, sharpen=3.0)


def _drafter8(target):
    return DFlashDrafter(random_dflash(vocab=V, block_size=4, layer_ids=(0, 1)), target)


#: Generations per chi-square run: at 1,200 the broken control (argmax drafts scored with softmax q) scored
#: 179 against a critical 51.3; its noncentrality scaled to 800 rejects with probability 0.99998 (0.996 from
#: its 2-sigma lower bound).
SAMPLES = 800


@pytest.mark.slow  # statistical
def test_sampled_blocks_are_lossless(target8):
    params = SamplingParams(temp=1.0)
    stat, critical = chi_square(
        sample_joint(target8, _drafter8(target8), params, n=SAMPLES), exact_joint(target8, params)
    )
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_a_wrong_q(target8, monkeypatch):
    """Draft each position's argmax but hand the verifier the softmax q it was not drawn from."""

    def argmax_with_softmax_q(logits, sampling):
        return mx.argmax(logits, axis=-1).astype(mx.int32), warp(logits, sampling)

    monkeypatch.setattr(dflash_drafter, "sample", argmax_with_softmax_q)
    params = SamplingParams(temp=1.0)
    stat, critical = chi_square(
        sample_joint(target8, _drafter8(target8), params, n=SAMPLES), exact_joint(target8, params)
    )
    assert stat > critical


# --- checkpoints -------------------------------------------------------------------------------


def write_published(folder, hidden=64, vocab=264, layers=2, target_layers=2, seed=3) -> dict:
    """A synthetic checkpoint written by hand in z-lab's later layout (block size inside
    ``dflash_config``, ``rope_parameters``), with the tensor names of their ``DFlashDraftModel``."""
    rng = np.random.default_rng(seed)
    nh, nkv, hd, inter = 4, 2, hidden // 4, 2 * hidden
    shapes = {"fc.weight": (hidden, 2 * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (nh * hd, hidden),
                p + "self_attn.k_proj.weight": (nkv * hd, hidden),
                p + "self_attn.v_proj.weight": (nkv * hd, hidden),
                p + "self_attn.o_proj.weight": (hidden, nh * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    weights = {
        k: mx.array(
            (1.0 + 0.1 * rng.standard_normal(s)) if len(s) == 1 else 0.2 * rng.standard_normal(s),
            dtype=mx.bfloat16,
        )
        for k, s in shapes.items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "vocab_size": vocab,
        "num_target_layers": target_layers,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "dtype": "bfloat16",
        "layer_types": ["full_attention"] * layers,
        "dflash_config": {"block_size": 8, "mask_token_id": vocab - 2, "target_layer_ids": [0, 1]},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return weights


def test_a_published_layout_checkpoint_loads_and_drafts(tmp_path):
    weights = write_published(tmp_path / "dflash")
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    drafter = make_drafter(f"dflash:heads={tmp_path / 'dflash'}", target, tokenizer)
    config = drafter.config
    assert (config.block_size, config.mask_token_id, config.target_layer_ids, config.rope_theta) == (
        8,
        262,
        (0, 1),
        1e4,
    )
    assert mx.array_equal(
        drafter.net.layers[1].mlp.up_proj.weight, weights["layers.1.mlp.up_proj.weight"].astype(mx.float32)
    )
    result = generate(
        target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=7, max_tokens=60, stop_tokens=set()
    )
    assert result.tokens == generate(target, tokenizer, PROMPT, max_tokens=60, stop_tokens=set()).tokens
    assert result.stats.drafted >= 7 * 2
    save_dflash(drafter.net, tmp_path / "saved")  # our layout (z-lab's first) reads back identically
    again = load_dflash(tmp_path / "saved", target)
    assert again.config == config and mx.array_equal(again.fc.weight, drafter.net.fc.weight)


@pytest.mark.parametrize("change,message", [
    (dict(hidden=32), "hidden size 32 but the target's is 64"),
    (dict(vocab=300), "vocabulary 300 but the target's is 264"),
    (dict(target_layers=24), "target of 24 decoder layers but this target has 2"),
])
def test_a_drafter_that_does_not_fit_is_refused_at_load(tmp_path, change, message):
    write_published(tmp_path / "bad", **change)
    with pytest.raises(ValueError, match=message):
        make_drafter(f"dflash:heads={tmp_path / 'bad'}", tiny_llama(seed=0), byte_tokenizer())


def test_unsupported_variants_and_missing_files_are_refused(tmp_path):
    write_published(tmp_path / "swa")
    config = json.loads((tmp_path / "swa" / "config.json").read_text())
    config["layer_types"][0] = "sliding_attention"
    (tmp_path / "swa" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding-window or causal layers"):
        load_dflash(tmp_path / "swa")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_dflash(tmp_path / "empty")
