"""One base-model forward over a whole candidate tree, with tree attention.

The mask, position ids and cache are passed explicitly; nothing is stored on the model.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from core.kvcache import KVCache
from core.model import BaseModel


class VerifyOutput:
    """Hidden states of every verified token; logits computed only for the rows asked for.

    The vocabulary projection of a 64-node tree is a [64, H] x [H, 49152] matmul, about a
    quarter of a CPU verify. Acceptance only needs the logits of nodes that have children
    and of the last accepted node, so rows are projected on demand and cached.
    """

    def __init__(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor],
                 tapped: torch.Tensor | None = None) -> None:
        self.hidden = hidden  # [n, H] last (normed) hidden state of every token
        self.tapped = tapped  # [T, n, H] the residual streams a drafter asked for (None: none asked)
        self._lm_head = lm_head  # hidden rows [r, H] -> logits [r, V]
        self._rows: dict[int, torch.Tensor] = {}  # row -> its logits [V] (a view of a projected block)
        self._block: tuple[tuple[int, ...], torch.Tensor] | None = None  # the last projection's rows and logits

    def project(self, rows: list[int]) -> None:
        """Compute and keep the logits of `rows` not projected yet (one lm_head call)."""
        missing = [r for r in dict.fromkeys(rows) if r not in self._rows]
        if missing:
            projected = self._lm_head(self.hidden[missing]).float()  # [len(missing), V]
            self._rows.update(zip(missing, projected))
            self._block = (tuple(missing), projected)

    def logits(self, rows: list[int]) -> torch.Tensor:
        """float32 next-token logits of `rows`: [len(rows), V]. Read-only: the rows one projection made,
        in its order, come back as that projection's tensor (copying 16 rows of 49,152 logits costs
        ~0.1 ms a step), other selections as a new one."""
        self.project(rows)
        if self._block is not None and tuple(rows) == self._block[0]:
            return self._block[1]
        return torch.stack([self._rows[r] for r in rows])

    def row(self, index: int) -> torch.Tensor:
        """float32 logits of one row: [V] (read-only, kept)."""
        self.project([index])
        return self._rows[index]

    def projected_argmax(self, rows: int) -> list[int]:
        """The base model's top token after each of the first `rows` rows; -1 where not projected."""
        return [int(self._rows[r].argmax()) if r in self._rows else -1 for r in range(rows)]


def tree_attention_bias(tree_mask: torch.Tensor, past_len: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """Additive 4D mask [1, 1, n+1, past+n+1]: 0 where a node may attend, dtype-min elsewhere.

    Every node sees the whole committed context and, inside the tree, itself and its
    ancestors. A float mask, because a bool 4D mask is silently misread by `eager` attention.
    """
    size = tree_mask.shape[0]
    bias = torch.zeros(size, past_len + size, dtype=dtype, device=device)  # [n+1, past+n+1]
    bias[:, past_len:].masked_fill_(~tree_mask.to(device), torch.finfo(dtype).min)
    return bias[None, None]


def forward_tokens(base: BaseModel, cache: KVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   tree_mask: torch.Tensor | None = None, taps: tuple[int, ...] = ()) -> VerifyOutput:
    """Run `input_ids` [n] at `position_ids` [n] on top of `cache` (which grows by n).

    Among the new tokens, token i sees what row i of `tree_mask` (bool [n, n]) allows, or the
    tokens before it when None (a prefill, a chain, a plain step); every cached token is visible.
    The exact or lean forward (core.engine) runs where the model allows it, transformers' elsewhere.
    `taps`: layers whose incoming residual stream the output keeps too (`VerifyOutput.tapped`).
    """
    if base.engine is not None:
        hidden, tapped = base.engine.forward_tapped(input_ids, position_ids, cache, tree_mask, taps)  # [n, H]
        return VerifyOutput(hidden, base.engine.project, tapped)
    past_len = int(cache.get_seq_length())
    if tree_mask is not None:
        bias = tree_attention_bias(tree_mask, past_len, base.dtype, base.device)
    elif input_ids.shape[0] == 1:
        bias = plain_step_bias(base, past_len)
    else:
        bias = None  # transformers' own causal mask
    out = base.model.model(
        input_ids=input_ids[None].to(base.device),  # [1, n]
        position_ids=position_ids[None].to(base.device),  # [1, n]
        attention_mask=bias,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=bool(taps),
    )
    tapped = torch.stack([out.hidden_states[t][0] for t in taps]) if taps else None  # [T, n, H]
    return VerifyOutput(out.last_hidden_state[0], base.lm_head, tapped)  # hidden [n, H]


class WalkedRows:
    """A tree's rows computed on demand down one path, for a rule that reads only the rows of the
    nodes it walks (speculative sampling): each row is a one-token forward on top of the cache, as
    plain decoding runs it (bitwise a tree verify's row on the exact kernels), so judging a 64-node
    tree beside a step costs the rows of its accepted path, not a 64-row verify. The caller drops
    the walked rows from the cache afterwards (`truncate`). Same reading interface as `VerifyOutput`."""

    def __init__(self, base: BaseModel, cache: KVCache, parents: list[int], node_tokens: list[int]) -> None:
        self.base, self.cache = base, cache
        self.parents, self.node_tokens = parents, node_tokens  # [n+1] each, root first
        self.walked: list[int] = []
        self._rows: dict[int, torch.Tensor] = {}

    def row(self, index: int) -> torch.Tensor:
        """float32 logits after node `index` [V]: the root first, then a child of the last node walked."""
        if index in self._rows:
            return self._rows[index]
        expected_parent = self.walked[-1] if self.walked else -1
        if self.parents[index] != expected_parent:
            raise ValueError(f"rows are walked down one path: node {index} is not a child of node {expected_parent}")
        position = torch.tensor([int(self.cache.get_seq_length())])
        out = forward_tokens(self.base, self.cache, torch.tensor([self.node_tokens[index]]), position)
        self._rows[index] = out.row(0)
        self.walked.append(index)
        return self._rows[index]

    def logits(self, rows: list[int]) -> torch.Tensor:
        """float32 logits of `rows` (walked in order): [len(rows), V]."""
        return torch.stack([self.row(r) for r in rows])

    def projected_argmax(self, rows: int) -> list[int]:
        """The base model's top token after each of the first `rows` nodes; -1 where not walked."""
        return [int(self._rows[r].argmax()) if r in self._rows else -1 for r in range(rows)]


def plain_step_bias(base: BaseModel, past_len: int) -> torch.Tensor | None:
    """transformers' forward, one-token step: no mask, or an all-zero float mask (both exact).

    They select different SDPA kernels, and which is faster depends on the precision: over 1,400
    cached tokens on this CPU a bf16 step took 81 ms without a mask and 48 ms with one, an fp32 step
    63 ms without and 93 ms with (median of 6; equal at 100 tokens). Plain decoding takes the faster
    one, so no speed-up here is measured against a handicapped baseline.
    """
    if base.device.type == "cpu" and base.dtype != torch.float32:
        return torch.zeros(1, 1, 1, past_len + 1, dtype=base.dtype)  # [1, 1, 1, past+1]
    return None


def verify_tree(base: BaseModel, cache: KVCache, node_tokens: torch.Tensor, tree_mask: torch.Tensor,
                depths: torch.Tensor, taps: tuple[int, ...] = ()) -> VerifyOutput:
    """Verify all tree nodes in one forward: positions are context length + depth."""
    past_len = int(cache.get_seq_length())
    if tree_mask.shape[0] == 1:  # the root alone: a plain step
        return forward_tokens(base, cache, node_tokens, past_len + depths, taps=taps)
    return forward_tokens(base, cache, node_tokens, past_len + depths, tree_mask, taps)
