"""Offline work: nothing at decode time imports this package.

- `sharegpt`, `evalset`: prompt readers (ShareGPT first turns; MT-Bench and the second set);
- `datagen`: self-distillation data (the base model's greedy answers, features captured while
  generating, continuous batching);
- `train`, `train_hydra`: Medusa and Hydra heads on those features; `simulate`: exact tokens
  per step of a tree over recorded answers; `bench`: the benchmark (`python -m core.bench`).
"""
