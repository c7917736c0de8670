"""The store as the one owner of its layout, without services: readers ask it which versions there
are and what a version is made of, and never work out its paths themselves."""

from __future__ import annotations

import numpy as np
import pytest

from diloco import quantize
from diloco.infra.store import Chain, FragmentStore, StoreError, Versions, run_ids
from diloco.plan import make_plan


def _store(tmp_path, run: str = "r") -> tuple[FragmentStore, dict[int, dict[str, np.ndarray]]]:
    """Fragment 0 at v0..v4, updates from the newest snapshot: v0 and v3 are snapshots (v3's own update
    from v0), v1, v2 from v0 and v4 from v3; v5 an orphan above the commit marker at v3 (v4 counts as
    committed: v5 is stored). Returns the store and each version's parameters as learners hold them."""
    rng = np.random.default_rng(0)
    value = {"w": rng.normal(size=(4, 6)).astype(np.float32)}
    store = FragmentStore(f"file://{tmp_path}", run)
    store.write_plan(make_plan(value, fragments=1))
    store.write(0, 0, value, {}, {})
    held, snapshot = {0: value}, 0
    for v in range(1, 6):
        target = {"w": held[v - 1]["w"] + 0.01 * v}
        wire, held[v], _ = quantize.encode_update(held[snapshot], target, {}, "int8")
        is_snap = v == 3
        store.write(0, v, held[v] if is_snap else {}, {}, {}, update=wire, update_scheme="int8",
                    snapshot_at=None if is_snap else snapshot, update_from=snapshot)
        snapshot = v if is_snap else snapshot
    store.mark_committed(0, 3)
    return store, held


def test_the_store_says_which_versions_there_are(tmp_path):
    store, _ = _store(tmp_path)
    (tmp_path / "r" / "fragments" / "000" / "v00000009" / "e000000").mkdir(parents=True)  # a write that crashed
    (tmp_path / "r" / "fragments" / "000" / "v00000009" / "e000000" / "x").write_bytes(b"")
    assert store.versions(0) == [0, 1, 2, 3, 4, 5] and store.committed(0) == 4
    assert store.committed_versions(0) == [0, 1, 2, 3, 4]                  # never the orphan v5
    assert store.catalog() == {0: Versions([0, 1, 2, 3, 4, 5], [9], 4)}
    assert store.versions(1) == [] and store.committed_versions(1) == []
    FragmentStore(f"file://{tmp_path}", "other").write_plan(make_plan({"x": np.ones(2, np.float32)}, fragments=1))
    assert run_ids(f"file://{tmp_path}") == ["other", "r"]


def test_the_store_says_what_a_version_is_made_of(tmp_path):
    store, held = _store(tmp_path)
    assert store.chain(0, 0) == Chain(0, []) and store.chain(0, 3) == Chain(3, [])
    c = store.chain(0, 2)
    assert (c.snapshot, [link.version for link in c.links]) == (0, [2])
    assert [link.version for link in store.chain(0, 4).links] == [4] and store.chain(0, 4).snapshot == 3
    # the path from what a reader holds: through the snapshots' own updates, stopping before a held version
    assert [(link.version, link.base, link.snapshot) for link in store.path(0, 4)] == \
        [(4, 3, False), (3, 0, True), (0, None, True)]
    assert [link.version for link in store.path(0, 4, held={0})] == [4, 3]
    assert [link.version for link in store.path(0, 4, held={3})] == [4]
    assert [link.version for link in store.path(0, 4, limit=1)] == [4] and store.path(0, 4, held={4}) == []
    meta = store.read_meta(0, 4)
    assert store.path(0, 4)[0].update_nbytes == sum(meta["update"]["stored"].values()) > 0
    for v in range(6):
        np.testing.assert_array_equal(store.read_params(0, v)[0]["w"], held[v]["w"])
    scheme, update, nbytes = store.read_update(0, 4)
    assert scheme == "int8" and set(update) == {"w"} and nbytes == store.path(0, 4)[0].update_nbytes


def test_an_update_that_does_not_come_from_an_earlier_version_is_refused(tmp_path):
    store, _ = _store(tmp_path)
    key = tmp_path / "r" / "fragments" / "000" / "v00000004" / "meta.json"
    key.write_text(key.read_text().replace('"from": 3', '"from": 4'))
    for walk in (lambda: store.chain(0, 4), lambda: store.path(0, 4), lambda: store.read_params(0, 4)):
        with pytest.raises(StoreError, match="fragment 0 v4 is an update from v4"):
            walk()


def test_the_store_says_how_many_bytes_a_version_occupies(tmp_path):
    """What the benchmarks report as store bytes, on any store (they once summed a file:// folder's files)."""
    store, _ = _store(tmp_path)
    for v in (1, 3):
        folder = tmp_path / "r" / "fragments" / "000" / f"v{v:08d}"
        assert store.stored_nbytes(0, v) == sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert store.path(0, 1)[0].update_nbytes < store.stored_nbytes(0, 1) < store.stored_nbytes(0, 3)  # a snapshot holds more
