"""The chat app under Textual's Pilot, against a fake engine that replays scripted events.

The fake runs the real ``Relay`` (the runner's records → batched messages) in its own thread, fed as the
runner feeds it (a record per round, stopping between rounds on cancel), so only the runner, model
loading and MLX are faked.
"""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from mlxspec_app.app import SpecChatApp
from mlxspec_app.engine import Relay, one_line
from mlxspec_app.messages import EngineInfo, EngineReady, GenerationFailed, LoadFailed, LoadProgress
from mlxspec_app.screens import DrafterScreen, HelpScreen
from mlxspec_app.widgets import ChatMessage, LoadBar, StatsPanel, TauSparkline
from mlxspec.core.metrics import RoundStats, GenerationStats, TokenEvent
from mlxspec.engine.output import Committed
from mlxspec.engine.runner import Done, Failed

INFO = EngineInfo("tiny[b] (MLX, float32)", False, None, "ngram", 4, ("draft", "ngram", "none"))
WAIT = object()  # in a script: block until the answer is cancelled


def script(rounds, *, finish="stop", gamma=4, end=True):
    """Events as ``stream_generate`` yields them; ``rounds`` lists ``[(text, kind), ...]`` per round."""
    events, totals = [], GenerationStats(drafter="ngram", num_draft_tokens=gamma)
    for index, tokens in enumerate(rounds):
        if tokens is WAIT or isinstance(tokens, Exception):
            events.append(tokens)
            continue
        events += [TokenEvent(100 + i, text, kind, index) for i, (text, kind) in enumerate(tokens)]
        accepted = sum(kind == "accepted" for _, kind in tokens)
        stats = RoundStats(index, gamma, accepted, len(tokens), 0.01, 0.09)
        totals.add_round(stats)
        events.append(stats)
    totals.finish_reason, totals.generation_s = finish, 0.5
    return events + [totals] if end else events


# τ = (2 + 4 + 0 + 1 accepted + 4 rounds) / 4 rounds = 2.75; α = 7 / 16 drafted.
ROUNDS = [
    [("Hel", "accepted"), ("lo", "accepted"), (" wor", "resampled")],
    [("ld", "accepted"), (",", "accepted"), (" caf", "accepted"), ("", "accepted"), ("é", "bonus")],
    [("!", "resampled")],
    [(" Bye", "accepted"), ("", "resampled")],  # the stop token has no text
]
SPANS = [("Hel", "accepted"), ("lo", "accepted"), (" wor", "resampled"), ("ld", "accepted"),
         (",", "accepted"), (" caf", "accepted"), ("é", "bonus"), ("!", "resampled"), (" Bye", "accepted")]


class FakeEngine:
    """The engine's interface over scripted answers, in one thread like the real one."""

    def __init__(self, answers, *, load_error=None, configure_error=None, info=INFO, drafting=None):
        self.answers = list(answers)
        self.load_error, self.configure_error, self.info = load_error, configure_error, info
        # what the real engine tells relay about the drafter (drafter, num_draft_tokens, policy, shape)
        self.drafting = {"drafter": "ngram", "num_draft_tokens": 4, **(drafting or {})}
        self.requests, self.configured, self.dtypes = [], [], []
        self.cancels: dict[int, threading.Event] = {}
        self.jobs: queue.Queue = queue.Queue()

    def start(self, post):
        self.post = post
        threading.Thread(target=self._run, daemon=True).start()

    def generate(self, request_id, messages):
        self.requests.append(messages)
        self.cancels[request_id] = threading.Event()
        self.jobs.put((request_id, self.answers.pop(0)))

    def cancel(self, request_id):
        self.cancels[request_id].set()

    def configure(self, drafter=None, num_draft_tokens=None, model=None, draft_model=None, *, dtype=None,
                  draft_dtype=None):
        self.configured.append((drafter if drafter is None else str(drafter),
                                num_draft_tokens, model, draft_model))
        self.dtypes.append((dtype, draft_dtype))
        self.jobs.put(("configure", None))

    def close(self):
        for event in self.cancels.values():
            event.set()
        self.jobs.put(None)

    def _run(self):
        self.post(LoadProgress("Loading the target model /m/[bold]tiny", 1, 1))  # not markup
        self.post(LoadFailed(self.load_error) if self.load_error else EngineReady(self.info))
        while (job := self.jobs.get()) is not None:
            request_id, events = job
            if request_id == "configure":
                self.post(LoadFailed(self.configure_error) if self.configure_error
                          else EngineReady(self.info))
                continue
            cancelled = self.cancels[request_id]
            relay = Relay(request_id, self.post, cancelled, **self.drafting, flush_s=0)
            for record in self._records(events, cancelled):
                relay(record)

    @staticmethod
    def _records(events, cancelled):
        """The scripted events as the runner posts them: a ``Committed`` per round with the
        running totals, then ``Done`` (``"cancelled"`` when cancelled between rounds) or
        ``Failed`` for a scripted exception."""
        totals, tokens = None, []
        for event in events:
            if event is WAIT:
                # until the test cancels (a generous ceiling: a loaded CI machine is slow)
                cancelled.wait(120)
            elif isinstance(event, Exception):
                yield Failed(one_line(event), 500)
                return
            elif isinstance(event, TokenEvent):
                tokens.append(event)
            elif isinstance(event, RoundStats):
                totals = totals or GenerationStats(drafter="ngram", num_draft_tokens=4)
                totals.add_round(event)
                yield Committed(tuple(tokens), event, GenerationStats(**totals.__dict__))
                tokens = []
                if cancelled.is_set():
                    yield Done(totals, "cancelled")
                    return
            elif isinstance(event, GenerationStats):
                yield Done(event, event.finish_reason or "length")
                return
        if cancelled.is_set():
            yield Done(totals or GenerationStats(), "cancelled")


async def wait_for(pilot, condition, timeout_s=120.0):
    """Let the app run until ``condition()`` holds (the fake engine answers from another thread); the ceiling
    is generous (a machine at load 15 took over 5 s), a passing test never waits it out."""
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await pilot.pause(0.02)
    raise AssertionError("timed out waiting for the app")


async def send(pilot, app, text):
    await wait_for(pilot, lambda: not app.generating)
    await pilot.click("#prompt")
    app.query_one("#prompt").value = text
    await pilot.press("enter")
    await pilot.pause()


def messages(app, role=None):
    return [m for m in app.chat_log.messages if role is None or m.role == role]


def colour(style):
    """``"green"``, ``"red"``, ``"underline"`` (no colour, underlined) or ``"plain"`` for a Rich style."""
    if style is None or style.color is None:
        return "underline" if style is not None and style.underline else "plain"
    r, g, b = style.color.get_truecolor()
    return "green" if g > max(r, b) else "red" if r > max(g, b) else f"other {r, g, b}"


def span_colours(message: ChatMessage):
    """The colour of each token span as drawn."""
    text, out, offset = message.styled_text(), [], 0
    for chunk, _ in message.spans:
        styles = [s.style for s in text.spans if s.start <= offset < s.end]
        assert all(s.start == offset and s.end == offset + len(chunk) for s in text.spans
                   if s.start <= offset < s.end), "a style crosses a token boundary"
        out.append(colour(styles[0] if styles else None))
        offset += len(chunk)
    return out


def run(coro):
    asyncio.run(coro)


# Calm by default: a resampled token (a rejected draft's correction, not an error) is only underlined.
EXPECTED_COLOURS = {"accepted": "green", "resampled": "underline", "bonus": "plain", "target": "plain"}


def test_answer_shows_coloured_tokens_and_tau():
    async def body():
        engine = FakeEngine([script(ROUNDS)])
        app = SpecChatApp(engine, system="Be brief.")
        async with app.run_test(size=(110, 36)) as pilot:
            await wait_for(pilot, lambda: app.info is not None)
            await send(pilot, app, "Say hello")
            await wait_for(pilot, lambda: not app.generating)
            answer = messages(app, "assistant")[0]
            assert answer.text == "Hello world, café! Bye"
            assert answer.spans == SPANS
            assert span_colours(answer) == [EXPECTED_COLOURS[kind] for _, kind in SPANS]
            panel = app.query_one(StatsPanel)
            assert str(panel.query_one("#tau").render()).startswith("τ  2.75")
            assert str(panel.query_one("#alpha").render()) == "α  0.44"
            await pilot.pause()  # running stats still queued must not overwrite the final ones
            assert str(panel.query_one("#speed").render()).startswith("22.0 tokens/s")  # 11 tokens / 0.5 s
            assert app.query_one(TauSparkline).values == (3, 5, 1, 2)
            assert "τ 2.75" in answer.border_subtitle
            assert engine.requests[0] == [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Say hello"}]
            assert app.history[-1] == {"role": "assistant", "content": "Hello world, café! Bye"}
            assert str(panel.query_one("#target").render()) == "tiny[b] (MLX, float32)\nquantized: no"

    run(body())


def picked(gammas, drafter="ngram"):
    """Events of rounds whose policy picked γ = ``gammas[i]`` (0: a plain round), each keeping one draft."""
    events, totals = [], GenerationStats(drafter=drafter, num_draft_tokens=max(gammas))
    for index, gamma in enumerate(gammas):
        kept = min(1, gamma)
        events += [TokenEvent(100, "a", "accepted", index)] * kept + [
            TokenEvent(101, "b", "resampled" if gamma else "target", index)]
        events.append(RoundStats(index, gamma, kept, kept + 1, 0.01, 0.09, depth=gamma, gamma=gamma))
        totals.add_round(events[-1])
        totals.add_gamma(gamma)
    totals.finish_reason, totals.generation_s = "stop", 0.5
    return events + [totals]


def found_nothing(gammas):
    """Events of rounds whose policy picked γ = ``gammas[i]`` but whose lookup found nothing to draft."""
    events, totals = [], GenerationStats(drafter="ngram", num_draft_tokens=15)
    for index, gamma in enumerate(gammas):
        events += [TokenEvent(101, "b", "target", index), RoundStats(index, 0, 0, 1, 0.01, 0.09, gamma=gamma)]
        totals.add_round(events[-1])
        totals.add_gamma(gamma)
    totals.finish_reason, totals.generation_s = "stop", 0.5
    return events + [totals]


# pacing.tree_summary's words, as generate prints them
EAGLE_SHAPE = "depth-4 chain + a 6-token n-gram branch"


@pytest.mark.parametrize("drafter,gamma,relayed,events,before,after,summary", [
    # γ auto: the pick of the latest round and the mean, not the largest γ auto may pick (15)
    ("ngram", "auto", {"num_draft_tokens": 15, "policy": "auto"}, picked([15, 15, 3]),
     "ngram   γ auto", "ngram   γ auto (now 3, mean 11.0)", ("α 0.09 ·", "· ngram γ auto (mean 11.0)")),
    # a tree drafter: its tree, not the depth that γ auto keeps (6)
    ("eagle", "auto", {"drafter": "eagle", "num_draft_tokens": 6, "shape": EAGLE_SHAPE},
     picked([6, 6], "eagle"),
     f"eagle   {EAGLE_SHAPE}", f"eagle   {EAGLE_SHAPE}", ("α 0.17 ·", f"· eagle {EAGLE_SHAPE}")),
    # nothing drafted: α is "–" everywhere, never 0.00
    ("none", "auto", {"drafter": "none", "num_draft_tokens": 0}, picked([0, 0], "none"),
     "none   plain decoding", "none   plain decoding", ("α – ·", "· none plain decoding")),
    # γ auto picked depths but the lookup found nothing: it says so, and no γ (issue 50)
    ("ngram", "auto", {"num_draft_tokens": 15, "policy": "auto"}, found_nothing([2, 2, 0]),
     "ngram   γ auto", "ngram   drafted 0", ("α – ·", "· ngram drafted 0")),
])
def test_stats_say_what_is_drafted(drafter, gamma, relayed, events, before, after, summary):
    async def body():
        shape = relayed.get("shape")
        info = EngineInfo("tiny (MLX, float32)", False, None, drafter, gamma,
                          ("eagle", "ngram", "none"), shape=shape)
        app = SpecChatApp(FakeEngine([events], info=info, drafting=relayed))
        async with app.run_test(size=(130, 36)) as pilot:
            await wait_for(pilot, lambda: app.info is not None)
            panel = app.query_one(StatsPanel)
            assert str(panel.query_one("#drafter").render()) == before
            assert messages(app, "info")[0].text.endswith(before.replace("   ", ", "))  # the Ready line
            await send(pilot, app, "hi")
            await wait_for(pilot, lambda: not app.generating)
            assert str(panel.query_one("#drafter").render()) == after
            assert all(part in messages(app, "assistant")[0].border_subtitle for part in summary)
            if drafter == "none":
                assert str(panel.query_one("#alpha").render()) == "α  – (nothing drafted)"

    run(body())


def test_plain_text_toggle_keeps_colours_on_each_message():
    async def body():
        app = SpecChatApp(FakeEngine([script(ROUNDS)]))
        async with app.run_test(size=(110, 36)) as pilot:
            await send(pilot, app, "hi")
            await wait_for(pilot, lambda: not app.generating and messages(app, "assistant"))
            answer = messages(app, "assistant")[0]
            await pilot.press("f3")
            assert set(span_colours(answer)) == {"plain"}
            await pilot.press("f3")
            assert "green" in span_colours(answer) and "underline" in span_colours(answer)
            await pilot.press("f4")  # full colour: resampled tokens red
            await pilot.pause()
            assert span_colours(answer) == [{**EXPECTED_COLOURS, "resampled": "red"}[kind]
                                            for _, kind in SPANS]
            await pilot.press("f4")
            await pilot.pause()
            assert span_colours(answer) == [EXPECTED_COLOURS[kind] for _, kind in SPANS]
            await pilot.click(answer)
            assert answer.plain and set(span_colours(answer)) == {"plain"}
            assert answer.spans == SPANS  # the kinds are kept for colouring again

    run(body())


def test_cancel_keeps_partial_answer_and_accepts_a_new_message():
    async def body():
        stopped = script([ROUNDS[0], WAIT, ROUNDS[1], ROUNDS[2], ROUNDS[3]])
        engine = FakeEngine([stopped, script([[("Next", "target")]])])
        app = SpecChatApp(engine)
        async with app.run_test(size=(110, 36)) as pilot:
            await send(pilot, app, "Tell me a long story")
            answer = messages(app, "assistant")[0]
            await wait_for(pilot, lambda: answer.text == "Hello wor")
            assert app.generating and not app.query_one("#stop").disabled
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.generating)
            # Stopped within one round: the round in flight lands, nothing after it.
            assert answer.text == "Hello world, café"
            assert "stopped" in answer.border_subtitle
            assert app.history[-1] == {"role": "assistant", "content": "Hello world, café"}
            await send(pilot, app, "And then?")
            await wait_for(pilot, lambda: not app.generating)
            assert messages(app, "assistant")[-1].text == "Next"
            assert engine.requests[1][-2:] == [{"role": "assistant", "content": "Hello world, café"},
                                               {"role": "user", "content": "And then?"}]

    run(body())


def test_stop_before_the_first_token_leaves_no_empty_answer_and_gives_the_message_back():
    async def body():
        # stopped before its first round lands (as when still queued behind a model load): no token at all
        engine = FakeEngine([script([[("Hi", "target")]]), script([WAIT], end=False),
                             script([[("Sure", "target")]])])
        app = SpecChatApp(engine)
        async with app.run_test(size=(110, 36)) as pilot:
            await send(pilot, app, "hello")
            await wait_for(pilot, lambda: not app.generating)
            await send(pilot, app, "never mind")
            assert app.generating and messages(app, "assistant")[-1].text == ""
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.generating)
            # No empty assistant turn: the conversation ends at the last real answer, as a failed send does.
            assert app.history == [{"role": "user", "content": "hello"},
                                   {"role": "assistant", "content": "Hi"}]
            assert [m.text for m in messages(app, "assistant")] == ["Hi"]
            unsent = messages(app, "user")[-1]
            assert unsent.text == "never mind" and unsent.has_class("-failed")
            assert unsent.border_subtitle == "not sent"
            assert app.query_one("#prompt").value == "never mind"
            await pilot.click("#prompt")
            await pilot.press("enter")  # sent again: it replaces the bubble marked not sent
            await wait_for(pilot, lambda: not app.generating)
            assert [m.text for m in messages(app, "user")] == ["hello", "never mind"]
            assert engine.requests[-1][-2:] == [{"role": "assistant", "content": "Hi"},
                                                {"role": "user", "content": "never mind"}]
            assert app.history[-1] == {"role": "assistant", "content": "Sure"}

    run(body())


def test_generation_and_load_errors_show_in_chat_and_keep_history():
    async def body():
        answers = [
            script(ROUNDS),
            script([ROUNDS[0], RuntimeError("device lost")], end=False),
            script([ValueError("the prompt has 9000 tokens but the model's context is 8192")], end=False),
            script([[("Fine", "target")]]),
            script([[("Also fine", "target")]]),
        ]
        engine = FakeEngine(answers, configure_error="Could not load the draft model /nope: No such file")
        app = SpecChatApp(engine)
        async with app.run_test(size=(110, 36)) as pilot:
            await send(pilot, app, "one")
            await send(pilot, app, "two")
            await wait_for(pilot, lambda: not app.generating and messages(app, "error"))
            assert "RuntimeError: device lost" in messages(app, "error")[0].text
            assert messages(app, "assistant")[1].text == "Hello wor"  # partial answer kept
            await send(pilot, app, "three")
            await wait_for(pilot, lambda: len(messages(app, "error")) == 2)
            assert "context is 8192" in messages(app, "error")[1].text
            assert "not added" in messages(app, "error")[1].text
            assert app.query_one("#prompt").value == "three"  # the unanswered message is back in the input
            # The failed "three" is not in the history; the rest is intact. Its bubble says it was not sent.
            assert [m["content"] for m in app.history] == ["one", "Hello world, café! Bye", "two",
                                                           "Hello wor"]
            unsent = messages(app, "user")[-1]
            assert unsent.text == "three" and unsent.has_class("-failed")
            assert unsent.border_subtitle == "not sent"
            await pilot.click("#prompt")
            await pilot.press("enter")  # sent again: it replaces the bubble marked not sent
            await wait_for(pilot, lambda: not app.generating)
            assert [m.text for m in messages(app, "user")] == ["one", "two", "three"]
            assert not messages(app, "user")[-1].has_class("-failed")
            assert app.history[-2:] == [{"role": "user", "content": "three"},
                                        {"role": "assistant", "content": "Fine"}]
            await pilot.press("f2")
            await pilot.pause()  # the dialog lays out its drafter's settings
            await pilot.click("#drafter-draft")
            await pilot.pause()  # the dialog now shows the draft drafter's settings: the layout moved
            app.screen.query_one("#draft-spec").value = "/nope"
            # the draft's settings (vocab) fill 36 rows
            app.screen.query_one("#apply").scroll_visible(animate=False)
            await pilot.pause()
            await pilot.click("#apply")
            assert engine.configured == [("draft", 4, None, "/nope")]
            await wait_for(pilot, lambda: len(messages(app, "error")) == 3)
            assert "/nope" in messages(app, "error")[2].text
            await send(pilot, app, "four")
            await wait_for(pilot, lambda: not app.generating)
            assert messages(app, "assistant")[-1].text == "Also fine"
            assert [m["content"] for m in engine.requests[-1]][-4:] == ["Hello wor", "three", "Fine", "four"]
            assert [m.text for m in messages(app, "user")] == ["one", "two", "three", "four"]

    run(body())


def test_a_failed_message_stays_marked_not_sent_while_something_else_is_typed():
    async def body():
        engine = FakeEngine([script([WAIT], end=False), script([[("ok", "target")]])])
        app = SpecChatApp(engine)
        async with app.run_test(size=(110, 36)) as pilot:
            await send(pilot, app, "lost?")
            app.query_one("#prompt").value = "typed meanwhile"
            app.post_message(GenerationFailed(app._request_id, "device lost"))
            await wait_for(pilot, lambda: messages(app, "error"))
            assert app.query_one("#prompt").value == "typed meanwhile"  # not overwritten
            assert "marked not sent" in messages(app, "error")[0].text and app.history == []
            engine.cancel(app._request_id)  # let the fake engine go on
            await send(pilot, app, "other")
            await wait_for(pilot, lambda: not app.generating and messages(app, "assistant"))
            # Another message does not replace it: it stays, marked, and out of the conversation.
            assert [(m.text, m.has_class("-failed")) for m in messages(app, "user")] == [("lost?", True),
                                                                                       ("other", False)]
            assert engine.requests[-1] == [{"role": "user", "content": "other"}]

    run(body())


def test_failed_start_up_load_is_reported_and_the_app_keeps_working():
    async def body():
        app = SpecChatApp(FakeEngine([script([[("ok", "target")]])],
                                     load_error="Could not load the target model /bad: No such file"))
        async with app.run_test(size=(110, 36)) as pilot:
            await wait_for(pilot, lambda: messages(app, "error"))
            assert "/bad" in messages(app, "error")[0].text
            assert app.query_one("LoadBar").has_class("-idle")
            await send(pilot, app, "still there?")
            await wait_for(pilot, lambda: not app.generating)
            assert messages(app, "assistant")[0].text == "ok"

    run(body())


def test_drafter_dialog_switches_drafter_and_gamma():
    async def body():
        engine = FakeEngine([])
        app = SpecChatApp(engine)
        async with app.run_test(size=(110, 40)) as pilot:
            await wait_for(pilot, lambda: app.info is not None)
            await pilot.press("f2")
            await pilot.pause()  # the dialog lays out its drafter's settings
            assert isinstance(app.screen, DrafterScreen)
            await pilot.click("#drafter-draft")
            await pilot.pause()  # each pick shows that drafter's settings: the layout moves
            await pilot.click("#apply")
            assert "needs a draft model" in str(app.screen.query_one("#drafter-error").render())
            await pilot.click("#drafter-none")
            await pilot.pause()
            app.screen.query_one("#gamma").value = "6"
            await pilot.click("#apply")
            assert not isinstance(app.screen, DrafterScreen)
            await wait_for(pilot, lambda: engine.configured)
            assert engine.configured == [("none", 6, None, None)]
            await pilot.press("f1")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)

    run(body())


def test_drafter_dialog_enter_on_the_list_applies_and_gamma_has_the_cli_bound():
    async def body():
        from textual.widgets import Label

        from mlxspec.pacing import MAX_NUM_DRAFT_TOKENS

        long_name = "SmolLM2-135M-Instruct-Q4_K_M.gguf (GGUF, float16) from a folder with a long name"
        engine = FakeEngine([], info=EngineInfo(INFO.model_name, False, long_name,
                                                "ngram", "auto", INFO.drafters))
        app = SpecChatApp(engine)
        async with app.run_test(size=(110, 44)) as pilot:
            await wait_for(pilot, lambda: app.info is not None)
            await pilot.press("f2")
            await pilot.pause()
            screen = app.screen
            box = screen.query_one("#drafter-box").content_region
            for label in screen.query(Label):  # every caption fits the dialog (wrapped, not cut off)
                assert label.region.right <= box.right, str(label.render())
            screen.query_one("#gamma").value = str(MAX_NUM_DRAFT_TOKENS + 1)
            await pilot.press("down", "enter")  # none: Enter picks it and applies, if γ is allowed
            await pilot.pause()
            assert f"from 0 to {MAX_NUM_DRAFT_TOKENS}" in str(screen.query_one("#drafter-error").render())
            screen.query_one("#gamma").value = str(MAX_NUM_DRAFT_TOKENS)
            screen.query_one("#drafter-kind").focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: engine.configured)
            assert not isinstance(app.screen, DrafterScreen)
            assert engine.configured == [("none", MAX_NUM_DRAFT_TOKENS, None, None)]

    run(body())


def test_drafter_dialog_gamma_takes_scheduled_as_the_cli_does():
    async def body():
        engine = FakeEngine([])
        app = SpecChatApp(engine)
        async with app.run_test(size=(110, 44)) as pilot:
            await wait_for(pilot, lambda: app.info is not None)
            await pilot.press("f2")
            await pilot.pause()
            screen = app.screen
            gamma = screen.query_one("#gamma")
            gamma.focus()
            gamma.value = "schedule"  # a typo: refused, saying what is allowed
            await pilot.press("enter")  # Enter in a field applies, as Apply does
            await pilot.pause()
            error = str(screen.query_one("#drafter-error").render())
            assert "'auto', 'scheduled' or a whole number from 0 to" in error and app.screen is screen
            gamma.value = " Scheduled "
            await pilot.press("enter")
            await wait_for(pilot, lambda: engine.configured)
            assert not isinstance(app.screen, DrafterScreen)
            assert engine.configured == [("ngram", "scheduled", None, None)]

    run(body())


def test_clear_forgets_the_conversation():
    async def body():
        engine = FakeEngine([script(ROUNDS), script([[("again", "target")]])])
        app = SpecChatApp(engine, system="sys")
        async with app.run_test(size=(110, 36)) as pilot:
            await send(pilot, app, "hi")
            await wait_for(pilot, lambda: not app.generating)
            await pilot.press("ctrl+l")
            await pilot.pause()
            assert app.history == [] and [m.role for m in messages(app)] == ["system"]
            await send(pilot, app, "fresh")
            await wait_for(pilot, lambda: not app.generating)
            assert engine.requests[-1] == [{"role": "system", "content": "sys"},
                                           {"role": "user", "content": "fresh"}]

    run(body())


def test_vivid_flag_starts_in_full_colour_and_the_legend_and_help_say_what_the_marks_mean():
    async def body():
        from mlxspec_app.widgets import Legend

        app = SpecChatApp(FakeEngine([script(ROUNDS)]), vivid=True)
        async with app.run_test(size=(130, 36)) as pilot:
            await send(pilot, app, "hi")
            await wait_for(pilot, lambda: not app.generating and messages(app, "assistant"))
            assert "red" in span_colours(messages(app, "assistant")[0])
            legend = app.query_one(Legend).render()
            assert "resampled (not an error)" in legend.plain and legend.plain.endswith("F4: red")
            await pilot.press("f1")
            text = str(app.screen.query_one("#help-colours").render())
            assert "not an error" in text and "underlined (red with F4)" in text

    run(body())


def test_drafter_dialog_starts_on_the_current_drafter_and_offers_its_settings():
    async def body():
        from textual.widgets import RadioSet, Select

        from mlxspec.drafters import DRAFTERS

        info = EngineInfo("tiny (MLX, float32)", False, None, "medusa", "auto",
                          DRAFTERS, (("tree", "small_15"),), "float32")
        engine = FakeEngine([], info=info)
        app = SpecChatApp(engine)
        async with app.run_test(size=(110, 60)) as pilot:
            await wait_for(pilot, lambda: app.info is not None)
            await pilot.press("f2")
            await pilot.pause()
            screen = app.screen
            radio = screen.query_one(RadioSet)
            assert screen.focused is radio and radio._selected == DRAFTERS.index("medusa")
            assert screen.query_one("#option-tree").value == "small_15"  # the setting in use
            assert "shipped" in screen.query_one("#option-heads").placeholder
            assert screen.query_one("#dtype", Select).value == "float32"
            await pilot.press("down", "space")  # the next drafter: eagle, with its own settings
            await wait_for(pilot, lambda: screen.query("#option-depth"))
            assert not screen.query("#option-tree").first().value  # eagle's tree: empty = its default
            screen.query_one("#option-depth").value = "0"
            await pilot.click("#apply")
            assert "--eagle-depth must be >= 1" in str(screen.query_one("#drafter-error").render())
            screen.query_one("#option-depth").value = "3"
            screen.query_one("#dtype", Select).value = "bfloat16"
            screen.query_one("#apply").press()  # (a click may land while the Select redraws)
            await wait_for(pilot, lambda: engine.configured)
            assert engine.configured == [("eagle:depth=3", "auto", None, None)]
            assert engine.dtypes == [("bfloat16", None)]
            await wait_for(pilot, lambda: len(app.chat_log.messages) == 2)  # "Ready" again, after the switch
            await pilot.press("f1")  # the engine keeps posting while a dialog covers the chat
            app.post_message(LoadProgress("Loading the target model x", 1, 2))
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen) and not app._part(LoadBar).has_class("-idle")

    run(body())
