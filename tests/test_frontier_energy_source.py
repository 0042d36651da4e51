"""Every measured point of the frontier and every measured candidate of `policy explain` names its energy
source, and an estimate is marked as one (table, JSON and plot) rather than passing for a measurement."""

from __future__ import annotations

import json

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


def test_a_points_source_covers_every_run_its_median_rests_on(tmp_path):
    # default: two RAPL runs then a newer estimate one; the median is over all three.
    db = _store(tmp_path, {"eager": ["rapl"] * 3, "default": ["rapl", "rapl", "estimate"]})
    data = json.loads(_invoke("frontier", "mlp", "--db", db, "--no-predict", "--json"))
    by_label = {p["label"]: p for p in data["points"]}
    assert by_label["default/fp32/b8"]["repeats"] == 3
    assert by_label["default/fp32/b8"]["energy_source"] == "rapl+estimate"
    assert by_label["eager/fp32/b8"]["energy_source"] == "rapl"
    assert all(p["source"] == "measured" for p in data["points"])
    # The points are compared on one axis: the result says they were not metered alike.
    assert any("not like for like" in note and "rapl+estimate" in note for note in data["notes"])


def test_points_metered_alike_carry_no_like_for_like_note(tmp_path):
    db = open_db(_store(tmp_path, {"eager": ["nvml"] * 3, "default": ["nvml"] * 3}), read_only=True)
    result = frontier(db, "mlp", predict=False)
    assert {p["energy_source"] for p in result["points"]} == {"nvml"}
    assert not [n for n in result["notes"] if "like for like" in n]


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


def test_a_candidates_source_covers_every_run_its_median_rests_on(tmp_path, monkeypatch):
    # default: two RAPL runs then a newer estimate one; eager: all RAPL. The median of default rests on both.
    monkeypatch.setenv("COLUMNS", "250")
    db = _store(tmp_path, {"eager": ["rapl"] * 3, "default": ["rapl", "rapl", "estimate"]})
    args = ["policy", "explain", str(tmp_path / "svc.toml"), "--db", db, "--device-name", "cpu"]
    data = json.loads(_invoke(*args, "--json"))
    sources = {c["label"]: c["figures"]["energy_source"] for c in data["candidates"]}
    assert sources == {"eager/fp32/b8": "rapl", "default/fp32/b8": "rapl+estimate"}
    out = _invoke(*args)
    assert "measured (rapl+estimate)" in out and ESTIMATE_LINE in out
