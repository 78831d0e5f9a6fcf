"""Speculative decoding (prompt lookup) against plain decoding: decode tokens/s on three
workloads, (a) answer from a passage quoting it, (b) rewrite a paragraph with a few words
changed, (c) open chat, with tokens per model call and greedy equality, in one run.

Entry script; the workloads and the code are `kvedge.bench.speculate`
(`python bench/speculate.py MODEL_DIR [MODEL_DIR ...] --threads 1 --rounds 3`); `kvedge bench`
runs it for its ort int4 + INT8-cache and portable float32 systems.
"""

from kvedge.bench.speculate import main

if __name__ == "__main__":
    main()
