"""Summaries of ``mlxspec bench`` runs: per-row speedups, predictions, tables and plots.

The runs are ``bench.RunRecord``s; speedup is the median over prompt × temperature pairs of
``generation_tps(system) / generation_tps(baseline)`` on the same pair (see ``mlxspec.bench.runs``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from .runs import BASELINE, CONTROL, RunRecord, System
from ..pacing import AUTO, NUM_BINS, SCHEDULED, Costs, expected_tau


def alpha_mle(rounds: list[tuple[int, int]]) -> float:
    """α from rounds of (drafted K, kept n): Σn / Σ min(n + 1, K), the truncated-geometric MLE.

    Unlike ``GenerationStats.alpha`` (kept / drafted) it does not count drafts behind the
    first rejection, which were never judged; it is the α of ``expected_tau``.
    """
    judged = sum(min(n + 1, k) for k, n in rounds if k > 0)
    return sum(n for k, n in rounds if k > 0) / judged if judged else 0.0


@dataclass
class SummaryRow:
    """One system on one prompt kind at one temperature, over its prompts.

    Attributes:
        system, family, gamma, kind, temp: What the row is.
        pairs: Prompt × temperature pairs measured.
        speedup: Median of paired ratios generation_tps(system) / generation_tps(baseline).
        speedup_min, speedup_max: Range of those ratios.
        predicted_speedup: The cost model's prediction at this row's measured α (``None`` if n/a).
        generation_tps, prompt_tps: Means over runs, tokens/s.
        alpha: Kept / drafted. alpha_mle: The truncated-geometric α (``alpha_mle``).
        tau: Tokens per verify round (kept + 1), pooled.
        acceptance_per_position: ``[i]`` = rounds that kept a draft at depth i+1 / rounds that drafted it.
        tau_histogram: ``[n]`` = rounds that produced n tokens.
        round_draft_ms, round_verify_ms, round_other_ms: Mean time per round (mlxspec only).
        peak_memory_gb: Largest peak over runs.
        same_output: Fraction of runs whose output equals the baseline's (temperature 0 only).
        mean_gamma, plain_fallback: Auto / scheduled γ's mean choice and fraction of rounds at γ = 0.
        best: Whether this is its family's best fixed γ for this kind and temperature.
        note: The system's own note (``System.note``).
    """

    system: str
    family: str
    gamma: int | str
    kind: str
    temp: float
    pairs: int
    speedup: float
    speedup_min: float
    speedup_max: float
    predicted_speedup: float | None
    generation_tps: float
    prompt_tps: float
    alpha: float | None
    alpha_mle: float | None
    tau: float | None
    acceptance_per_position: list[float]
    tau_histogram: list[int]
    round_draft_ms: float | None
    round_verify_ms: float | None
    round_other_ms: float | None
    peak_memory_gb: float
    same_output: float | None
    mean_gamma: float | None = None
    plain_fallback: float | None = None
    best: bool = False
    note: str = ""


def summarize(runs: list[RunRecord], systems: list[System], costs: dict[str, Costs]) -> list[SummaryRow]:
    """One ``SummaryRow`` per system × kind × temperature, with paired speedups and predictions."""
    baseline = {(r.prompt_id, r.temp): r for r in runs if r.system == BASELINE}
    groups = defaultdict(list)
    for r in runs:
        groups[(r.system, r.kind, r.temp)].append(r)
    by_name = {s.name: s for s in systems}
    rows = []
    for (name, kind, temp), group in groups.items():
        rows.append(_row(by_name[name], kind, temp, group, baseline, costs))
    _mark_best(rows)
    order = {s.name: i for i, s in enumerate(systems)}
    return sorted(rows, key=lambda row: (row.kind, row.temp, order[row.system]))


def _row(system: System, kind: str, temp: float, group: list[RunRecord], baseline: dict,
         costs: dict[str, Costs]) -> SummaryRow:
    ratios = [r.generation_tps / baseline[(r.prompt_id, r.temp)].generation_tps for r in group
              if baseline.get((r.prompt_id, r.temp)) and baseline[(r.prompt_id, r.temp)].generation_tps > 0]
    rounds = [tuple(x) for r in group for x in r.rounds]
    drafted, kept = sum(k for k, _ in rounds), sum(n for _, n in rounds)
    speculative = system.gamma != 0
    same = [r.output_sha == baseline[(r.prompt_id, r.temp)].output_sha for r in group
            if (r.prompt_id, r.temp) in baseline] if temp == 0 else []
    gamma_rounds = _add_lists([r.gamma_rounds for r in group])
    row = SummaryRow(
        system.name, system.family, system.gamma, kind, temp, len(group),
        statistics.median(ratios) if ratios else 0.0, min(ratios, default=0.0), max(ratios, default=0.0),
        _predict(system, costs, rounds) if speculative else 1.0,
        statistics.fmean(r.generation_tps for r in group),
        statistics.fmean(r.prompt_tokens / r.prompt_s if r.prompt_s > 0 else 0.0 for r in group),
        kept / drafted if drafted else None, alpha_mle(rounds) if drafted else None,
        (kept + len(rounds)) / len(rounds) if rounds else None,
        _per_position(rounds), _histogram([n + 1 for _, n in rounds]),
        *_round_split(group, len(rounds)),
        max(r.peak_memory_gb for r in group), sum(same) / len(same) if same else None, note=system.note,
    )
    if gamma_rounds:
        total = sum(gamma_rounds)
        row.mean_gamma = sum(g * n for g, n in enumerate(gamma_rounds)) / total
        row.plain_fallback = gamma_rounds[0] / total
    return row


def _predict(system: System, costs: dict[str, Costs], rounds: list[tuple[int, int]]) -> float | None:
    """The cost model's speedup at this row's measured α and draft lengths.

    Each round that drafted K tokens is predicted to yield τ(α, K) tokens in
    K · T_draft + T_verify(K + 1) seconds (a round with K = 0, an n-gram miss or an
    auto-γ fall-back, is a plain step: 1 token in T_target(1)), with α the truncated-geometric
    estimate of the row; speedup = Σ tokens · T_target(1) / Σ seconds.
    """
    cost = costs.get(system.drafter)
    if cost is None or not rounds:
        return None
    alpha = alpha_mle(rounds)
    tokens = sum(expected_tau(alpha, k) for k, _ in rounds)
    return tokens * cost.verify(1) / sum(cost.draft(k) + cost.verify(k + 1) for k, _ in rounds)


def _round_split(group: list[RunRecord], num_rounds: int) -> tuple:
    """Mean draft / verify / other milliseconds per round (mlxspec runs only)."""
    if not num_rounds or any(r.draft_s is None for r in group):
        return None, None, None
    draft = sum(r.draft_s for r in group)
    verify = sum(r.verify_s for r in group)
    other = sum(r.generation_s for r in group) - draft - verify
    return tuple(1000 * x / num_rounds for x in (draft, verify, other))


def _per_position(rounds: list[tuple[int, int]]) -> list[float]:
    depth = max((k for k, _ in rounds), default=0)
    drafted = [sum(k > i for k, _ in rounds) for i in range(depth)]
    kept = [sum(n > i for _, n in rounds) for i in range(depth)]
    return [a / d if d else 0.0 for a, d in zip(kept, drafted)]


def _histogram(values: list[int]) -> list[int]:
    out = [0] * (max(values, default=0) + 1)
    for v in values:
        out[v] += 1
    return out


def _add_lists(lists: list[list[int]]) -> list[int]:
    out = [0] * max((len(x) for x in lists), default=0)
    for x in lists:
        for i, v in enumerate(x):
            out[i] += v
    return out


def _mark_best(rows: list[SummaryRow]) -> None:
    """Flag the fixed γ with the best median speedup per family × kind × temperature."""
    best: dict[tuple, SummaryRow] = {}
    for row in rows:
        if isinstance(row.gamma, int) and row.gamma > 0:
            key = (row.family, row.kind, row.temp)
            if key not in best or row.speedup > best[key].speedup:
                best[key] = row
    for row in best.values():
        row.best = True


# ---------------------------------------------------------------- the verdict


@dataclass
class Verdict:
    """The answer to "is it faster here, and what should I set?" for one prompt kind at one temperature.

    Attributes:
        kind, temp: What the verdict is about.
        system: The fastest mlxspec setting that drafts (``System.name``), or ``None`` when none ran.
        drafter: Its drafter spec string (what ``--drafter`` takes), or ``None``.
        gamma: Its γ (what ``--num-draft-tokens`` takes), or ``None``.
        speedup: Its median speedup over plain mlx-lm (1.0 when none ran).
        noise: The noise floor: the largest |ratio − 1| of the plain-vs-plain control run's pairs
            (``mlx-lm (again)``), or ``None`` without a control run.
        wins: Whether ``speedup`` exceeds 1 by more than ``noise`` (by anything, without a control).
    """

    kind: str
    temp: float
    system: str | None
    drafter: str | None
    gamma: int | str | None
    speedup: float
    noise: float | None
    wins: bool


def verdicts(rows: list[SummaryRow], systems: list[System]) -> list[Verdict]:
    """One ``Verdict`` per kind × temperature: the mlxspec setting (drafter and γ, plain decoding
    excluded) with the best median speedup, and whether it beats plain decoding beyond the noise floor.
    A system priced as plain decoding (``System.priced_plain``) takes plain steps, so it is never picked:
    when nothing else drafts the verdict is plain decoding.

    Args:
        rows: From ``summarize``.
        systems: The systems the rows are about (their drafters and γ).
    """
    by_name = {s.name: s for s in systems}
    out = []
    for kind, temp in dict.fromkeys((r.kind, r.temp) for r in rows):
        group = [r for r in rows if (r.kind, r.temp) == (kind, temp)]
        control = next((r for r in group if r.system == CONTROL), None)
        noise = max(abs(control.speedup_min - 1), abs(control.speedup_max - 1)) if control else None
        candidates = [
            r
            for r in group
            if by_name[r.system].engine == "mlxspec"
            and by_name[r.system].gamma != 0
            and not by_name[r.system].priced_plain
        ]  # plain decoding in disguise
        best = max(candidates, key=lambda r: r.speedup, default=None)
        if best is None:
            out.append(Verdict(kind, temp, None, None, None, 1.0, noise, False))
            continue
        system = by_name[best.system]
        wins = best.speedup > 1.0 + (noise or 0.0)
        out.append(Verdict(kind, temp, system.name, system.drafter, system.gamma, best.speedup, noise, wins))
    return out


# ---------------------------------------------------------------- tables and plots


def format_table(rows: list[SummaryRow], compact: bool = False) -> str:
    """A Markdown table of summary rows.

    Args:
        rows: From ``summarize``.
        compact: Keep only non-speculative rows, each family's best fixed γ, auto and scheduled.
    """
    if compact:
        rows = [r for r in rows if r.gamma in (0, AUTO, SCHEDULED) or r.best]
    head = (
        "| kind | temp | system | tok/s | speedup (min–max) | predicted | α | τ | draft / verify / other ms "
        "per round | same output | notes |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append("| " + " | ".join([
            r.kind, f"{r.temp:g}", r.system + (" *" if r.best else ""), f"{r.generation_tps:.2f}",
            f"{r.speedup:.2f} ({r.speedup_min:.2f}–{r.speedup_max:.2f})", _fmt(r.predicted_speedup),
            _fmt(r.alpha), _fmt(r.tau), _split(r), _fmt(r.same_output, "{:.0%}"), _notes(r),
        ]) + " |")
    return "\n".join(lines)


def _fmt(value, spec: str = "{:.2f}") -> str:
    return "–" if value is None else spec.format(value)


def _split(r: SummaryRow) -> str:
    if r.round_verify_ms is None:
        return "–"
    return f"{r.round_draft_ms:.0f} / {r.round_verify_ms:.0f} / {r.round_other_ms:.0f}"


def _notes(r: SummaryRow) -> str:
    notes = [r.note] if r.note else []
    if r.mean_gamma is not None:
        notes.append(f"mean γ {r.mean_gamma:.1f}")
        if r.plain_fallback:
            notes[-1] += f"; plain decoding in {r.plain_fallback:.0%} of rounds"
    return "; ".join(notes)


def write_plots(rows: list[SummaryRow], folder, runs: list[RunRecord] = ()) -> list[str]:
    """``speedup_vs_gamma.png``, ``tau_histogram.png`` and, when ``runs`` include scheduled ones,
    ``reliability.png`` (predicted vs observed survival, ``reliability_data``) in ``folder``; returns their
    paths.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'mlxspec[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    panels = sorted({(r.kind, r.temp) for r in rows})
    paths = [folder / "speedup_vs_gamma.png", folder / "tau_histogram.png"] if panels else []
    for path, draw in zip(paths, (_plot_sweep, _plot_tau)):
        cols = min(2, len(panels))
        fig, axes = plt.subplots(
            (len(panels) + cols - 1) // cols,
            cols,
            figsize=(6 * cols, 4.2 * len(panels) / cols),
            squeeze=False,
        )
        for ax, (kind, temp) in zip(axes.flat, panels):
            draw(ax, [r for r in rows if (r.kind, r.temp) == (kind, temp)], f"{kind}, temp {temp:g}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    data = reliability_data(runs)
    if data:
        paths.append(folder / "reliability.png")
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
        _plot_reliability(axes, data)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=110)
    plt.close("all")
    return [str(p) for p in paths]


def reliability_data(runs: list[RunRecord]) -> dict[str, dict]:
    """Per scheduled system: pooled ``[nodes, Σ predicted, kept]`` per survival bin and per depth.

    Returns:
        dict: system name -> ``{"bins": [[n, Σs, k]] * NUM_BINS, "depths": [[n, Σs, k], ...]}``.
    """
    out: dict[str, dict] = {}
    for r in runs:
        if not r.calibration:
            continue
        pooled = out.setdefault(r.system, {"bins": [[0, 0.0, 0] for _ in range(NUM_BINS)], "depths": []})
        for key in ("bins", "depths"):
            rows = r.calibration[key]
            pooled[key] += [[0, 0.0, 0] for _ in range(len(rows) - len(pooled[key]))]
            for total, row in zip(pooled[key], rows):
                for j in range(3):
                    total[j] += row[j]
    return out


def _plot_reliability(axes, data: dict[str, dict]) -> None:
    """Left: observed survival per bin of predicted survival; right: mean predicted and observed per depth."""
    left, right = axes
    left.plot([0, 1], [0, 1], color="gray", linewidth=0.8, label="perfectly calibrated")
    for i, (system, tallies) in enumerate(sorted(data.items())):
        bins = [(s / n, k / n, n) for n, s, k in tallies["bins"] if n]
        if bins:
            left.plot([b[0] for b in bins], [b[1] for b in bins], "o-", color=f"C{i}", label=system)
        depths = [(d + 1, s / n, k / n) for d, (n, s, k) in enumerate(tallies["depths"]) if n]
        if depths:
            right.plot([d[0] for d in depths], [d[1] for d in depths], ":", marker="x", color=f"C{i}",
                       label=f"{system} predicted")
            right.plot([d[0] for d in depths], [d[2] for d in depths], "-", marker="o", color=f"C{i}",
                       label=f"{system} observed")
    left.set(
        title="reliability: verified draft nodes by predicted survival",
        xlabel="predicted survival (bin mean)",
        ylabel="observed survival",
        xlim=(0, 1),
        ylim=(0, 1),
    )
    right.set(title="survival per draft position", xlabel="depth", ylabel="survival", ylim=(0, 1))
    left.legend(fontsize=7)
    right.legend(fontsize=7)


def _plot_sweep(ax, rows: list[SummaryRow], title: str) -> None:
    families = sorted({r.family for r in rows if isinstance(r.gamma, int) and r.gamma > 0})
    for i, family in enumerate(families):
        color = f"C{i}"
        sweep = sorted((r for r in rows if r.family == family and isinstance(r.gamma, int) and r.gamma > 0),
                       key=lambda r: r.gamma)
        ax.plot([r.gamma for r in sweep], [r.speedup for r in sweep], "o-", color=color, label=family)
        predicted = [(r.gamma, r.predicted_speedup) for r in sweep if r.predicted_speedup is not None]
        if predicted:
            ax.plot(*zip(*predicted), ":", color=color, alpha=0.7)
        for r in rows:
            if r.family == family and r.gamma in (AUTO, SCHEDULED):
                ax.axhline(r.speedup, color=color, linestyle="--" if r.gamma == AUTO else "-.", alpha=0.7,
                           label=f"{family} {r.gamma}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set(title=title, xlabel="γ (draft tokens per round)", ylabel="speedup over mlx-lm plain")
    ax.legend(fontsize=7)


def _plot_tau(ax, rows: list[SummaryRow], title: str) -> None:
    rows = [r for r in rows if r.tau_histogram and (r.best or r.gamma in (AUTO, SCHEDULED))]
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        total = sum(r.tau_histogram) or 1
        xs = [n - 0.4 + (i + 0.5) * width for n in range(len(r.tau_histogram))]  # grouped around n
        ax.bar(xs, [c / total for c in r.tau_histogram], width=width, label=r.system)
    ax.set_xticks(range(max((len(r.tau_histogram) for r in rows), default=1)))
    ax.set(title=title, xlabel="tokens per round (τ)", ylabel="share of rounds")
    ax.legend(fontsize=7)
