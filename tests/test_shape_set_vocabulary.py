"""Shape sets and padding in the configuration vocabulary: buckets and shares, configuration ids that stay as
they were, the padding column in the store, and workload ids that tell a shape set from a single shape."""

from __future__ import annotations

import sqlite3

import pytest
from joulepilot.compiler import CompileConfig, ConfigError, ShapeSet
from joulepilot.compiler.shape_set import parse_shape_set, shape_set_variants
from joulepilot.compiler.workloads import workload_id
from joulepilot.store import (
    SCHEMA_VERSION,
    insert_run,
    list_runs,
    open_db,
    schema_version,
    stable_id,
    upsert_config,
    upsert_host,
    upsert_workload,
)
from joulepilot.store.connection import Store
from joulepilot.store.runs import workload_runs
from joulepilot.store.schema import MIGRATIONS


def test_sizes_are_sorted_with_their_weights_and_shares_sum_to_one():
    shapes = ShapeSet("seq_len", (512, 64, 256, 128), (1, 4, 2, 3))
    assert shapes.sizes == (64, 128, 256, 512)
    assert shapes.weights == (4.0, 3.0, 2.0, 1.0)
    assert shapes.shares == pytest.approx((0.4, 0.3, 0.2, 0.1))
    assert ShapeSet("image_size", (224, 160)).shares == (0.5, 0.5)


def test_buckets_are_powers_of_two_unless_the_set_names_them():
    pow2 = ShapeSet("seq_len", (5, 6, 7, 9, 12))
    assert pow2.run_sizes("buckets") == (8, 8, 8, 16, 16)
    assert pow2.run_sizes("none") == pow2.sizes
    assert pow2.padding_changes_anything
    named = ShapeSet("seq_len", (50, 100, 300), buckets=(512, 128))
    assert named.buckets == (128, 512)
    assert named.run_sizes("buckets") == (128, 128, 512)
    on_buckets = ShapeSet("seq_len", (64, 128, 256, 512))
    assert on_buckets.run_sizes("buckets") == on_buckets.sizes and not on_buckets.padding_changes_anything


@pytest.mark.parametrize("kwargs, message", [
    ({"dim": "batch_size", "sizes": (1, 2)}, "varies one of seq_len, image_size"),
    ({"dim": "seq_len", "sizes": ()}, "positive integers"),
    ({"dim": "seq_len", "sizes": (64, 64)}, "distinct"),
    ({"dim": "seq_len", "sizes": (64, 128), "weights": (1.0,)}, "one weight per size"),
    ({"dim": "seq_len", "sizes": (64, 128), "weights": (1.0, 0.0)}, "positive numbers"),
    ({"dim": "seq_len", "sizes": (64, 300), "buckets": (128, 256)}, "largest padding bucket (256)"),
    ({"dim": "seq_len", "sizes": tuple(range(1, 18))}, "at most 16 sizes"),
])
def test_a_bad_shape_set_is_refused_with_the_reason(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ShapeSet(**kwargs)


def test_unpadded_configurations_keep_the_ids_they_had_before_padding_existed():
    for mode, fusion, precision, dynamic, batch in (("eager", "default", "fp32", False, 1),
                                                    ("default", "no-epilogue-fusion", "bf16", True, 32)):
        config = CompileConfig(mode=mode, fusion=fusion, precision=precision, dynamic=dynamic, batch_size=batch)
        # the id as it was computed before the padding knob
        assert config.id == stable_id("config", mode, fusion, [], precision, dynamic, batch)
        assert "padding" not in config.to_row()
    padded = CompileConfig(mode="default", padding="buckets", batch_size=4)
    assert padded.id != padded.replace(padding="none").id
    assert padded.label == "default/fp32/pad/b4"
    assert CompileConfig.from_row(padded.to_row()) == padded
    with pytest.raises(ConfigError, match="unknown padding 'bucket'; did you mean 'buckets'"):
        CompileConfig(mode="default", padding="bucket")


def test_padding_round_trips_through_the_store(db):
    host = upsert_host(db, {"id": "h", "hostname": "h", "cpu": "x86"})
    shapes = ShapeSet("seq_len", (5, 6, 7))
    wid = upsert_workload(db, {"id": workload_id("transformer", 2, shapes=shapes), "spec": "transformer",
                               "batch_size": 2})
    for config in (CompileConfig(mode="default", batch_size=2), CompileConfig(mode="default", padding="buckets",
                                                                             batch_size=2)):
        upsert_config(db, config.to_row())
        insert_run(db, {"workload_id": wid, "config_id": config.id, "host_id": host, "device": "cpu",
                        "status": "ok", "started_at": 1.0, "energy_j_per_inference": 0.5})
    rows = {r["config_id"]: r for r in list_runs(db)}
    typed = {r.config_id: r for r in workload_runs(db, wid)}
    for config_id, row in rows.items():
        config = CompileConfig.from_row(row)
        assert config.id == config_id
        assert typed[config_id].padding == config.padding
    assert sorted(r["padding"] for r in rows.values()) == ["buckets", "none"]


def test_a_version_4_database_gets_the_padding_column_with_none_for_its_configurations(tmp_path):
    path = tmp_path / "v4.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for migrate in MIGRATIONS[:4]:
        migrate(Store(conn))
    conn.execute("PRAGMA user_version = 4")
    old = CompileConfig(mode="default", dynamic=True, batch_size=8)
    conn.execute("INSERT INTO configs VALUES (?, ?, 'default', 'default', '{}', 'fp32', 1, 8)", [old.id, old.label])
    conn.close()

    db = open_db(path)
    assert schema_version(db) == SCHEMA_VERSION
    row = next(db.query("SELECT * FROM configs"))
    assert row["padding"] == "none"
    assert CompileConfig.from_row(row) == old


def test_a_shape_set_makes_its_own_workload_id():
    single = workload_id("transformer", 4, 128)
    assert single == stable_id("workload", "transformer", 4, 128, None)  # as before shape sets existed
    shapes = ShapeSet("seq_len", (64, 128), (3, 1))
    mixed = workload_id("transformer", 4, shapes=shapes)
    assert mixed not in (single, workload_id("transformer", 4))
    assert mixed == workload_id("transformer", 4, shapes=ShapeSet("seq_len", (128, 64), (0.25, 0.75)))
    assert mixed != workload_id("transformer", 4, shapes=ShapeSet("seq_len", (64, 128), (1, 1)))
    assert mixed != workload_id("transformer", 4, shapes=ShapeSet("seq_len", (64, 128), (3, 1), buckets=(256,)))


def test_bench_variants_sweep_static_dynamic_and_padding_for_compiled_modes_only():
    plain = [CompileConfig(mode="eager"), CompileConfig(mode="default", precision="bf16")]
    labels = [c.label for c in shape_set_variants(plain, parse_shape_set("seq_len=5:2,9"))]
    assert labels == ["eager/fp32/b1", "default/bf16/b1", "default/bf16/pad/b1", "default/bf16/dynamic/b1",
                      "default/bf16/dynamic/pad/b1"]
    on_buckets = parse_shape_set("seq_len=8,16", buckets="8,16")
    assert [c.label for c in shape_set_variants(plain, on_buckets, (True,))] == ["eager/fp32/b1",
                                                                               "default/bf16/dynamic/b1"]
    assert parse_shape_set("image_size=224:1,160:3") == ShapeSet("image_size", (160, 224), (3, 1))


def test_a_size_or_bucket_past_the_bound_is_one_line_before_anything_runs():
    """A typo'd size would reach the worker, whose tensor constructor fails with C++ frames in the run's reason."""
    from joulepilot.compiler.shape_set import parse_shape_set

    with pytest.raises(ConfigError, match=r"sizes must be positive integers of at most 1,048,576, got "
                                          r"\(64, 99999999999999999999\)"):
        parse_shape_set("seq_len=64,99999999999999999999")
    with pytest.raises(ConfigError, match="buckets must be distinct positive integers of at most 1,048,576"):
        parse_shape_set("seq_len=64,128", buckets="128,4294967296")
    assert ShapeSet("seq_len", (1 << 20,)).sizes == (1 << 20,)  # the bound itself is a size


def test_shares_of_weights_near_the_float_maximum_still_sum_to_one():
    """Weights are relative, so 1e308 each is an even split; summed as they are they overflow to inf, and every
    share (and the J per call weighted by them) became 0."""
    huge = ShapeSet("seq_len", (64, 128), (1e308, 1e308))
    assert huge.shares == (0.5, 0.5)
    assert huge.key() == ShapeSet("seq_len", (64, 128)).key()
    uneven = ShapeSet("seq_len", (64, 128), (1.5e308, 0.5e308))
    assert uneven.shares == pytest.approx((0.75, 0.25))
