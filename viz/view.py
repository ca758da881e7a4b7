"""The page's view of one run at one step, built from `RunFacts` alone (live runs and replays alike).

`build_view(facts, index, message)` returns a `View`: one value per output the page redraws, by
name (`VIEW_FIELDS`), never patched by position. The app turns it into Gradio updates.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from core.families import FAMILIES
from core.records import StepKind
from viz.facts import RunFacts, RunStats, loops, summary, token_sources
from viz.mask_plot import mask_figure
from viz.text_html import emitted_tokens, heads_html, sources_note, stats_html, text_html
from viz.timing_plot import accepted_figure, cumulative_figure, phase_figure
from viz.tree_plot import empty_figure, tree_figure
from viz.verify_view import verification_html

if TYPE_CHECKING:
    from core.records import StepRecord

START_HINT = "Type a prompt and press **Start** or **Step**."


@dataclass(frozen=True)
class StepControl:
    """The "Revisit a step" control: `count` steps recorded (0: none yet), `value` shown (from 1)."""

    count: int = 0
    value: int = 1


@dataclass(frozen=True)
class View:
    """Every output of a decoding event, by name."""

    status: str
    stats: str
    text: str
    plain_text: str
    summary: dict[str, Any]
    step_slider: StepControl
    tree: Any
    tree_compare: Any
    heads: str
    mask: Any
    phases: Any
    accepted: Any
    cumulative: Any
    verify: str
    tree_rival: Any  # the other heads family's tree on the same context (Medusa <-> Hydra); None when not asked
    notice: str  # replay: what to notice at this step (or in the run), beside the tree
    recording: str  # replay: the recording's own settings, read-only, where the live settings were ("": live)


VIEW_FIELDS = tuple(f.name for f in fields(View))


@dataclass(frozen=True)
class Progress:
    """What a redraw sends while a run is running: its progress, none of its figures or tables."""

    status: str
    stats: str
    text: str
    step_slider: StepControl


PROGRESS_FIELDS = tuple(f.name for f in fields(Progress))


def empty_view(message: str = START_HINT, hint: str = "Type a prompt and press Start or Step.") -> View:
    """The page before any run (or after Reset)."""
    blank = empty_figure(hint)
    return View(status=message, stats=stats_html(RunStats()), text=text_html([]), plain_text="", summary={},
                step_slider=StepControl(), tree=blank, tree_compare=blank, heads=heads_html(None), mask=blank,
                phases=blank, accepted=blank, cumulative=blank, verify=verification_html(None, True),
                tree_rival=None, notice="", recording="")


def build_view(facts: RunFacts | None, index: int | None = None, message: str = "") -> View:
    """Every output for step `index` (0-based; default: the latest) of a run."""
    if facts is None:
        return empty_view(message or START_HINT)
    if not facts.records:
        return _prefill_view(facts, message)
    records = facts.records
    index = len(records) - 1 if index is None else max(0, min(int(index), len(records) - 1))
    record = records[index]
    note = "; ".join(n for n in (_depth_note(facts, record), _bonus_note(facts)) if n)
    return View(
        status=_status(facts, message, index), stats=_stats(facts), text=_text(facts, index),
        plain_text=facts.text, summary=summary(facts, index), step_slider=StepControl(len(records), index + 1),
        tree=_tree(facts, record, note),
        tree_compare=_comparison(facts, record), heads=heads_html(record, facts.token_bytes, _plain_why(facts, index)),
        mask=mask_figure(record.outcome, record.context_length, facts.token_bytes),
        phases=phase_figure(records, index), accepted=accepted_figure(records, index),
        cumulative=cumulative_figure(records, facts.ar), verify=verification_html(record, facts.greedy,
                                                                                   facts.token_bytes),
        tree_rival=_rival(facts, record), notice=_notice(facts, index), recording=recording_settings(facts))


def build_progress(facts: RunFacts, message: str = "") -> Progress:
    """The run's progress at its latest step (the status line, the cards, the text, Revisit), built
    without the step's figures: a redraw while the run is running."""
    if not facts.records:
        view = build_view(facts, None, message)
        return Progress(status=view.status, stats=view.stats, text=view.text, step_slider=view.step_slider)
    count = len(facts.records)
    return Progress(status=_status(facts, message, count - 1), stats=_stats(facts), text=_text(facts, count - 1),
                    step_slider=StepControl(count, count))


def _tree(facts: RunFacts, record: StepRecord, note: str) -> Any:
    """The step's tree: the drafters' whole proposal where the step verified a part of it (the rest
    faded), else the verified tree."""
    proposal = record.proposal
    if proposal is None:
        return tree_figure(record.outcome, tree_title(facts, record), note, facts.token_bytes)
    unverified = record.outcome.unverified_in(proposal)
    verified = proposal.tree.num_nodes - len(unverified)
    if record.controller == "probing":
        why = "none verified: this step is plain, to measure plain decoding's speed (faded: proposed, not verified)"
    elif record.kind == StepKind.CHAINS:
        why = "the heads had not paid lately: the auto budget verified the lookup chain alone (the heads' nodes faded)"
    elif record.kind == StepKind.PLAIN:
        why = "none verified: the heads had not paid lately, so the auto budget skipped them (faded)"
    else:
        why = f"the budget verified the best {verified} (faded: proposed, not verified)"
    note = "; ".join(n for n in (f"{proposal.tree.num_nodes} nodes proposed, {why}", note) if n)
    return tree_figure(proposal, tree_title(facts, record), note, facts.token_bytes, unverified=unverified)


def _status(facts: RunFacts, message: str, index: int | None = None) -> str:
    records = facts.records
    recorded = f"▶ Replay of a recorded run: {facts.recording} · " if facts.recording else ""
    parts = [f"{recorded}**{len(records)} step(s)** · {facts.strategy_label} · {facts.settings.get('precision', '')}"
             f" · {facts.state}."]
    if facts.spec.auto and records:
        shown = len(records) - 1 if index is None else index
        parts.append(f"Auto budget chose **{records[shown].outcome.tree.num_nodes} node(s)** at step {shown + 1}.")
    if facts.note:
        parts.append(f"Note: {facts.note}.")
    if message:
        parts.append(message)
    return " ".join(parts)


def tree_title(facts: RunFacts, record: StepRecord) -> str:
    """The tree panel's title: which tree this step verified and how it was sized."""
    settings, nodes = facts.settings, record.outcome.tree.num_nodes
    top_m, depth, budget = settings.get("top_m"), settings.get("depth"), facts.budget
    chain = " + lookup ◆" if record.outcome.lookup_rank is not None else ""
    family = facts.spec.family
    if record.kind == StepKind.CHAINS:
        main = f"Heads skipped (auto is backing off): the prompt-lookup chain alone, {nodes} nodes"
    else:
        entry = FAMILIES[family]
        if entry.grows_tree:
            sizing = f"auto budget: {nodes} of ≤ {budget} nodes" if facts.spec.auto else f"{nodes} nodes"
            main = f"{entry.tree_phrase}, {sizing} (depth {depth}){chain}"
        elif entry.sized and facts.spec.auto:
            main = f"{entry.tree_phrase}, auto budget: {nodes} of ≤ {budget} nodes (top-{top_m}, depth {depth}){chain}"
        elif entry.sized:
            main = f"{entry.tree_phrase} (budget {budget}, top-{top_m}, depth {depth}){chain}"
        elif entry.drafts:
            main = f"{entry.tree_phrase} {settings.get('fixed_preset')} ({nodes} nodes)"
        else:
            main = entry.tree_phrase
    return f"Step {record.index + 1}: {main}"


def _plain_why(facts: RunFacts, index: int) -> str:
    """Why step `index` of a drafting run verified no tree ("" for plain decoding's own steps): one token
    left to the limit leaves no room for a guess, else the drafters offered nothing this step."""
    record = facts.records[index]
    if not facts.spec.drafts or record.kind != StepKind.PLAIN:
        return ""
    emitted_before = 1 + sum(len(r.new_tokens) for r in facts.records[:index])  # the prefill gave the first
    limit = facts.settings.get("max_new_tokens")
    if isinstance(limit, int) and limit - emitted_before <= 1:
        return "one token was left to the limit, so there was nothing to guess and the base model gave it alone"
    return "the drafters offered nothing this step, so the base model gave one token alone"


def _depth_note(facts: RunFacts, record: StepRecord) -> str:
    """Why a dynamic tree is shallower than the depth setting allows."""
    tree, depth = record.outcome.tree, int(facts.settings.get("depth", 0))
    entry = FAMILIES[record.family] if record.kind == StepKind.TREE else None
    ranked_tree = entry is not None and entry.sized and not entry.grows_tree  # sized by the heads' ranks
    if not ranked_tree or tree.num_nodes == 0 or tree.max_depth >= depth:
        return ""
    return f"deepest node at depth {tree.max_depth} of {depth} allowed: no deeper path scored high enough to make the budget"


def _bonus_note(facts: RunFacts) -> str:
    if facts.greedy:
        return ""
    return ("bonus sampled by the base model (from the residual after a rejected guess), so the two trees' "
            "bonus tokens can differ")


def _comparison(facts: RunFacts, record: StepRecord) -> Any:
    """The fixed tree on the same step, or a message saying why there is none."""
    family, preset = facts.spec.family, facts.settings.get("fixed_preset")
    if record.comparison is not None:
        return tree_figure(record.comparison, f"Fixed tree {preset}, same heads & context", _bonus_note(facts),
                           facts.token_bytes)
    if record.kind == StepKind.CHAINS:
        why = (f"No fixed-tree comparison at step {record.index + 1}: the auto budget skipped the heads this step "
               f"(they had not paid lately) and verified only the prompt-lookup chain, so there were no head "
               f"guesses for a fixed tree to use.")
    elif FAMILIES[family].drafts and not FAMILIES[family].sized:  # the fixed tree
        why = "The tree above is the fixed tree itself."
    elif FAMILIES[family].grows_tree:
        why = (f"A fixed tree is a set of rank paths over the Medusa heads' guesses; the {FAMILIES[family].label} is "
               f"grown from its own path-conditioned guesses, so there is no fixed tree to draw beside it.")
    elif not FAMILIES[family].drafts:
        why = "Autoregressive decoding builds no tree, so there is nothing to compare."
    elif not facts.settings.get("compare_fixed"):
        why = ("This run was recorded without the fixed-tree comparison." if facts.recording else
               "The comparison is off: tick “Compare with the fixed tree” and press Start.")
    else:
        why = f"No fixed-tree comparison at step {record.index + 1}."
    return empty_figure(why, height=120)


def _notice(facts: RunFacts, index: int | None) -> str:
    """What to notice beside the tree: this step's note, else the recorded run's (replay only)."""
    text = ""
    if index is not None and facts.step_notes.get(index):
        text = f"**What to notice at step {index + 1}:** {facts.step_notes[index]}"
    elif facts.notice:
        noted = ", ".join(str(i + 1) for i in sorted(facts.step_notes)[:12])
        text = f"**What to notice:** {facts.notice}" + (f" Steps with a note: {noted}." if noted else "")
    return text


def recording_settings(facts: RunFacts) -> str:
    """A recording's own prompt and settings, read-only (Markdown; "" for a live run): what the steps on
    screen were decoded with, shown where the live settings are while the recording is on screen."""
    if not facts.recording:
        return ""
    settings = facts.settings
    rows = [("Strategy", facts.strategy_label), ("Precision", settings.get("precision", "?"))]
    family = FAMILIES[facts.spec.family]
    if family.drafts:
        rows += [("Top-m per head", settings.get("top_m", "?")), ("Depth (heads used)", settings.get("depth", "?"))]
    if family.decodes_fixed_tree or family.fixed_beside:
        compared = family.decodes_fixed_tree or settings.get("compare_fixed")
        rows.append(("Fixed tree", settings.get("fixed_preset", "?") if compared else "not compared"))
    temperature = float(settings.get("temperature", 0.0) or 0.0)
    rows += [("Acceptance", f"{settings.get('rule', 'greedy')}" + (f" at temperature {temperature:g}" if temperature
                                                                   else " (temperature 0)")),
             ("Max new tokens", settings.get("max_new_tokens", "?"))]
    if facts.model:
        rows.append(("Model", facts.model))
    prompt = facts.prompt if len(facts.prompt) <= 240 else facts.prompt[:239] + "…"
    table = "\n".join(f"| {name} | {escape_cell(value)} |" for name, value in rows)
    return (f"**This recording's settings** (read-only: they made the steps on screen)\n\n"
            f"Prompt: *{escape_cell(prompt)}*\n\n| setting | value |\n|---|---|\n{table}")


def escape_cell(value: Any) -> str:
    """A value as Markdown table text: no pipes, no line breaks, no markup."""
    text = str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")
    return re.sub(r"([*_`<>\[\]#])", r"\\\1", text)


def _stats(facts: RunFacts) -> str:
    """The cards, with who produced the tokens so far (and a word when the text loops)."""
    sizes = None if not FAMILIES[facts.spec.family].drafts else [r.outcome.tree.num_nodes for r in facts.records]
    looping = loops(facts.output_ids)
    return stats_html(facts.stats, sources_note(token_sources(facts.records), looping), sizes,
                      looping=looping)


def _rival(facts: RunFacts, record: StepRecord) -> Any:
    """The other heads family's tree on the same context, with what it would have accepted (None: not asked)."""
    rival = record.rival
    if rival is None:
        wanted = facts.settings.get("compare_heads") and facts.spec.grown
        why = (f"No other drafter's tree at step {record.index + 1} (no heads step, the drafter chosen is this "
               f"run's own, or its weights are not shipped)." if wanted else "")
        return empty_figure(why, height=80) if why else None  # None: the page shows no box
    entry = FAMILIES[rival.tree.kind]
    other = f"{entry.weights_name} ({entry.guesses})"
    mine, theirs = record.outcome.accepted_length - 1, rival.accepted_length - 1
    title = (f"Step {record.index + 1}, same context: the {other} tree of {rival.tree.num_nodes} nodes would "
             f"accept {theirs} token(s); this run's tree accepted {mine}")
    return tree_figure(rival, title, _bonus_note(facts), facts.token_bytes)


def _text(facts: RunFacts, index: int | None) -> str:
    tokens = emitted_tokens(facts.records, facts.output_ids[0], facts.first_text, len(facts.output_ids),
                            facts.token_bytes)
    return text_html(tokens, index)


def _prefill_view(facts: RunFacts, message: str) -> View:
    default = ("The first token (from the prefill) already ended the run." if facts.finished
               else "Prefilled. Press **Step** to run the first tree.")
    blank = empty_figure("Prefill done: the base model chose the first token." +
                         ("" if facts.finished else " Press Step for the first tree."))
    status = _status(facts, message if message.startswith("⚠️") else " ".join(m for m in (message, default) if m))
    base = empty_view("")
    return View(status=status, stats=_stats(facts), text=_text(facts, None), plain_text=facts.text,
                summary=summary(facts, None), step_slider=StepControl(), tree=blank, tree_compare=blank,
                heads=base.heads, mask=base.mask, phases=base.phases, accepted=base.accepted,
                cumulative=base.cumulative, verify=base.verify, tree_rival=base.tree_rival,
                notice=_notice(facts, None), recording=recording_settings(facts))
