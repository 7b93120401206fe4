"""`specjax bench --plots`: what is drawn (pure, no matplotlib) and the drawing (when matplotlib
is installed): undefined points left out, slowdowns coloured apart, titles naming the run,
prompt counts in the labels."""
from __future__ import annotations

import pytest

from specjax.measure.bench import ModeRecord, build_report, validate_report
from specjax.measure.plots import (
    SLOWDOWN_COLOR,
    SPEEDUP_COLOR,
    defined_acceptance,
    length_fractions,
    plot_title,
    report_sections,
    section_label,
    speedup_bars,
    throughput_bars,
    write_plots,
)
from specjax.metrics import summarize

CONFIG = {"model": "smollm2-135m", "draft": "ngram", "tree": {"name": "chain3"}, "batch_size": 4}


def mode(tokens: int, seconds: float, spec_rows=()) -> ModeRecord:
    return ModeRecord(new_tokens=tokens, first_tokens=1 if seconds else 0,
                      batch_times=[seconds] if seconds else [], ttfts=[seconds / 4] if seconds else [],
                      spec_rows=list(spec_rows))


@pytest.fixture(scope="module")
def report():
    """summarization: 2 prompts, 2x faster, no step accepted position 2 (so conditional[3] is
    0/0); coding: 1 prompt, 2x slower, nothing accepted; idle: 1 prompt, nothing timed."""
    rows = [{"category": c, "prompt": "p"} for c in ("summarization", "summarization", "coding", "idle")]
    records = {
        "summarization": (mode(40, 2.0), mode(40, 1.0, [summarize(10, 30, 6, [6, 0, 0])])),
        "coding": (mode(20, 1.0), mode(20, 2.0, [summarize(5, 15, 0, [0, 0, 0])])),
        "idle": (mode(0, 0.0), mode(0, 0.0)),
    }
    report = build_report(rows, records, CONFIG)
    validate_report(report)
    return report


def test_undefined_acceptance_is_left_out_not_drawn_as_zero(report):
    summ, coding, idle = (report["categories"][c]["spec"] for c in ("summarization", "coding", "idle"))
    assert summ["conditional_acceptance"] == [0.6, 0.0, 0.0]  # the report's 0 for 0/0 at 3
    assert defined_acceptance(summ) == {"conditional": [(1, 0.6), (2, 0.0)],  # 0/6: a real 0
                                        "joint": [(1, 0.6), (2, 0.0), (3, 0.0)]}
    assert defined_acceptance(coding)["conditional"] == [(1, 0.0)]
    assert defined_acceptance(idle) == {"conditional": [], "joint": []}  # no steps at all


def test_slowdowns_have_their_own_colour(report):
    # sections in order: summarization, coding, idle (no speedup: left out), overall
    assert speedup_bars(report) == [(0, pytest.approx(2.0), SPEEDUP_COLOR),
                                    (1, pytest.approx(0.5), SLOWDOWN_COLOR),
                                    (3, pytest.approx(1.0), SPEEDUP_COLOR)]
    assert SPEEDUP_COLOR != SLOWDOWN_COLOR


def test_unmeasured_throughput_and_empty_histograms_are_left_out(report):
    bars = throughput_bars(report)
    assert [i for i, _ in bars["baseline"]] == [0, 1, 3] == [i for i, _ in bars["spec"]]
    assert bars["spec"][0] == (0, pytest.approx(40.0))
    assert length_fractions(report["categories"]["idle"]["spec"]) == []
    assert length_fractions(report["overall"]["spec"]) == [(0, pytest.approx(9 / 15)),
                                                           (1, pytest.approx(6 / 15)), (2, 0.0), (3, 0.0)]


def test_labels_carry_prompt_counts_and_titles_name_the_run(report):
    labels = [section_label(n, s) for n, s in report_sections(report).items()]
    assert labels == ["summarization (n=2)", "coding (n=1)", "idle (n=1)", "overall (n=4)"]
    title = plot_title(report, "speedup per category")
    date = report["created"][:10]
    device = report["environment"]["device_kind"]
    assert title == f"speedup per category\nsmollm2-135m · ngram chain3 · B=4 · {device} · {date}"
    bare = plot_title({"categories": {}, "overall": {}}, "x")
    assert bare == "x\n? · ? · B=? · ? · ?"


def test_drawing(report, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from specjax.measure.plots import draw_acceptance, draw_speedup

    paths = write_plots(report, tmp_path)
    assert [p.name for p in paths] == ["acceptance_per_position.png", "throughput.png",
                                       "speedup.png", "accepted_lengths.png"]
    assert all(p.stat().st_size > 0 for p in paths)

    fig = draw_acceptance(plt, report)
    conditional = {line.get_label(): list(line.get_xdata()) for line in fig.axes[0].get_lines()}
    assert conditional == {"summarization (n=2)": [1, 2], "coding (n=1)": [1], "overall (n=4)": [1, 2]}
    assert "smollm2-135m · ngram chain3 · B=4" in fig._suptitle.get_text()
    plt.close(fig)

    fig = draw_speedup(plt, report)
    ax = fig.axes[0]
    bars = [p for p in ax.patches if p.get_height() > 0]
    colours = [p.get_facecolor() for p in bars]
    assert len(bars) == 3 and colours[0] == colours[2] != colours[1]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "summarization (n=2)", "coding (n=1)", "idle (n=1)", "overall (n=4)"]
    assert "B=4" in ax.get_title()
    plt.close(fig)
