import pytest

from diloco.config import ConfigError, build_config, load_config


def test_defaults_and_the_demo_config_load(tmp_path):
    cfg = load_config("configs/local.yaml")
    assert cfg.num_learners == 4 and cfg.learner_ids() == ["us-0", "us-1", "eu-0", "eu-1"]
    assert (load_config(None).fragments.quantization, load_config(None).syncer.broadcast) == ("int4", "int4")


def test_overrides_are_typed_and_reach_lists():
    cfg = load_config("configs/local.yaml", ["inner.steps=50", "regions.1.speed=0.5", "fragments.quantization=bf16"])
    assert cfg.inner.steps == 50 and cfg.regions[1].speed == 0.5 and cfg.fragments.quantization == "bf16"


@pytest.mark.parametrize("override, key, words", [
    ("inner.stpes=3", "inner.stpes", "unknown key"),
    ("fragments.quantization=fp4", "fragments.quantization", "must be one of"),
    ("syncer.quorum=9", "syncer.quorum", "exceeds the number of learners"),
    ("inner.steps=-1", "inner.steps", "greater than or equal to 1"),
    ("store.url=s3://x", "store.url", "should match pattern"),
    ("transport.min_insync_replicas=2", "transport.min_insync_replicas (2)", "exceeds transport.replication_factor (1)"),
    ("transport.acks=2", "transport.acks", "must be one of"),
    ("model.options.n_heads=3", "n_heads", "divisible"),
    ("model.options.d_modle=64", "d_modle", "Extra inputs are not permitted"),
    ("model.entry=not-a-module", "model.entry", "should match pattern"),
])
def test_bad_values_name_the_key(override, key, words):
    with pytest.raises(ConfigError) as err:
        load_config("configs/local.yaml", [override])
    assert key in str(err.value) and words in str(err.value)


def test_malformed_overrides_and_files(tmp_path):
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["inner.steps"])
    with pytest.raises(ConfigError, match="not an index"):
        load_config(None, ["regions.7.speed=1"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("inner: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_duplicate_region_names_are_refused():
    with pytest.raises(ConfigError, match="unique"):
        build_config({"regions": [{"name": "a"}, {"name": "a"}]})


def test_the_step_budget_is_shared_by_speed_only_when_asked():
    regions = [{"name": "us", "learners": 2}, {"name": "eu", "learners": 2, "speed": 0.5}]
    even = build_config({"regions": regions, "inner": {"steps": 240}})
    assert [even.learner_steps(lid) for lid in even.learner_ids()] == [240, 240, 240, 240]
    shared = build_config({"regions": regions, "inner": {"steps": 240, "steps_by_speed": True}})
    steps = [shared.learner_steps(lid) for lid in shared.learner_ids()]
    assert steps == [320, 320, 160, 160] and sum(steps) == 4 * 240  # same tokens, same finishing time


def test_the_defaults_are_the_recommended_settings_and_presets_name_the_others():
    """Without a YAML a user gets what the demo and the bench measured best (docs/bench.md)."""
    from pathlib import Path
    demo = load_config(Path(__file__).resolve().parents[1] / "configs/local.yaml")
    cfg = build_config({})
    keys = {"outer": ("lr", "momentum"), "fragments": ("apply", "one_delta_per_version", "quantization"),
            "syncer": ("merge", "scale_partial_rounds", "quorum_of_fresh", "staleness_discount", "broadcast")}
    for section, names in keys.items():
        for name in names:
            assert getattr(getattr(cfg, section), name) == getattr(getattr(demo, section), name), f"{section}.{name}"
    paper = build_config({"preset": "paper"})
    assert (paper.syncer.merge, paper.outer.lr, paper.outer.momentum, paper.fragments.apply) == ("rda", 0.7, 0.9, "overwrite")
    # what a config says wins over its preset, and --set preset=... picks one too
    assert build_config({"preset": "paper", "outer": {"lr": 0.5}}).outer.lr == 0.5
    assert build_config({}, ["preset=paper"]).syncer.merge == "rda"
    with pytest.raises(ConfigError, match="preset: must be one of decoupled, paper"):
        build_config({"preset": "fast"})


def test_configure_merges_sections_key_by_key(tmp_path):
    """diloco.configure(yaml, syncer={...}) keeps the YAML's other syncer keys."""
    import diloco
    path = tmp_path / "c.yaml"
    path.write_text("syncer: {quorum: 3, merge: rda, grace_max_s: 1.5}\nregions: [{name: us, learners: 4}]\n")
    cfg = diloco.configure(path, syncer={"quorum": 2})
    assert (cfg.syncer.quorum, cfg.syncer.merge, cfg.syncer.grace_max_s) == (2, "rda", 1.5)
    assert cfg.num_learners == 4



def test_a_learner_belongs_to_its_own_region_when_one_regions_name_starts_anothers():
    """region_of matched by prefix: with regions us and us-east, us-east-0 was us's (its topic, runner, cluster)."""
    cfg = build_config({"regions": [{"name": "us", "learners": 2}, {"name": "us-east", "learners": 1, "max_learners": 2}]})
    assert cfg.region_of("us-east-0").name == "us-east" and cfg.region_of("us-1").name == "us"
    assert [cfg.shard_index(lid) for lid in cfg.member_ids()] == list(range(cfg.num_shards))
    assert cfg.is_member_id("us-east-1") and not cfg.is_member_id("us-2") and not cfg.is_member_id(["us-0"])
    with pytest.raises(ConfigError, match="unknown learner 'us-east-2'"):
        cfg.region_of("us-east-2")


def test_updates_come_from_the_snapshot_unless_the_broadcast_code_is_below_4_bits():
    assert build_config({}).syncer.updates_from == "snapshot"
    assert build_config({"syncer": {"broadcast": "int4"}}).syncer.updates_from == "snapshot"
    for code in ("int2", "topk"):   # a code that coarse of everything since the snapshot would stay that coarse
        assert build_config({"syncer": {"broadcast": code}}).syncer.updates_from == "previous"
    assert build_config({"syncer": {"broadcast": "topk", "update_base": "snapshot"}}).syncer.updates_from == "snapshot"
