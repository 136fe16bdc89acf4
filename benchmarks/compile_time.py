"""Wall time and peak memory of the 718B compile on 6144 ascend-910b devices (target: <= 10 s, <= 2 GB).

Runs the real CLI in a child process and prints one JSON line: wall seconds, peak RSS of the process tree (the
largest of the parent's and its search workers' max RSS), and the compile time the plan records.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    args = sys.argv[1:] or ["pangu-ultra-moe-718b", "--target", "ascend-910b", "--devices", "6144"]
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "moeplan.cli", "compile", *args, "--json", "-o", str(Path(d) / "plan.yaml")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"compile failed ({proc.returncode}): {proc.stderr.strip()}")
    summary = json.loads(proc.stdout)
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"command": " ".join(["moeplan compile", *args]), "wall_s": round(wall, 2),
                      "peak_rss_bytes": peak_kib * 1024, "peak_rss_gb": round(peak_kib * 1024 / 1e9, 3),
                      "compile_s": round(summary["compile_s"], 2), "layout": summary["layout"],
                      "step_time_s": summary["predicted"]["step_time_s"]}))


if __name__ == "__main__":
    main()
