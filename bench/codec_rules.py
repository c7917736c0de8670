"""`python -m bench.codec_rules [--size quick] [--seed 0]`: how much error feedback has to carry under
each rule of the ternary code, on the deltas of a real run.

It trains ideal DiLoCo (bench.ideal: decoupled's settings, no system) and keeps every learner's fp32
delta of every round and the global's step, then feeds each stream through error feedback as a
learner (one stream per learner and fragment) and the syncer's downlink (one per fragment) do: each
message is the code of the new value plus what the code left out before. Per rule it prints the
residual after one message (what the code alone loses), after the last, and the largest, each as a
share of a message's size, and what is still held back at the end as a share of everything sent.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

from bench import setups
from diloco import quantize

THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # x the row's mean |x|: more values kept at a lower scale, or fewer higher


def ternary_code(threshold: float) -> Callable[[np.ndarray], np.ndarray]:
    """What a receiver decodes from the ternary code of x under `threshold`: the wire's bytes, decoded."""
    def code(x: np.ndarray) -> np.ndarray:
        rows, cols = quantize._rows(x.shape)
        scale, codes = quantize.ternary_rows(x.reshape(rows, cols), threshold)
        return quantize.decode(scale.tobytes() + quantize.pack_trits(codes).tobytes(), x.shape, "ternary")
    return code


def feedback(stream: list[dict[str, np.ndarray]], code: Callable[[np.ndarray], np.ndarray]) -> dict[str, float]:
    """Error feedback over one sender's messages (each a dict of tensors): what the code loses of a
    message alone (mean over messages, relative), the residual's mean norm over the run over the
    mean message norm (what the receiver is missing at a time), and the residual at the end over the
    norm of the messages' sum (the share of the progress never sent)."""
    residual = {n: np.zeros_like(a, np.float32) for n, a in stream[0].items()}
    alone, held, sizes = [], [], []
    for message in stream:
        want = {n: message[n] + residual[n] for n in message}
        residual = {n: want[n] - code(want[n]) for n in want}
        sizes.append(_norm(message))
        held.append(_norm(residual))
        alone.append(_norm({n: message[n] - code(message[n]) for n in message}) / sizes[-1])
    total = {n: sum(m[n] for m in stream) for n in stream[0]}
    return {"alone": float(np.mean(alone)), "held": float(np.mean(held) / np.mean(sizes)),
            "held_back": held[-1] / _norm(total)}


def _norm(tensors: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in tensors.values())))


def streams(rounds: list) -> tuple[list[list[dict]], list[list[dict]]]:
    """(the learners' delta streams, one per learner and fragment; the global's step streams, one per
    fragment) of bench.ideal's recorded rounds."""
    up: dict[tuple[int, int], list] = {}
    down: dict[int, list] = {}
    for fragment, deltas, step in rounds:
        for learner, d in deltas.items():
            up.setdefault((learner, fragment), []).append(d)
        down.setdefault(fragment, []).append(step)
    return list(up.values()), list(down.values())


def measure(rounds: list, codes: dict[str, Callable]) -> list[dict]:
    """Per code and direction, `feedback`'s figures averaged over the streams."""
    up, down = streams(rounds)
    rows = []
    for name, code in codes.items():
        for way, group in (("up", up), ("down", down)):
            got = [feedback(s, code) for s in group]
            rows.append({"code": name, "way": way, "streams": len(group), "messages": len(group[0]),
                         **{k: float(np.mean([g[k] for g in got])) for k in got[0]}})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m bench.codec_rules", description=__doc__)
    ap.add_argument("--size", choices=list(setups.SIZES), default="quick")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from bench import ideal
    from diloco.learners.data import eval_batches
    from diloco.pipelines.prepared import corpus_for

    cfg = setups.build("ideal", "healthy", a.size, [f"data.seed={a.seed}", f"model.seed={a.seed}"])
    corpus = corpus_for(cfg)
    held = eval_batches(corpus.heldout_tokens(), n_batches=2, batch_size=cfg.run.eval_batch_size,
                        seq_len=cfg.model.transformer.seq_len)
    rounds: list = []
    ideal.train_ideal(cfg, corpus, held, evals=1, rounds=rounds)
    codes = {f"ternary, keep > {t} x mean |x|": ternary_code(t) for t in THRESHOLDS}
    codes["int2 (for reference)"] = lambda x: quantize.roundtrip(x, "int2")
    rows = measure(rounds, codes)
    print("| code | way | streams x messages | one message alone | buffer, mean over the run | held back at the end |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['code']} | {r['way']} | {r['streams']} x {r['messages']} | {r['alone']:.3f} | {r['held']:.3f} | "
              f"{r['held_back']:.4f} |")
    return rows


if __name__ == "__main__":
    main()
