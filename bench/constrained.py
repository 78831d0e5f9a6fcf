"""What a JSON-schema constraint costs per decoded token, at batch 1 and 4, in one run.

Entry script; the code is `kvedge.bench.constrained` (`python bench/constrained.py --help`).
"""

from kvedge.bench.constrained import main

if __name__ == "__main__":
    main()
