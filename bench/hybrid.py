"""Speed of the hybrid models (LFM2, Qwen3.5) at a real shape, random weights: kvedge against
transformers on the CPU, side by side.

Entry script; the code is `kvedge.bench.hybrid` (`python bench/hybrid.py --help`).
"""

from kvedge.bench.hybrid import main

if __name__ == "__main__":
    main()
