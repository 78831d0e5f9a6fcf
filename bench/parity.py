"""Measure kvedge-vs-transformers logit parity on the real default model (figures for docs).

Entry script; the code is `kvedge.bench.parity` (`python bench/parity.py --help`).
"""

from kvedge.bench.parity import main

if __name__ == "__main__":
    main()
