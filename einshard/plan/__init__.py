"""The planner: resolving layouts, the local lowering, transitions, contractions, cost, FFT and halo plans
(imports nothing itself)."""
