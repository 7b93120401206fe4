"""PNG plots of a `specjax bench` report (the `plots` extra: matplotlib).

What is drawn is computed by the pure functions at the top (no matplotlib needed, tested on
their own); the drawing functions below only place their output:

- a value whose denominator is zero is undefined and left out, never drawn as 0: the
  conditional acceptance at a depth no step reached, any acceptance of a category with no
  steps, the throughput of a mode with no measured time, a speedup the report leaves null;
- a speedup below 1 (a slowdown) has its own colour;
- every title names the model, the drafter and draft shape, the batch size, the device and
  the report's date; every category label carries its prompt count, "coding (n=10)".
"""
from __future__ import annotations

import os
from pathlib import Path

SPEEDUP_COLOR = "tab:green"
SLOWDOWN_COLOR = "tab:red"
OVERALL = "overall"

# ---------------------------------------------------------------------------------------------
# What is drawn (pure)
# ---------------------------------------------------------------------------------------------


def report_sections(report: dict) -> dict[str, dict]:
    """The report's categories, then "overall"."""
    return {**report["categories"], OVERALL: report["overall"]}


def section_label(name: str, section: dict) -> str:
    """"summarization (n=10)": the section's name and its number of prompts."""
    return f"{name} (n={section['num_prompts']})"


def run_description(report: dict) -> str:
    """"smollm2-135m · ngram chain4 · B=1 · cpu · 2026-11-30": the model, the drafter and its
    draft shape, the batch size, the device and the date of the run ("?" where the report
    does not say)."""
    config, env = report.get("config", {}), report.get("environment", {})
    tree = config.get("tree") or {}
    drafter = " ".join(str(x) for x in (config.get("draft", "?"), tree.get("name")) if x)
    device = env.get("device_kind") or env.get("backend") or "?"
    return " · ".join([str(config.get("model", "?")), drafter, f"B={config.get('batch_size', '?')}",
                       device, (report.get("created") or "?")[:10]])


def plot_title(report: dict, what: str) -> str:
    """A plot's title: what it shows, then the run it comes from (`run_description`)."""
    return f"{what}\n{run_description(report)}"


def defined_acceptance(spec: dict) -> dict[str, list[tuple[int, float]]]:
    """(draft position, value) of the conditional and joint acceptance where they are defined:
    joint[j] = accepted_per_position[j] / steps needs steps > 0; conditional[j] divides by the
    steps that accepted the previous position (j = 0: all steps) and needs that count > 0. The
    report stores 0 for an undefined 0/0; these points are left out instead."""
    steps, per_pos = spec["steps"], spec["accepted_per_position"]
    denominators = {"conditional": [steps, *per_pos[:-1]], "joint": [steps] * len(per_pos)}
    return {
        kind: [(j + 1, value) for j, (value, denominator)
               in enumerate(zip(spec[f"{kind}_acceptance"], denominators[kind])) if denominator > 0]
        for kind in denominators
    }


def mode_rate(mode: dict) -> float | None:
    """A mode's tokens/s, None when no time was measured (the report stores 0 there)."""
    return mode["tokens_per_s"] if mode["time_s"] > 0 else None


def throughput_bars(report: dict) -> dict[str, list[tuple[int, float]]]:
    """(section index, tokens/s) per mode ("baseline", "spec"), undefined rates left out."""
    sections = list(report_sections(report).values())
    return {mode: [(i, rate) for i, sec in enumerate(sections)
                   if (rate := mode_rate(sec[mode])) is not None]
            for mode in ("baseline", "spec")}


def speedup_bars(report: dict) -> list[tuple[int, float, str]]:
    """(section index, speedup, colour) of each section with a defined speedup: slowdowns
    (speedup < 1) in SLOWDOWN_COLOR, the rest in SPEEDUP_COLOR."""
    return [(i, sec["speedup"], SLOWDOWN_COLOR if sec["speedup"] < 1 else SPEEDUP_COLOR)
            for i, sec in enumerate(report_sections(report).values()) if sec["speedup"] is not None]


def length_fractions(spec: dict) -> list[tuple[int, float]]:
    """(accepted draft tokens k, fraction of steps) of the histogram; empty without steps."""
    hist = spec["accepted_length_histogram"]
    total = sum(hist)
    return [(k, count / total) for k, count in enumerate(hist)] if total else []


# ---------------------------------------------------------------------------------------------
# Drawing (matplotlib)
# ---------------------------------------------------------------------------------------------


def write_plots(report: dict, out_dir: str | os.PathLike) -> list[Path]:
    """PNGs in out_dir: acceptance per position, throughput and speedup per category, accepted
    lengths; returns their paths. A ValueError when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plots needs matplotlib: pip install 'specjax[plots]'") from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {
        "acceptance_per_position.png": draw_acceptance,
        "throughput.png": draw_throughput,
        "speedup.png": draw_speedup,
        "accepted_lengths.png": draw_accepted_lengths,
    }
    paths = []
    for name, draw in figures.items():
        fig = draw(plt, report)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def _category_axis(ax, report: dict) -> None:
    labels = [section_label(n, s) for n, s in report_sections(report).items()]
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")


def _bar_figsize(num_sections: int) -> tuple[float, float]:
    return (max(6.0, 0.9 * num_sections), 4.8)


def draw_acceptance(plt, report: dict):
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for name, sec in report_sections(report).items():
        style = dict(lw=2.5, color="black") if name == OVERALL else dict(lw=1, alpha=0.8)
        for ax, points in zip(axes, defined_acceptance(sec["spec"]).values()):
            if points:
                ax.plot(*zip(*points), marker="o", label=section_label(name, sec), **style)
    for ax, what in zip(axes, ("conditional acceptance", "joint acceptance")):
        ax.set(xlabel="draft position", ylabel=what, ylim=(0, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(plot_title(report, "acceptance per draft position (undefined points left out)"))
    return fig


def draw_throughput(plt, report: dict):
    fig, ax = plt.subplots(figsize=_bar_figsize(len(report_sections(report))))
    bars = throughput_bars(report)
    for mode, shift, label in (("baseline", -0.2, "baseline"), ("spec", 0.2, "speculative")):
        if bars[mode]:
            xs, rates = zip(*bars[mode])
            ax.bar([x + shift for x in xs], rates, 0.4, label=label)
    _category_axis(ax, report)
    ax.set(ylabel="output tokens / s", title=plot_title(report, "throughput per category"))
    ax.legend()
    return fig


def draw_speedup(plt, report: dict):
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=_bar_figsize(len(report_sections(report))))
    bars = speedup_bars(report)
    if bars:
        xs, values, colors = zip(*bars)
        ax.bar(xs, values, color=colors)
    ax.axhline(1.0, color="gray", lw=1)
    _category_axis(ax, report)
    ax.set(ylabel="speedup vs baseline", title=plot_title(report, "speedup per category"))
    ax.legend(handles=[Patch(color=SPEEDUP_COLOR, label="faster (speedup >= 1)"),
                       Patch(color=SLOWDOWN_COLOR, label="slower (speedup < 1)")], fontsize=7)
    return fig


def draw_accepted_lengths(plt, report: dict):
    fig, ax = plt.subplots(figsize=(6, 4.8))
    points = length_fractions(report["overall"]["spec"])
    if points:
        ax.bar(*zip(*points))
    ax.set(xlabel="accepted draft tokens per step", ylabel="fraction of steps",
           title=plot_title(report, f"accepted lengths, {section_label(OVERALL, report['overall'])}"))
    return fig
