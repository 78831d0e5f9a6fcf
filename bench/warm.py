"""The warm-prefix section of `kvedge bench` alone, on one export (no peers, no other systems).

    python bench/warm.py --model artifacts/bench/kvedge-portable-float32 [--threads 1] [--rounds 3]
                         [--json out.json]

Method and targets: `kvedge/bench/warm.py` and `kvedge.bench.report.warm_targets`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvedge.bench.report import format_target, warm_targets
from kvedge.bench.warm import measure_warm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    figures = measure_warm(args.model, args.threads, args.rounds)
    text = json.dumps(figures, indent=2)
    print(text)
    for row in warm_targets({args.model.name: figures}):
        print(format_target(row))
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
