"""Is a rerun on another machine inside the committed headline's distribution?

Usage: python check.py COMMITTED_RESULTS_JSON RERUN_RESULTS_JSON
Prints, per FP8 label and rerun seed, the rerun's paired val gap and the 95%
prediction interval of the committed per-seed gaps
(fp8jax.lab.compare.reproduction_check).
"""

import json
import sys

from fp8jax.lab.compare import reproduction_check

committed, rerun = (json.load(open(p)) for p in sys.argv[1:3])
rows = reproduction_check(committed, rerun)
print("| label | rerun seed | val gap to bf16 | committed 95% prediction interval | inside |")
print("|---|---|---|---|---|")
for r in rows:
    print(
        f"| {r['label']} | {r['seed']} | {r['gap']:+.2%} | [{r['lo']:+.2%}, {r['hi']:+.2%}] "
        f"| {'yes' if r['inside'] else 'no'} |"
    )
