"""The warm-prefix section of `kvedge bench` alone, on one export (no peers, no other systems).

    python bench/warm.py --model artifacts/bench/kvedge-portable-float32 [--threads 1] [--rounds 3]
                         [--json out.json]

Entry script; the code, method and targets are `kvedge.bench.warm` and
`kvedge.bench.report.warm_targets`.
"""

from kvedge.bench.warm import main

if __name__ == "__main__":
    main()
