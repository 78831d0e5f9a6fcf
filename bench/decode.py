"""`make bench`: the side-by-side benchmark, i.e. `kvedge bench` with any extra options given.

    python bench/decode.py [--threads 1] [--quick] ...

Results go to a new bench/results/<date>-<commit>-<device>-t<threads>/ (bench.json, bench.png);
docs/PERFORMANCE.md explains them.
"""

from __future__ import annotations

import sys

from kvedge.cli import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]])
