"""One export on two builds of kvedge (x86-64 native and generic, aarch64), compared by KL / top-1.

Entry script; the code is `kvedge.bench.crossbuild` (`python bench/crossbuild.py --help`).
"""

import sys

from kvedge.bench.crossbuild import main

if __name__ == "__main__":
    sys.exit(main())
