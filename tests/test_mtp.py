"""MTP drafting: synthetic checkpoints in each published layout load and draft; greedy identity over 300
tokens; losslessness at temperature > 0 (with a failing control that reports the wrong q); the error
when a model has no MTP layers."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate, make_drafter
from mlxspec.cli import main
from mlxspec.drafters import Draft
from mlxspec.drafters.mtp import MTPDrafter
from mlxspec.heads.mtp import has_mtp, init_mtp, load_mtp, save_mtp
from mlxspec.sampling import SamplingParams
from stats import chi_square
from test_generate import plain_greedy
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
    """The module's tensors as a published checkpoint names them (docs/mtp.md 1.2)."""
    out = {}
    for name, value in weights.items():
        if layout == "qwen3.5":
            name = {"eh_proj.weight": "fc.weight", "enorm.weight": "pre_fc_norm_embedding.weight",
                    "hnorm.weight": "pre_fc_norm_hidden.weight"}.get(name, name)
            out["mtp." + name.replace("blocks.", "layers.")] = value
        else:  # deepseek-v3 and glm: one extra decoder layer
            name = {"norm.weight": "shared_head.norm.weight", "head.weight": "shared_head.head.weight"}.get(name, name)
            out[f"model.layers.{N}." + name.replace("blocks.0.", "")] = value
    if layout == "glm":  # GLM-4.7-Flash also repeats the embedding inside the MTP layer
        out[f"model.layers.{N}.embed_tokens.weight"] = embed
    return out


def write_checkpoint(folder, target, layout: str, seed: int = 1, sharded: bool = False) -> dict[str, mx.array]:
    """A model folder: the target's weights plus MTP tensors in ``layout``; returns the module's weights."""
    folder.mkdir(parents=True, exist_ok=True)
    N = target.args.num_hidden_layers
    own_head = layout == "glm"
    module = random_mtp(target, seed, own_head)
    main_weights = dict(tree_flatten(target.parameters()))
    extra = published(module, layout, N, target.model.embed_tokens.weight)
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": N, "vocab_size": target.args.vocab_size}
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
    with pytest.raises(ValueError, match=r"no MTP layers for tiny: .*--mtp-weights FOLDER.*mlxspec train mtp"):
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
    with pytest.raises(ValueError, match=r"MTP tensor mtp\.\S+ in .* has shape \(64.*\) but this target needs \(32.*\)"):
        load_mtp(tmp_path / "b", tiny_llama(seed=0, hidden_size=32))


# --- losslessness at temperature > 0 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    """A vocabulary-8 target and an MTP module for it that drafts often enough to matter."""
    target = tiny_llama(seed=0, vocab_size=V, sharpen=3.0)
    return target, init_mtp(target)


@pytest.mark.parametrize("params", [SamplingParams(temp=1.0), SamplingParams(temp=0.7, top_k=3)],
                         ids=["temp1", "temp0.7-top_k3"])
def test_sampled_mtp_chains_follow_the_target(small, params):
    target, stack = small
    drafter = MTPDrafter(stack, target, depth=3)
    counts = sample_joint(target, drafter, params)
    stat, critical = chi_square(counts, exact_joint(target, params))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


class WrongQ(MTPDrafter):
    """Samples from the module's q but reports a flattened q (the softmax at twice the temperature)."""

    def propose(self, history, num_draft_tokens, sampling):
        draft = super().propose(history, num_draft_tokens, sampling)
        if draft.logprobs is None:
            return draft
        flat = draft.logprobs * 0.5
        return Draft.chain(draft.tokens, flat - mx.logsumexp(flat, axis=-1, keepdims=True))


def test_the_same_test_rejects_the_wrong_q(small):
    target, stack = small
    params = SamplingParams(temp=1.0)
    stat, critical = chi_square(sample_joint(target, WrongQ(stack, target, depth=3), params),
                                exact_joint(target, params))
    assert stat > critical
