"""Names of the local run record and of the arms, shared by `tracking` (writes) and `compare` (reads).

No imports: `trl-costaware compare` reads runs without importing transformers or torch.
"""

METRICS_FILE = "cost_aware_metrics.jsonl"
RUN_FILE = "cost_aware_run.json"
RECORD_VERSION = 1
BASELINE_ARM = "baseline"
COST_AWARE_ARM = "cost_aware"
