"""One attention layer alone: kvedge.Int8CacheAttention against GroupQueryAttention (figures for docs).

Entry script; the code is `kvedge.bench.kernel` (`python bench/kernel.py --help`).
"""

from kvedge.bench.kernel import main

if __name__ == "__main__":
    main()
