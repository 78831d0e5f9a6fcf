#!/bin/bash
# alternating runs of the two exports, each in a fresh process; peak RSS via /usr/bin/time
cd /work/main
for r in 1 2 3; do
  for c in gemma-3-1b gemma-4-e2b; do
    /usr/bin/time -f "$c round $r maxrss_kb %M wall %e" .venv/bin/python - /tmp/scale/$c/portable-int4 <<'PY' 2>&1 | grep -v Warning
import json, statistics, sys
from pathlib import Path
import numpy as np
from kvedge.bench.systems import SystemSpec
spec = SystemSpec("x", "kvedge", Path(sys.argv[1]), "", max_len=2048)
system = spec.build(2)
ids = np.random.default_rng(0).integers(16, 40000, 512).tolist()
ttft, steps = system.run(ids, 16)
print(json.dumps({"ttft_s": round(ttft, 2), "decode_ms": round(1000 * statistics.median(steps), 1)}))
PY
  done
done
