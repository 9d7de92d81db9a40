"""One plot (and one JSON) from several `jaxspec-bench --json` files of the same set, e.g. a
sweep run as two calls (small batches on fewer prompts, large batches on more).

    python -m bench.merge_sweeps OUT.png A.json B.json [...]   # also writes OUT.json
"""
from __future__ import annotations

import json
import sys
from typing import List


def merge(results: List[dict]) -> dict:
    """The first result's header with every result's rows and peers; categories are the
    smallest batch's (the plot's per-category table), so the first file's."""
    if not results:
        raise SystemExit("merge_sweeps: no JSON files given")
    sets = {(r.get("dataset"), r.get("model_label"), r.get("draft_label")) for r in results}
    if len(sets) > 1:
        raise SystemExit(f"merge_sweeps: the files are of different sets: {sorted(map(str, sets))}")
    out = dict(results[0])
    out["rows"] = [row for r in results for row in r["rows"]]
    out["peers"] = [p for r in results for p in (r.get("peers") or [])]
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not argv[0].endswith(".png"):
        raise SystemExit(__doc__)
    results = []
    for path in argv[1:]:
        with open(path) as f:
            results.append(json.load(f))
    merged = merge(results)
    from jaxspec.benchmark.plots import plot
    plot(merged, argv[0])
    with open(argv[0][:-4] + ".json", "w") as f:
        json.dump(merged, f, indent=1)
    print(f"wrote {argv[0]} and {argv[0][:-4]}.json from {len(results)} files")


if __name__ == "__main__":
    main()
