"""The drafter registry: every registered drafter is greedy-identical and lossless (so a new drafter
is covered by adding it), spec strings and generated flags, ``auto`` means one policy everywhere, and
a new drafter is one file (a toy "repeat the last token" drafter registered here)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate, make_drafter
from mlxspec.commands.cli import main
from mlxspec.pacing import Auto, Costs
from mlxspec.drafters import (
    DRAFTERS,
    Draft,
    Drafter,
    DrafterSpec,
    DrafterType,
    drafter_types,
    parse_specs,
    registry,
)
from mlxspec.pacing import Fixed, make_pacer
from mlxspec.heads.dflash import save_dflash
from mlxspec.heads.dspark import save_dspark
from mlxspec.heads.eagle import save_eagle
from mlxspec.heads.medusa import save_medusa
from mlxspec.loading.identity import write_card
from mlxspec.heads.mtp import init_mtp, save_mtp
from test_dflash import random_dflash
from test_dspark import random_dspark
from test_eagle import random_head
from test_generate import plain_greedy
from test_lossless import SWEEP_SAMPLES, V, exact_joint, sample_joint
from test_medusa import random_heads
from test_pacing import MEMORY_BOUND
from stats import chi_square

PROMPT = [10, 20, 30, 40, 10, 20, 30, 41, 50, 60]


def ship_heads(root, name: str, vocab: int) -> None:
    """Random Medusa and EAGLE heads, DFlash and DSpark drafters and an MTP module shipped in folders called
    ``name``; the heads for ``tiny_llama(seed=0)`` of ``vocab`` (matched to the target by its card,
    ``identity.write_card``)."""
    target = tiny_llama(seed=0, vocab_size=vocab)
    save_medusa(root / "medusa" / name, random_heads(vocab=vocab, shared=True))
    save_eagle(random_head(1, vocab=vocab), root / "eagle" / name)
    save_dflash(random_dflash(vocab=vocab, layer_ids=(0, 1)), root / "dflash" / name)
    save_dspark(random_dspark(vocab=vocab), root / "dspark" / name)
    for kind in ("medusa", "eagle", "dflash", "dspark"):
        write_card(root / kind / name, target)
    like = tiny_llama(seed=5, vocab_size=vocab)
    save_mtp(init_mtp(like), root / "mtp" / name, like)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    ship_heads(root, "tiny", 264)
    ship_heads(root, "tiny8", V)
    return root


@pytest.fixture(autouse=True)
def shipped_assets(models_dir, monkeypatch):
    monkeypatch.setenv("MLXSPEC_MODELS", str(models_dir))


def build(name: str, target, tokenizer, draft_model, target_name: str) -> Drafter:
    """What ``mlxspec generate --drafter NAME`` builds: the registered type with its default options."""
    return make_drafter(name, target, tokenizer, target_name=target_name,
                        draft_model=draft_model if name == "draft" else None)


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_registered_drafter_is_greedy_identical(name):
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    drafter = build(name, target, tokenizer, tiny_llama(seed=3), "tiny")
    # γ 4 on a fixed memory-bound cost curve: a priced tree (Medusa's default) drafts on any machine, however
    # loaded
    pacer = make_pacer(4, target, drafter, costs=MEMORY_BOUND, learn=False)
    result = generate(
        target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=pacer, max_tokens=80, stop_tokens=set()
    )
    assert result.tokens == plain_greedy(target, PROMPT, 80)
    assert result.stats.drafter == name
    if name != "none":
        assert result.stats.drafted > 0, "the drafter never proposed anything, so nothing was tested"


@pytest.mark.slow  # statistical
@pytest.mark.parametrize("name", DRAFTERS)
def test_every_registered_drafter_is_lossless_at_temperature_1(name):
    """Chi-square of the first two sampled tokens against the exact joint (see test_lossless, which sweeps the
    sampling settings and holds the broken controls)."""
    from mlxspec.core.sampling import SamplingParams

    target = tiny_llama(seed=0, vocab_size=V, sharpen=3.0)
    # test_lossless's short prompt recurs only in 1-token matches
    spec = "ngram:min=1" if name == "ngram" else name
    drafter = build(spec, target, list(range(V)), tiny_llama(seed=7, vocab_size=V, sharpen=3.0), "tiny8")
    drafted, propose = [], drafter.propose
    drafter.propose = lambda *args, **kwargs: (
        drafted.append((draft := propose(*args, **kwargs)).size) or draft
    )
    params = SamplingParams(temp=1.0)
    stat, critical = chi_square(
        sample_joint(target, drafter, params, n=SWEEP_SAMPLES), exact_joint(target, params)
    )
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"
    assert name == "none" or sum(drafted) > 0, f"{name} drafted nothing, so nothing was verified"


def test_ngram_needs_a_three_token_match_by_default_and_max_alone_lowers_it():
    """A 1- or 2-token match is mostly chance and its drafts miss (docs/archive/results-archive.md, run G):
    the default drafts only from a 3-token match; ``ngram:max=2`` alone means 2..2, not an error about a
    default the user did not set."""
    two = [5, 6, 7, 8, 9, 1, 2, 7, 8]  # "7 8" occurred before, "2 7 8" did not
    three = [5, 6, 7, 8, 9, 1, 6, 7, 8]  # "6 7 8" occurred before

    def drafts(spec, history):
        return make_drafter(spec).propose(history, 4, None).tokens.tolist()

    assert drafts("ngram", two) == [] and drafts("ngram", three) == [9, 1, 6, 7]
    assert drafts("ngram:min=1", two) == [9, 1, 2, 7]
    assert (make_drafter("ngram:max=2").min_ngram, make_drafter("ngram:max=2").max_ngram) == (2, 2)
    with pytest.raises(ValueError, match="got min=3, max=2"):
        make_drafter("ngram:min=3,max=2")


def test_ngram_drafts_from_the_longest_match_up_to_eight_tokens():
    """An edit repeats short runs all over the code: the most recent 4-token match may continue differently
    from the text being copied, the 8-token match does not (docs/archive/results-archive.md, run N)."""
    history = [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 9, 9, 9, 9, 5, 6, 7, 8, 30, 31, 1, 2, 3, 4, 5, 6, 7, 8]

    def drafts(spec):
        return make_drafter(spec).propose(history, 2, None).tokens.tolist()

    assert drafts("ngram") == [20, 21]  # "1 .. 8" occurred at the start
    assert drafts("ngram:max=4") == [30, 31]  # the most recent "5 6 7 8"
    assert make_drafter("ngram").max_ngram == 8


def test_spec_strings_round_trip_and_refuse_bad_input():
    specs = parse_specs("eagle:depth=4,top-k=1,ngram=6,medusa:tree=small_15,ngram,none")
    assert [str(s) for s in specs] == [
        "eagle:depth=4,top_k=1,ngram=6",
        "medusa:tree=small_15",
        "ngram",
        "none",
    ]
    assert DrafterSpec.parse(str(specs[0])) == specs[0]
    assert (
        specs[0].options.total_tokens is None
        and specs[0].replace(total_tokens="auto").options.total_tokens == "auto"
    )
    refused = [("nope", "unknown drafter 'nope'"), ("eagle:depth=0", "'eagle:depth=0': depth must be >= 1"),
               ("draft:vocab=-3", "'draft:vocab=-3': vocab must be >= 0"),  # the key written, not its flag
               ("ngram:max=3,max=4", "max is given twice"),
               ("eagle:size=3", "the eagle drafter takes heads, depth"), ("ngram:min", "KEY=VALUE"),
               ("ngram:min=x", "min: expected an integer, got 'x'"),
               ("eagle:depth=banana", "depth: expected an integer, got 'banana'"),
               ("medusa:tree=nope", "unknown Medusa tree"), ("", "no drafter")]
    for text, message in refused:
        with pytest.raises(ValueError, match=message):
            parse_specs(text)


def test_every_option_has_a_flag_with_help(capsys):
    from mlxspec.commands.generate import setup_arg_parser

    text = setup_arg_parser().format_help()
    for kind in drafter_types().values():
        assert kind.summary in " ".join(text.split())
        for field in kind.options.__dataclass_fields__.values():
            assert f"--{kind.name}-{field.name.replace('_', '-')}" in text and field.metadata["help"]


# --- auto: one policy for the CLI and the API ---------------------------------------------------


FAKE_COSTS = Costs([0.010 + 0.001 * k for k in range(16)], 0.001)


@pytest.mark.parametrize("name", DRAFTERS)
def test_auto_is_the_same_policy_in_the_api_and_the_cli(
    name, tmp_path, tiny_model_dir, tiny_draft_dir, monkeypatch, capsys
):
    import sys

    import mlxspec.commands.generate as command
    import mlxspec.pacing as gamma

    engine = sys.modules["mlxspec.engine.generate"]  # the package's ``generate`` is the function

    ship_heads(tmp_path, tiny_model_dir.name, 264)
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path))
    monkeypatch.setattr(gamma, "load_or_calibrate", lambda *a, **k: FAKE_COSTS)
    chosen = {}

    def recording(where):
        def policy(*args, **kwargs):
            chosen[where] = gamma.make_pacer(*args, **kwargs)
            return chosen[where]
        return policy

    monkeypatch.setattr(command, "make_pacer", recording("cli"))
    monkeypatch.setattr(engine, "make_pacer", recording("api"))
    draft_flags = ["--draft-model", str(tiny_draft_dir)] if name == "draft" else []  # refused for the others
    assert main(["generate", "--model", str(tiny_model_dir), *draft_flags, "--drafter", name,
                 "--prompt", "hi", "--max-tokens", "8", "--json"]) == 0, capsys.readouterr().err
    from mlxspec.engine.session import build_drafter, load_model

    target, draft = load_model(str(tiny_model_dir)), load_model(str(tiny_draft_dir))
    drafter = build_drafter(DrafterSpec(name), target, draft)
    generate(target.model, target.tokenizer, "hi", drafter=drafter, num_draft_tokens="auto", max_tokens=8)
    cli, api = chosen["cli"], chosen["api"]
    assert type(cli) is type(api) and cli.max_gamma == api.max_gamma
    if name == "none":
        assert cli == Fixed(0)
    # a priced tree (Medusa's default): its depth, each round sized by its budget
    elif drafter.profile.budget:
        assert (
            isinstance(cli, Fixed) and cli.budget is not None and cli.max_gamma == drafter.profile.max_depth
        )
    else:  # priced round by round up to its depth, on the nodes it sends (never dropped: issue 50)
        assert isinstance(api, Auto) and api.costs == cli.costs == FAKE_COSTS and api.profile == cli.profile
        assert api.max_gamma == (drafter.profile.max_depth or 15)


# --- a new drafter is one file -------------------------------------------------------------------
# Everything below is what a drafter module holds (here in a test, registered for the test only).


class RepeatDrafter(Drafter):
    """Drafts the last committed token ``times`` times (a toy: right only on runs of one token)."""

    name = "repeat"

    def __init__(self, times: int):
        self.times = times

    def propose(self, history, num_draft_tokens, sampling, plan=None):
        return Draft.chain([history[-1]] * min(self.times, num_draft_tokens))


@dataclass(frozen=True)
class RepeatOptions:
    times: int = registry.option(2, "how often to repeat the last token", parse=int)

    def __post_init__(self):
        registry.at_least(1, self.times, "--repeat-times")


REPEAT = DrafterType("repeat", RepeatOptions, lambda options, context: RepeatDrafter(options.times),
                     "repeats the last token (a test toy)")


def test_a_new_drafter_is_one_registration(monkeypatch, capsys, tiny_model_dir):
    monkeypatch.setitem(registry._TYPES, "repeat", REPEAT)
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    prompt = [7, 7, 7, 7, 8, 9]
    result = generate(target, tokenizer, prompt, drafter="repeat:times=3", num_draft_tokens=4, max_tokens=40,
                      stop_tokens=set())
    assert result.tokens == plain_greedy(target, prompt, 40) and result.stats.drafter == "repeat"
    assert result.stats.drafted > 0
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "aaaa", "--max-tokens", "10", "--json"]
    assert main([*base, "--drafter", "repeat", "--repeat-times", "3", "--num-draft-tokens", "3"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["drafter"] == "repeat" and record["num_draft_tokens"] == 3
    assert main([*base, "--drafter", "repeat", "--repeat-times", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--repeat-times must be >= 1, got 0" in err
    assert (
        main([*base, "--drafter", "repeat:times=2"]) == 0
        and json.loads(capsys.readouterr().out)["drafter"] == "repeat"
    )


def test_registering_a_taken_name_is_refused():
    ngram = drafter_types()["ngram"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(DrafterType("ngram", RepeatOptions, lambda o, c: RepeatDrafter(1), "another ngram"))
    assert drafter_types()["ngram"] is ngram and registry.register(ngram) is ngram
