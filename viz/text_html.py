"""HTML views: the generated text coloured by step and role, the heads' guesses, running totals.

Everything model- or user-supplied is HTML-escaped; styling comes from classes in assets/app.css.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from viz.labels import escape, visible
from viz.style import STEP_CYCLE

if TYPE_CHECKING:
    from core.records import StepRecord

ROLES = {
    "root": "first token (root of step 0, from the prefill)",
    "accepted": "head guess accepted",
    "copied": "prompt-lookup guess accepted",
    "bonus": "bonus token (base model)",
}


@dataclass(frozen=True)
class EmittedToken:
    """One generated token and where it came from."""

    text: str
    token_id: int
    step: int  # the step that emitted it; -1 for the prefill token
    role: str  # root | accepted | copied | bonus


def emitted_tokens(records: Sequence[StepRecord], first_id: int, first_text: str, limit: int) -> list[EmittedToken]:
    """Generated tokens in order, cut at `limit` (the session's output length: EOS / max tokens cut steps short)."""
    tokens = [EmittedToken(first_text, first_id, -1, "root")]
    for record in records:
        outcome = record.outcome
        texts = outcome.node_texts if len(outcome.node_texts) == len(outcome.node_tokens) else None
        copied = outcome.lookup_nodes
        for node in outcome.accepted_nodes[1:]:
            text = texts[node] if texts else f"#{outcome.node_tokens[node]}"
            role = "copied" if node in copied else "accepted"
            tokens.append(EmittedToken(text, outcome.node_tokens[node], record.index, role))
        bonus_text = outcome.bonus_text if outcome.bonus_text or texts else f"#{outcome.bonus_token}"
        tokens.append(EmittedToken(bonus_text, outcome.bonus_token, record.index, "bonus"))
    return tokens[:limit]


def _token_span(token: EmittedToken, selected_step: int | None) -> str:
    body = escape(token.text).replace("\t", '<span class="ws">⇥</span>')
    body = body.replace("\n", '<span class="ws">↵</span><br>')
    if body == "":
        body = '<span class="ws">∅</span>'
    step_class = "s-pre" if token.step < 0 else f"s{token.step % STEP_CYCLE}"
    selected = " sel" if selected_step is not None and token.step == selected_step else ""
    where = "prefill" if token.step < 0 else f"step {token.step}"
    title = escape(f"{where} · {ROLES[token.role]} · id {token.token_id} · {visible(token.text)}")
    return f'<span class="tok {step_class} r-{token.role}{selected}" title="{title}">{body}</span>'


def text_html(tokens: Sequence[EmittedToken], selected_step: int | None = None) -> str:
    """The generated text, one span per token: background = step, underline = head guess, bold orange = bonus."""
    copied = ('<span class="tok s0 r-copied">lookup guess accepted</span> '
              if any(t.role == "copied" for t in tokens) else "")
    legend = ('<div class="gen-legend"><span class="tok s-pre r-root">first token</span> '
              '<span class="tok s0 r-accepted">head guess accepted</span> ' + copied +
              '<span class="tok s0 r-bonus">bonus (base model)</span> '
              '<span class="hint">background colour = step that produced the token; hover for details</span></div>')
    if not tokens:
        return f'<div class="gen-text">{legend}<div class="gen-body empty">Press Start or Step.</div></div>'
    spans = "".join(_token_span(token, selected_step) for token in tokens)
    return f'<div class="gen-text">{legend}<div class="gen-body">{spans}</div></div>'


def heads_html(record: StepRecord | None) -> str:
    """Each head's top guesses with probabilities; the guesses on the accepted path are marked ✓."""
    if record is None:
        return '<div class="heads-table empty">Each head\'s top guesses appear here after the first step.</div>'
    if not record.head_probs and record.strategy == "lookup":
        return ('<div class="heads-table empty">No heads in this step: the auto budget is backing off (the heads '
                'have not paid lately), so the tree is only the prompt-lookup chain (◆).</div>')
    if not record.head_probs:
        return ('<div class="heads-table empty">No heads in this step: autoregressive decoding asks only the '
                'base model for one token.</div>')
    accepted_ranks = {len(path): path[-1] for path in
                      (record.outcome.tree.paths[node - 1] for node in record.outcome.accepted_nodes[1:])}
    texts = record.head_texts or [[f"#{t}" for t in row] for row in record.head_token_ids]
    header = "".join(f"<th>rank {r}</th>" for r in range(len(record.head_probs[0])))
    rows = []
    for depth, (probs, row_texts) in enumerate(zip(record.head_probs, texts), start=1):
        cells = []
        for rank, (p, text) in enumerate(zip(probs, row_texts)):
            mark = ' class="acc"' if accepted_ranks.get(depth) == rank else ""
            tick = "✓ " if mark else ""
            shade = min(1.0, p ** 0.5) if p == p else 0.0  # sqrt: small probabilities stay visible
            cells.append(f'<td{mark} style="--p:{shade:.3f}"><code>{tick}{escape(visible(text))}</code>'
                         f"<small>{p:.3f}</small></td>")
        rows.append(f"<tr><th>head {depth}<br><small>guesses t+{depth + 1}</small></th>{''.join(cells)}</tr>")
    return (f'<div class="heads-table"><table><thead><tr><th></th>{header}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


@dataclass(frozen=True)
class RunStats:
    """Running totals shown above the plots."""

    tokens: int = 0
    steps: int = 0
    mean_accepted: float = 0.0
    tokens_per_s: float = 0.0
    status: str = "not started"
    check: str = ""  # the plain-greedy comparison, in words
    check_state: str = "na"  # ok | diff | pending | na


def stats_html(stats: RunStats) -> str:
    """Cards with the running totals and the greedy-exactness check."""
    cards = [
        ("tokens", f"{stats.tokens}"),
        ("steps", f"{stats.steps}"),
        ("tokens / step", f"{stats.mean_accepted:.2f}"),
        ("tokens / s", f"{stats.tokens_per_s:.1f}"),
    ]
    items = "".join(f'<div class="card"><div class="v">{escape(v)}</div><div class="k">{escape(k)}</div></div>'
                    for k, v in cards)
    check = (f'<div class="card check {escape(stats.check_state)}"><div class="v">{escape(stats.check)}</div>'
             f'<div class="k">vs plain greedy decoding</div></div>') if stats.check else ""
    return (f'<div class="stats">{items}{check}<div class="card status"><div class="v">{escape(stats.status)}</div>'
            f'<div class="k">status</div></div></div>')
