"""The run summary's pure parts: the loss warning and the per-link traffic ledger (no services)."""

from __future__ import annotations

from diloco.config import build_config


def test_a_run_that_made_the_model_worse_says_so():
    from diloco.summary import run_warnings, summary_rows
    counts = {k: 0 for k in ("published", "applied", "late", "rejected", "pending", "applied_twice", "unread")}
    worse = {"eval_loss_start": 5.5, "eval_loss_end": 16.5, "eval_loss_drop": (5.5 - 16.5) / 5.5, "contributions": counts}
    [warning] = run_warnings(worse)
    assert "ROSE from 5.5000 to 16.5000" in warning
    assert run_warnings({**worse, "eval_loss_end": 2.0}) == []
    s = {**worse, "tokens": 0, "versions": {}, "merges": {}, "bytes_across": 0, "bytes_sent": 0, "bytes_fetched": 0,
         "bytes_dp_equivalent": 0, "bytes_ratio": 0, "bytes_ratio_sent": 0, "rejections": {}}
    assert "ROSE 200.0%" in dict(summary_rows(s))["held-out loss start -> end"]
    assert "never read by the syncer" not in dict(summary_rows(s))


def test_contributions_the_syncer_never_read_are_a_warning_and_a_row():
    from diloco.summary import run_warnings, summary_rows
    counts = {"published": 10, "applied": 6, "late": 0, "rejected": 1, "pending": 0, "applied_twice": 0, "unread": 3}
    s = {"eval_loss_start": 5.5, "eval_loss_end": 2.0, "eval_loss_drop": 0.6, "contributions": counts, "tokens": 0,
         "versions": {}, "merges": {}, "bytes_across": 0, "bytes_sent": 0, "bytes_fetched": 0,
         "bytes_dp_equivalent": 0, "bytes_ratio": 0, "bytes_ratio_sent": 0, "rejections": {}}
    [warning] = run_warnings(s)
    assert warning.startswith("3 published contributions were never read") and "drain_timeout_s" in warning
    assert dict(summary_rows(s))["  never read by the syncer"] == "3"


def test_the_traffic_ledger_splits_bytes_by_learner_region_and_fragment():
    from diloco.progress import Progress
    from diloco.summary import traffic_ledger
    cfg = build_config({"regions": [{"name": "us", "learners": 2}, {"name": "eu", "learners": 1}]})
    prog = Progress()
    for lid, inc, down, parts in (("us-0", "a", 100, {"0": 60, "1": 40}), ("us-0", "b", 10, {"1": 10}),
                                  ("eu-0", "a", 50, {"0": 50})):
        prog.apply({"kind": "heartbeat", "eid": lid + inc, "learner": lid, "incarnation": inc, "step": 1,
                    "bytes_fetched": down, "fetched_by_fragment": parts})
    up = {("us-0", "us", 0): 300, ("eu-0", "eu", 1): 200, ("?", "us", 1): 7}
    t = traffic_ledger(cfg, up, prog)
    assert t["by_learner"] == {"?": {"up": 7, "down": 0}, "eu-0": {"up": 200, "down": 50},
                               "us-0": {"up": 300, "down": 110}}
    assert t["by_region"] == {"eu": {"up": 200, "down": 50}, "us": {"up": 307, "down": 110}}
    assert t["by_fragment"] == {"0": {"up": 300, "down": 110}, "1": {"up": 207, "down": 50}}
