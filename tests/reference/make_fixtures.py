"""Make the parity fixtures: tiny targets and drafters built and run by their authors' own code.

Each fixture is a tiny Hugging Face target (random weights, fixed seed) and a tiny head built with the
reference implementation, imported at generation time from a checkout of its authors' repository
(never copied into mlxspec), saved the way that code saves it, plus the numbers that code produces on
fixed inputs (``reference.npz``). ``tests/test_parity_*.py`` load the same files through mlxspec's
ordinary loaders and must reproduce those numbers; they need only the committed files, never torch.

Install (a separate environment; torch and transformers are never needed at run or test time)::

    python3 -m venv /path/to/venv-ref
    /path/to/venv-ref/bin/pip install -r tests/reference/requirements.txt

Get the reference code (any checkout of these repositories; the commits the committed fixtures were
made from are in ``tests/fixtures/parity/SOURCES.json``) and run, from the repository root::

    /path/to/venv-ref/bin/python tests/reference/make_fixtures.py \\
        --eagle PATH/SafeAILab/EAGLE --medusa PATH/FasterDecoding/Medusa

The speculators fixture needs transformers 5, on which the EAGLE code does not run: make it in an
environment of its own (``tests/reference/requirements-speculators.txt``) with
``--speculators installed`` (it imports the installed ``speculators`` package and reads the llama fixture).

Each ``--NAME`` also reads ``MLXSPEC_REF_NAME`` (e.g. ``MLXSPEC_REF_EAGLE``). Fixtures whose reference is
not given are left as they are. The run is deterministic (fixed seeds, one CPU thread, float32): run it
twice and ``git diff --stat tests/fixtures/parity`` stays empty (``--check`` compares instead of
writing and prints the largest difference).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "parity"
PROMPT = [17, 200, 3, 88, 141, 9, 255, 64, 120, 33, 7, 190]  # fixed input ids (< the tiny vocabulary)
VOCAB = 256


def seed(n: int) -> None:
    torch.manual_seed(n)
    np.random.seed(n)


def randomize(module: torch.nn.Module, std: float, n: int) -> None:
    """Every parameter ~ N(0, std) (norm weights 1 + N(0, std)), from seed ``n``: deterministic and
    far from the zero/identity inits some reference classes use, so a swapped or skipped tensor shows."""
    g = torch.Generator().manual_seed(n)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=g) * std
            p.copy_(1.0 + noise if "norm" in name else noise)


# --- tokenizer and targets -------------------------------------------------------------------------------

def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over ``t0 … t255`` (the fixtures feed ids; mlxspec's loader wants one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2")
    fast.save_pretrained(folder)


def make_target(kind: str, folder: Path, n: int):
    """A tiny llama or qwen2 target, float32, saved with ``save_pretrained`` (safetensors)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, torch_dtype="float32", bos_token_id=2, eos_token_id=1)
    if kind == "llama":
        # rope_theta differs from the 10000 EAGLE heads default to, so a head that inherits it shows
        config = tf.LlamaConfig(num_hidden_layers=8, rope_theta=50000.0, **common)
        model = tf.LlamaForCausalLM(config)
    elif kind == "qwen3":
        config = tf.Qwen3Config(num_hidden_layers=4, rope_theta=10000.0, head_dim=8, **common)
        model = tf.Qwen3ForCausalLM(config)
    else:
        config = tf.Qwen2Config(num_hidden_layers=4, rope_theta=10000.0, use_sliding_window=False, **common)
        model = tf.Qwen2ForCausalLM(config)
    randomize(model, 0.15, n)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)
    return model


def layer_inputs(model, ids: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """The residual stream entering each decoder layer in ``layers`` (forward pre-hooks), [L, H]."""
    seen, hooks = {}, []
    for i in layers:
        def hook(module, args, kwargs, i=i):
            seen[i] = (args[0] if args else kwargs["hidden_states"])[0].detach().clone()
        hooks.append(model.model.layers[i].register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def target_outputs(model, ids: list[int]) -> dict[str, np.ndarray]:
    """Logits [L, V], final normed hidden states [L, H] and every layer's input [N, L, H]."""
    x = torch.tensor([ids])
    N = len(model.model.layers)
    inputs = layer_inputs(model, x, list(range(N)))
    with torch.no_grad():
        final = model.model(x).last_hidden_state[0]
        logits = model(x).logits[0]
    return {"ids": np.array(ids, dtype=np.int64), "logits": logits.numpy(), "final": final.numpy(),
            "layer_inputs": np.stack([inputs[i].numpy() for i in range(N)])}


# --- EAGLE (SafeAILab/EAGLE) ------------------------------------------------------------------------------

def eagle_tree(
    ref_model, hidden: torch.Tensor, ids: list[int], root: int, lm_head=None
) -> dict[str, np.ndarray]:
    """Run the reference ``topK_genrate`` once; record its tree and every draft-logit call."""
    calls = []
    head = ref_model.lm_head if lm_head is None else lm_head
    hook = head.register_forward_hook(
        lambda m, a, out: calls.append(out.detach().reshape(-1, out.shape[-1]).clone())
    )
    ref_model.init_tree()
    ref_model.reset_kv()
    with torch.no_grad():
        input_ids = torch.tensor([ids + [root]])
        if lm_head is None:
            tokens, retrieve, mask, positions = ref_model.topK_genrate(hidden[None], input_ids, None, None)
        else:
            tokens, retrieve, mask, positions = ref_model.topK_genrate(hidden[None], input_ids, lm_head, None)
    hook.remove()
    out = {"tree_tokens": tokens[0].numpy(), "tree_mask": mask[0, 0].numpy().astype(bool),
           "tree_positions": positions.numpy(), "retrieve": retrieve.numpy()}
    for d, logits in enumerate(calls):
        out[f"draft_logits_{d}"] = logits.numpy()
    return out


def make_eagle3(ref: Path, target, t_out: dict, folder: Path, reduced: bool, n: int) -> dict:
    sys.path.insert(0, str(ref / "eagle" / "model"))
    try:
        import cnets  # EAGLE-3 draft (SafeAILab/EAGLE eagle/model/cnets.py)
        from configs import EConfig
    finally:
        sys.path.pop(0)
    N, H = target.config.num_hidden_layers, target.config.hidden_size
    draft_vocab = 64 if reduced else VOCAB
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": 256,
        "pad_token_id": 0,
        "hidden_act": "silu",
        "bias": False,
        "torch_dtype": "float32",
    }  # no rope_theta: the draft runs at EAGLE's default 10000
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    econfig = EConfig.from_pretrained(str(folder))
    seed(n)
    model = cnets.Model(econfig, total_tokens=16, depth=3, top_k=4)
    randomize(model, 0.2, n)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        if reduced:  # EAGLE-3's recipe: the most used target ids, sorted; d2t = offsets, t2d = mask
            used = sorted(np.random.RandomState(n).choice(VOCAB, draft_vocab, replace=False).tolist())
            model.d2t.copy_(torch.tensor([u - i for i, u in enumerate(used)]))
            model.t2d.copy_(torch.tensor([i in used for i in range(VOCAB)]))
    if not reduced:
        del model.d2t, model.t2d  # as EaModel does when the vocabularies agree
    model.eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("embed_tokens.")}
    torch.save(state, folder / "pytorch_model.bin")  # the published EAGLE-3 layout (DeepSpeed's 16-bit save)
    aux = [2, N // 2, N - 3]  # EAGLE-3 reads the inputs of these layers (modeling_llama_kv.py)
    hidden = torch.cat([torch.from_numpy(t_out["layer_inputs"][i]) for i in aux], dim=-1)
    ids = t_out["ids"].tolist()
    root = int(np.argmax(t_out["logits"][-1]))
    with torch.no_grad():
        seq = model.lm_head(model.norm(model(hidden[None], input_ids=torch.tensor([ids[1:] + [root]]))))[0]
    return {"aux_layers": np.array(aux), "root": np.array(root), "seq_logits": seq.numpy(),
            "top_k": np.array(4), "depth": np.array(3), "total_tokens": np.array(16),
            **eagle_tree(model, hidden, ids, root)}


def make_eagle1(ref: Path, target, t_out: dict, folder: Path, n: int) -> dict:
    sys.path.insert(0, str(ref / "eagle" / "model"))
    try:
        import cnets1  # EAGLE-1/2 draft (SafeAILab/EAGLE eagle/model/cnets1.py)
        from configs import EConfig
    finally:
        sys.path.pop(0)
    H = target.config.hidden_size
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "pad_token_id": 0,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }  # no "bias": fc has one
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    econfig = EConfig.from_pretrained(str(folder))
    seed(n)
    model = cnets1.Model(econfig, bias=True, total_tokens=16, depth=3, top_k=4)
    randomize(model, 0.2, n)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    model.eval()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")  # published repos keep embed_tokens
    ids = t_out["ids"].tolist()
    root = int(np.argmax(t_out["logits"][-1]))
    hidden = torch.from_numpy(t_out["final"])
    with torch.no_grad():
        seq = target.lm_head(model(hidden[None], input_ids=torch.tensor([ids[1:] + [root]])))[0]
    return {"root": np.array(root), "seq_logits": seq.numpy(), "top_k": np.array(4), "depth": np.array(3),
            "total_tokens": np.array(16), **eagle_tree(model, hidden, ids, root, lm_head=target.lm_head)}


# --- Medusa (FasterDecoding/Medusa) -----------------------------------------------------------------------

def make_medusa(ref: Path, target, t_out: dict, folder: Path, n: int) -> dict:
    import transformers.utils
    if not hasattr(transformers.utils, "is_flash_attn_available"):  # Medusa's modeling_llama_kv.py imports
        transformers.utils.is_flash_attn_available = lambda: False  # this name, gone from transformers 4.4x
    sys.path.insert(0, str(ref))
    try:
        from medusa.model.medusa_model import ResBlock
        from medusa.model.medusa_choices import mc_sim_7b_63
        from medusa.model import utils as medusa_utils
    finally:
        sys.path.pop(0)
    import torch.nn as nn
    from safetensors.torch import save_file

    H, heads = target.config.hidden_size, 5
    seed(n)
    medusa_head = nn.ModuleList(
        [nn.Sequential(ResBlock(H), nn.Linear(H, VOCAB, bias=False)) for _ in range(heads)]
    )
    randomize(medusa_head, 0.2, n)
    medusa_head.eval()
    folder.mkdir(parents=True, exist_ok=True)
    state = medusa_head.state_dict()
    torch.save(state, folder / "medusa_lm_head.pt")  # what MedusaModel.from_pretrained reads
    # train_legacy.py
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "medusa_lm_head.safetensors")
    # the published configs under-count the heads (medusa-vicuna-7b-v1.3 says 2; the file holds 5)
    (folder / "config.json").write_text(
        json.dumps(
            {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "tiny-llama"}, indent=1
        )
        + "\n"
    )
    hidden = torch.from_numpy(t_out["final"])[None]
    logits = torch.from_numpy(t_out["logits"])[None]
    with torch.no_grad():
        medusa_logits = torch.stack([h(hidden) for h in medusa_head])  # [heads, 1, L, V]
    buffers = medusa_utils.generate_medusa_buffers(mc_sim_7b_63, device="cpu")
    _, tree_candidates = medusa_utils.generate_candidates(
        medusa_logits, logits, buffers["tree_indices"], buffers["retrieve_indices"], temperature=0)
    return {"medusa_logits": medusa_logits[:, 0].numpy(), "tree_tokens": tree_candidates[0].numpy(),
            "tree_mask": buffers["medusa_attn_mask"][0, 0].numpy().astype(bool),
            "tree_positions": buffers["medusa_position_ids"].numpy()}


# --- DFlash (z-lab/dflash) -------------------------------------------------------------------------------

def run_blocks(model, target, prompt: list[int], generate, **kw) -> dict[str, np.ndarray]:
    """Run the reference's generation loop for a few rounds; record every draft forward's block logits."""
    calls = []
    B = model.block_size

    def hook(module, args, kwargs, out):
        hidden = out if isinstance(out, torch.Tensor) else out[0]
        calls.append(target.lm_head(hidden[:, -B:]).detach()[0].clone())
    handle = model.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        out_ids = generate(model, target=target, input_ids=torch.tensor([prompt]), max_new_tokens=6,
                           stop_token_ids=None, temperature=0.0, **kw)
    handle.remove()
    rec = {"output_ids": out_ids[0].numpy(), "block_size": np.array(B)}
    for r, logits in enumerate(calls):
        rec[f"block_logits_{r}"] = logits.numpy()  # [B, V]: row j scores the token at anchor + j
    return rec


def make_dflash(ref: Path, target, folder: Path, layout: int, n: int) -> dict:
    """z-lab's ``DFlashDraftModel`` (2 Qwen3 layers, block 4) saved with ``save_pretrained``. Layout 1 is
    what transformers 4.x writes (``block_size``, ``rope_theta`` at the top); layout 2 the later one
    (``block_size`` in ``dflash_config``, ``rope_parameters``), written from the same save by moving
    those two fields as transformers 5 / z-lab's later configs place them."""
    sys.path.insert(0, str(ref))
    try:
        from dflash.model import DFlashDraftModel, dflash_generate
    finally:
        sys.path.pop(0)
    import transformers as tf

    theta = 10000.0 if layout == 1 else 1000000.0
    config = tf.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                            rope_theta=theta, max_position_embeddings=256, tie_word_embeddings=False,
                            torch_dtype="float32", attn_implementation="eager")
    config.architectures = ["DFlashDraftModel"]
    config.num_target_layers = target.config.num_hidden_layers
    config.block_size = 4
    config.dflash_config = {"mask_token_id": 250, "target_layer_ids": [1, 5]}
    seed(n)
    model = DFlashDraftModel(config)
    randomize(model, 0.2, n)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if layout == 2:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
        cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
        cfg.pop("rope_scaling", None)
        (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return run_blocks(model, target, PROMPT, dflash_generate)


# --- DSpark (deepseek-ai/DeepSpec) -----------------------------------------------------------------------

class _Args(dict):
    __getattr__ = dict.__getitem__


def make_dspark(ref: Path, target, folder: Path, n: int) -> dict:
    """DeepSpec's ``Qwen3DSparkModel`` (2 layers, 4 proposals, Markov rank 8, confidence head with Markov
    features) from its ``build_draft_config``, saved as its ``ckpt_manager`` does (``save_pretrained``
    with the full state dict), run for a few rounds by its evaluator's own propose/update steps in its
    ``generate_decoding_sample`` loop (greedy)."""
    import types
    for name in ("deepspec.modeling.dspark.gemma4", "deepspec.modeling.eagle3.gemma4"):
        stub = types.ModuleType(name)  # Gemma-4 classes need transformers 5; the Qwen3 path never uses them
        stub.Gemma4DSparkModel = stub.Gemma4Eagle3Model = type("Gemma4Unused", (), {})
        sys.modules[name] = stub
    sys.path.insert(0, str(ref))
    try:
        from deepspec.eval.base_evaluator import generate_decoding_sample
        from deepspec.eval.dspark.evaluator import Qwen3DSparkEvaluator
        from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
        from deepspec.modeling.dspark.qwen3.config import build_draft_config
    finally:
        sys.path.pop(0)
    args = _Args(block_size=4, num_draft_layers=2, target_layer_ids=[1, 2], mask_token_id=250, num_anchors=8,
                 markov_rank=8, markov_head_type="vanilla", confidence_head_alpha=1.0,
                 confidence_head_with_markov=True)
    config = build_draft_config(target.config, args)
    config._attn_implementation = "eager"
    seed(n)
    model = Qwen3DSparkModel(config)
    randomize(model, 0.2, n)
    model.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, state_dict=model.state_dict(), safe_serialization=True)

    evaluator = types.SimpleNamespace(draft_model=model, max_proposal_tokens=model.block_size,
                                      args=types.SimpleNamespace(temperature=0.0, confidence_threshold=0.0))
    proposals = []

    def propose(**kw):
        p = Qwen3DSparkEvaluator._propose(evaluator, **kw)
        proposals.append(p)
        return p
    with torch.no_grad():
        out = generate_decoding_sample(
            target_model=target, input_ids=torch.tensor([PROMPT]), max_new_tokens=6,
            max_proposal_tokens=model.block_size, temperature=0.0, stop_token_ids=None,
            init_context=lambda **kw: Qwen3DSparkEvaluator._init_context(evaluator, **kw), propose=propose,
            update=lambda c, v: Qwen3DSparkEvaluator._update(evaluator, c, v))
    rec = {"output_ids": out.output_ids[0].numpy(), "proposals": np.array(model.block_size)}
    for r, p in enumerate(proposals):
        rec[f"drafts_{r}"] = p.verify_input_ids[0, 1:].numpy()
        rec[f"confidence_logits_{r}"] = p.confidence_logits[0].numpy()
    return rec


# --- MTP, DeepSeek-V3 layout (no runnable code from DeepSeek: vLLM's deepseek_mtp.py forward) -------------

def make_mtp_deepseek(folder: Path, n: int) -> dict:
    """A tiny GLM-4.5 MoE target (transformers' ``Glm4MoeForCausalLM``: partial RoPE, q/k norms, routed and
    shared experts) with one MTP layer in the DeepSeek-V3 layout, as DeepSeek and GLM publish it
    (``model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.*,embed_tokens}`` and the block's own tensors,
    beside the main weights). GLM stands in for DeepSeek-V3 because mlx-lm's ``deepseek_v3`` drops only
    ``model.layers.61`` (the full model's MTP index), so a tiny DeepSeek-V3 with its MTP layer does not
    load there. DeepSeek's inference code has no MTP forward, so the numbers follow vLLM's
    ``DeepSeekMultiTokenPredictorLayer.forward`` (its ``glm4_moe_mtp`` and SGLang's ``deepseek_nextn`` are
    the same) with transformers' own decoder layer as the block: the embedding is zeroed at position 0,
    x = eh_proj([enorm(e); hnorm(h)]), the block, logits = shared_head.head(shared_head.norm(x)); a chain
    feeds x (before shared_head.norm) back as h."""
    import transformers as tf
    from safetensors.torch import save_file
    from transformers.models.glm4_moe import modeling_glm4_moe as ds

    cfg = tf.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
        use_qk_norm=True, attention_bias=True, rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=False, num_nextn_predict_layers=1, rms_norm_eps=1e-6, bos_token_id=2,
        eos_token_id=1, torch_dtype="float32", attn_implementation="eager")
    seed(n)
    target = tf.Glm4MoeForCausalLM(cfg)
    randomize(target, 0.15, n)
    target.eval()
    N, H = cfg.num_hidden_layers, cfg.hidden_size
    mtp = torch.nn.Module()
    mtp.enorm, mtp.hnorm = ds.Glm4MoeRMSNorm(H, 1e-6), ds.Glm4MoeRMSNorm(H, 1e-6)
    mtp.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
    mtp.block = ds.Glm4MoeDecoderLayer(cfg, layer_idx=N)
    mtp.shared_head = torch.nn.Module()
    mtp.shared_head.norm = ds.Glm4MoeRMSNorm(H, 1e-6)
    randomize(mtp, 0.15, n + 1)
    mtp.eval()

    state = {k: v.contiguous() for k, v in target.state_dict().items()}
    for k, v in mtp.state_dict().items():
        state[f"model.layers.{N}.{k.removeprefix('block.')}"] = v.contiguous()
    state[f"model.layers.{N}.shared_head.head.weight"] = target.lm_head.weight.detach().clone()
    state[f"model.layers.{N}.embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    folder.mkdir(parents=True, exist_ok=True)
    target.config.save_pretrained(folder)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    save_tokenizer(folder)

    t_out = target_outputs(target, PROMPT)
    ids = PROMPT
    root = int(np.argmax(t_out["logits"][-1]))

    def mtp_forward(tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """vLLM's MTP layer over positions 0..T-1 (causal): the block output x [T, H]."""
        T = len(tokens)
        positions = torch.arange(T)
        e = target.model.embed_tokens(torch.tensor(tokens)).clone()
        e[positions == 0] = 0  # "masking inputs at position 0, as not needed by MTP"
        x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(hidden)], dim=-1))[None]
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        cos_sin = target.model.rotary_emb(x, positions[None])
        out = mtp.block(x, attention_mask=mask, position_ids=positions[None], position_embeddings=cos_sin)
        return (out[0] if isinstance(out, tuple) else out)[0]

    def logits(x):
        return target.lm_head(mtp.shared_head.norm(x))

    with torch.no_grad():
        hidden = torch.from_numpy(t_out["final"])  # the target's last hidden states (after its final norm)
        x1 = mtp_forward(ids[1:] + [root], hidden)  # position i: h_i with token i + 1
        l1 = logits(x1)
        d1 = int(torch.argmax(l1[-1]))
        x2 = mtp_forward(ids[1:] + [root, d1], torch.cat([hidden, x1[-1:]]))  # the chain: x fed back as h
        l2 = logits(x2[-1])
    return {
        **{f"target_{k}": v for k, v in t_out.items()},
        "root": np.array(root),
        "depth1_logits": l1.numpy(),
        "depth2_logits": l2.numpy(),
        "drafts": np.array([d1, int(torch.argmax(l2))]),
    }


# --- speculators EAGLE-3 (vllm-project/speculators; needs transformers 5, so a run of its own) -------------

def make_speculators_eagle3(out: Path, n: int) -> dict:
    """speculators' ``Eagle3DraftModel`` (the layout vLLM serves: ``layers.0.*``, ``d2t``/``t2d``, a
    ``transformer_layer_config`` and ``eagle_aux_hidden_state_layer_ids``, output-of-layer ids), for the
    committed tiny llama target, saved with its ``save_pretrained``. The numbers are the draft logits of its
    own ``forward`` (one TTT step: the causal draft over the prompt), read at its ``lm_head``. Its
    position ids start at 1 in training; RoPE is relative, so the logits are those of positions 0.. ."""
    from safetensors.numpy import load_file
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    t_out = dict(np.load(out / "llama" / "reference.npz"))
    embed = load_file(out / "llama" / "model.safetensors")["model.embed_tokens.weight"]
    N = t_out["layer_inputs"].shape[0]
    layer = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                        rms_norm_eps=1e-6, rope_theta=70000.0, tie_word_embeddings=False)  # not EAGLE's 10000
    layer._attn_implementation = "eager"
    aux = [0, 2, N - 3]  # outputs of these layers (not the default 2, N/2, N - 3 inputs, so a misread shows)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=64, eagle_aux_hidden_state_layer_ids=aux,
        embed_requires_grad=False,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    seed(n)
    model = Eagle3DraftModel(config)
    randomize(model, 0.2, n)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.from_numpy(embed))
        used = sorted(np.random.RandomState(n).choice(VOCAB, 64, replace=False).tolist())
        model.d2t.copy_(torch.tensor([u - i for i, u in enumerate(used)]))
        model.t2d.copy_(torch.tensor([i in used for i in range(VOCAB)]))
    model.eval()
    folder = out / "speculators_eagle3"
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    # a copy of speculators' config class (remote code): not ours
    (folder / "config.py").unlink(missing_ok=True)
    ids = t_out["ids"].tolist()
    root = int(np.argmax(t_out["logits"][-1]))
    hidden = torch.cat([torch.from_numpy(t_out["layer_inputs"][i + 1]) for i in aux], dim=-1)[None]
    calls = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: calls.append(o.detach()[0].clone()))
    with torch.no_grad():
        model(hidden_states=hidden, input_ids=torch.tensor([ids[1:] + [root]]),
              document_ids=torch.zeros(1, len(ids), dtype=torch.long), ttt_steps=1)
    hook.remove()
    return {"root": np.array(root), "seq_logits": calls[0].numpy(), "aux_layer_outputs": np.array(aux)}


# --- MTP, Qwen3.5 / Qwen3-Next layout (vLLM's qwen3_next_mtp.py forward) ---------------------------------

def make_mtp_qwen(folder: Path, n: int) -> dict:
    """A tiny Qwen3-Next target (transformers' ``Qwen3NextForCausalLM``: Gated DeltaNet and gated full
    attention layers, routed + shared experts, zero-centred RMSNorms) with its MTP module as Qwen publishes
    it (``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*``,
    ``mtp.norm``). Qwen ships no MTP forward; the numbers follow vLLM's
    ``Qwen3NextMultiTokenPredictor.forward`` with transformers' own ``Qwen3NextDecoderLayer`` (full attention)
    and ``Qwen3NextRMSNorm``: x = fc([pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)]), the layer, norm, the
    target's LM head."""
    import transformers as tf
    from safetensors.torch import save_file
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    cfg = tf.Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        decoder_sparse_step=1,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        full_attention_interval=2,
        mtp_num_hidden_layers=1,
        bos_token_id=2,
        eos_token_id=1,
        torch_dtype="float32",
        attn_implementation="eager",
    )
    seed(n)
    target = tf.Qwen3NextForCausalLM(cfg)
    randomize(target, 0.15, n)
    target.eval()
    H = cfg.hidden_size
    mtp = torch.nn.Module()
    mtp.fc = torch.nn.Linear(2 * H, H, bias=False)
    mtp.pre_fc_norm_embedding = qn.Qwen3NextRMSNorm(H, 1e-6)
    mtp.pre_fc_norm_hidden = qn.Qwen3NextRMSNorm(H, 1e-6)
    mtp.layers = torch.nn.ModuleList(
        [qn.Qwen3NextDecoderLayer(cfg, layer_idx=cfg.layer_types.index("full_attention"))]
    )
    mtp.norm = qn.Qwen3NextRMSNorm(H, 1e-6)
    g = torch.Generator().manual_seed(n + 1)
    with torch.no_grad():  # zero-centred norms store w - 1: small offsets, as trained checkpoints hold
        for _, p in sorted(mtp.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    mtp.eval()
    state = {k: v.contiguous() for k, v in target.state_dict().items()}
    state.update({f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()})
    folder.mkdir(parents=True, exist_ok=True)
    target.config.save_pretrained(folder)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    save_tokenizer(folder)

    t_out = target_outputs(target, PROMPT)
    root = int(np.argmax(t_out["logits"][-1]))
    tokens = PROMPT[1:] + [root]
    with torch.no_grad():
        T = len(tokens)
        positions = torch.arange(T)[None]
        e = target.model.embed_tokens(torch.tensor([tokens]))
        h = torch.from_numpy(t_out["final"])[None]
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(h)], dim=-1))
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        x = mtp.layers[0](x, attention_mask=mask, position_ids=positions,
                          position_embeddings=target.model.rotary_emb(x, positions))
        x = x[0] if isinstance(x, tuple) else x
        logits = target.lm_head(mtp.norm(x))[0]
    return {
        **{f"target_{k}": v for k, v in t_out.items()},
        "root": np.array(root),
        "depth1_logits": logits.numpy(),
    }


# --- tree verification (item 5): transformers on every root-to-node path ---------------------------------

def make_tree_verify(target, prompt: list[int], n: int) -> dict:
    """A fixed 12-node tree over ``prompt``; transformers runs each root-to-node path on its own."""
    parents = [-1, -1, -1, 0, 0, 1, 3, 3, 4, 6, 2, 9]  # draft nodes; -1 = the root (the prompt's last token)
    tokens = np.random.RandomState(n).randint(0, VOCAB, size=len(parents)).tolist()
    rows = []
    for node in range(-1, len(parents)):
        path, a = [], node
        while a >= 0:
            path.append(tokens[a])
            a = parents[a]
        with torch.no_grad():
            rows.append(target(torch.tensor([prompt + path[::-1]])).logits[0, -1].numpy())
    return {"prompt": np.array(prompt), "parents": np.array(parents), "tokens": np.array(tokens),
            "path_logits": np.stack(rows)}


# --- driver ----------------------------------------------------------------------------------------------

def write_npz(path: Path, arrays: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{k: np.asarray(v) for k, v in sorted(arrays.items())})


def git_commit(ref: Path) -> str | None:
    """The checkout's commit (``git rev-parse HEAD``, or a ``REVISION`` file for an exported tree)."""
    import subprocess
    if (ref / "REVISION").is_file():
        return (ref / "REVISION").read_text().strip()
    try:
        return subprocess.run(["git", "-C", str(ref), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def generate(out: Path, refs: dict[str, Path | None]) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # a separate environment (transformers 5): only this fixture, from the llama one
    if refs.get("speculators"):
        write_npz(out / "speculators_eagle3" / "reference.npz", make_speculators_eagle3(out, 60))
        old = out / "SOURCES.json"
        from importlib.metadata import version
        merged = {**json.loads(old.read_text()), "speculators": version("speculators"),
                  "transformers (speculators)": __import__("transformers").__version__}
        old.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        return
    llama = make_target("llama", out / "llama", 1)
    qwen2 = make_target("qwen2", out / "qwen2", 2)
    t_llama = target_outputs(llama, PROMPT)
    write_npz(out / "llama" / "reference.npz", t_llama)
    write_npz(out / "qwen2" / "reference.npz", target_outputs(qwen2, PROMPT))
    write_npz(out / "tree_verify_llama.npz", make_tree_verify(llama, PROMPT, 3))
    write_npz(out / "tree_verify_qwen2.npz", make_tree_verify(qwen2, PROMPT, 4))
    sources = {"transformers": __import__("transformers").__version__, "torch": torch.__version__}
    if refs.get("eagle"):
        ref = refs["eagle"]
        write_npz(
            out / "eagle3" / "reference.npz", make_eagle3(ref, llama, t_llama, out / "eagle3", True, 10)
        )
        write_npz(out / "eagle3_full_vocab" / "reference.npz",
                  make_eagle3(ref, llama, t_llama, out / "eagle3_full_vocab", False, 11))
        write_npz(out / "eagle1" / "reference.npz", make_eagle1(ref, llama, t_llama, out / "eagle1", 12))
        sources["SafeAILab/EAGLE"] = git_commit(ref)
    if refs.get("medusa"):
        ref = refs["medusa"]
        write_npz(out / "medusa" / "reference.npz", make_medusa(ref, llama, t_llama, out / "medusa", 20))
        sources["FasterDecoding/Medusa"] = git_commit(ref)
    if refs.get("dflash"):
        ref = refs["dflash"]
        for layout in (1, 2):
            name = "dflash" if layout == 1 else "dflash_layout2"
            write_npz(out / name / "reference.npz", make_dflash(ref, llama, out / name, layout, 30 + layout))
        sources["z-lab/dflash"] = git_commit(ref)
    if refs.get("deepspec"):
        ref = refs["deepspec"]
        qwen3 = make_target("qwen3", out / "qwen3", 5)
        write_npz(out / "qwen3" / "reference.npz", target_outputs(qwen3, PROMPT))
        write_npz(out / "dspark" / "reference.npz", make_dspark(ref, qwen3, out / "dspark", 40))
        sources["deepseek-ai/DeepSpec"] = git_commit(ref)
    write_npz(out / "mtp_deepseek" / "reference.npz", make_mtp_deepseek(out / "mtp_deepseek", 50))
    write_npz(out / "mtp_qwen" / "reference.npz", make_mtp_qwen(out / "mtp_qwen", 55))
    old = out / "SOURCES.json"
    merged = {
        **(json.loads(old.read_text()) if old.is_file() else {}),
        **{k: v for k, v in sources.items() if v},
    }
    old.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")


REFS = ("eagle", "medusa", "dflash", "deepspec", "speculators")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in REFS:
        p.add_argument(f"--{name}", type=Path, default=os.environ.get(f"MLXSPEC_REF_{name.upper()}"),
                       help=f"checkout of the {name} reference repository (or MLXSPEC_REF_{name.upper()})")
    p.add_argument("--out", type=Path, default=OUT, help="fixture folder (default: tests/fixtures/parity)")
    p.add_argument("--check", action="store_true", help="generate into a temporary folder and compare")
    args = p.parse_args(argv)
    refs = {name: getattr(args, name) for name in REFS}
    if not args.check:
        generate(args.out, refs)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "parity"
        if args.out.is_dir():
            shutil.copytree(args.out, fresh)
        generate(fresh, refs)
        return compare(args.out, fresh)


def compare(old: Path, new: Path) -> int:
    """Print every file that differs (npz: the largest absolute difference per array)."""
    bad = 0
    for f in sorted(p for p in new.rglob("*") if p.is_file()):
        g = old / f.relative_to(new)
        if not g.is_file():
            print(f"new file {f.relative_to(new)}")
            bad += 1
        elif f.read_bytes() != g.read_bytes():
            bad += 1
            if f.suffix == ".npz":
                a, b = np.load(f), np.load(g)
                for k in a.files:
                    diff = (
                        np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))
                        if a[k].shape == b[k].shape
                        else "shape"
                    )
                    print(f"{f.relative_to(new)}:{k} max diff {diff}")
            else:
                print(f"{f.relative_to(new)} differs")
    print("identical" if not bad else f"{bad} files differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
