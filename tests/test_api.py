"""The bring-your-own-model contract without services: plans from any pytree (names, dtypes, local
leaves), bad specs failing with the leaf or pattern named, and bf16 kept bit for bit."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import diloco
from diloco import quantize
from diloco.checkpoint import restore
from diloco.config import ConfigError, build_config
from diloco.infra.store import FragmentStore, StoreError
from diloco.plan import Plan, PlanError, check_tree, flatten, make_plan, unflatten
from diloco.run import provision_run
from diloco.shard_format import Corpus
from diloco.spec import initial_plan, load_spec
from diloco.syncer import merge

BF16 = ml_dtypes.bfloat16


def tree():
    return {"embed": np.ones((16, 4), BF16), "layers": [{"w": np.zeros((4, 4), np.float32), "b": np.zeros(4, np.float32)}],
            "rng": jax.random.key(0), "step": np.zeros((), np.int32), "stats": {"mean": np.zeros(4, np.float32)}}


def test_names_come_from_key_paths_and_only_float_leaves_are_synced():
    plan = make_plan(tree(), fragments=2, local=("stats.*",))
    assert sorted(t.name for t in plan.tensors) == ["embed", "layers.0.b", "layers.0.w"]
    assert plan.by_name["embed"].dtype == "bfloat16" and plan.by_name["layers.0.w"].dtype == "float32"
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["format"] == "diloco-plan/1"


def test_flax_nnx_state_names_drop_the_variable_value():
    from flax import nnx

    class M(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(3, 2, rngs=rngs)
            self.bn = nnx.BatchNorm(2, rngs=rngs)

    _, params, rest = nnx.split(M(nnx.Rngs(0)), nnx.Param, ...)
    plan = make_plan(params, fragments=1)
    assert sorted(t.name for t in plan.tensors) == ["bn.bias", "bn.scale", "l.bias", "l.kernel"]
    assert {n for n, _ in __import__("diloco.plan", fromlist=["named_leaves"]).named_leaves(rest)} == {"bn.mean", "bn.var"}


def test_unflatten_replaces_synced_leaves_and_keeps_the_rest():
    t = tree()
    plan = make_plan(t, fragments=1, local=("stats.*",))
    values = {n: np.full(s, 2.0, np.float32) for n, s in plan.shapes.items()}
    out = unflatten(t, plan, values)
    assert out["embed"].dtype == BF16 and float(out["embed"][0, 0]) == 2.0
    assert out["rng"] is t["rng"] and out["step"] is t["step"] and out["stats"]["mean"] is t["stats"]["mean"]
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(t)
    assert set(flatten(out, plan)) == set(plan.shapes)


@pytest.mark.parametrize("kwargs, words", [
    ({"sync": ("step",)}, "leaf 'step' is marked for sync but is a int32 array"),
    ({"sync": ("rng",)}, "leaf 'rng' is marked for sync but is a key<fry> array"),
    ({"mean_merge": ("tok_embed",)}, "mean-merge pattern 'tok_embed' (syncer.mean_merge_tensors) matches no synced tensor"),
    ({"local": ("nope*",)}, "local pattern 'nope*' matches no leaf"),
    ({"fragments": 9}, "9 fragments requested but the model has only 4 tensors"),
])
def test_bad_specs_fail_with_the_leaf_or_pattern_named(kwargs, words):
    with pytest.raises(PlanError) as err:
        make_plan(tree(), **{"fragments": 1, **kwargs})
    assert words in str(err.value)


def test_a_tree_that_differs_from_the_run_is_refused_naming_the_leaves():
    plan = make_plan(tree(), fragments=1)
    other = tree() | {"embed": np.ones((16, 4), np.float32)}
    del other["layers"]
    with pytest.raises(PlanError, match=r"missing \['layers.0.b', 'layers.0.w'\]; embed: the run has bfloat16\[16, 4\], "
                                        r"this tree float32\[16, 4\]"):
        check_tree(other, plan)


def test_unknown_mean_merge_pattern_of_the_builtin_model_is_a_config_error_at_provisioning():
    cfg = build_config({"syncer": {"mean_merge_tensors": ["embedding"]}})
    with pytest.raises(PlanError, match="'embedding'"):
        initial_plan(cfg, load_spec(cfg))
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        load_spec(build_config({"model": {"entry": "no_such_module:spec"}}))


def test_the_plan_labels_the_merge_each_tensor_will_really_get():
    """Issue 51: under syncer.merge mean (the default) every tensor is a plain mean, whatever the
    mean_merge patterns say, and plan.json said rda for most of them; under rda the patterns choose."""
    cfg = build_config({"syncer": {"mean_merge_tensors": ["*embed"]}})
    plan, _ = initial_plan(cfg, load_spec(cfg))
    assert cfg.syncer.merge == "mean" and {t.merge for t in plan.tensors} == {"mean"}
    paper = build_config({"preset": "paper", "syncer": {"mean_merge_tensors": ["ln*"]}})
    plan, _ = initial_plan(paper, load_spec(paper))
    assert {t.name for t in plan.tensors if t.merge == "mean"} == {"ln_f"}                 # the patterns, not the spec
    assert {t.merge for t in plan.tensors} == {"mean", "rda"}


def test_a_vocabulary_larger_than_the_models_fails_at_provisioning(tmp_path):
    corpus = Corpus(tmp_path, {"vocab_size": 70_000, "shards": [], "heldout": {}})
    with pytest.raises(ConfigError, match="vocabulary of 70,000 tokens, larger than the model's 256"):
        provision_run(build_config({}), "r", state=None, corpus=corpus)


def test_bf16_round_trips_bit_exactly_through_the_store_and_restore(tmp_path):
    rng = np.random.default_rng(0)
    t = {"embed": rng.normal(size=(16, 4)).astype(BF16), "w": rng.normal(size=(4, 4)).astype(np.float32),
         "step": np.zeros((), np.int32)}
    plan = make_plan(t, fragments=2)
    store = FragmentStore(f"file://{tmp_path}", "run-bf16")
    store.write_plan(plan)
    for p, names in enumerate(plan.fragment_names):
        store.write(p, 0, {n: t[n] for n in names}, {}, {})
    template = {"embed": jnp.zeros((16, 4), jnp.bfloat16), "w": jnp.zeros((4, 4)), "step": jnp.ones((), jnp.int32)}
    back = restore(f"file://{tmp_path}", "run-bf16", template)
    assert back["embed"].dtype == jnp.bfloat16 and isinstance(back["embed"], jax.Array)
    assert np.array_equal(np.asarray(back["embed"]).view(np.uint16), t["embed"].view(np.uint16))
    assert np.array_equal(np.asarray(back["w"]), t["w"]) and int(back["step"]) == 1  # local leaves kept


def test_a_store_of_another_layout_is_refused_by_name(tmp_path):
    """Provisioning records the store's layout version in plan.json; a reader of a run written with
    another layout, or before layouts were versioned (versions and no plan.json, or a plan.json without
    a layout), is refused naming both layouts instead of reading paths it may not understand."""
    from diloco.infra.store import LAYOUT, LayoutError

    t = {"w": np.ones((4, 4), np.float32)}
    store = FragmentStore(f"file://{tmp_path}", "run")
    store.write_plan(make_plan(t, fragments=1))
    store.write(0, 0, t, {}, {})
    raw = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert raw["layout"] == LAYOUT == "diloco-store/1" and store.read_plan() == make_plan(t, fragments=1)
    assert np.array_equal(restore(f"file://{tmp_path}", "run", {"w": jnp.zeros((4, 4))})["w"], t["w"])
    for layout, words in (("diloco-store/0", "store layout 'diloco-store/0' is not supported"),
                          (None, "no layout version (written before store layouts were versioned)")):
        (tmp_path / "run" / "plan.json").write_text(json.dumps(raw | {"layout": layout} if layout else
                                                               {k: v for k, v in raw.items() if k != "layout"}))
        with pytest.raises(LayoutError, match=re.escape(words) + ".*this build reads 'diloco-store/1'"):
            restore(f"file://{tmp_path}", "run", {"w": jnp.zeros((4, 4))})
        with pytest.raises(LayoutError):
            store.write_plan(make_plan(t, fragments=1))  # provisioning again does not paper over it
    (tmp_path / "run" / "plan.json").unlink()  # a run from before plans were stored: versions alone
    with pytest.raises(LayoutError, match="written before store layouts were versioned"):
        store.read_plan()
    with pytest.raises(StoreError, match="not provisioned"):
        FragmentStore(f"file://{tmp_path}", "nothing").read_plan()


def test_bf16_globals_stay_bf16_through_the_outer_step_and_the_broadcast_update():
    rng = np.random.default_rng(1)
    old = {"e": rng.normal(size=(8, 4)).astype(BF16)}
    opt = merge.outer_optimizer(0.7, 0.9, True)
    state = opt.init(merge.as_float32(old))
    new, _ = merge.outer_step(opt, old, state, {"e": rng.normal(size=(8, 4)).astype(np.float32) * 0.01})
    assert new["e"].dtype == BF16
    wire, published, residual = quantize.encode_update(old, new, {}, "int8")
    assert published["e"].dtype == BF16 and residual["e"].dtype == np.float32
    again = quantize.apply_update(old, wire, "int8")  # what a learner holding `old` computes
    assert np.array_equal(again["e"].view(np.uint16), published["e"].view(np.uint16))


def test_the_public_api_is_one_module_reachable_from_the_package():
    from diloco import api

    for name in api.__all__:
        assert getattr(diloco, name) is getattr(api, name)
    cfg = diloco.configure(None, model={"entry": "examples.flax_nnx_lm:spec"}, inner={"steps": 5})
    assert cfg.model.entry == "examples.flax_nnx_lm:spec" and cfg.inner.steps == 5


def test_every_config_key_the_api_page_names_exists():
    """docs/api.md names config keys as `section.key`; each must be a field of that section (it once
    documented `fragments.catch_up_versions`, which never existed)."""
    from pathlib import Path

    from diloco.config import Config

    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    named = set(re.findall(r"`([a-z_]+)\.([a-z_]+)`", text))
    sections = {name: field.annotation for name, field in Config.model_fields.items()}
    keys = [(section, key) for section, key in sorted(named) if section in sections]
    assert len(keys) >= 10, keys                                   # the page names config keys at all
    missing = [f"{section}.{key}" for section, key in keys if key not in sections[section].model_fields]
    assert missing == [], missing
