"""Head training: the assistant mask, the split, the feature cache, Medusa-1 training, the CLI."""

from __future__ import annotations

import json
import random
import string

import mlx.core as mx
import numpy as np
import pytest
from conftest import CHAT_TEMPLATE, byte_tokenizer, tiny_llama

from mlxspec.commands.train import main as train_main
from mlxspec.loading.data import Conversation, Turn, read_prompts_jsonl
from mlxspec.heads.medusa import load_medusa
from mlxspec.core.sampling import SamplingParams
from mlxspec.core.taps import output_head
from mlxspec.train import (
    EvalRecord,
    FeatureCache,
    MedusaTrainConfig,
    StepRecord,
    assistant_mask,
    extract_features,
    heldout_prompts,
    read_conversations,
    split_conversations,
    tokenize_conversations,
    train_medusa,
    write_heldout_prompts,
)
from mlxspec.train.features import valid_targets

pytestmark = pytest.mark.slow  # training

LETTERS = string.ascii_lowercase


def alphabet_conversations(n: int, seed: int = 0) -> list[Conversation]:
    """Answers that walk the alphabet from a random letter: token t + 2 follows from token t."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        start, length = rng.randrange(26), rng.randrange(20, 40)
        answer = "".join(LETTERS[(start + j) % 26] for j in range(length))
        out.append(Conversation(f"c{i}", (Turn("user", f"walk {i}"), Turn("assistant", answer))))
    return out


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=0), byte_tokenizer()


def examples_of(tokenizer, conversations, max_length=256):
    return list(tokenize_conversations(tokenizer, conversations, max_length=max_length))


# --- data ---------------------------------------------------------------------------------


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_assistant_mask_covers_exactly_the_assistant_spans():
    tok = byte_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4, é"}]
    tokens, mask = assistant_mask(tok, messages)
    spans = [tok.decode(tokens[a:b]) for a, b in _runs(mask)]
    assert spans == ["hello there<|im_end|>", "4, é<|im_end|>"]
    # everything unmasked is template or the other roles' text
    unmasked = tok.decode([t for t, m in zip(tokens, mask) if not m])
    assert "hello" not in unmasked and "be brief" in unmasked and "2+2?" in unmasked


def test_tokenize_drops_leading_assistant_turns_truncates_and_refuses_unstable_templates():
    tok = byte_tokenizer()
    leading = Conversation("a", (Turn("assistant", "orphan"), Turn("user", "q"), Turn("assistant", "answer")))
    ex = examples_of(tok, [leading])[0]
    assert "orphan" not in tok.decode(ex.tokens.tolist())
    assert tok.decode(ex.tokens[ex.mask].tolist()) == "answer<|im_end|>"
    cut = examples_of(tok, [leading], max_length=24)[0]
    assert len(cut.tokens) == 24 and tok.decode(cut.tokens[cut.mask].tolist()) == "answ"
    assert examples_of(tok, [leading], max_length=12) == []  # no assistant token left
    tok._tokenizer.chat_template = "{{ messages[-1]['content'] }}"  # rewrites earlier turns
    from mlxspec.train import DataReport

    report = DataReport()
    assert list(tokenize_conversations(tok, [leading], max_length=99, report=report)) == []
    assert sum(report.skipped.values()) == 1
    tok._tokenizer.chat_template = CHAT_TEMPLATE


def test_jsonl_formats_and_errors(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
        + "\n\n"
        + json.dumps(
            {"id": "x", "conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]}
        )
        + "\n"
    )
    conversations, _ = read_conversations(str(path))
    assert [[(t.role, t.text) for t in c.turns] for c in conversations] == [
        [("user", "a"), ("assistant", "b")], [("user", "c"), ("assistant", "d")]]
    assert conversations[1].id == "x"
    path.write_text('{"messages": [{"role": "robot", "content": "a"}]}\n')
    with pytest.raises(ValueError, match="data.jsonl:1"):
        read_conversations(str(path))


def test_split_is_seeded_disjoint_and_drops_repeated_prompts(tmp_path):
    conversations = alphabet_conversations(40)
    twin = Conversation("twin", conversations[5].turns)  # ShareGPT repeats prompts
    conversations.append(twin)
    train, heldout = split_conversations(conversations, num_heldout=8, seed=3)
    again, heldout_again = split_conversations(conversations, num_heldout=8, seed=3)
    assert [c.id for c in heldout] == [c.id for c in heldout_again] and len(heldout) == 8
    assert [c.id for c in train] == [c.id for c in again]
    held = {c.turns[0].text for c in heldout}
    assert not held & {c.turns[0].text for c in train}
    assert len(train) == 41 - 8 - (1 if conversations[5].turns[0].text in held else 0)
    write_heldout_prompts(tmp_path / "p.jsonl", heldout_prompts(heldout))
    assert [p.text for p in read_prompts_jsonl(tmp_path / "p.jsonl")] == [c.turns[0].text for c in heldout]


# --- feature cache ------------------------------------------------------------------------


def test_feature_cache_resumes_and_replays_the_same_batches(tiny, tmp_path):
    model, tok = tiny
    examples = examples_of(tok, alphabet_conversations(24))
    interrupted, fresh = tmp_path / "a", tmp_path / "b"
    for progress in extract_features(model, examples, interrupted, chunk_tokens=300):
        if progress.chunk == 1:  # chunk 0 is on disk: stop mid-extraction
            break
    with pytest.raises(ValueError, match="unfinished"):
        FeatureCache(interrupted)
    resumed = list(extract_features(model, examples, interrupted, chunk_tokens=300))
    assert resumed[0].computed == 0  # chunk 0 was skipped, not recomputed
    assert resumed[-1].done == sum(len(ex.tokens) for ex in examples) > resumed[-1].computed
    list(extract_features(model, examples, fresh, chunk_tokens=300))
    a, b = FeatureCache(interrupted), FeatureCache(fresh)
    assert a.num_chunks >= 3

    def flat(cache, epoch):
        return [
            np.concatenate(
                [np.array(x.hidden).ravel(), np.array(x.labels).ravel(), np.array(x.valid).ravel()]
            )
            for x in cache.batches(3, 32, epoch=epoch, seed=7)
        ]

    first = flat(a, 0)
    assert len(first) == a.steps_per_epoch(3, 32)
    assert all(np.array_equal(x, y) for x, y in zip(first, flat(b, 0))) and len(first) == len(flat(b, 0))
    assert all(np.array_equal(x, y) for x, y in zip(first, flat(a, 0)))
    assert not all(np.array_equal(x, y) for x, y in zip(first, flat(a, 1)))  # a new epoch reshuffles
    # the stored features are the target's: hidden state and greedy token of example 0
    chunk = a.load_chunk(0)
    n = len(examples[0].tokens)
    logits = model(mx.array(examples[0].tokens)[None])[0]
    hidden = model.model(mx.array(examples[0].tokens)[None])[0]
    np.testing.assert_allclose(chunk["hidden"][:n].astype(np.float32), np.array(hidden), atol=2e-2, rtol=1e-2)
    rows = examples[0].mask[1:]  # greedy tokens are kept where the next token is an assistant token
    assert np.array_equal(chunk["greedy"][:n - 1][rows], np.array(mx.argmax(logits, axis=-1))[:-1][rows])
    assert (chunk["greedy"][:n][~np.append(rows, False)] == -1).all()


def test_valid_positions_stay_inside_an_example_and_on_assistant_tokens():
    arrays = {"mask": np.array([0, 0, 1, 1, 0, 1, 1, 1], bool), "offsets": np.array([0, 4, 8])}
    valid = valid_targets(arrays, 2)
    # head 0 at t targets t + 2; position 2 would target 4, which lies in the next example
    assert valid[0].tolist() == [True, True, False, False, True, True, False, False]
    assert valid[1].tolist() == [True, False, False, False, True, False, False, False]


# --- training -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def caches(tiny, tmp_path_factory):
    model, tok = tiny
    root = tmp_path_factory.mktemp("features")
    train_ex = examples_of(tok, alphabet_conversations(120, seed=1))
    heldout_ex = examples_of(tok, alphabet_conversations(12, seed=2))
    list(extract_features(model, train_ex, root / "train", chunk_tokens=2000))
    list(extract_features(model, heldout_ex, root / "heldout"))
    return FeatureCache(root / "train"), FeatureCache(root / "heldout")


CONFIG = MedusaTrainConfig(num_heads=2, epochs=3, batch_size=64, learning_rate=3e-3, warmup_steps=5)


def test_training_learns_a_pattern_and_the_checkpoint_reloads(tiny, caches, tmp_path):
    model, _ = tiny
    records = list(train_medusa(model, *caches, tmp_path, CONFIG))
    steps = [r for r in records if isinstance(r, StepRecord)]
    evals = [r for r in records if isinstance(r, EvalRecord)]
    assert [e.epoch for e in evals] == [0, 1, 2, 3]
    losses = [s.loss for s in steps]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    head1_before, head1_after = evals[0].accuracy[0], evals[-1].accuracy[0]
    assert head1_after > 0.5 > 1 / 26 and head1_after > head1_before + 0.3
    # the checkpoint is the published layout and reloads to the same logits
    heads = load_medusa(tmp_path, hidden_size=64, vocab_size=264)
    assert heads.config.medusa_num_heads == 2 and heads.config.shared_lm_head
    copy = load_medusa(tmp_path / "epoch-3", hidden_size=64, vocab_size=264)
    h = mx.random.normal((5, 64), key=mx.random.key(0))
    np.testing.assert_allclose(np.array(copy(h, output_head(model))), np.array(heads(h, output_head(model))),
                               atol=5e-2)
    assert set(mx.load(str(tmp_path / "medusa_lm_head.safetensors"))) == {
        "0.0.linear.weight", "0.0.linear.bias", "1.0.linear.weight", "1.0.linear.bias"}
    assert json.loads((tmp_path / "config.json").read_text())["medusa_num_heads"] == 2


def test_resuming_mid_run_gives_the_same_heads(tiny, caches, tmp_path):
    model, _ = tiny
    config = MedusaTrainConfig(num_heads=2, epochs=2, batch_size=64, warmup_steps=2, save_every=4)
    whole = tmp_path / "whole"
    list(train_medusa(model, caches[0], None, whole, config))
    cut = tmp_path / "cut"
    for record in train_medusa(model, caches[0], None, cut, config):
        if isinstance(record, StepRecord) and record.epoch == 1 and record.step == 4:
            break  # a checkpoint was written at this step
    state = json.loads((cut / "trainer_state.json").read_text())
    assert (state["epoch"], state["step"]) == (1, 4)
    rest = [r for r in train_medusa(model, caches[0], None, cut, config) if isinstance(r, StepRecord)]
    assert rest[0].epoch == 1 and rest[0].step == 5
    a = mx.load(str(whole / "medusa_lm_head.safetensors"))
    b = mx.load(str(cut / "medusa_lm_head.safetensors"))
    for key in a:
        np.testing.assert_allclose(np.array(a[key]), np.array(b[key]), atol=1e-6)
    with pytest.raises(ValueError, match="different num_heads"):
        next(
            train_medusa(model, caches[0], None, cut, MedusaTrainConfig(num_heads=3, epochs=2, batch_size=64))
        )


def test_own_lm_heads_start_as_the_target_head(tiny, caches, tmp_path):
    model, _ = tiny
    config = MedusaTrainConfig(num_heads=2, epochs=1, batch_size=64, own_lm_head=True)
    from mlxspec.train import init_heads

    heads = init_heads(model, config)
    h = mx.random.normal((3, 64), key=mx.random.key(1))
    target_logits = np.array(output_head(model)(h))
    for logits in np.array(heads(h)):
        np.testing.assert_allclose(logits, target_logits, atol=1e-5)
    list(train_medusa(model, caches[0], None, tmp_path, config))
    weights = mx.load(str(tmp_path / "medusa_lm_head.safetensors"))
    assert weights["1.1.weight"].shape == (264, 64)
    assert not load_medusa(tmp_path, hidden_size=64, vocab_size=264).config.shared_lm_head


# --- CLI ----------------------------------------------------------------------------------


def test_cli_trains_then_measures(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    lines = [json.dumps({"id": c.id, "messages": c.messages()}) for c in alphabet_conversations(40, seed=4)]
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "heads"
    argv = ["medusa", "--model", str(tiny_model_dir), "--data", str(data), "--output", str(out),
            "--num-heads", "2", "--epochs", "1", "--batch-size", "64", "--num-heldout", "5",
            "--features-dir", str(tmp_path / "features"), "--max-tokens-total", "1500"]
    assert train_main(argv) == 0
    captured = capsys.readouterr()
    assert "before training: held-out top-1 per head" in captured.out and "epoch 1:" in captured.out
    assert len(read_prompts_jsonl(out / "heldout_prompts.jsonl")) == 5
    run = json.loads((out / "run.json").read_text())
    assert 1500 <= run["data"]["train"]["tokens"] < 1500 + 256 and run["extract_s"] >= 0
    assert (out / "epoch-1" / "medusa_lm_head.safetensors").is_file()
    measure = ["measure", "--model", str(tiny_model_dir), "--prompts", str(out / "heldout_prompts.jsonl"),
               "--contender", f"medusa chain_4=--drafter medusa --medusa-heads {out} --medusa-tree chain_4 "
               "--num-draft-tokens 2", "--num-prompts", "2", "--temps", "0",
               "--max-tokens", "12", "--output", str(tmp_path / "m.jsonl")]
    assert train_main(measure) == 0
    table = capsys.readouterr().out
    assert "| 0 | plain decoding | 1.00 | – | 2 | 1.00 |" in table
    row = next(line for line in table.splitlines() if "medusa chain_4" in line).split("|")
    assert row[3] == row[6] and row[5].strip() == row[9].strip() == "2"  # replayed τ = engine τ at temp 0
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2 * 3  # plain, replay, engine per prompt
    from mlxspec.train.measure import markdown_table, read_records

    assert markdown_table(read_records(tmp_path / "m.jsonl")) + "\n" == (tmp_path / "m.md").read_text()
    # replaying from the stored plain runs: the same τ, no new plain generation, no engine rows
    again = measure[:-1] + [str(tmp_path / "again.jsonl"), "--plain-runs", str(tmp_path / "m.jsonl"),
                            "--engine-prompts", "0"]
    assert train_main(again) == 0
    replayed = next(line for line in capsys.readouterr().out.splitlines() if "medusa chain_4" in line).split(
        "|"
    )
    assert replayed[3] == row[3] and replayed[9].strip() == "0"
    first, second = read_records(tmp_path / "m.jsonl"), read_records(tmp_path / "again.jsonl")
    plain = lambda records: [  # noqa: E731
        (r.prompt_id, r.tokens, r.stats.generation_s) for r in records if r.config == "plain"
    ]
    assert plain(second) == plain(first)  # the stored runs, timings included: nothing was generated
    assert train_main(again[:-4] + ["--max-tokens", "4", "--plain-runs", str(tmp_path / "m.jsonl")]) == 2
    assert "more than --max-tokens 4" in capsys.readouterr().err
    for bad in (tmp_path / "nowhere.jsonl", data):  # a missing file, a JSONL of something else
        assert train_main(again[:-4] + ["--plain-runs", str(bad)]) == 2
        assert "--plain-runs" in capsys.readouterr().err
    assert train_main(["medusa", "--data", str(data), "--output", str(out), "--epochs", "0"]) == 2
    assert "epochs must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["medusa", "ngram", "draft"])
def test_replay_matches_the_engine_at_temperature_zero(kind):
    from mlxspec.drafters import DraftModelDrafter, MedusaDrafter, NgramDrafter
    from mlxspec.core.tree import read_tree
    from mlxspec.engine.generate import generate
    from mlxspec.train import init_heads
    from mlxspec.train.measure import replay, target_features

    model, tok = tiny_llama(seed=2, sharpen=4.0), byte_tokenizer()
    if kind == "medusa":
        heads = init_heads(model, MedusaTrainConfig(num_heads=3))
        for head in heads.heads:  # untrained heads guess token t + 1; nudge them so they differ
            head[0].linear.bias = mx.random.normal((64,), key=mx.random.key(5)) * 0.3
        drafters = [MedusaDrafter(heads, output_head(model), read_tree(t)) for t in ("small_15", "chain_4")]
    elif kind == "ngram":
        drafters = [NgramDrafter(1, 3)]
    else:
        draft = tiny_llama(seed=2, sharpen=4.0)  # the target with a noisy LM head: accepts some, not all
        draft.lm_head.weight = draft.lm_head.weight + 0.1 * mx.random.normal(
            draft.lm_head.weight.shape, key=mx.random.key(1)
        )
        drafters = [DraftModelDrafter(draft, 264, 259)]
    accepted = 0
    for text in ["abc", "hello world", "xyzzy", "abcabcabc"]:
        ids = tok.encode(text)
        plain = generate(model, tok, ids, drafter="none", max_tokens=40)
        features = target_features(model, ids + plain.tokens, drafters)
        for drafter in drafters:
            run = generate(model, tok, ids, drafter=drafter, num_draft_tokens=3, max_tokens=40)
            assert run.tokens == plain.tokens
            replayed = replay(drafter, ids, plain.tokens, features, num_draft_tokens=3, max_tokens=40,
                              sampling=SamplingParams())
            assert (replayed.rounds, replayed.accepted_per_position) == (
                run.stats.rounds, run.stats.accepted_per_position)
            accepted += run.stats.accepted
    assert accepted > 5  # the comparison is not between two empty runs


def test_a_sampled_draft_is_not_replayed():
    from mlxspec.drafters import DraftModelDrafter
    from mlxspec.engine.generate import generate
    from mlxspec.train.measure import NotReplayable, replay

    model, tok = tiny_llama(seed=2), byte_tokenizer()
    drafter = DraftModelDrafter(tiny_llama(seed=3, num_layers=1), 264, 259)
    ids = tok.encode("abc")
    plain = generate(model, tok, ids, drafter="none", max_tokens=8)
    with pytest.raises(NotReplayable):
        replay(
            drafter,
            ids,
            plain.tokens,
            {},
            num_draft_tokens=3,
            max_tokens=8,
            sampling=SamplingParams(temp=0.7),
        )


def test_a_restricted_training_vocabulary_still_learns(tiny, caches, tmp_path):
    """--train-vocab: the loss over the most frequent label tokens only; letters are all in the set."""
    model, _ = tiny
    config = MedusaTrainConfig(num_heads=2, epochs=3, batch_size=64, learning_rate=3e-3, warmup_steps=5,
                               train_vocab=40)
    records = list(train_medusa(model, *caches, tmp_path, config))
    evals = [r for r in records if isinstance(r, EvalRecord)]
    assert evals[-1].accuracy[0] > 0.5 and evals[-1].accuracy[0] > evals[0].accuracy[0] + 0.3
    with pytest.raises(ValueError, match="train-vocab"):
        MedusaTrainConfig(train_vocab=-1)


def test_medusa_trains_on_a_corpus(tiny_model_dir, tmp_path, capsys):
    from mlxspec.loading.models import load
    from mlxspec.train.corpus import build_corpus

    model, tok = load(str(tiny_model_dir))
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": f"walk {i}"}], add_generation_prompt=True))
        for i in range(24)
    ]
    list(
        build_corpus(
            model, tok, prompts[:20], tmp_path / "corpus" / "train", max_new_tokens=24, batch_size=10
        )
    )
    list(
        build_corpus(
            model, tok, prompts[20:], tmp_path / "corpus" / "validation", max_new_tokens=24, batch_size=4
        )
    )
    argv = [
        "medusa",
        "--model",
        str(tiny_model_dir),
        "--corpus",
        str(tmp_path / "corpus"),
        "--output",
        str(tmp_path / "heads"),
        "--num-heads",
        "2",
        "--epochs",
        "2",
        "--batch-size",
        "64",
        "--train-vocab",
        "64",
    ]
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "before training" in out and "epoch 2:" in out
    assert (
        load_medusa(tmp_path / "heads" / "epoch-2", hidden_size=64, vocab_size=264).config.medusa_num_heads
        == 2
    )
    assert (
        train_main(["medusa", "--corpus", str(tmp_path / "nowhere"), "--output", str(tmp_path / "h2")]) == 2
    )
    assert "no corpus in" in capsys.readouterr().err
