"""`compiler.cache_bypass`: the bypass lines Inductor's FX-graph cache and AOTAutograd's cache log are kept with
the cache they speak for, once each, and the loggers are left as they were."""

from __future__ import annotations

import logging

from joulepilot.compiler.cache_bypass import LOGGERS, recording_cache_bypasses

AOT = "torch._functorch._aot_autograd.autograd_cache"
FX = "torch._inductor.codecache"


def test_bypass_lines_are_kept_with_their_cache_once_and_other_lines_are_not(caplog):
    before = {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in LOGGERS}
    with caplog.at_level(logging.WARNING), recording_cache_bypasses() as found:
        for _ in range(2):  # torch says it once per graph; two graphs with one cause are one line
            logging.getLogger(AOT).info("Bypassing autograd cache due to: %s", "Cannot cache a graph with freezing enabled")
        logging.getLogger(FX).info("Bypassing FX Graph Cache because '%s'", "Can't cache HigherOrderOperators")
        logging.getLogger(FX).info("fx graph cache hit for key %s", "f123")
    assert found == ["aot_autograd: Bypassing autograd cache due to: Cannot cache a graph with freezing enabled",
                     "fxgraph: Bypassing FX Graph Cache because 'Can't cache HigherOrderOperators'"]
    assert not caplog.records  # INFO lines nobody asked for did not reach the other handlers
    assert {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in LOGGERS} == before
    logging.getLogger(AOT).info("Bypassing autograd cache due to: %s", "after the block")
    assert len(found) == 2


def test_a_logger_someone_listens_to_still_reaches_them():
    """With TORCH_LOGS asking for the cache's lines, torch has set the logger to INFO: they still reach its
    handlers."""
    logger = logging.getLogger(AOT)
    seen: list[str] = []
    listener = logging.Handler(logging.INFO)
    listener.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(listener)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with recording_cache_bypasses() as found:
            logger.info("Bypassing autograd cache due to: %s", "x" * 1000)
        assert logger.level == logging.INFO
    finally:
        logger.removeHandler(listener)
        logger.setLevel(level)
    assert len(found[0]) < 350 and found[0].startswith("aot_autograd: Bypassing autograd cache due to: xxx")
    assert [line[:34] for line in seen] == ["Bypassing autograd cache due to: x"]


def test_a_real_compile_that_bypasses_aotautograds_cache_is_recorded_with_torchs_reason():
    """Inductor's freezing is one thing AOTAutograd's cache will not cache: a real CPU compile with it on."""
    import torch

    def double_plus_one(x):
        return x * 2 + 1

    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(freezing=True), recording_cache_bypasses() as found:
        out = torch.compile(double_plus_one)(torch.ones(4))
    torch._dynamo.reset()
    assert out.tolist() == [3.0] * 4
    assert "aot_autograd: Bypassing autograd cache due to: Cannot cache a graph with freezing enabled" in found, found
