"""Operator tools against a tiny real run: `diloco topics` and `diloco ckpt ls|show|diff|export`."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import TINY
from rich.console import Console
from safetensors import safe_open
from safetensors.numpy import load_file
from typer.testing import CliRunner

from diloco import messages
from diloco.checkpoint import read_global
from diloco.cli import app
from diloco.config import build_config
from diloco.infra import kafka as kafka_io
from diloco.infra.store import LAYOUT, FragmentStore
from diloco.ops import OpsError
from diloco.ops.ckpt import nest, open_checkpoint, pick_versions, split_url
from diloco.plan import Plan, Tensor, make_plan
from diloco.run import train
from diloco.syncer import state as state_mod

pytestmark = pytest.mark.integration
cli = CliRunner()


@pytest.fixture(scope="module")
def done(tmp_path_factory, kafka_bootstrap, redis_url, data_dir):
    """One finished tiny run: (config with run.id, run id, the run's config.yaml, checkpoint URL)."""
    tmp = tmp_path_factory.mktemp("ops")
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY.items()}
    tree["inner"]["steps"] = 40
    tree["data"]["dir"] = str(data_dir)
    tree["run"]["dir"] = str(tmp / "runs")
    # every version a snapshot (its outer state and residual stored), so that ckpt show and diff have all to show
    tree |= {"transport": {"bootstrap_servers": kafka_bootstrap}, "state": {"redis_url": redis_url},
             "store": {"url": f"file://{tmp}/store", "snapshot_every": 1}}
    cfg = build_config(tree)
    run_id = train(cfg, progress=False, console=Console(quiet=True))["run_id"]
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": run_id})})
    return cfg, run_id, tmp / "runs" / run_id / "config.yaml", f"file://{tmp}/store/{run_id}"


def invoke_json(*args):
    res = cli.invoke(app, [*map(str, args), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def fails_clearly(args, *needles):
    res = cli.invoke(app, list(map(str, args)))
    assert res.exit_code == 1, res.output
    assert "error:" in res.output and "Traceback" not in res.output
    for n in needles:
        assert n in res.output, res.output
    return res.output


def test_topics_agree_with_the_broker_and_the_syncer_offsets(done):
    cfg, run_id, conf, _ = done
    rep = invoke_json("topics", "--config", conf, "--interval", "0.3")
    assert rep["run"] == run_id and rep["caught_up"]
    topics = kafka_io.Topics.for_run(cfg, run_id)
    offsets = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id) \
        .committed(topics.events)
    by_name = {t["topic"]: t for t in rep["topics"]}
    assert set(by_name) == set(topics.all())
    for topic, n in topics.all().items():
        row = by_name[topic]
        assert row["partitions"] == n and row["messages_per_s"] == 0  # the run is over
        for p, part in enumerate(row["by_partition"]):
            recs = kafka_io.read_to_end(cfg.transport, [kafka_io.partitions_of(topic, n)[p]])
            assert part["messages"] == len(recs) == part["high_watermark"]
            assert part["bytes"] == sum(len(r.value) + len(r.key or b"") for r in recs)
            assert part["committed"] == offsets.get((topic, p))
            if part["committed"] is not None:
                assert part["lag"] == part["high_watermark"] - part["committed"]
            if recs:
                assert part["newest_age_s"] > 0
    for region, topic in topics.fragments.items():
        row = by_name[topic]
        assert row["region"] == region and row["lag"] == 0 and row["malformed"] == 0  # the syncer drained it
        recs = kafka_io.read_to_end(cfg.transport, kafka_io.partitions_of(topic, topics.partitions))
        headers = [messages.parse_frame(r.value)[0] for r in recs]
        manifests = Counter(h["learner"] for h in headers if h["kind"] == "manifest")
        assert {lid: s["contributions"] for lid, s in row["learners"].items()} == manifests
        assert set(manifests) == {lid for lid in cfg.learner_ids() if lid.startswith(region + "-")}
        assert sum(s["frames"] for s in row["learners"].values()) == len(recs)
        assert sum(s["payload_bytes"] for s in row["learners"].values()) == \
            sum(h["total_bytes"] for h in headers if h["kind"] == "manifest")
    versions = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id).versions()
    assert rep["announced"] == {str(p): v for p, v in versions.items()}
    fails_clearly(["topics", "--config", conf, "--run", "no-such-run"], "no topics of run 'no-such-run'", run_id)


def test_ckpt_ls_lists_exactly_the_versions_redis_reports(done):
    cfg, run_id, conf, url = done
    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
    rep = invoke_json("ckpt", "ls", url)
    assert rep == invoke_json("ckpt", "ls", "--config", conf)  # the same through the run's config
    versions = state.versions()
    assert {f["fragment"]: [v["version"] for v in f["versions"]] for f in rep["fragments"]} == \
        {p: list(range(v + 1)) for p, v in versions.items()}
    merges = {(m["fragment"], m["version"]): m for m in state.merges()}
    for f in rep["fragments"]:
        assert f["latest"] == versions[f["fragment"]] and f["incomplete"] == []
        for v in f["versions"][1:]:
            m = merges[f["fragment"], v["version"]]
            assert v["tokens"] == m["tokens"] > 0 and v["contributors"] == m["learners"]


def test_ckpt_show_statistics_match_numpy(done):
    url = done[3]
    store = FragmentStore(*split_url(url))
    rep = invoke_json("ckpt", "show", url, "--fragment", 1, "--version", 1)
    [f] = rep["fragments"]
    fv = store.read(1, 1)
    assert (f["fragment"], f["version"]) == (1, 1) and set(f["opt"]) == set(fv.opt) and fv.opt
    for group in ("params", "opt"):
        for name, a in getattr(fv, group).items():
            s = f[group][name]
            assert s["shape"] == list(a.shape) and s["dtype"] == "float32" and s["nonfinite"] == 0
            assert s["norm"] == pytest.approx(np.linalg.norm(a.astype(np.float64)), rel=1e-9)
            assert (s["min"], s["max"]) == (float(a.min()), float(a.max()))
            assert s["mean"] == pytest.approx(a.astype(np.float64).mean(), rel=1e-9, abs=1e-12)
    latest = invoke_json("ckpt", "show", url)
    assert {f["fragment"]: f["version"] for f in latest["fragments"]} == \
        {p: store.versions(p)[-1] for p in range(4)}


def test_ckpt_diff_of_a_version_with_itself_is_zero_and_of_two_is_their_difference(done):
    url = done[3]
    same = invoke_json("ckpt", "diff", url, 1, 1)
    assert len(same["fragments"]) == 4
    for f in same["fragments"]:
        assert f["params_change_norm"] == 0 and f["params_relative"] == 0
        assert all(t["change_norm"] == 0 == t["max_abs"] for t in f["tensors"].values())
    [f] = invoke_json("ckpt", "diff", url, 0, 1, "--fragment", 0)["fragments"]
    store = FragmentStore(*split_url(url))
    a, b = store.read(0, 0).params, store.read(0, 1).params
    for name in a:
        d = b[name].astype(np.float64) - a[name]
        t = f["tensors"][f"params/{name}"]
        assert t["change_norm"] == pytest.approx(np.linalg.norm(d), rel=1e-9) and t["change_norm"] > 0
        assert t["relative"] == pytest.approx(np.linalg.norm(d) / np.linalg.norm(a[name].astype(np.float64)))


def test_ckpt_export_round_trips(done, tmp_path):
    _, run_id, _, url = done
    store = FragmentStore(*split_url(url))
    latest = {p: store.versions(p)[-1] for p in range(4)}
    rep = invoke_json("ckpt", "export", url, "--output", tmp_path / "model.safetensors")
    assert rep["versions"] == {str(p): v for p, v in latest.items()}
    loaded = load_file(tmp_path / "model.safetensors")
    with safe_open(tmp_path / "model.safetensors", "np") as fh:
        meta = fh.metadata()
    assert meta["run"] == run_id and json.loads(meta["versions"]) == {str(p): v for p, v in latest.items()}
    expected = {n: a for p, v in latest.items() for n, a in store.read(p, v, with_opt=False).params.items()}
    assert set(loaded) == set(expected) and rep["tensors"] == len(expected)
    for n, a in expected.items():
        np.testing.assert_array_equal(loaded[n], a)
    # an older cut as .npz: each fragment at its newest version <= 1
    invoke_json("ckpt", "export", url, "--version", 1, "--output", tmp_path / "v1.npz")
    with np.load(tmp_path / "v1.npz") as z:
        meta = json.loads(str(z["__diloco_metadata__"]))
        assert json.loads(meta["versions"]) == {str(p): 1 for p in range(4)}
        for n in expected:
            p = next(p for p in range(4) if n in store.read_meta(p, 1)["params"])
            np.testing.assert_array_equal(z[n], store.read(p, 1, with_opt=False).params[n])


def orbax_restored(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays by dotted name, custom metadata) of an Orbax checkpoint, read back with Orbax alone."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    tree, meta = ckptr.restore(path), ckptr.metadata(path).custom_metadata
    ckptr.close()
    flat = {".".join(str(k.key) for k in kp): np.asarray(a) for kp, a in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return flat, meta


def assert_bit_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for n, a in want.items():
        assert got[n].dtype == a.dtype and got[n].shape == a.shape, n
        assert got[n].tobytes() == np.ascontiguousarray(a).tobytes(), n


def test_ckpt_export_orbax_restores_what_tensorstore_holds(done, tmp_path):
    _, run_id, _, url = done
    store = FragmentStore(*split_url(url))
    plan = store.read_plan()
    latest = {p: store.versions(p)[-1] for p in range(plan.fragments)}
    rep = invoke_json("ckpt", "export", url, "--format", "orbax", "-o", tmp_path / "model")
    assert (rep["format"], rep["layout"], rep["tensors"]) == ("orbax", "nested", len(plan.tensors))
    assert rep["versions"] == {str(p): v for p, v in latest.items()} and rep["parameters"] == plan.num_params
    arrays, meta = orbax_restored(tmp_path / "model")
    assert_bit_equal(arrays, read_global(store, plan, latest))
    assert meta == {"format": "diloco", "run": run_id, "source": url, "requested_version": "latest",
                    "versions": {str(p): v for p, v in latest.items()}, "layout": "nested"}
    # an older cut; an existing folder is refused, not replaced
    invoke_json("ckpt", "export", url, "--version", 1, "-f", "orbax", "-o", tmp_path / "v1")
    arrays, meta = orbax_restored(tmp_path / "v1")
    assert meta["versions"] == {str(p): 1 for p in range(plan.fragments)}
    assert_bit_equal(arrays, read_global(store, plan, {p: 1 for p in range(plan.fragments)}))
    fails_clearly(["ckpt", "export", url, "-f", "orbax", "-o", tmp_path / "v1"], "already exists")
    res = cli.invoke(app, ["ckpt", "export", url, "-f", "zip", "-o", tmp_path / "m.zip"])
    assert res.exit_code == 2 and "--format must be one of safetensors, npz, orbax" in res.output


def test_orbax_tree_nests_at_dots_unless_a_name_is_leaf_and_branch():
    a, b = np.zeros(2, np.float32), np.ones(3, np.float32)
    assert nest({"layer0.qkv": a, "layer0.fc.w": b, "emb": a}) == \
        ({"layer0": {"qkv": a, "fc": {"w": b}}, "emb": a}, "nested")
    for flat in ({"a": a, "a.b": b}, {"a.b": b, "a": a}, {"a.b.c": a, "a.b": b}, {"a..b": a}):
        assert nest(flat) == (flat, "flat")


def bf16_store(root: Path, run: str = "bf16run") -> tuple[FragmentStore, dict[str, np.ndarray]]:
    params = {"w": (np.arange(12, dtype=np.float32).reshape(3, 4) / 7 - 0.5).astype(ml_dtypes.bfloat16),
              "b": np.linspace(-1, 1, 5, dtype=np.float32)}
    store = FragmentStore(f"file://{root}", run)
    store.write_plan(make_plan(params, fragments=1))
    store.write(0, 0, params, {}, {})
    return store, params


def safetensors_header(path: Path) -> dict:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def test_ckpt_export_keeps_bf16(tmp_path):
    store, params = bf16_store(tmp_path / "store")
    url = store.url
    assert store.read(0, 0).params["w"].dtype == ml_dtypes.bfloat16  # TensorStore holds bf16
    invoke_json("ckpt", "export", url, "-o", tmp_path / "model.safetensors")
    header, data = safetensors_header(tmp_path / "model.safetensors")
    assert header["w"]["dtype"] == "BF16" and header["w"]["shape"] == [3, 4]
    assert header["b"]["dtype"] == "F32" and header["__metadata__"]["run"] == "bf16run"
    for n, a in params.items():
        start, end = header[n]["data_offsets"]
        assert data[start:end] == a.tobytes()  # the exact bits, little-endian
    from safetensors.flax import load_file as load_flax

    loaded = load_flax(tmp_path / "model.safetensors")
    assert_bit_equal({n: np.asarray(a) for n, a in loaded.items()}, params)
    invoke_json("ckpt", "export", url, "-f", "orbax", "-o", tmp_path / "orbax")
    assert_bit_equal(orbax_restored(tmp_path / "orbax")[0], params)


def test_ckpt_ls_of_a_store_root_lists_its_runs(done):
    _, run_id, _, url = done
    root, _ = split_url(url)
    store = FragmentStore(root, run_id)
    plan = store.read_plan()
    rep = invoke_json("ckpt", "ls", root)
    assert rep == invoke_json("ckpt", "ls", root + "/")
    assert rep == {"url": root, "runs": [{
        "run": run_id, "fragments": plan.fragments, "tensors": len(plan.tensors), "parameters": plan.num_params,
        "dtypes": ["float32"], "latest": {str(p): store.versions(p)[-1] for p in range(plan.fragments)},
        "note": None}]}
    assert invoke_json("ckpt", "ls", url)["run"] == run_id  # a run folder still lists its versions
    res = cli.invoke(app, ["ckpt", "ls", root])  # the table renders
    assert res.exit_code == 0 and "Traceback" not in res.output


def test_ckpt_ls_root_refuses_runs_of_another_store_layout_by_name(tmp_path):
    """The store layout is versioned in plan.json (infra.store.LAYOUT): a run written before layouts
    were versioned (no plan.json) or with another layout is listed as not read, and opening it fails
    naming the layout, never guessing at its paths."""
    bf16_store(tmp_path / "store", "b-planned")
    legacy = FragmentStore(f"file://{tmp_path}/store", "a-legacy")  # written before runs stored plan.json
    for v in (0, 1):
        legacy.write(0, v, {"e": np.ones(3, np.float32)}, {}, {})
    legacy.write(1, 0, {"f": np.ones(2, np.float32)}, {}, {})
    FragmentStore(f"file://{tmp_path}/store", "c-new").write_plan(make_plan({"x": np.ones(4, np.float32)}, fragments=1))
    other = tmp_path / "store" / "d-other" / "plan.json"
    other.parent.mkdir()
    plan = json.loads((tmp_path / "store" / "c-new" / "plan.json").read_text())
    assert plan["layout"] == LAYOUT == "diloco-store/1"
    other.write_text(json.dumps(plan | {"layout": "diloco-store/0"}))
    rep = invoke_json("ckpt", "ls", tmp_path / "store")  # a plain path is a file:// URL
    assert rep["url"] == f"file://{tmp_path}/store"
    a, b, c, d = rep["runs"]
    assert (a["run"], a["fragments"], a["tensors"], a["parameters"], a["dtypes"], a["latest"]) == \
        ("a-legacy", None, None, None, [], {}) and "written before store layouts were versioned" in a["note"]
    assert (b["run"], b["fragments"], b["tensors"], b["parameters"], b["dtypes"], b["latest"], b["note"]) == \
        ("b-planned", 1, 2, 17, ["bfloat16", "float32"], {"0": 0}, None)
    assert (c["run"], c["latest"], c["note"]) == ("c-new", {"0": None}, "provisioned; no version written yet")
    assert (d["run"], d["latest"]) == ("d-other", {}) and "'diloco-store/0' is not supported" in d["note"]
    fails_clearly(["ckpt", "ls", f"file://{tmp_path}/store/a-legacy"], "written before store layouts were versioned",
                  "diloco-store/1")
    fails_clearly(["ckpt", "ls", f"file://{tmp_path}/store/d-other"], "'diloco-store/0' is not supported")
    fails_clearly(["ckpt", "ls", f"file://{tmp_path}/nothing"], "no checkpoint here", "no runs")


def test_ckpt_on_gcs_through_the_emulator(gcs_emulator):
    store = FragmentStore(f"{gcs_emulator}/ops", "gsrun")
    store.write_plan(Plan((Tensor("b", (4,), "float32", 0, "rda"), Tensor("w", (8, 4), "float32", 0, "rda"),
                           Tensor("e", (6,), "float32", 1, "rda")), 2))
    rng = np.random.default_rng(0)
    arrays = {v: {"w": rng.normal(size=(8, 4)).astype(np.float32), "b": np.ones(4, np.float32) * v} for v in (0, 1)}
    for v, params in arrays.items():
        store.write(0, v, params, {"0.trace.w": params["w"] * 0.1}, {"tokens": 100 * v, "learners": ["us-0"] * v})
    store.write(1, 0, {"e": np.arange(6, dtype=np.float32)}, {}, {"tokens": 0, "contributors": []})
    url = f"{gcs_emulator}/ops/gsrun"
    rep = invoke_json("ckpt", "ls", url)
    assert [(f["fragment"], [v["version"] for v in f["versions"]]) for f in rep["fragments"]] == [(0, [0, 1]), (1, [0])]
    assert rep["fragments"][0]["versions"][1]["tokens"] == 100
    [f] = invoke_json("ckpt", "show", url, "-p", 0, "--version", 1)["fragments"]
    assert f["params"]["w"]["norm"] == pytest.approx(np.linalg.norm(arrays[1]["w"].astype(np.float64)))
    assert f["params"]["b"]["mean"] == 1.0 and f["opt"]["0.trace.w"]["max"] == pytest.approx(arrays[1]["w"].max() * 0.1)
    fails_clearly(["ckpt", "show", url, "-p", 1, "--version", 1], "fragment 1 has no version 1", "v0")
    [row] = invoke_json("ckpt", "ls", f"{gcs_emulator}/ops")["runs"]  # the store root, listed on gs:// too
    assert (row["run"], row["fragments"], row["latest"], row["note"]) == ("gsrun", 2, {"0": 1, "1": 0}, None)


def test_bad_url_missing_version_and_corrupted_chunk_fail_clearly(done, tmp_path):
    _, run_id, _, url = done
    fails_clearly(["ckpt", "ls", "http://example.com/x"], "not a checkpoint URL")
    fails_clearly(["ckpt", "ls", f"file://{tmp_path}/store/{run_id}"], "no checkpoint here")
    fails_clearly(["ckpt", "show", url, "--fragment", 0, "--version", 9999], "fragment 0 has no version 9999")
    fails_clearly(["ckpt", "export", url, "--version", 9999, "-o", tmp_path / "x.safetensors"], "no fragment has version 9999")
    fails_clearly(["ckpt", "show", url, "--fragment", 7], "no fragment 7")
    src = Path(split_url(url)[0].removeprefix("file://"))
    shutil.copytree(src / run_id, tmp_path / "store" / run_id)
    broken = f"file://{tmp_path}/store/{run_id}"
    chunk = next((tmp_path / "store" / run_id / "fragments/000/v00000001").glob("e*/params/*/c/*/*"))
    chunk.write_bytes(b"not a chunk")
    fails_clearly(["ckpt", "show", broken, "-p", 0, "--version", 1], "fragment 0 v1 unreadable")
    chunk.unlink()  # the store opens arrays with fill_missing_data_reads off: an error naming it, never zeros
    fails_clearly(["ckpt", "export", broken, "--version", 1, "-o", tmp_path / "x.npz"], "fragment 0 v1 unreadable",
                  f'fragments/000/v00000001/{chunk.parents[4].name}/params/{chunk.parents[2].name}/c/0/0" is missing')
    assert not (tmp_path / "x.npz").exists()


def test_url_parsing():
    assert split_url("file:///data/store/run-1/") == ("file:///data/store", "run-1")
    assert split_url("file://.diloco/store/run-1") == ("file://.diloco/store", "run-1")
    assert split_url("gs://bucket/a/b/run-1") == ("gs://bucket/a/b", "run-1")
    for bad in ("gs://bucket", "gs://bucket/", "s3://b/run"):
        with pytest.raises(OpsError):
            split_url(bad)


def test_version_choice_across_fragments(done):
    ck = open_checkpoint(done[3])
    newest = {p: vs[-1] for p, vs in ck.versions.items()}
    assert pick_versions(ck, None) == newest
    low = min(newest.values())
    assert pick_versions(ck, low) == {p: low for p in newest}
    assert pick_versions(ck, max(newest.values())) == newest
    with pytest.raises(OpsError, match="no fragment has version"):
        pick_versions(ck, max(newest.values()) + 1)


def test_ckpt_reads_a_version_between_snapshots_by_replaying_updates(tmp_path):
    """A version that is not a snapshot stores only its update: show, diff and export give its
    parameters as the snapshot plus the updates since (what learners hold), and say so."""
    from diloco import quantize

    store, v0 = bf16_store(tmp_path / "store", run="snaprun")
    rng = np.random.default_rng(0)
    held, residual = v0, {}
    for v in (1, 2):
        new = {n: (a.astype(np.float32) + 0.01 * rng.normal(size=a.shape)).astype(a.dtype) for n, a in held.items()}
        update, held, residual = quantize.encode_update(held, new, residual, "int8")
        store.write(0, v, held, {}, {"tokens": 10 * v}, update=update, update_scheme="int8", snapshot_at=0)
    assert store.read_meta(0, 2)["snapshot"] is False and store.read_meta(0, 2)["params"] == []
    [f] = invoke_json("ckpt", "show", store.url, "--fragment", 0, "--version", 2)["fragments"]
    assert f["snapshot"] is False and f["snapshot_at"] == 0 and f["opt"] == {}
    assert f["params"]["w"]["norm"] == pytest.approx(np.linalg.norm(held["w"].astype(np.float64)), rel=1e-9)
    [d] = invoke_json("ckpt", "diff", store.url, 0, 2)["fragments"]
    assert set(d["tensors"]) == {"params/w", "params/b"} and d["params_change_norm"] > 0
    invoke_json("ckpt", "export", store.url, "-o", tmp_path / "v2.npz")
    with np.load(tmp_path / "v2.npz") as z:
        np.testing.assert_array_equal(z["b"], held["b"])


def test_a_lost_snapshot_chunk_is_an_error_wherever_it_is_read_never_zeros(tmp_path):
    """A version between snapshots is its snapshot plus updates: with a chunk of the snapshot gone,
    every later version read as built on zeros. Now each reader fails, naming the chunk."""
    import shutil

    from diloco import quantize
    from diloco.infra.store import StoreError

    store, v0 = bf16_store(tmp_path / "store", run="lostrun")
    update, held, _ = quantize.encode_update(v0, {n: (a.astype(np.float32) + 0.01).astype(a.dtype) for n, a in v0.items()},
                                             {}, "int8")
    store.write(0, 1, held, {}, {"tokens": 10}, update=update, update_scheme="int8", snapshot_at=0)
    np.testing.assert_array_equal(store.read_params(0, 1)[0]["w"], held["w"])
    [chunks] = (tmp_path / "store" / "lostrun" / "fragments" / "000" / "v00000000").glob("*/params/w/c")
    assert chunks.is_dir()
    shutil.rmtree(chunks)                                     # the snapshot's chunk of w, lost
    for read in (lambda: store.read(0, 0), lambda: store.read_params(0, 1)):
        with pytest.raises(StoreError, match="missing"):
            read()
    fails_clearly(["ckpt", "show", store.url, "--fragment", 0, "--version", 1], "missing")


def test_a_packed_update_is_stored_smaller_read_bit_for_bit_and_refused_when_damaged(tmp_path):
    """syncer.broadcast_packing=zstd stores each tensor's update codes as one zstd frame: the meta
    names the packing and the stored bytes, a reader gets the very codes back (and counts what it
    read), and a damaged frame is an error naming the tensor, never other values."""
    from diloco import quantize
    from diloco.infra.store import StoreError, stored_update_bytes

    rng = np.random.default_rng(1)
    v0 = {"w": rng.normal(size=(64, 96)).astype(np.float32), "b": np.zeros(3, np.float32)}
    store = FragmentStore(f"file://{tmp_path}/store", "packrun")
    store.write_plan(make_plan(v0, fragments=1))
    store.write(0, 0, v0, {}, {})
    new = {n: a + 0.01 * rng.laplace(size=a.shape).astype(np.float32) for n, a in v0.items()}
    update, held, _ = quantize.encode_update(v0, new, {}, "int4")
    store.write(0, 1, held, {}, {"tokens": 10}, update=update, update_scheme="int4", update_packing="zstd",
                snapshot_at=0)
    info = store.read_meta(0, 1)["update"]
    # w's codes pack; b's 14 bytes would grow in a frame, so they are stored as they are
    assert info["packing"] == {"w": "zstd", "b": "none"} and info["stored"]["b"] == len(update["b"])
    scheme, codes, read = store.read_update(0, 1)
    assert scheme == "int4" and codes == update
    assert read == sum(info["stored"].values()) == stored_update_bytes(store.read_meta(0, 1))
    assert read < sum(len(b) for b in update.values())
    params, nbytes = store.read_params(0, 1)
    assert all(np.array_equal(params[n], held[n]) for n in held) and nbytes == sum(a.nbytes for a in v0.values()) + read
    [blob] = (tmp_path / "store" / "packrun" / "fragments" / "000" / "v00000001").glob("*/update/w")
    blob.write_bytes(blob.read_bytes()[:-3])                  # a frame cut short
    with pytest.raises(StoreError, match="update/w: zstd frame does not decode"):
        store.read_update(0, 1)


def test_ckpt_show_in_a_pipe_prints_whole_values(tmp_path):
    """In a pipe (no terminal) rich cut every column to fit 80 characters ("128x5…", "floa…")."""
    params = {"encoder.layers.0.attention.query_key_value.kernel_with_a_long_name": np.ones((128, 512), np.float32),
              "b": np.zeros(5, np.float32)}
    store = FragmentStore(f"file://{tmp_path}/store", "piperun")
    store.write_plan(make_plan(params, fragments=1))
    store.write(0, 0, params, {}, {})
    res = cli.invoke(app, ["ckpt", "show", store.url, "--fragment", "0", "--version", "0"])
    assert res.exit_code == 0, res.output
    assert "encoder.layers.0.attention.query_key_value.kernel_with_a_long_name" in res.output
    assert "128x512" in res.output and "float32" in res.output and "…" not in res.output
