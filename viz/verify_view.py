"""Why the accepted path stopped where it did: the base model's own token at each verified node beside the
candidates there, ✓/✗, along the accepted path and at the first rejected depth.

The base model's top token after a node is read from `TreeOutcome.base_top_tokens` when the record
carries it; otherwise it is the token accepted after the node (or, at the last accepted node, the bonus
token), which under greedy acceptance is exactly the argmax. Under typical or speculative acceptance
without that field the shown tokens are the sampled ones, and the view says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.families import FAMILIES
from viz.labels import TokenBytes, escape, standalone_text, visible
from viz.tree_plot import node_texts

if TYPE_CHECKING:
    from core.records import StepRecord, TreeOutcome


@dataclass(frozen=True)
class Candidate:
    """One candidate at a verified depth."""

    text: str
    source: str  # head d rank r / lookup
    probability: float  # joint head probability (lookup: its learned chance)
    matches: bool  # the base model chose this token


@dataclass(frozen=True)
class DepthCheck:
    """One depth of the verification: after `parent`, the base model chose `choice`; these were proposed."""

    depth: int
    parent: str
    choice: str
    candidates: list[Candidate]
    accepted: bool  # a candidate matched, so the path went on


def base_tops(record: StepRecord) -> list[int] | None:
    """The base model's argmax after each node, when the record carries it (-1 where not projected)."""
    tops = list(record.outcome.base_top_tokens)
    return tops if len(tops) == len(record.outcome.node_tokens) else None


def _choice_text(token: int, known: dict[int, str], token_bytes: TokenBytes | None) -> str:
    if token in known:
        return known[token]
    if token_bytes is not None and token in token_bytes:
        return standalone_text(token_bytes[token])
    return f"#{token}"


def verification(record: StepRecord, token_bytes: TokenBytes | None = None) -> list[DepthCheck]:
    """The accepted path's depths and the first rejected one (if the tree went that deep)."""
    outcome = record.outcome
    texts, bonus_text = node_texts(outcome, token_bytes)
    known = {outcome.bonus_token: bonus_text, **{t: texts[i] for i, t in enumerate(outcome.node_tokens)}}
    parents = outcome.tree.parents
    copied = outcome.lookup_nodes
    accepted = list(outcome.accepted_nodes)
    tops = base_tops(record)
    checks = []
    for depth, parent in enumerate(accepted, start=1):
        children = [n for n in range(1, len(parents)) if parents[n] == parent]
        if not children:
            break  # the tree ends here: nothing was proposed to check
        chosen = accepted[depth] if depth < len(accepted) else None
        token = outcome.node_tokens[chosen] if chosen is not None else outcome.bonus_token
        if tops is not None and tops[parent] >= 0:
            token = tops[parent]
        candidates = [Candidate(texts[n], _source(outcome, n, n in copied), outcome.node_scores[n], n == chosen)
                      for n in children]
        checks.append(DepthCheck(depth, texts[parent], _choice_text(token, known, token_bytes), candidates,
                                 chosen is not None))
    return checks


def _source(outcome: TreeOutcome, node: int, copied: bool) -> str:
    path = outcome.tree.paths[node - 1]
    if copied:
        return f"◆ {outcome.node_source(node)}"
    if outcome.grown:
        return f"{FAMILIES[outcome.tree.kind].node_phrase} {len(path)}, child {outcome.sibling_ranks()[node]}"
    return f"head {len(path)} rank {path[-1]}"


def _cell(candidate: Candidate) -> str:
    mark = "✓" if candidate.matches else "✗"
    state = "ok" if candidate.matches else "no"
    return (f'<span class="cand {state}" title="{escape(candidate.source)} · p {candidate.probability:.3g}">'
            f'{mark} <code>{escape(visible(candidate.text))}</code></span>')


def verification_html(record: StepRecord | None, greedy: bool, token_bytes: TokenBytes | None = None,
                      max_candidates: int = 12) -> str:
    """The verification table of one step (a short note when there is nothing to verify)."""
    if record is None:
        return '<div class="verify empty">After a step, this shows why its accepted path stopped where it did.</div>'
    checks = verification(record, token_bytes)
    if not checks:
        return ('<div class="verify empty">Nothing to verify in this step: the tree is the root alone, so the base '
                'model just emitted its own next token (the bonus).</div>')
    # the heading and verdicts follow the acceptance rule: greedy accepts the argmax, sampling by probability
    if greedy:
        who = "the base model's top token (its argmax)"
        verdicts = ("✓ a candidate matches: the path goes on",
                    "✗ no candidate matches: the path stops here and the base model's token becomes the bonus")
    else:
        who = ("the base model's argmax (for reference: sampling accepts by probability)" if base_tops(record)
               is not None else "the base model's token (sampled: accepted by the rule, or the bonus drawn from "
               "the residual)")
        verdicts = ("✓ the sampling rule accepted a candidate: the path goes on",
                    "✗ the rule accepted no candidate: the path stops and the bonus is drawn from what remains")
    rows = []
    for check in checks:
        shown = sorted(check.candidates, key=lambda c: (not c.matches, -c.probability))[:max_candidates]
        more = len(check.candidates) - len(shown)
        extra = f' <span class="more">+{more} more ✗</span>' if more > 0 else ""
        verdict = verdicts[0] if check.accepted else verdicts[1]
        rows.append(f'<tr class="{"ok" if check.accepted else "stop"}"><th>depth {check.depth}</th>'
                    f'<td><code>{escape(visible(check.parent))}</code></td>'
                    f'<td><code class="choice">{escape(visible(check.choice))}</code></td>'
                    f'<td>{"".join(_cell(c) for c in shown)}{extra}</td><td class="verdict">{verdict}</td></tr>')
    return (f'<div class="verify"><table><thead><tr><th></th><th>after</th><th>{who}</th><th>candidates there</th>'
            f'<th></th></tr></thead><tbody>{"".join(rows)}</tbody></table></div>')
