"""The tree-verify forward against Hugging Face transformers run on each root-to-node path on its own.

mlxspec verifies a whole draft tree in one target forward: the tree mask (every node sees the prefix, its
ancestors and itself, ``cache.tree_attention``) and per-node RoPE positions P + depth (``cache.TreeRoPE``).
The reference (tests/reference/make_fixtures.py) is transformers' own llama and qwen2 forward over
prompt + path for every node of a fixed 12-node tree, taking the last position's logits: a node's logits
must not depend on its siblings or cousins. Float32, 1e-4 relative.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.core.cache import prefill, speculative_cache, tree_attention
from mlxspec.core.tree import Tree
from parity import assert_close, reference, target


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_parity_tree_verify(name):
    ref = reference(f"tree_verify_{name}")
    model = target(name)
    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    tree = Tree(tuple(int(p) for p in ref["parents"]))
    cache = speculative_cache(model)
    prefill(model, cache, prompt[:-1])  # the root (the prompt's last token) is verified with the tree
    with tree_attention(model, cache, tree):
        logits = model(mx.array([[prompt[-1]] + tokens]), cache=cache)[0]
    assert_close(np.array(logits), ref["path_logits"], f"{name}: tree-verify logits vs each path run alone")
    # and the plain forward over the prompt gives transformers' logits (the target loads as a user's folder)
    assert_close(
        np.array(target(name)(mx.array([prompt]))[0]), reference(name)["logits"], f"{name}: target logits"
    )
