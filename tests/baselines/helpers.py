"""Rows and a fit loop for the baseline tests (their fixtures are in ``conftest.py``)."""

from __future__ import annotations

import torch

PAD = 0
PROMPT = 4


def random_rows(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 48, (n, length), generator=g).tolist()


def fit(model: torch.nn.Module, rows: list[list[int]], steps: int, lr: float = 1e-2) -> None:
    ids = torch.tensor(rows)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
