"""Methods and scenarios as config overrides on one shared base, so every run differs only in
what the method or scenario names."""

from __future__ import annotations

from diloco.config import Config, build_config

# Sizes: quick (~1 min per run on 2 shared CPU cores) and full (closer to the demo).
SIZES = {
    "quick": {
        "model": {"options": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64}},
        "inner": {"steps": 240, "batch_size": 8, "lr": 3e-3, "warmup_steps": 20},
        "fragments": {"count": 4, "sync_every": 20, "quantization": "int8"},
        "run": {"heartbeat_s": 0.5, "eval_batches": 8, "eval_batch_size": 16, "timeout_s": 900},
    },
    # the quick model over 5x the steps: 60 outer steps per fragment instead of 12, so that what the
    # outer optimizer does over many rounds (momentum, staleness) shows; ~4 min per DiLoCo run here
    "long": {
        "model": {"options": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64}},
        "inner": {"steps": 1200, "batch_size": 8, "lr": 3e-3, "warmup_steps": 20},
        "fragments": {"count": 4, "sync_every": 20, "quantization": "int8"},
        "run": {"heartbeat_s": 0.5, "eval_batches": 8, "eval_batch_size": 16, "timeout_s": 2400},
    },
    "full": {
        "model": {"options": {"d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 128}},
        "inner": {"steps": 600, "batch_size": 8, "lr": 3e-3, "warmup_steps": 50},
        "fragments": {"count": 4, "sync_every": 40, "quantization": "int8"},
        "run": {"heartbeat_s": 1.0, "eval_batches": 16, "eval_batch_size": 16, "timeout_s": 1800},
    },
}
REGIONS = [{"name": "us", "learners": 2}, {"name": "eu", "learners": 2}]  # M = 4
# Both DiLoCo methods rebase learners on new global fragments, scale partial rounds by n/M and take
# an outer step without momentum (lr 1): at these short horizons
# (~12 outer steps per fragment) that beat DiLoCo's lr 0.7 / Nesterov 0.9 in the healthy quick run for
# both (the figures are in docs/bench.md).
for _size in SIZES.values():
    _size["preset"] = "paper"  # every setting a method relies on is named here or in METHODS
    _size["outer"] = {"lr": 1.0, "momentum": 0.0}
    _size["fragments"]["apply"] = "rebase"
    _size["syncer"] = {"scale_partial_rounds": True, "broadcast": "int8"}  # `decoupled` is int8 both ways


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Decoupled: K = 2, the inner lr of every method (3e-3), and the token-weighted plain mean with outer
# lr 1 (sync's merge math): rounds here hold 2-4 deltas, and RDA's step grows with a round's size
# (about sqrt(n) times the mean's for near-orthogonal deltas), so how a period's deltas split into
# rounds changed how far the global moved; the mean with the n/M share counts every delta 1/M
# wherever it lands. Over twenty seeds of the quick healthy run the mean with lr 1 is 0.55% better
# than RDA with lr 0.8 (docs/bench.md, issue 21). A late delta waits for a round with fresh
# ones (syncer.quorum_of_fresh) and weighs (1 + staleness) ** -2 there (syncer.staleness_discount), a
# quarter of a fresh one when one version late: over five seeds of ideal DiLoCo with half the deltas
# one round late that recovers all the loss lateness costs (bench.ideal; docs/bench.md, issue 21).
# Its learners do not share the step budget by speed (inner.steps_by_speed): on this CPU-bound machine
# that made the mixed run slower and worse (2.667 at 19.0 s against 2.638 at 17.4 s; docs/bench.md).
DECOUPLED = {"syncer": {"quorum": 2, "quorum_of_fresh": True, "staleness_discount": 2.0, "merge": "mean"},
             "fragments": {"one_delta_per_version": True}}

# Each DiLoCo method: overrides of the syncer / fragments sections. "dp" runs in bench.dp and
# "ideal" (decoupled's settings, no system: bench.ideal) in-process instead; "ideal-late" is ideal with
# IDEAL_LATE_SHARE of the deltas merged one round late, about what decoupled's healthy runs see.
METHODS: dict[str, dict] = {
    "dp": {},
    "ideal": DECOUPLED,
    "ideal-late": DECOUPLED,
    # OpenDiLoCo / torchft style: wait for every learner, no grace, equal-weight plain mean, and
    # learners stop (overlap_steps after each send, as streaming DiLoCo) until the merge is back.
    "sync": {"syncer": {"quorum": sum(r["learners"] for r in REGIONS), "grace_max_s": 0.0, "merge": "mean",
                        "token_weighting": False}, "fragments": {"wait_for_merge": True}},
    "decoupled": DECOUPLED,
    "decoupled-p1": _merge(DECOUPLED, {"fragments": {"count": 1}}),
    "decoupled-fp32": _merge(DECOUPLED, {"fragments": {"quantization": "fp32"}}),
    "decoupled-bf16": _merge(DECOUPLED, {"fragments": {"quantization": "bf16"}}),
    # int4 both ways: deltas up and the syncer's updates down (quality held in healthy quick runs)
    "decoupled-int4": _merge(DECOUPLED, {"fragments": {"quantization": "int4"}, "syncer": {"broadcast": "int4"}}),
    # int4 both ways with the codes as they are (no zstd packing): what packing saves, in the same run
    "decoupled-int4-unpacked": _merge(DECOUPLED, {"fragments": {"quantization": "int4", "packing": "none"},
                                                  "syncer": {"broadcast": "int4", "broadcast_packing": "none"}}),
    # int4 both ways, each update from the version before (finer codes, one download per version)
    "decoupled-int4-previous": _merge(DECOUPLED, {"fragments": {"quantization": "int4"},
                                                  "syncer": {"broadcast": "int4", "update_base": "previous"}}),
    # int8 deltas up, int4 updates down
    "decoupled-int4-down": _merge(DECOUPLED, {"syncer": {"broadcast": "int4"}}),
    # below 4 bits, with error feedback (what a code leaves out goes with the next delta or update):
    # int2 or topk (8 of every 256 values) up with int4 down, or both ways (each update from the
    # version before: a code this coarse of everything since the snapshot would stay that coarse)
    "decoupled-int2-up": _merge(DECOUPLED, {"fragments": {"quantization": "int2"}, "syncer": {"broadcast": "int4"}}),
    "decoupled-topk-up": _merge(DECOUPLED, {"fragments": {"quantization": "topk"}, "syncer": {"broadcast": "int4"}}),
    "decoupled-int2": _merge(DECOUPLED, {"fragments": {"quantization": "int2"},
                                         "syncer": {"broadcast": "int2", "update_base": "previous"}}),
    "decoupled-topk": _merge(DECOUPLED, {"fragments": {"quantization": "topk"},
                                         "syncer": {"broadcast": "topk", "update_base": "previous"}}),
    # int4 deltas up, and updates down below 4 bits
    "decoupled-int2-down": _merge(DECOUPLED, {"fragments": {"quantization": "int4"},
                                              "syncer": {"broadcast": "int2", "update_base": "previous"}}),
    "decoupled-topk-down": _merge(DECOUPLED, {"fragments": {"quantization": "int4"},
                                              "syncer": {"broadcast": "topk", "update_base": "previous"}}),
    # ternary (-s, 0, +s per row, five codes a byte: 1.6 bits a value) up with int4 down, or both ways
    # as int2 (each update from the version before); and both ways at the sync period of 1000x (below)
    "decoupled-ternary-up": _merge(DECOUPLED, {"fragments": {"quantization": "ternary"},
                                               "syncer": {"broadcast": "int4"}}),
    "decoupled-ternary": _merge(DECOUPLED, {"fragments": {"quantization": "ternary"},
                                            "syncer": {"broadcast": "ternary", "update_base": "previous"}}),
    # learners fetch a fragment only shortly before they sync it: fewer downloads, older globals
    "decoupled-before-sync": _merge(DECOUPLED, {"fragments": {"fetch": "before_sync"}}),
    # the round policy alone, the paper's comparison on mixed hardware: every learner waited for
    # (K = M, learners still never block), and K = 1 with and without the grace window
    "decoupled-kM": _merge(DECOUPLED, {"syncer": {"quorum": sum(r["learners"] for r in REGIONS)}}),
    "decoupled-k1": _merge(DECOUPLED, {"syncer": {"quorum": 1}}),
    "decoupled-k1-nograce": _merge(DECOUPLED, {"syncer": {"quorum": 1, "grace_max_s": 0.0}}),
}
QUORUM_VARIANTS = ("decoupled-kM", "decoupled-k1", "decoupled-k1-nograce")
# decoupled-1000x (issue 50): ternary both ways at the sync period that puts the long size at 1000x
# data-parallel's bytes, all traffic, or more (`python -m bench --size long --methods
# decoupled,decoupled-1000x`). The all-traffic ratio is 6H / (bytes per parameter up + down per sync
# period): data-parallel's ring all-reduce moves 6 bytes per parameter per step at M = 4. On the quick
# model's 1,221 rows of 64-256 values ternary is 0.244 bytes per parameter (29,077 bytes); the frames
# add about a tenth up (a manifest of ~700 bytes per contribution); and learners fetch every version
# (updates from the version before), about 1.47 a sync period (int4 at H = 100 on the long size:
# 4.27 MB down for 3.00 MB up, packing apart; docs/bench.md). That is 0.244 x (1.1 + 1.47) = 0.63
# bytes per parameter per period: 1000x needs H >= 105, and H = 120 (10 periods of 1,200 steps) puts
# the mean near 1,150x, room for the spread between seeds (int4 at H = 100: 451-506x about 472x).
THOUSAND_X_SYNC_EVERY = 120
METHODS["decoupled-1000x"] = _merge(METHODS["decoupled-ternary"], {"fragments": {"sync_every": THOUSAND_X_SYNC_EVERY}})
# decoupled with RDA (over learners) and outer lr 0.8: the merge rule alone
METHODS["decoupled-rda"] = _merge(DECOUPLED, {"syncer": {"merge": "rda"}, "outer": {"lr": 0.8}})
# decoupled without its staleness-aware pieces: late deltas make rounds of their own and weigh as fresh
# ones, and a learner ahead sends every H steps whatever version it holds
METHODS["decoupled-plain"] = _merge(DECOUPLED, {"syncer": {"quorum_of_fresh": False, "staleness_discount": 0.0},
                                                "fragments": {"one_delta_per_version": False}})
# DiLoCo's outer Nesterov (lr 0.7, momentum 0.9); decoupled's trace decays per full round's worth of
# deltas (outer.momentum_per_round), however many partial rounds bring them
NESTEROV = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
METHODS["sync-nesterov"] = _merge(METHODS["sync"], {"outer": NESTEROV})
METHODS["decoupled-nesterov"] = _merge(DECOUPLED, {"outer": {**NESTEROV, "momentum_per_round": True}})

IDEAL_LATE_SHARE = {"ideal": 0.0, "ideal-late": 0.5}

# The emulated WAN is scaled to the tiny model: an all-reduce of ~0.5 MB per step on 10 Mbit/s
# per region costs about what a 2-5 Gbit/s link costs a billion-parameter model.
WAN = {"wan_bandwidth_mbps": 10.0, "wan_latency_ms": 50.0}

SCENARIOS: dict[str, dict] = {
    "healthy": {},
    "mixed": {"regions": [REGIONS[0], {**REGIONS[1], "speed": 0.5}]},
    "failures": {"chaos": {"seed": 0, "learner_kills": 1, "syncer_kills": 1, "restart_after_s": 2.0}},
    "wan": {"transport": WAN},
}


# A joining learner needs a while to start (JAX start-up and compilation beside the running
# learners): at the quick size's 240 steps the run is over before any joiner's first step, so scavenge
# trains longer (docs/bench.md, "scavenge", has the figures).
SCAVENGE_STEPS = 2000


def _scavenge(joiners: int) -> dict:
    """Idle compute joins a third of the way in: `joiners` learners split over the regions, on the
    run's token budget (build sets it). Every case may grow to +100%, so all read the same 8 data shards."""
    per_region = joiners // len(REGIONS)
    return {"regions": [{**r, "max_learners": 2 * r["learners"]} for r in REGIONS], "inner": {"steps": SCAVENGE_STEPS},
            "run": {"joins": [{"at_tokens_fraction": 1 / 3, "region": r["name"], "count": per_region}
                              for r in REGIONS if per_region]}}


# Scavenging idle compute: 0, +50% and +100% learners; `--scenarios scavenge` runs the three cases.
SCAVENGE = {"scavenge-0": _scavenge(0), "scavenge-50": _scavenge(2), "scavenge-100": _scavenge(4)}
SCENARIOS |= SCAVENGE
GROUPS = {"scavenge": list(SCAVENGE)}
SCAVENGE_METHODS = ("dp", "decoupled")  # the question is elastic DiLoCo against a growing data-parallel job

# The fragment and quantization variants, and the ideal method (no clock, nothing sent), run only
# where they matter: quality and bytes; the quorum variants also where speeds differ, and
# decoupled-1000x, the candidate for the defaults below 4 bits, everywhere.
VARIANTS_ONLY_IN = {"ideal": ("healthy",), "ideal-late": ("healthy",), "sync-nesterov": ("healthy",),
                    **{m: ("healthy", "mixed") for m in QUORUM_VARIANTS},
                    # issue 50's acceptance: it must also heal and count exactly on mixed speeds and failures
                    "decoupled-1000x": ("healthy", "mixed", "failures", "wan")}


def runs_in(method: str, scenario: str) -> bool:
    where = VARIANTS_ONLY_IN.get(method, ("healthy",) if method.startswith("decoupled-") else None)
    return where is None or scenario in where


def expand(scenarios: list[str]) -> list[str]:
    """Scenario names with each group (GROUPS) replaced by its cases."""
    return [case for s in scenarios for case in GROUPS.get(s, [s])]


def build(method: str, scenario: str, size: str = "quick", overrides: list[str] = ()) -> Config:
    """The config of one (method, scenario) run; `overrides` (key=value) carry local services and paths."""
    tree = _merge({"regions": REGIONS, **SIZES[size]}, METHODS[method])
    tree = _merge(tree, SCENARIOS[scenario])
    tree = _merge(tree, {"run": {"name": f"bench-{method}-{scenario}"}})
    if scenario in SCAVENGE:  # the same tokens as the starting learners' inner.steps (overrides too), whoever joins
        c = build_config(_merge(tree, {"run": {"joins": []}}), overrides)
        budget = c.inner.steps * c.num_learners * c.inner.batch_size * c.model.transformer.seq_len
        tree = _merge(tree, {"run": {"token_budget": budget}})
    return build_config(tree, overrides)


def plan(methods: list[str], scenarios: list[str]) -> list[tuple[str, str]]:
    """(method, scenario) pairs to run; variants (decoupled-*) and ideal only in the healthy scenario
    (the quorum variants also in mixed), the scavenge cases only for SCAVENGE_METHODS."""
    return [(m, s) for s in scenarios for m in methods if runs_in(m, s) and not (s in SCAVENGE and m not in SCAVENGE_METHODS)]
