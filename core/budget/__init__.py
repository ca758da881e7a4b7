"""The adaptive budget: how many tree nodes a step verifies.

- `cost_profile`: what a verify of n nodes costs on this machine (measured once, cached), the
  per-depth calibration of the heads' scores and the best prefix of a scored tree;
- `controller`: `AutoBudget`, which corrects that profile with the run's own measurements and
  chooses each step's tree size (plain probes, back-off, exploring steps).
"""
