"""Smaller LM heads for a tied model, simulated: their KL against the model as it is (figures for docs).

Entry script; the code is `kvedge.bench.head_bits` (`python bench/head_bits.py --help`).
"""

from kvedge.bench.head_bits import main

if __name__ == "__main__":
    main()
