"""A guided policy is decided with the trade-off model its search planned with during the pass: a model refitted
on the runs the search just made may see another candidate worth measuring, which left the search that had
stopped without a decision (seen on an H200 pass over ConvNeXt-Tiny's 20 configurations)."""

from __future__ import annotations

from daemon_factories import write_daemon_config, write_policy
from joulepilot.controller import daemon as daemon_mod
from joulepilot.controller.daemon import Daemon
from joulepilot.controller.daemon_config import load_daemon_config
from joulepilot.store import open_db
from joulepilot.store.decisions import latest_decision


class NoPredictions:
    """A fitted model that predicts nothing (the search then measures by the judge alone): each fit is its own."""

    def predict_many(self, workload, rows, device_kind):
        return [{} for _ in rows]


def test_the_decision_uses_the_model_the_search_planned_with(tmp_path, flow_worker, own_tmpdir, restore_logging,
                                                             monkeypatch):
    fits: list[NoPredictions] = []
    used: list[object] = []
    real_decide_now = daemon_mod.decide_now

    def fit(db):
        fits.append(NoPredictions())
        return fits[-1]

    def decide_now(db, policy, device_kind, model, **kwargs):
        used.append(model)
        return real_decide_now(db, policy, device_kind, model, **kwargs)

    monkeypatch.setattr(daemon_mod, "fit_or_none", fit)
    monkeypatch.setattr(daemon_mod, "decide_now", decide_now)
    db_path = tmp_path / "j.db"
    policies = tmp_path / "policies"
    write_policy(policies, "g", modes=("eager", "default"), strategy="guided")
    cfg = load_daemon_config(write_daemon_config(tmp_path / "daemon.toml", db=db_path, policies=policies,
                                                 min_seconds=0.2))
    result = Daemon(cfg).run(once=True)
    assert result.exit_code == 0, result.summary
    assert len(fits) == 2  # once for the pass's searches, once more when deciding
    assert used and all(model is fits[0] for model in used)
    database = open_db(db_path)
    try:
        assert latest_decision(database, "g", "cpu") is not None
    finally:
        database.close()
