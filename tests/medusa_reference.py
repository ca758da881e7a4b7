"""Medusa's own buffer construction for a choices list, re-implemented from its description
(FasterDecoding/Medusa, medusa/model/utils.py: generate_medusa_buffers) as the test oracle:
paths sorted by (length, ranks); mask = identity + root column + each path's ancestors;
position = depth; retrieve rows built from the deepest path backwards, each path not yet
covered contributing its chain of prefixes, padded with -1 after shifting by the root."""
from __future__ import annotations

import torch


def medusa_buffers(choices: list[list[int]]) -> dict[str, torch.Tensor]:
    ordered = sorted(choices, key=lambda x: (len(x), x))
    size = len(ordered) + 1
    mask = torch.eye(size, size)
    mask[:, 0] = 1
    for i, path in enumerate(ordered):
        for c in range(len(path) - 1):
            mask[i + 1, ordered.index(path[: c + 1]) + 1] = 1
    positions = torch.zeros(size, dtype=torch.long)
    for i, path in enumerate(ordered):
        positions[i + 1] = len(path)
    rows, covered = [], []
    for path in reversed(ordered):
        if path in covered:
            continue
        row = []
        for c in range(len(path)):
            row.append(ordered.index(path[: c + 1]))
            covered.append(path[: c + 1])
        rows.append(row)
    width = max(len(r) for r in rows)
    retrieve = torch.tensor([r + [-2] * (width - len(r)) for r in rows]) + 1
    retrieve = torch.cat([torch.zeros(len(rows), 1, dtype=torch.long), retrieve], dim=1)
    return {"attn_mask": mask.bool(), "position_ids": positions, "retrieve_indices": retrieve}
