"""Print the short table that ends scripts/gpu_check.sh: test counts per file (from every test process), the per-kernel table,
the step benchmarks, the default run and the step profiles."""
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def main(out: Path) -> None:
    xmls = sorted(out.glob("gpu-tests*.xml"))       # one per test process
    if xmls:
        counts: dict = defaultdict(lambda: [0, 0, 0])
        for case in (c for xml in xmls for c in ET.parse(xml).iter("testcase")):
            f = case.get("file") or case.get("classname", "?")
            status = 1 if case.find("failure") is not None or case.find("error") is not None else (
                2 if case.find("skipped") is not None else 0)
            counts[f][status] += 1
        print(f"\n{'GPU test file':<44}{'pass':>6}{'fail':>6}{'skip':>6}")
        for f, (p, fl, s) in sorted(counts.items()):
            print(f"{f:<44}{p:>6}{fl:>6}{s:>6}")
    kernels = out / "kernels.json"
    if kernels.exists():
        print(f"\n{'kernel (0.22B shapes)':<52}{'ms':>9}{'GB/s':>9}{'TFLOP/s':>9}{'roofline':>10}")
        for b in json.loads(kernels.read_text())["benchmarks"]:
            e = b.get("extra_info", {})
            name = b["name"].removeprefix("test_")
            print(f"{name:<52}{e.get('ms', 0):>9.3f}{e.get('GB/s', 0):>9.0f}{e.get('TFLOP/s', 0):>9.2f}"
                  f"{e.get('roofline_%', 0):>8.1f}% {e.get('ceiling', '')}")
    bench = out / "bench.json"
    if bench.exists():
        print(f"\n{'benchmark':<60}{'median ms':>12}  extra")
        for b in json.loads(bench.read_text())["benchmarks"]:
            extra = ", ".join(f"{k}={v}" for k, v in b.get("extra_info", {}).items())
            print(f"{b['name']:<60}{1e3 * b['stats']['median']:>12.3f}  {extra}")
    for train in sorted(out.glob("train-*.log")):
        precision = train.stem.removeprefix("train-")
        print(f"\ndefault `python -m rwkvx train --device gpu --precision {precision}`:")
        print("\n".join(train.read_text().strip().splitlines()[-6:]))
    for prof in sorted(out.glob("profile-*.log")):
        lines = prof.read_text().strip().splitlines()
        print(f"\n{prof.name}:\n" + "\n".join(lines[:14]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
