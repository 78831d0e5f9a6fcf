"""Turn 6's time to first token after kill -9 and a restart, against no restart and a cold start.

Entry script; the code, method and targets are `kvedge.bench.restart` (`python bench/restart.py --help`).
"""

from kvedge.bench.restart import main

if __name__ == "__main__":
    main()
