"""The export at a real model's size (random weights at a configs/models card's shape): export
in each form, plan, load and decode, each phase's wall time and peak RSS; onnxruntime-genai's
int4 build beside it with --genai.

Entry script; the code is `kvedge.bench.scale` (`python bench/scale.py --help`).
"""

from kvedge.bench.scale import main

if __name__ == "__main__":
    main()
