"""The chat engine: ``Relay`` on scripted runner records, and the real engine on a tiny MLX model."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from mlx_lm.utils import save_config, save_model

from mlxspec_app.app import SpecChatApp
from mlxspec_app.engine import Engine, EngineConfig, Relay, chat_prompt
from mlxspec_app.messages import GenerationDone, GenerationFailed, TokensCommitted
from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate
from mlxspec.commands import chat
from mlxspec.engine.output import Committed
from mlxspec.engine.runner import Done, Failed
from mlxspec.loading.models import load
from mlxspec.core.metrics import RoundStats, GenerationStats, TokenEvent
from test_app import messages, wait_for


def rounds(n):
    """``n`` rounds of two tokens (one with empty text), as the runner posts them, then its ``Done``."""
    totals = GenerationStats(drafter="ngram")
    for index in range(n):
        stats = RoundStats(index, 2, 1, 2, 0.0, 0.1)
        totals.add_round(stats)
        last = index == n - 1
        totals.finish_reason = "stop" if last else None
        yield Committed((TokenEvent(1, "", "accepted", index),
                         TokenEvent(2, f"t{index}", "resampled", index)),
                        stats, GenerationStats(**{**totals.__dict__}), "stop" if last else None)
    yield Done(totals, "stop")


def collect(records, *, cancel_after=None, flush_s=0.0):
    posted, cancelled = [], threading.Event()
    relay = Relay(7, posted.append, cancelled, drafter="ngram", num_draft_tokens=2, flush_s=flush_s)
    for record in records:
        relay(record)
        if (cancel_after is not None and isinstance(record, Committed)
                and record.round.round + 1 == cancel_after):
            cancelled.set()
    return posted


def test_relay_batches_tokens_and_drops_empty_texts():
    posted = collect(rounds(5), flush_s=60.0)
    tokens = [m for m in posted if isinstance(m, TokensCommitted)]
    # The first round flushes at once; the rest arrive as one batch at the end.
    assert [len(m.spans) for m in tokens] == [1, 4]
    assert [s for m in tokens for s in m.spans] == [(f"t{i}", "resampled") for i in range(5)]
    assert isinstance(posted[-1], GenerationDone) and not posted[-1].cancelled
    assert posted[-1].stats.rounds == 5 and posted[-1].stats.tau == 2.0


def test_relay_flushes_on_cancel_and_ends_as_the_runner_says():
    records = list(rounds(10))[:3] + [Done(list(rounds(10))[2].totals, "cancelled")]
    posted = collect(records, cancel_after=3, flush_s=60.0)
    done = posted[-1]
    assert isinstance(done, GenerationDone) and done.cancelled and done.finish_reason is None
    assert done.stats.rounds == 3
    assert "".join(s for m in posted if isinstance(m, TokensCommitted) for s, _ in m.spans) == "t0t1t2"
    assert done.stats.tau == 2.0 and done.stats.taus == (2, 2, 2)


def test_relay_says_a_refusal_in_the_chats_words():
    posted = collect([Failed("no draft model; pass --draft-model PATH_OR_REPO", 400)])
    assert isinstance(posted[-1], GenerationFailed)
    assert posted[-1].error == ("no draft model; give a draft model in F2 "
                                "(or start the chat with --draft-model)")


def test_real_engine_thread_answers_like_plain_greedy_decoding(tmp_path):
    """The whole path: the real engine thread loads a saved tiny model with ``load``, the app sends
    the templated conversation, and the coloured answer equals plain greedy decoding."""
    model, tokenizer = tiny_llama(seed=3, sharpen=4.0), byte_tokenizer()
    save_model(tmp_path, model)
    save_config(dict(model.args.__dict__, eos_token_id=256), tmp_path / "config.json")
    tokenizer._tokenizer.save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), drafter="ngram", num_draft_tokens=3, max_tokens=40)

    async def body():
        app = SpecChatApp(Engine(config), system="Be brief.")
        async with app.run_test(size=(110, 36)) as pilot:
            await wait_for(pilot, lambda: app.info is not None, timeout_s=30)
            assert app.info.drafter == "ngram" and not app.info.quantized
            for text in ("abcabcabc", "again"):
                app.query_one("#prompt").value = text
                await pilot.press("enter")
                await wait_for(pilot, lambda: not app.generating, timeout_s=30)
            app.engine.configure(draft_model=str(tmp_path / "missing"))
            app.engine.configure("draft", 2)  # no draft model: refused, the n-gram drafter stays
            await wait_for(pilot, lambda: len(messages(app, "error")) == 2, timeout_s=30)
            await wait_for(pilot, lambda: app.info.num_draft_tokens == 2, timeout_s=30)
            errors = [m.text for m in messages(app, "error")]
            return app.history, [m.spans for m in messages(app, "assistant")], errors, app.info

    history, spans, errors, info = asyncio.run(body())
    assert [m["role"] for m in history] == ["user", "assistant"] * 2
    assert "missing" in errors[0] and "needs a draft model" in errors[1]
    assert "give a draft model in F2" in errors[1] and "pass --draft-model" not in errors[1]  # chat wording
    assert (info.drafter, info.draft_name) == ("ngram", None)
    reference, reference_tokenizer = load(str(tmp_path))
    conversation = [{"role": "system", "content": "Be brief."}]
    for turn, turn_spans in zip(history[1::2], spans):
        conversation.append(history[len(conversation) - 1])
        plain = generate(reference, reference_tokenizer, chat_prompt(reference_tokenizer, conversation),
                         drafter="none", max_tokens=40)
        assert turn["content"] == plain.text and plain.text
        assert {"accepted", "resampled"} & {kind for _, kind in turn_spans}  # drafts were verified
        conversation.append(turn)
    assert any("accepted" in {kind for _, kind in turn_spans} for turn_spans in spans)


def test_chat_command_rejects_bad_flags_before_starting_the_app(capsys):
    assert chat.main(["--num-draft-tokens", "-1"]) == 2
    assert "--num-draft-tokens must be from 0 to 64" in capsys.readouterr().err
    assert chat.main(["--num-draft-tokens", "65"]) == 2  # the bound F2 has too: pacing.MAX_NUM_DRAFT_TOKENS
    assert "--num-draft-tokens must be from 0 to 64" in capsys.readouterr().err
    assert chat.main(["--model", "no-draft-ships-for-this", "--drafter", "draft"]) == 2
    assert "needs a draft model" in capsys.readouterr().err


def test_chat_takes_the_draft_shipped_for_the_default_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path))  # no draft ships in the repository: file one here
    args = chat.setup_arg_parser().parse_args(["--drafter", "draft"])
    assert chat.main(["--drafter", "draft"]) == 2
    assert "needs a draft model" in capsys.readouterr().err
    folder = tmp_path / "draft" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    config = chat.checked_config(args)
    assert config.drafter.name == "draft"
    assert Path(config.draft_model.spec).resolve() == folder.resolve()


def test_chat_flags_become_the_engine_config():
    args = chat.setup_arg_parser().parse_args(
        ["--model", "m", "--draft-model", "d", "--num-draft-tokens", "6", "--temp", "0.7", "--seed", "1",
         "--dtype", "float32", "--system", "hi", "-m", "99"])
    config = chat.engine_config(args)
    assert (config.model.spec, config.draft_model.spec, config.drafter.name, config.num_draft_tokens) == \
        ("m", "d", "draft", 6)
    assert (config.sampling.temp, config.seed, config.model.dtype,
            config.max_tokens) == (0.7, 1, "float32", 99)
    assert args.system == "hi"


def test_medusa_flags_reach_the_engine_config():
    args = chat.setup_arg_parser().parse_args(
        ["--drafter", "medusa", "--medusa-heads", "h", "--medusa-tree", "small_15",
         "--typical-threshold", "0.09", "--typical-alpha", "0.3"])
    config = chat.engine_config(args)
    assert (config.drafter.name, config.drafter.options.heads, config.drafter.options.tree) == \
        ("medusa", "h", "small_15")
    assert config.typical == (0.09, 0.3)


def test_engine_switches_drafter_settings_and_reloads_the_target_in_another_dtype(tmp_path):
    """F2's choices reach the real engine: a drafter with settings, then the same target in float16;
    ``EngineReady`` reports the settings and dtype the dialog shows next time."""
    import queue

    from mlxspec.drafters import DrafterSpec
    from mlxspec_app.messages import EngineReady, LoadFailed

    model, tokenizer = tiny_llama(seed=3), byte_tokenizer()
    save_model(tmp_path, model)
    save_config(dict(model.args.__dict__, eos_token_id=256), tmp_path / "config.json")
    tokenizer._tokenizer.save_pretrained(tmp_path)
    engine, posted = Engine(EngineConfig(model=str(tmp_path), drafter="ngram:max=3",
                                         num_draft_tokens=2)), queue.Queue()
    engine.start(posted.put)

    def ready():
        while not isinstance(message := posted.get(timeout=60), (EngineReady, LoadFailed)):
            pass
        assert isinstance(message, EngineReady), message
        return message.info

    try:
        info = ready()
        assert (info.drafter, info.options, info.dtype) == ("ngram", (("max", "3"),), None)
        engine.configure(DrafterSpec.parse("ngram:min=2,max=2"), 3)
        info = ready()
        assert info.options == (("min", "2"), ("max", "2")) and info.num_draft_tokens == 3
        engine.configure("none", dtype="float16")
        info = ready()
        assert (info.drafter, info.dtype, info.options) == ("none", "float16", ())
        assert "float16" in info.model_name
        engine.configure("ngram")  # by name: the settings it had
        assert ready().options == (("min", "2"), ("max", "2"))
        # F2's γ field takes it; the n-gram drafter cannot: the CLI's error
        engine.configure(None, "scheduled")
        while not isinstance(message := posted.get(timeout=60), LoadFailed):
            pass
        assert ("Cannot use γ scheduled: --num-draft-tokens scheduled needs a drafter that estimates"
                in message.error)
        assert "the ngram drafter does not: use 'auto' or an integer" in message.error
        assert ready().num_draft_tokens == 4  # the default γ instead
    finally:
        assert engine.close()


def test_recalibrate_measures_the_costs_again_once_per_target_and_drafter(tmp_path, monkeypatch):
    """``mlxspec chat --recalibrate`` reaches the engine, which calls ``load_or_calibrate(refresh=True)`` as
    ``mlxspec generate --recalibrate`` does: once per target and drafter pair; later
    switches use the cache."""
    import queue

    import mlxspec.pacing as gamma
    import mlxspec_app.engine as engine_module
    from mlxspec_app.messages import EngineReady, LoadFailed
    from test_registry import FAKE_COSTS

    args = chat.setup_arg_parser().parse_args(["--recalibrate"])
    assert chat.engine_config(args).recalibrate
    assert not chat.engine_config(chat.setup_arg_parser().parse_args([])).recalibrate
    calls = []

    def measured(how):
        def load_or_calibrate(model, drafter=None, *, refresh=False, on_measure=None):
            calls.append((how, drafter.name, refresh))
            return FAKE_COSTS
        return load_or_calibrate

    monkeypatch.setattr(engine_module, "load_or_calibrate", measured("engine"))
    monkeypatch.setattr(gamma, "load_or_calibrate", measured("make_pacer"))
    model, tokenizer = tiny_llama(seed=3), byte_tokenizer()
    save_model(tmp_path, model)
    save_config(dict(model.args.__dict__, eos_token_id=256), tmp_path / "config.json")
    tokenizer._tokenizer.save_pretrained(tmp_path)
    engine = Engine(EngineConfig(model=str(tmp_path), drafter="ngram",
                                 num_draft_tokens="auto", recalibrate=True))
    posted = queue.Queue()
    engine.start(posted.put)

    def ready():
        while not isinstance(message := posted.get(timeout=60), (EngineReady, LoadFailed)):
            pass
        assert isinstance(message, EngineReady), message

    try:
        ready()
        assert calls == [("engine", "ngram", True)]
        engine.configure("none")
        ready()
        engine.configure("ngram")  # measured once already in this chat: the cached costs
        ready()
        assert calls == [("engine", "ngram", True), ("make_pacer", "ngram", False)]
    finally:
        assert engine.close()


def test_the_engine_says_what_its_drafter_drafts(tiny_model_dir, tmp_path, monkeypatch):
    """What the chat shows for the drafter is what ``mlxspec generate``'s stats say: a tree drafter's tree
    (``pacing.tree_summary``) rather than the depth γ auto keeps, and with γ auto each round's pick."""
    import queue

    import mlxspec.pacing as gamma
    from mlxspec.pacing import Costs
    from mlxspec.drafters import parse_specs
    from mlxspec.heads.eagle import save_eagle
    from mlxspec_app.messages import EngineReady, LoadFailed
    from test_pacing import MEMORY_BOUND
    from test_eagle import random_head

    save_eagle(random_head(1), tmp_path / "eagle")
    # drafting pays: auto drafts
    monkeypatch.setattr(gamma, "load_or_calibrate", lambda *a, **k: MEMORY_BOUND)
    spec = f"eagle:depth=3,top_k=1,ngram=4,heads={tmp_path / 'eagle'}"
    engine = Engine(EngineConfig(model=str(tiny_model_dir), drafter=spec,
                                 num_draft_tokens="auto", max_tokens=12))
    posted = queue.Queue()
    engine.start(posted.put)

    def wait(kinds):
        while not isinstance(message := posted.get(timeout=60), kinds):
            pass
        return message

    def answer(request_id):
        engine.generate(request_id, [{"role": "user", "content": "abcabcabcabc"}])
        return wait(GenerationDone).stats

    try:
        info = wait((EngineReady, LoadFailed)).info
        assert (info.drafter, info.num_draft_tokens) == ("eagle", "auto")
        assert info.shape == "depth-3 chain + a 4-token n-gram branch"
        stats = answer(1)
        assert stats.shape == info.shape and stats.policy == "auto"  # auto picks each round's depth, up to 4
        assert 0 <= stats.gamma_now <= stats.num_draft_tokens == 4
        engine.configure("ngram")
        assert wait((EngineReady, LoadFailed)).info.shape is None
        stats = answer(2)
        assert stats.policy == "auto" and stats.shape is None and stats.drafted > 0
        assert 0 < stats.gamma_mean <= stats.num_draft_tokens == 15 and 0 <= stats.gamma_now <= 15
        # costs where no round can win: γ auto runs the EAGLE chain as plain decoding, and the panel says so
        monkeypatch.setattr(gamma, "load_or_calibrate",
                            lambda *a, **k: Costs([0.01 * k for k in range(1, 17)], 0.05))
        engine.configure(parse_specs(spec)[0])
        ready = wait((EngineReady, LoadFailed))
        assert isinstance(ready, EngineReady), ready
        assert ready.info.shape == gamma.PRICED_PLAIN
        stats = answer(3)
        assert stats.shape == gamma.PRICED_PLAIN and stats.drafted == 0
    finally:
        assert engine.close()
