"""Does the library install beside the JAX model ecosystem? For each model library, one pip command
with the base package (a learner's install) and that library, resolved against the package registry
without installing (`pip install --dry-run --ignore-installed --report`: a fresh environment's view);
with --venv LIBS, also a real fresh venv of the base package and those libraries in one command,
where their imports (`import flax.nnx`, `import equinox`, `from gemma import gm`) and `import
diloco` must succeed.

    python .ci/coexistence.py [--only flax,equinox,gemma] [--venv flax,equinox] [--venv gemma]
    (`make coexistence`: the three dry runs and the flax + equinox venv)

Needs the registry and minutes (gemma pulls TensorFlow); not part of `make test`. Prints one JSON
line per check and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What each library is installed as, in the same command as the base package. gemma takes the newest
# sentencepiece, whose generated protobuf code needs protobuf 7, while TensorFlow (gemma's kauldron
# needs it) caps protobuf below 7: `from gemma import gm` then fails, so sentencepiece is pinned below
# 0.2.3 beside it, as the library's own [pipelines] extra pins it.
LIBRARIES = {"flax": ["flax"], "equinox": ["equinox"], "gemma": ["gemma", "sentencepiece<0.2.3"]}
IMPORTS = {"flax": "import flax.nnx", "equinox": "import equinox", "gemma": "from gemma import gm"}
TIMEOUT_S = 900


def dry_run(name: str, requirements: list[str], timeout_s: float = TIMEOUT_S) -> dict:
    """Resolve the base package and `requirements` in one pip command; what pip would install."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        t0 = time.time()
        try:
            run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                                  "--report", str(report), str(ROOT), *requirements],
                                 capture_output=True, text=True, timeout=timeout_s)
            ok, why = run.returncode == 0, run.stderr.strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            ok, why = False, [f"pip did not resolve within {timeout_s:.0f} s (backtracking?)"]
        out = {"check": f"dry run: base + {' '.join(requirements)}", "ok": ok, "seconds": round(time.time() - t0)}
        if ok:
            installs = json.loads(report.read_text())["install"]
            versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
            out |= {"packages": len(installs),
                    "versions": {k: versions.get(k) for k in ("decoupled-diloco", "jax", name, "protobuf")}}
        else:
            out["why"] = why
        return out


def fresh_venv(names: list[str]) -> dict:
    """A real venv of the base package and the libraries `names`, one pip command; imports and its size."""
    requirements = [r for name in names for r in LIBRARIES[name]]
    imports = "; ".join([IMPORTS[name] for name in names] + ["import diloco, diloco.learners.learner"])
    with tempfile.TemporaryDirectory() as tmp:
        venv, t0 = Path(tmp) / "venv", time.time()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", str(ROOT), *requirements],
                             capture_output=True, text=True, timeout=TIMEOUT_S)
        out = {"check": f"fresh venv: base + {' '.join(requirements)}", "ok": pip.returncode == 0,
               "install_seconds": round(time.time() - t0)}
        if pip.returncode:
            return out | {"why": pip.stderr.strip().splitlines()[-3:]}
        run = subprocess.run([str(venv / "bin" / "python"), "-c", imports], capture_output=True, text=True, cwd=tmp)
        size = subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True).stdout.split()[0]
        return out | {"ok": run.returncode == 0, "imports": imports, "venv_mb": int(size),
                      **({"why": run.stderr.strip().splitlines()[-3:]} if run.returncode else {})}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", action="append", default=[], metavar="LIBS",
                    help="also build a fresh venv of the base package and these libraries (comma-separated, e.g. "
                         "flax,equinox) and import them; may be given again for another venv")
    ap.add_argument("--only", default=",".join(LIBRARIES), help="comma-separated, of " + ", ".join(LIBRARIES))
    a = ap.parse_args(argv)
    results = [dry_run(name, LIBRARIES[name]) for name in a.only.split(",")]
    results += [fresh_venv(libs.split(",")) for libs in a.venv]
    for r in results:
        print(json.dumps(r), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
