"""The load-level calibration figures (reserved seeds) of qwen3-8b-mi300x with constants overridden: ``k=v ...``.

Run from the repository: ``PYTHONPATH=src python3 docs/results/calibration-decode-probe/probe.py kv_read_s=1.1e-7
mixed_decode_factor=6 mixed_share_exponent=3``. Its output for the rows of docs/calibration.md is probe.log.
"""
import sys, tempfile
from dataclasses import replace
import numpy as np
from kvgate.engine.costmodel import QWEN3_8B_MI300X, save_profile
from kvgate.calibration import paper as P
from kvgate.analysis import metrics as m
from kvgate.analysis.drain import fit_cold_cost, fit_cold_cost_all_miss, cold_work_per_session
from kvgate.workload.shapes import preset
kw = {}
for a in sys.argv[1:]:
    k, v = a.split("=")
    kw[k] = float(v)
OUT = tempfile.mkdtemp()
name = "probe-" + "-".join(f"{k}{v:g}" for k, v in kw.items())
prof = replace(QWEN3_8B_MI300X, name=name, **kw)
path = f"{OUT}/{name}.json"
save_profile(prof, __import__("pathlib").Path(path))
eng = [P._decode_rate(path, 1, 6000), P._decode_rate(path, 20, 30000), P._decode_rate(path, 16, 25000)]
r = P._load_runs(path, False, False)
end = r["end"]
cost = fit_cold_cost(r["nocache"])
deg = [x for x in r["bursts"] if x.meta["summary"]["persistently_degraded"]]
dc = fit_cold_cost_all_miss(deg, from_s=1200.0)
cap, hit = P.warm_capacity(r["warm"], end)
resp = float(np.mean([np.mean(x.turns["end_s"] - x.turns["sent_s"]) for x in r["healthy"]]))
h_sess = float(np.mean([m.sample_mean(x.samples, "in_system", 600, end) for x in r["healthy"]]))
h_last = float(np.mean([m.sample_mean(x.samples, "in_system", end - 300, end) for x in r["healthy"]]))
invs = 1 / cold_work_per_session(dc, preset("paper-8b"))
print(f"{name}: dec1@6K {eng[0]:.0f} dec20@30K {eng[1]:.1f} dec16@25K {eng[2]:.1f} | slope {cost.slope_ms_per_token:.4f} "
      f"int {cost.intercept_s:.2f} | deg slope {dc.slope_ms_per_token:.4f} int {dc.intercept_s:.2f} 1/S {invs:.4f} ndeg {len(deg)} | cap {cap:.3f} hit {hit:.3f} | "
      f"R {resp:.2f} N {h_sess:.2f} N5 {h_last:.2f} nh {len(r['healthy'])} | busy {m.turn_rate(r['busy'].turns, end-1800, end):.3f}", flush=True)
