"""Every measured point of the frontier and every measured candidate of `policy explain` names its energy
source, and an estimate is marked as one (table, JSON and plot) rather than passing for a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bill_factories import store_run, write_policy
from click.testing import CliRunner
from joulepilot.controller import frontier
from joulepilot.store import open_db

from joulepilot.cli import main

ESTIMATE_LINE = "not a measurement"


def _store(tmp_path, sources: dict[str, list[str]]) -> str:
    """Three-or-so runs per mode of the built-in mlp, each with the energy source given, and a policy over them."""
    path = tmp_path / "j.db"
    db = open_db(path)
    for mode, per_run in sources.items():
        for source in per_run:
            store_run(db, mode, "fp32", 0.02 if mode == "eager" else 0.01, source=source)
    db.close()
    write_policy(tmp_path, "svc", modes=tuple(sources), precisions=("fp32",))
    return str(path)


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _row(output: str, label: str) -> str:
    return next(line for line in output.splitlines() if label in line)


def test_an_estimate_only_frontier_says_estimate_on_every_row(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    db = _store(tmp_path, {"eager": ["estimate"] * 3, "default": ["estimate"] * 3})
    out = _invoke("frontier", "mlp", "--db", db, "--no-predict")
    for label in ("eager/fp32/b8", "default/fp32/b8"):
        assert "measured (estimate)" in _row(out, label)
    assert ESTIMATE_LINE in out


def test_a_metered_frontier_names_its_meter_and_no_estimate(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    db = _store(tmp_path, {"eager": ["rapl"] * 3, "default": ["rapl"] * 3})
    out = _invoke("frontier", "mlp", "--db", db, "--no-predict")
    assert "measured (rapl)" in _row(out, "eager/fp32/b8")
    assert "estimate" not in out and ESTIMATE_LINE not in out


def test_a_points_median_rests_on_its_runs_of_the_source_ranked(tmp_path):
    # default: two RAPL runs then a newer estimate one; the frontier ranks RAPL points, so default's point rests
    # on its two RAPL runs and its estimate run is named as not counted.
    db = _store(tmp_path, {"eager": ["rapl"] * 3, "default": ["rapl", "rapl", "estimate"]})
    data = json.loads(_invoke("frontier", "mlp", "--db", db, "--no-predict", "--json"))
    by_label = {p["label"]: p for p in data["points"]}
    assert by_label["default/fp32/b8"]["repeats"] == 2 and len(by_label["default/fp32/b8"]["run_ids"]) == 2
    assert by_label["default/fp32/b8"]["energy_source"] == by_label["eager/fp32/b8"]["energy_source"] == "rapl"
    assert all(p["source"] == "measured" and p["compared"] for p in data["points"])
    assert any(note.startswith("default/fp32/b8: 1 run metered by estimate not counted") for note in data["notes"])


def test_a_point_measured_only_with_an_estimate_is_shown_but_off_the_frontier(tmp_path):
    # default (estimate) looks cheaper than eager (RAPL), but the two are not compared: only eager is ranked.
    db = _store(tmp_path, {"eager": ["rapl"] * 3, "default": ["estimate"] * 3})
    data = json.loads(_invoke("frontier", "mlp", "--db", db, "--no-predict", "--json"))
    by_label = {p["label"]: p for p in data["points"]}
    default, eager = by_label["default/fp32/b8"], by_label["eager/fp32/b8"]
    assert default["energy_j_per_inference"] < eager["energy_j_per_inference"]
    assert default["compared"] is False and default["pareto"] is False and default["measured_pareto"] is False
    assert default["not_compared"] == "not compared: measured with estimate; the frontier ranks rapl runs"
    assert eager["compared"] is True and data["frontier"] == data["measured_frontier"] == ["eager/fp32/b8"]
    assert any("not compared" in note and "default/fp32/b8" in note for note in data["notes"])


def test_points_metered_alike_are_all_compared_without_a_note(tmp_path):
    db = open_db(_store(tmp_path, {"eager": ["nvml"] * 3, "default": ["nvml"] * 3}), read_only=True)
    result = frontier(db, "mlp", predict=False)
    assert {p["energy_source"] for p in result["points"]} == {"nvml"}
    assert all(p["compared"] for p in result["points"]) and result["notes"] == []


def _texts(fig) -> list[str]:
    ax = fig.axes[0]
    return [t.get_text() for t in ax.texts]


@pytest.mark.parametrize(("sources", "estimate"), [
    ({"eager": ["estimate"] * 3, "default": ["estimate"] * 3}, True),
    ({"eager": ["rapl"] * 3, "default": ["estimate"] * 3}, True),
    ({"eager": ["rapl"] * 3, "default": ["rapl"] * 3}, False),
])
def test_the_plot_marks_estimate_points_as_the_report_does(tmp_path, sources, estimate):
    import matplotlib.pyplot as plt
    from joulepilot.controller.frontier import frontier_figure

    db = open_db(_store(tmp_path, sources), read_only=True)
    fig = frontier_figure(frontier(db, "mlp", predict=False))
    try:
        ax = fig.axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert ("ESTIMATE" in ax.get_title(loc="left")) is estimate
        assert ("ESTIMATE" in _texts(fig)) is estimate
        assert any("ESTIMATE" in text for text in legend) is estimate
        if "rapl" in {s for runs in sources.values() for s in runs}:
            assert any("rapl" in text for text in legend)
    finally:
        plt.close(fig)


def test_the_plot_path_is_in_the_json(tmp_path):
    db = _store(tmp_path, {"eager": ["estimate"] * 3, "default": ["estimate"] * 3})
    png = tmp_path / "front.png"
    out = _invoke("frontier", "mlp", "--db", db, "--no-predict", "--plot", str(png), "--json")
    assert json.loads(out)["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"


def test_policy_explain_names_each_measured_candidates_energy_source(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    db = _store(tmp_path, {"eager": ["estimate"] * 3, "default": ["estimate"] * 3})
    out = _invoke("policy", "explain", str(tmp_path / "svc.toml"), "--db", db, "--device-name", "cpu")
    for label in ("eager/fp32/b8", "default/fp32/b8"):
        row = next(line for line in out.splitlines() if line.split()[:2] in (["kept", label], ["chosen", label]))
        assert "measured (estimate)" in row
    assert ESTIMATE_LINE in out
    data = json.loads(_invoke("policy", "explain", str(tmp_path / "svc.toml"), "--db", db, "--device-name", "cpu",
                              "--json"))
    assert {c["figures"]["energy_source"] for c in data["candidates"]} == {"estimate"}


def test_policy_explain_with_a_meter_names_it_and_no_estimate(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    db = _store(tmp_path, {"eager": ["rapl"] * 3, "default": ["rapl"] * 3})
    out = _invoke("policy", "explain", str(tmp_path / "svc.toml"), "--db", db, "--device-name", "cpu")
    assert "measured (rapl)" in out and ESTIMATE_LINE not in out


def test_a_candidates_median_rests_on_its_runs_of_the_source_ranked(tmp_path, monkeypatch):
    # default: two RAPL runs then a newer estimate one; eager: all RAPL. The decision ranks RAPL runs, so
    # default is judged on its two RAPL runs and its estimate run is named as not counted.
    monkeypatch.setenv("COLUMNS", "250")
    db = _store(tmp_path, {"eager": ["rapl"] * 3, "default": ["rapl", "rapl", "estimate"]})
    args = ["policy", "explain", str(tmp_path / "svc.toml"), "--db", db, "--device-name", "cpu"]
    data = json.loads(_invoke(*args, "--json"))
    by_label = {c["label"]: c for c in data["candidates"]}
    assert {label: c["figures"]["energy_source"] for label, c in by_label.items()} == {
        "eager/fp32/b8": "rapl", "default/fp32/b8": "rapl"}
    assert by_label["default/fp32/b8"]["repeats"] == 2
    assert "1 run metered by estimate not counted: the decision ranks rapl runs" in by_label["default/fp32/b8"]["notes"]
    assert data["ranked_source"] == "rapl"
    out = _invoke(*args)
    assert "measured (rapl)" in out and ESTIMATE_LINE not in out


def test_the_plots_labels_stay_inside_and_never_cover_each_other(tmp_path):
    """ResNet-50's sweep (14 configurations, some a few pixels apart): labels overlapped and ran off the right edge."""
    import matplotlib.pyplot as plt
    from joulepilot.controller.frontier import frontier_figure
    from joulepilot.store import import_runs, read_export
    from matplotlib.text import Annotation, Text

    db = open_db(tmp_path / "s.db")
    import_runs(db, read_export(Path(__file__).parent / "data" / "synthetic_sweep.json"))
    result = frontier(db, "torchvision:resnet50", predict=False)
    fig = frontier_figure(result)
    try:
        renderer = fig.canvas.get_renderer()
        frame = fig.axes[0].get_window_extent(renderer)
        labels = [text for text in fig.axes[0].texts if isinstance(text, Annotation)]
        for label in labels:
            label.update_positions(renderer)
        boxes = [Text.get_window_extent(label, renderer) for label in labels]  # the text, not its leader line
        texts = [label.get_text() for label in labels]
        assert set(result["frontier"]) <= set(texts)  # every frontier point is named
        assert len(texts) == len(set(texts))
        for i, box in enumerate(boxes):
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, texts[i]
            for j in range(i):
                assert not box.overlaps(boxes[j]), (texts[i], texts[j])
    finally:
        plt.close(fig)
