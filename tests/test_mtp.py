"""MTP drafting: synthetic checkpoints in each published layout load and draft; greedy identity over 300
tokens; losslessness at temperature > 0 (with a failing control that reports the wrong q); the error
when a model has no MTP layers."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate, make_drafter
from mlxspec.commands.cli import main
from mlxspec.drafters import Draft, Plan
from mlxspec.drafters.mtp import MTPDrafter
from mlxspec.heads.mtp import MTPStack, has_mtp, init_mtp, load_mtp, save_mtp
from mlxspec.pacing import Fixed, make_pacer
from mlxspec.core.sampling import SamplingParams, warp
from stats import chi_square
from test_generate import plain_greedy
from test_lossless import PROMPT as PROMPT_V
from test_lossless import V, exact_joint, sample_joint

PROMPT = [10, 20, 30, 40, 10, 20, 30, 41, 50, 60]


def random_mtp(target, seed: int = 1, own_head: bool = False) -> dict[str, mx.array]:
    """A module for ``target`` with random weights, as ``MTPModule`` parameter names."""
    stack = init_mtp(target)
    mx.random.seed(seed)
    weights = {k: v + 0.05 * mx.random.normal(v.shape) for k, v in tree_flatten(stack.first.parameters())}
    if own_head:
        weights["head.weight"] = 0.2 * mx.random.normal(target.lm_head.weight.shape)
    return weights


def published(weights: dict[str, mx.array], layout: str, N: int, embed: mx.array) -> dict[str, mx.array]:
    """The module's tensors as a published checkpoint names them (docs/heads.md 7.2)."""
    out = {}
    for name, value in weights.items():
        if layout == "qwen3.5":
            name = {"eh_proj.weight": "fc.weight", "enorm.weight": "pre_fc_norm_embedding.weight",
                    "hnorm.weight": "pre_fc_norm_hidden.weight"}.get(name, name)
            out["mtp." + name.replace("blocks.", "layers.")] = value
        else:  # deepseek-v3 and glm: one extra decoder layer
            name = {"norm.weight": "shared_head.norm.weight", "head.weight": "shared_head.head.weight"}.get(
                name, name
            )
            out[f"model.layers.{N}." + name.replace("blocks.0.", "")] = value
    if layout == "glm":  # GLM-4.7-Flash also repeats the embedding inside the MTP layer
        out[f"model.layers.{N}.embed_tokens.weight"] = embed
    return out


def write_checkpoint(
    folder, target, layout: str, seed: int = 1, sharded: bool = False
) -> dict[str, mx.array]:
    """A model folder: the target's weights plus MTP tensors in ``layout``; returns the module's weights."""
    folder.mkdir(parents=True, exist_ok=True)
    N = target.args.num_hidden_layers
    own_head = layout == "glm"
    module = random_mtp(target, seed, own_head)
    main_weights = dict(tree_flatten(target.parameters()))
    extra = published(module, layout, N, target.model.embed_tokens.weight)
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": N,
        "vocab_size": target.args.vocab_size,
    }
    if layout == "qwen3.5":
        config["text_config"] = {"mtp_num_hidden_layers": 1}
    else:
        config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    if sharded:  # the MTP tensors in their own shard, found through the index
        mx.save_safetensors(str(folder / "model-00001-of-00002.safetensors"), main_weights)
        mx.save_safetensors(str(folder / "model-00002-of-00002.safetensors"), extra)
        weight_map = {**{k: "model-00001-of-00002.safetensors" for k in main_weights},
                      **{k: "model-00002-of-00002.safetensors" for k in extra}}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        mx.save_safetensors(str(folder / "model.safetensors"), {**main_weights, **extra})
    return module


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, sharpen=4.0)


LAYOUTS = [("deepseek-v3", False), ("glm", True), ("qwen3.5", False)]


@pytest.mark.parametrize("layout,sharded", LAYOUTS, ids=[layout for layout, _ in LAYOUTS])
def test_published_layouts_load_and_draft_greedy_identically(tmp_path, target, layout, sharded):
    written = write_checkpoint(tmp_path / "model", target, layout, sharded=sharded)
    assert has_mtp(tmp_path / "model")
    stack = load_mtp(tmp_path / "model", target)
    loaded = dict(tree_flatten(stack.first.parameters()))
    assert set(loaded) == set(written)
    for name, value in written.items():
        assert mx.array_equal(loaded[name], value), name
    assert stack.config.own_head == (layout == "glm")
    # no --mtp-weights: the target's own folder is where its MTP layers are found
    drafter = make_drafter("mtp:depth=3", target, byte_tokenizer(), target_path=str(tmp_path / "model"))
    result = generate(target, byte_tokenizer(), PROMPT, drafter=drafter, num_draft_tokens=3, max_tokens=300,
                      stop_tokens=set())
    assert result.tokens == plain_greedy(target, PROMPT, 300)
    assert result.stats.drafted > 0 and result.stats.drafter == "mtp"


def test_a_module_saved_here_loads_back_and_drafts_what_it_was(tmp_path, target):
    stack = init_mtp(target)
    save_mtp(stack, tmp_path / "mtp", target, {"draft_depth": 3})
    again = load_mtp(tmp_path / "mtp", target)
    assert again.config.draft_depth == 3 and again.config.layout == "deepseek"
    for (name, a), (_, b) in zip(tree_flatten(stack.parameters()), tree_flatten(again.parameters())):
        assert mx.array_equal(a, b), name
    drafter = make_drafter(f"mtp:weights={tmp_path / 'mtp'}", target, byte_tokenizer())
    assert drafter.depth == 3  # the module's own draft_depth
    hidden = mx.random.normal((len(PROMPT) - 1, 64))
    drafter.prefill(PROMPT, hidden)
    draft = drafter.propose(PROMPT, 3, SamplingParams())
    assert draft.size == 3 and draft.logprobs is None
    assert drafter.cache[0].offset == len(PROMPT) - 1  # speculative entries trimmed


def test_no_mtp_layers_is_one_clear_error(tmp_path, target, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"holds no MTP layers .*mlxspec train mtp"):
        load_mtp(tiny_model_dir, target)
    assert not has_mtp(tiny_model_dir)
    with pytest.raises(
        ValueError, match=r"no MTP layers for tiny: .*--mtp-weights FOLDER.*mlxspec train mtp"
    ):
        make_drafter("mtp", target, byte_tokenizer(), target_name="tiny", target_path=str(tiny_model_dir))
    assert main(["generate", "--model", str(tiny_model_dir), "--drafter", "mtp", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no MTP layers" in err and "mlxspec train mtp" in err


def test_a_missing_or_misfit_part_is_named(tmp_path, target):
    write_checkpoint(tmp_path / "a", target, "deepseek-v3")
    weights = mx.load(str(tmp_path / "a" / "model.safetensors"))
    N = target.args.num_hidden_layers
    del weights[f"model.layers.{N}.hnorm.weight"]
    mx.save_safetensors(str(tmp_path / "a" / "model.safetensors"), weights)
    with pytest.raises(ValueError, match=r"lacks hnorm.weight"):
        load_mtp(tmp_path / "a", target)
    write_checkpoint(tmp_path / "b", target, "qwen3.5")
    with pytest.raises(
        ValueError, match=r"MTP tensor mtp\.\S+ in .* has shape \(64.*\) but this target needs \(32.*\)"
    ):
        load_mtp(tmp_path / "b", tiny_llama(seed=0, hidden_size=32))


# --- losslessness at temperature > 0 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    """A vocabulary-8 target and an MTP module for it that drafts often enough to matter."""
    target = tiny_llama(seed=0, vocab_size=V, sharpen=3.0)
    return target, init_mtp(target)


@pytest.mark.parametrize("params", [SamplingParams(temp=1.0), SamplingParams(temp=0.7, top_k=3)],
                         ids=["temp1", "temp0.7-top_k3"])
@pytest.mark.slow  # statistical
def test_sampled_mtp_chains_follow_the_target(small, params):
    target, stack = small
    drafter = MTPDrafter(stack, target, depth=3)
    counts = sample_joint(target, drafter, params)
    stat, critical = chi_square(counts, exact_joint(target, params))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


class WrongQ(MTPDrafter):
    """Samples from the module's q but reports a flattened q (the softmax at twice the temperature)."""

    def propose(self, history, num_draft_tokens, sampling, plan=None):
        draft = super().propose(history, num_draft_tokens, sampling)
        if draft.logprobs is None:
            return draft
        flat = draft.logprobs * 0.5
        return Draft.chain(draft.tokens, flat - mx.logsumexp(flat, axis=-1, keepdims=True))


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_the_wrong_q(small):
    target, stack = small
    params = SamplingParams(temp=1.0)
    stat, critical = chi_square(sample_joint(target, WrongQ(stack, target, depth=3), params),
                                exact_joint(target, params))
    assert stat > critical


def test_a_deepseek_v3_target_reads_its_hf_mtp_layer_through_its_own_sanitize(tmp_path):
    """MoE experts stored one by one and MLA's fused kv_b_proj, as in DeepSeek-V3's safetensors."""
    from mlx_lm.models import deepseek_v3

    from mlxspec.heads.mtp import new_block

    args = deepseek_v3.ModelArgs(
        model_type="deepseek_v3",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        n_group=1,
        topk_group=1,
        max_position_embeddings=512,
        rope_scaling=None,
    )
    mx.random.seed(0)
    model = deepseek_v3.Model(args)
    block = new_block(model)
    mx.eval(model.parameters(), block.parameters())
    N, H, hf = 2, 64, {}
    for name, value in tree_flatten(block.parameters()):
        if ".switch_mlp." in name:  # HF keeps one tensor per expert
            hf.update(
                {
                    f"model.layers.{N}." + name.replace("switch_mlp", f"experts.{e}"): value[e]
                    for e in range(4)
                }
            )
        else:
            hf[f"model.layers.{N}." + name] = value
    embed_q = hf.pop(f"model.layers.{N}.self_attn.embed_q.weight")  # [heads, kv_lora, nope]
    unembed = hf.pop(f"model.layers.{N}.self_attn.unembed_out.weight")  # [heads, v, kv_lora]
    hf[f"model.layers.{N}.self_attn.kv_b_proj.weight"] = mx.concatenate(
        [embed_q.swapaxes(-1, -2), unembed], axis=1).reshape(-1, embed_q.shape[1])
    hf.update(
        {
            f"model.layers.{N}.{k}": v
            for k, v in {
                "enorm.weight": mx.ones((H,)),
                "hnorm.weight": mx.ones((H,)),
                "eh_proj.weight": 0.1 * mx.random.normal((H, 2 * H)),
                "shared_head.norm.weight": mx.ones((H,)),
                "shared_head.head.weight": model.lm_head.weight,
                "embed_tokens.weight": model.model.embed_tokens.weight,
            }.items()
        }
    )
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {**dict(tree_flatten(model.parameters())), **hf})
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": N, "num_nextn_predict_layers": 1}))
    stack = load_mtp(tmp_path, model)
    loaded = dict(tree_flatten(stack.first.parameters()))
    for name, value in tree_flatten(block.parameters()):
        assert mx.allclose(loaded["blocks.0." + name], value).item(), name
    prompt = [5, 6, 7, 8, 5, 6, 7, 9]
    result = generate(
        model,
        byte_tokenizer(),
        prompt,
        drafter=MTPDrafter(stack, model, depth=2),
        num_draft_tokens=2,
        max_tokens=60,
        stop_tokens=set(),
    )
    assert result.tokens == plain_greedy(model, prompt, 60) and result.stats.drafted > 0


def test_auto_runs_mtp_plainly_where_no_chain_of_its_depth_could_win(tmp_path, target):
    """MTP sizes its own rounds too: γ auto prices them (``pacing.make_pacer``) and, where a fully accepted
    chain loses to a plain step, decodes plainly for 16 rounds before a probe (the costs may be off) and says
    so."""
    from mlxspec.commands.generate import format_stats
    from mlxspec.pacing import PRICED_PLAIN, Auto, Costs, make_pacer, tree_summary

    stack = init_mtp(target)
    save_mtp(stack, tmp_path / "mtp", target, {"draft_depth": 3})
    drafter = make_drafter(f"mtp:weights={tmp_path / 'mtp'}", target, byte_tokenizer())
    steep = Costs([0.01 * k for k in range(1, 17)], draft_s=0.002)
    flat = Costs([0.01 + 0.0001 * k for k in range(16)], draft_s=0.002)
    # a chain: priced round by round, up to its depth
    chosen = make_pacer("auto", target, drafter, costs=flat)
    assert isinstance(chosen, Auto) and chosen.max_gamma == 3 and chosen.costs == flat
    policy = make_pacer("auto", target, drafter, costs=steep)
    assert isinstance(policy, Auto) and policy.priced_out and tree_summary(drafter, policy) == PRICED_PLAIN
    result = generate(
        target,
        byte_tokenizer(),
        PROMPT,
        drafter=drafter,
        num_draft_tokens=policy,
        max_tokens=16,
        stop_tokens=set(),
    )
    assert result.tokens == plain_greedy(target, PROMPT, 16) and result.stats.drafted == 0
    assert result.stats.gamma_rounds == [16] and "Drafter: mtp, drafted 0; rounds: 16" in format_stats(
        result.stats, drafter
    )


def test_auto_falls_back_to_plain_decoding_when_the_chain_keeps_missing(target):
    """A chain that follows γ is priced on its running acceptance: drafts that never survive send γ auto back
    to plain decoding after a few rounds (the module trained for Qwen2.5-Coder-0.5B, τ 1.25, lost 20-30% to
    plain decoding at its full depth)."""
    from mlxspec.pacing import Auto, Costs

    plain = plain_greedy(target, PROMPT, 60)
    never = next(i for i in range(target.args.vocab_size) if i not in plain)
    drafter = MTPDrafter(
        MTPStack(init_mtp(target).chain, init_mtp(target).config, np.array([never], np.int32)),
        target,
        depth=3,
    )
    costs = Costs([0.01 * (1 + 0.1 * k) for k in range(16)], draft_s=0.0005)
    # as given: no wall-clock in the test
    policy = make_pacer("auto", target, drafter, costs=costs, learn=False)
    assert isinstance(policy, Auto) and policy.max_gamma == 3
    result = generate(
        target,
        byte_tokenizer(),
        PROMPT,
        drafter=drafter,
        num_draft_tokens=policy,
        max_tokens=60,
        stop_tokens=set(),
    )
    assert result.tokens == plain and result.stats.accepted == 0
    # a few missed rounds at γ <= 3 sink the estimate below break-even, then plain steps and a probe or two
    assert 0 < result.stats.drafted <= 8 * 3 + 2 * 2 and result.stats.gamma_rounds[0] >= 45


class Scripted(Fixed):
    """A γ policy that replays a fixed pattern of γ (0 = a plain step), then keeps its last value."""

    def __init__(self, pattern):
        super().__init__(max(pattern))
        self.pattern, self.round = list(pattern), 0

    def plan(self):
        gamma = self.pattern[min(self.round, len(self.pattern) - 1)]
        self.round += 1
        return Plan(gamma)


def test_plain_rounds_between_chains_are_pipelined_and_still_feed_the_drafter(target, monkeypatch):
    """γ auto's fall-back rounds for a feature-reading drafter are pipelined plain steps (as ``--drafter
    none``'s) that keep each step's features: every chain drafted after a run of them is the chain a fresh
    drafter drafts from the whole history's features, and the output stays the target's greedy one."""
    from mlxspec.core.taps import HiddenTap

    stack = init_mtp(target)
    mx.random.seed(3)
    stack.first.update(tree_map(lambda v: v + 0.3 * mx.random.normal(v.shape), stack.first.parameters()))
    queued = []
    engine = sys.modules["mlxspec.engine.plain_steps"]
    original_queue = engine.PlainSteps.queue
    monkeypatch.setattr(
        engine.PlainSteps, "queue", lambda self, *a: queued.append(1) or original_queue(self, *a)
    )
    drafter, seen = MTPDrafter(stack, target, depth=3), []
    propose = drafter.propose
    drafter.propose = lambda history, gamma, sampling, plan=None: (
        seen.append((len(history), d := propose(history, gamma, sampling, plan))) or d
    )
    pattern = [3, 0, 0, 0, 2, 0, 3, 0, 0, 3, 0, 0, 0, 0, 3]
    result = generate(target, byte_tokenizer(), PROMPT, drafter=drafter, num_draft_tokens=Scripted(pattern),
                      max_tokens=40, stop_tokens=set())
    assert result.tokens == plain_greedy(target, PROMPT, 40)
    assert len(queued) >= 5  # runs of plain rounds were pipelined
    assert len(seen) >= 5 and all(d.size > 0 for _, d in seen)  # plain rounds never call the drafter
    tap, history = HiddenTap(target), PROMPT + result.tokens
    target(mx.array(history[:-1])[None])
    features = tap.features()[0]  # [len(history) - 1, H]: one forward over everything
    differs = 0
    for n, draft in seen[1:]:
        fresh = MTPDrafter(stack, target, depth=3)
        fresh.prefill(history[:n], features[: n - 1])
        assert (
            fresh.propose(history[:n], draft.size, SamplingParams()).tokens.tolist() == draft.tokens.tolist()
        ), n
        blind = MTPDrafter(stack, target, depth=3)
        blind.prefill(history[:n], mx.zeros_like(features[: n - 1]))
        differs += (
            blind.propose(history[:n], draft.size, SamplingParams()).tokens.tolist() != draft.tokens.tolist()
        )
    assert differs >= 2  # the drafts depend on the features, so a mis-fed one would show


# --- a draft vocabulary (docs/heads.md 7.4) ---------------------------------------------------------

HALF = np.array([0, 2, 3, 6], dtype=np.int32)  # half of the vocabulary-8 target's ids
#: The draft-vocabulary pair's generations: at 1,200 the broken control (q over the whole vocabulary) scored
#: 513 against a critical 51.3; its noncentrality scaled to 600 rejects with probability 1.0 (lower bound
#: too).
VOCAB_SAMPLES = 600


@pytest.mark.slow  # statistical
def test_a_draft_vocabulary_drafts_only_its_ids_and_stays_lossless(small):
    target, stack = small
    restricted = MTPStack(stack.chain, stack.config, HALF)
    drafter = MTPDrafter(restricted, target, depth=3)
    drafter.prefill(list(PROMPT_V), mx.random.normal((len(PROMPT_V) - 1, target.args.hidden_size)))
    draft = drafter.propose(list(PROMPT_V), 3, SamplingParams(temp=1.0))
    q = np.exp(np.array(draft.logprobs))  # [3, V]
    assert set(np.array(draft.tokens).tolist()) <= set(HALF.tolist())
    np.testing.assert_allclose(q.sum(axis=-1), 1.0, rtol=1e-5)
    assert q[:, np.setdiff1d(np.arange(V), HALF)].max() == 0.0
    params = SamplingParams(temp=1.0)
    stat, critical = chi_square(
        sample_joint(target, MTPDrafter(restricted, target, depth=3), params, n=VOCAB_SAMPLES),
        exact_joint(target, params),
    )
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


class UnrestrictedQ(MTPDrafter):
    """Samples from the draft vocabulary but reports q over the whole vocabulary (the mistake to catch)."""

    def _sample(self, module, h, sampling):
        token, _ = super()._sample(module, h, sampling)
        return token, warp(module.logits(h, self.lm_head), sampling)


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_q_that_ignores_the_draft_vocabulary(small):
    target, stack = small
    params = SamplingParams(temp=1.0)
    drafter = UnrestrictedQ(MTPStack(stack.chain, stack.config, HALF), target, depth=3)
    stat, critical = chi_square(sample_joint(target, drafter, params, n=VOCAB_SAMPLES),
                                exact_joint(target, params))
    assert stat > critical


def test_a_draft_vocabulary_is_saved_loaded_and_drafts_greedy_identically(tmp_path, target):
    stack = init_mtp(target)
    ids = np.arange(0, target.args.vocab_size, 3, dtype=np.int32)
    save_mtp(stack, tmp_path / "mtp", target, draft_ids=ids)
    again = load_mtp(tmp_path / "mtp", target)
    np.testing.assert_array_equal(again.draft_ids, ids)
    drafter = make_drafter(f"mtp:weights={tmp_path / 'mtp'},depth=3", target, byte_tokenizer())
    h = mx.random.normal((2, target.args.hidden_size))
    np.testing.assert_allclose(
        np.array(drafter.sub_head(h)), np.array(target.lm_head(h))[:, ids], rtol=1e-4, atol=1e-4
    )
    result = generate(target, byte_tokenizer(), PROMPT, drafter=drafter, num_draft_tokens=3, max_tokens=300,
                      stop_tokens=set())
    assert result.tokens == plain_greedy(target, PROMPT, 300)
    assert result.stats.drafted > 0
    mx.save_safetensors(
        str(tmp_path / "mtp" / "draft_vocab.safetensors"), {"ids": mx.array(ids[::-1].copy())}
    )
    with pytest.raises(
        ValueError, match=r"draft_vocab.safetensors must hold 'ids', distinct sorted token ids"
    ):
        load_mtp(tmp_path / "mtp", target)
