"""Wall time of the architecture screen (target: >= 10,000 architectures in <= 60 s on a 2-core machine).

Runs the real CLI on examples/spaces/pangu-ultra-moe.yaml for 6144 ascend-910b devices in a child process and
prints one JSON line: wall seconds, architectures screened, the shortlist size and the screen's own seconds.
``--verify K`` (default 0 here) also compiles the best K in full and prints the screen-vs-full gaps.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPACE = Path(__file__).resolve().parent.parent / "examples" / "spaces" / "pangu-ultra-moe.yaml"


def main() -> None:
    verify = sys.argv[sys.argv.index("--verify") + 1] if "--verify" in sys.argv else "0"
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "moeplan.cli", "explore", str(SPACE), "--target", "ascend-910b", "--devices",
               "6144", "--verify", verify, "--json", "--out", d]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"explore failed ({proc.returncode}): {proc.stderr.strip()}")
    s = json.loads(proc.stdout)
    print(json.dumps({"command": " ".join(["moeplan explore", SPACE.name, "--verify", verify]), "wall_s": round(wall, 1),
                      "screened": s["screened_ok"], "kept": s["kept"], "shortlist": s["shortlist"],
                      "screen_s": round(s["screen_s"], 1), "verify_s": round(s["verify_s"], 1),
                      "verified": s["verified"], "gap_median": s["gap_median"], "gap_max_abs": s["gap_max_abs"]}))


if __name__ == "__main__":
    main()
