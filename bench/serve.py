"""`kvedge serve` throughput: concurrent streams with batched decode vs one slot at a time.

Entry script; the code is `kvedge.bench.service` (`python bench/serve.py --help`).
"""

from kvedge.bench.service import main

if __name__ == "__main__":
    main()
