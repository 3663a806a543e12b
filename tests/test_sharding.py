"""A sharded job's set-up, in one process (issues 50 and 51): a split that cannot work is refused from the
model's config alone, before any weight is read, naming a fix that works for that model; the flags a job
cannot honour are refused with it; and plugins are recognised by what they declare, not by their names.

The 2-rank launches (each refusal printed once, by rank 0) are in tests/test_distributed.py.
"""

from __future__ import annotations

import pytest

from conftest import byte_tokenizer, save_tiny_model, tiny_llama, tiny_qwen2
from mlxspec.drafters import DrafterSpec, drafter_types, make_drafter
from mlxspec.loading.sharded import check_shardable
from mlxspec.sharding import _check_start


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A 2-layer llama (no pipeline stages in mlx-lm) and a 4-layer qwen2, 4 heads and 2 KV heads each, whose
    weights files are then removed: only their configs and tokenizers are left to read."""
    root, made = tmp_path_factory.mktemp("shardable"), {}
    for name, model in (("llama", tiny_llama()), ("qwen2", tiny_qwen2(num_layers=4))):
        (root / name).mkdir()
        made[name] = save_tiny_model(root / name, model, byte_tokenizer())
        for weights in made[name].glob("*.safetensors"):
            weights.unlink()
    return made


def test_a_split_llama_cannot_make_is_refused_naming_the_one_it_can(folders):
    with pytest.raises(ValueError, match=r"a llama model into pipeline stages; use --shard tensor$"):
        check_shardable(str(folders["llama"]), "pipeline", 2)
    check_shardable(str(folders["llama"]), "tensor", 2)  # from the config: the weights are gone


def test_heads_that_do_not_divide_name_the_other_kind_or_a_rank_count_that_works(folders):
    with pytest.raises(ValueError, match=r"4 attention heads, 2 key/value heads.*; use --shard pipeline$"):
        check_shardable(str(folders["qwen2"]), "tensor", 3)
    with pytest.raises(ValueError, match=r"3 ranks cannot split evenly; use 2 ranks, or run it in one "):
        check_shardable(str(folders["llama"]), "tensor", 3)  # and llama has no pipeline stages to offer
    with pytest.raises(ValueError, match=r"cannot be split into 5 pipeline stages; use 4 ranks"):
        check_shardable(str(folders["qwen2"]), "pipeline", 5)


def test_an_unreadable_config_is_left_to_the_load_to_explain(tmp_path):
    check_shardable(str(tmp_path / "missing"), "tensor", 2)
    with pytest.raises(ValueError, match="unknown --shard 'rows'"):
        check_shardable(str(tmp_path / "missing"), "rows", 2)


def test_a_job_refuses_scheduled_gamma_and_a_split_before_loading(folders):
    with pytest.raises(ValueError, match="--num-draft-tokens scheduled measures costs on each machine"):
        _check_start("tensor", str(folders["llama"]), "scheduled", 2)
    with pytest.raises(ValueError, match="use --shard tensor"):
        _check_start("pipeline", str(folders["llama"]), 4, 2)
    _check_start("tensor", str(folders["llama"]), "auto", 2)


def test_plain_decoding_and_the_second_model_drafter_are_declared():
    """What the commands, the pacer and the engine ask of a drafter is declared by its type and its
    profile."""
    kinds = drafter_types()
    assert [name for name, kind in kinds.items() if kind.plain] == ["none"]
    assert [name for name, kind in kinds.items() if kind.needs_draft_model] == ["draft"]
    assert DrafterSpec("none").kind.plain and not DrafterSpec("ngram").kind.plain
    assert make_drafter("none").profile.plain
    assert not make_drafter("ngram").profile.plain
    assert make_drafter("none").vocab_summary() is None  # declared on every drafter: no getattr needed
