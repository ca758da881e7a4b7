"""HTML views: the generated text coloured by step and marked by source, the heads' guesses, running totals.

Everything model- or user-supplied is HTML-escaped; styling comes from classes in assets/app.css.
Steps are numbered from 1 wherever a user reads them (records keep core's 0-based index).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from core.families import FAMILIES, depth_label
from core.records import StepKind
from viz.facts import RunStats, ratio_verdict
from viz.labels import TokenBytes, escape, sequence_texts, texts_from_bytes, visible
from viz.style import STEP_CYCLE

if TYPE_CHECKING:
    from core.records import StepRecord

ROLES = {
    "root": "first token (from the prefill)",
    "accepted": "head guess accepted",
    "copied": "prompt-lookup guess accepted",
    "bonus": "bonus token (base model)",
}
CHAIN_NAMES = {"lookup": "prompt lookup", "store": "datastore"}  # TreeOutcome.node_source -> words
DEPTH_MARKS = 4  # underline styles for accepted guesses at depth 1, 2, 3 and 4+


@dataclass(frozen=True)
class EmittedToken:
    """One generated token and where it came from."""

    text: str
    token_id: int
    step: int  # the record index of the step that emitted it; -1 for the prefill token
    role: str  # root | accepted | copied | bonus
    source: str = ""  # who guessed it, in words: head k rank r (joint p), lookup depth d, bonus
    depth: int = 0  # depth in the step's tree (0: root or bonus)
    joins_next: bool = False  # ends inside a character that the next token completes

    @property
    def step_label(self) -> str:
        return "prefill" if self.step < 0 else f"step {self.step + 1}"


def _source(record: StepRecord, node: int, copied: bool) -> tuple[str, int]:
    """Who proposed an accepted node, and its depth."""
    outcome = record.outcome
    path = outcome.tree.paths[node - 1]
    if copied:
        drafter = CHAIN_NAMES.get(outcome.node_source(node), outcome.node_source(node))
        return f"{drafter}, depth {len(path)}", len(path)
    if outcome.grown:
        return (f"{FAMILIES[outcome.tree.kind].node_phrase} {len(path)}, child {outcome.sibling_ranks()[node]} "
                f"(joint p {outcome.node_scores[node]:.3g})", len(path))
    return f"head {len(path)} rank {path[-1]} (joint p {outcome.node_scores[node]:.3g})", len(path)


def _step_tokens(record: StepRecord, texts: Sequence[str] | None) -> list[EmittedToken]:
    outcome = record.outcome
    copied = outcome.lookup_nodes
    tokens = []
    for node in outcome.accepted_nodes[1:]:
        text = texts[node] if texts else f"#{outcome.node_tokens[node]}"
        source, depth = _source(record, node, node in copied)
        role = "copied" if node in copied else "accepted"
        tokens.append(EmittedToken(text, outcome.node_tokens[node], record.index, role, source, depth))
    bonus_text = outcome.bonus_text if outcome.bonus_text or texts else f"#{outcome.bonus_token}"
    tokens.append(EmittedToken(bonus_text, outcome.bonus_token, record.index, "bonus",
                               "bonus: the base model's own token after the accepted path"))
    return tokens


def _with_bytes(tokens: list[EmittedToken], token_bytes: TokenBytes | None) -> list[EmittedToken]:
    """Texts from raw bytes: a character split over tokens shown whole on the token that completes it."""
    if token_bytes is None or not all(t.token_id in token_bytes for t in tokens):
        return tokens
    shown = sequence_texts([token_bytes[t.token_id] for t in tokens])
    return [EmittedToken(text, t.token_id, t.step, t.role, t.source, t.depth, joins)
            for t, (text, joins) in zip(tokens, shown)]


def emitted_tokens(records: Sequence[StepRecord], first_id: int, first_text: str, limit: int,
                   token_bytes: TokenBytes | None = None) -> list[EmittedToken]:
    """Generated tokens in order, cut at `limit` (the session's output length: EOS / max tokens cut steps short)."""
    tokens = [EmittedToken(first_text, first_id, -1, "root", ROLES["root"])]
    for record in records:
        outcome = record.outcome
        texts = outcome.node_texts if len(outcome.node_texts) == len(outcome.node_tokens) else None
        tokens += _step_tokens(record, texts)
    return _with_bytes(tokens[:limit], token_bytes)


def _body(text: str) -> str:
    body = escape(text).replace("\t", '<span class="ws">⇥</span>')
    body = body.replace("\n", '<span class="ws">↵</span><br>')
    return body if body else '<span class="ws">∅</span>'


def _classes(token: EmittedToken, selected_step: int | None) -> str:
    step_class = "s-pre" if token.step < 0 else f"s{token.step % STEP_CYCLE}"
    depth = f" d{min(token.depth, DEPTH_MARKS)}" if token.depth else ""
    selected = " sel" if selected_step is not None and token.step == selected_step else ""
    return f"tok {step_class} r-{token.role}{depth}{selected}"


def _title(token: EmittedToken) -> str:
    return f"{token.step_label} · {token.source or ROLES[token.role]} · id {token.token_id} · {visible(token.text)}"


def _span(group: Sequence[EmittedToken], selected_step: int | None) -> str:
    """One span for a token, or for the tokens that together make one character (the last one's style)."""
    last = group[-1]
    title = " + ".join(_title(t) for t in group)
    return f'<span class="{_classes(last, selected_step)}" title="{escape(title)}">' \
           f'{_body("".join(t.text for t in group))}</span>'


def _groups(tokens: Sequence[EmittedToken]) -> list[list[EmittedToken]]:
    groups: list[list[EmittedToken]] = [[]]
    for token in tokens:
        groups[-1].append(token)
        if not token.joins_next:
            groups.append([])
    return [g for g in groups if g]


def _legend(tokens: Sequence[EmittedToken]) -> str:
    copied = ('<span class="tok s0 r-copied">lookup guess accepted</span> '
              if any(t.role == "copied" for t in tokens) else "")
    depths = "".join(f'<span class="tok s0 r-accepted d{d}">{d}</span> ' for d in range(1, DEPTH_MARKS + 1))
    return ('<div class="gen-legend"><span class="tok s-pre r-root">first token</span> '
            f'<span class="depths">head guess accepted, underline by depth: {depths}</span>' + copied +
            '<span class="tok s0 r-bonus">bonus (base model)</span> '
            '<span class="hint">background colour = step that produced the token; hover a token for its source'
            '</span></div>')


def text_html(tokens: Sequence[EmittedToken], selected_step: int | None = None) -> str:
    """The generated text, one span per token: background = step, underline = head guess (style by depth),
    dashed purple = copied by prompt lookup, bold orange = bonus. Hover names the source and the step."""
    legend = _legend(tokens)
    if not tokens:
        return f'<div class="gen-text">{legend}<div class="gen-body empty">Press Start or Step.</div></div>'
    spans = "".join(_span(group, selected_step) for group in _groups(tokens))
    return f'<div class="gen-text">{legend}<div class="gen-body">{spans}</div></div>'


def heads_html(record: StepRecord | None, token_bytes: TokenBytes | None = None, plain_why: str = "") -> str:
    """Each head's top guesses with probabilities; the guesses on the accepted path are marked ✓.

    `plain_why`: why a plain step of a drafting run verified no tree (else the step is plain decoding's)."""
    if record is None:
        return '<div class="heads-table empty">Each head\'s top guesses appear here after the first step.</div>'
    if not record.head_probs and record.kind == StepKind.CHAINS:
        return ('<div class="heads-table empty">No heads in this step: the auto budget is backing off (the heads '
                'have not paid lately), so the tree is only the prompt-lookup chain (◆).</div>')
    if not record.head_probs and plain_why:
        return f'<div class="heads-table empty">No heads in this step: {escape(plain_why)}.</div>'
    if not record.head_probs:
        return ('<div class="heads-table empty">No heads in this step: autoregressive decoding asks only the '
                'base model for one token.</div>')
    accepted_ranks = _accepted_ranks(record)
    header = "".join(f"<th>rank {r}</th>" for r in range(len(record.head_probs[0])))
    row_label = depth_label(record.outcome.tree.kind)
    rows = []
    for depth, (probs, ids) in enumerate(zip(record.head_probs, record.head_token_ids), start=1):
        fallback = record.head_texts[depth - 1] if len(record.head_texts) >= depth else []
        row_texts = texts_from_bytes(ids[:len(probs)], token_bytes, fallback[:len(probs)])
        cells = []
        for rank, (p, text) in enumerate(zip(probs, row_texts)):
            mark = ' class="acc"' if accepted_ranks.get(depth) == rank else ""
            tick = "✓ " if mark else ""
            shade = min(1.0, p ** 0.5) if p == p else 0.0  # sqrt: small probabilities stay visible
            shown = escape(visible(text))
            cells.append(f'<td{mark} style="--p:{shade:.3f}" title="{shown} {p:.3f}"><code>{tick}{shown}</code>'
                         f"<small>{p:.3f}</small></td>")
        what = "after the best path" if record.outcome.grown else f"guesses t+{depth + 1}"
        rows.append(f"<tr><th>{row_label} {depth}<br><small>{what}</small></th>{''.join(cells)}</tr>")
    caption = (f'<caption>{escape(FAMILIES[record.outcome.tree.kind].table_caption)}</caption>'
               if record.outcome.grown else "")
    return (f'<div class="heads-table"><table>{caption}<thead><tr><th></th>{header}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def _accepted_ranks(record: StepRecord) -> dict[int, int]:
    """depth -> the rank (column of the table) the accepted path took there, where it is shown.

    Medusa heads: the accepted node's rank. Hydra heads: the table holds the conditionals along
    the best path, so a cell is marked only while the accepted path follows that path."""
    outcome = record.outcome
    copied = outcome.lookup_nodes
    heads_nodes = [node for node in outcome.accepted_nodes[1:] if node not in copied]
    if not outcome.grown:
        return {len(outcome.tree.paths[node - 1]): outcome.tree.paths[node - 1][-1] for node in heads_nodes}
    ranks: dict[int, int] = {}
    for depth, node in enumerate(outcome.accepted_nodes[1:], start=1):
        if depth > len(record.head_token_ids) or node in copied:
            break
        row = record.head_token_ids[depth - 1]
        token = outcome.node_tokens[node]
        if token not in row:
            break
        ranks[depth] = row.index(token)
        if ranks[depth] != 0:
            break  # off the best path: the rows below are conditioned on another token
    return ranks


def _measured(stats: RunStats) -> bool:
    return stats.vs_plain_basis.startswith("measured")


def _tree_size_card(sizes: Sequence[int] | None) -> str:
    """Nodes verified per step on average, how many steps were plain (the root alone) and the largest tree:
    what an adaptive budget chose, seen at a glance."""
    if not sizes:  # plain decoding (None), or no step yet
        return ""
    plain = sum(1 for size in sizes if size == 0)
    mean = sum(sizes) / len(sizes)
    return (f'<div class="card trees" title="nodes verified per step besides the root; a plain step verifies the '
            f'root alone; largest: the biggest tree verified"><div class="v">{mean:.1f}</div>'
            f'<div class="k">nodes / step</div><div class="sub">{plain} plain · largest {max(sizes)}</div></div>')


def _verdict(stats: RunStats, looping: bool) -> str:
    """wins / loses / ties for a measured ratio; a loop gets no winning verdict (copying drafters accept a
    loop whole, so its speed-up says nothing about other text)."""
    state = ratio_verdict(stats.vs_plain)
    return "loop" if looping and state == "wins" else state


def _speed_card(stats: RunStats, looping: bool = False) -> str:
    """Tokens/s, and the ratio to plain decoding once plain decoding is measured: a verdict (wins / loses)
    when not on a loop; before, "measuring" (recordings of older runs: their estimate, marked as one);
    plain decoding is never compared with itself."""
    if stats.vs_plain is None and stats.vs_plain_basis.startswith("measuring"):
        sub = f'<div class="sub neutral" title="{escape(stats.vs_plain_basis)}">vs plain decoding: measuring…</div>'
    elif stats.vs_plain is None:
        sub = (f'<div class="sub neutral">{escape(stats.vs_plain_basis)}</div>' if stats.vs_plain_basis else "")
    elif _measured(stats):
        state = _verdict(stats, looping)
        colour = "neutral" if state == "loop" else state
        # two decimals below 2x: the card's sentence works the ratio out to two ("= 1.06×"), and a
        # header rounded to "1.1×" beside it did not add up
        ratio = f"{stats.vs_plain:.1f}" if stats.vs_plain >= 2 else f"{stats.vs_plain:.2f}"
        sub = (f'<div class="sub {colour}" title="{escape(stats.vs_plain_basis)}">{ratio}× plain '
               f'decoding (measured{", on a loop" if state == "loop" else ""})</div>')
    else:  # a recording made when the card still estimated
        sub = (f'<div class="sub neutral" title="{escape(stats.vs_plain_basis)}">≈ {stats.vs_plain:.1f}× plain '
               f'decoding (estimated, not yet measured)</div>')
    page = (f'<div class="sub neutral page" title="the page\'s own time over the run\'s steps (drawing the tree, tables and '
            f'plots; a moment left to a browser on this machine to draw them): not decoding time, so not in '
            f'tokens / s or the ratio">page: {stats.page_ms:.0f} ms '
            f'a step, apart</div>' if stats.page_ms is not None else "")
    return (f'<div class="card speed"><div class="v">{stats.tokens_per_s:.1f}</div><div class="k">tokens / s</div>'
            f'{sub}{page}</div>')


def _speed_note(stats: RunStats, looping: bool = False) -> str:
    """Why the run wins or loses, once the plain run is measured; before, what the estimate rests on. The
    reason (`vs_plain_why`, "wins: ..." or "loses: ...") is the whole run's: part-way through a replay the
    ratio so far may say otherwise, and then only the verdict is shown."""
    if not stats.vs_plain_why or stats.vs_plain is None:
        return ""
    if not _measured(stats):
        return (f'<div class="speed-note neutral">An estimate ({escape(stats.vs_plain_basis)}); the verdict comes '
                f'when the plain run of this prompt is measured (at the end of the run, or press Check).</div>')
    state = _verdict(stats, looping)
    if state == "ties":  # within a run's noise: no verdict
        return (f'<div class="speed-note neutral">About as fast as plain decoding '
                f'(plain decoding: {escape(stats.vs_plain_basis)}).</div>')
    if state == "loop":
        return (f'<div class="speed-note neutral">Faster than plain decoding, but the text repeats itself: no verdict '
                f'(plain decoding: {escape(stats.vs_plain_basis)}).</div>')
    why = stats.vs_plain_why if stats.vs_plain_why.startswith(f"{state}:") else f"{state} so far"
    return (f'<div class="speed-note {state}">This setting {escape(why)} '
            f'(plain decoding: {escape(stats.vs_plain_basis)}).</div>')


def sources_note(sources: dict[str, int], looping: bool) -> str:
    """Who produced the tokens (so a speed-up is credited to the right drafter), and a warning on loops."""
    guessed = {k: v for k, v in sources.items() if k != "base model" and v}
    if not guessed and not looping:
        return ""
    names = {"heads": "the heads", "lookup": "prompt lookup", "store": "the datastore"}
    parts = ", ".join(f"{v} by {names[k]}" for k, v in guessed.items()) or "none"
    loop = (" The text repeats itself (a loop): copying drafters accept loops whole, so this speed-up says little "
            "about other text." if looping else "")
    return (f'<div class="speed-note neutral">Accepted guesses: {escape(parts)}; '
            f'{sources.get("base model", 0)} token(s) from the base model itself.{escape(loop)}</div>')


def stats_html(stats: RunStats, sources: str = "", tree_sizes: Sequence[int] | None = None, *,
               looping: bool = False) -> str:
    """Cards with the running totals, the tree sizes verified (`tree_sizes`: nodes besides the root per
    step; None for plain decoding), the speed against plain decoding and the greedy-exactness check;
    `sources`: the `sources_note` under them; `looping`: the text repeats itself (no winning verdict)."""
    cards = [("tokens", f"{stats.tokens}"), ("steps", f"{stats.steps}"), ("tokens / step", f"{stats.mean_accepted:.2f}")]
    items = "".join(f'<div class="card"><div class="v">{escape(v)}</div><div class="k">{escape(k)}</div></div>'
                    for k, v in cards) + _tree_size_card(tree_sizes)
    check = (f'<div class="card check {escape(stats.check_state)}"><div class="v">{escape(stats.check)}</div>'
             f'<div class="k">vs plain greedy decoding</div></div>') if stats.check else ""
    return (f'<div class="stats">{items}{_speed_card(stats, looping)}{check}<div class="card status"><div class="v">'
            f'{escape(stats.status)}</div><div class="k">status</div></div></div>{_speed_note(stats, looping)}{sources}')
