"""`sglang-l3 plan`: per-rank sizes, what fits on the device / in host RAM / in L3,
how fast an agent comes back from L3 beside recomputing, and the launch flags
(docs/plan.md). geometry.py and weights.py read a config.json; planner.py holds
the arithmetic; models.py the packaged table."""
