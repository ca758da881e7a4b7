"""Re-record the gallery (assets/gallery): real runs of the shipped model and heads, each chosen to show one thing.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python scripts/record_gallery.py [--only NAME ...]

Every run goes through the lab's own code (labstate: settings, prefill, steps, the plain-greedy
check), is exported as a trace (labstate.trace) and gets its "what to notice", for the run and for the
steps that show it, found from the records themselves (no hand-picked step numbers), so the notes
stay true when the heads change. Run it again whenever the heads or the model change.
"""
from __future__ import annotations

import argparse
import json
from core import settings
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import labstate
from core.records import StepKind, StepRecord, TreeOutcome

GALLERY = Path(__file__).resolve().parent.parent / "assets" / "gallery"
Notes = Callable[[list[StepRecord]], dict[int, str]]


@dataclass(frozen=True)
class Recording:
    name: str
    title: str
    notice: str
    prompt: str
    settings: dict
    notes: Notes = field(default=lambda records: {})
    alternatives: tuple[str, ...] = ()  # prompts tried in turn until one shows what the run is for
    shows: Callable[[labstate.LabState], bool] = field(default=lambda lab: True)  # the run shows its point
    engine: str = ""  # the forward it is recorded on ("": the lab's default, the exact kernels where they build)
    point: Callable[[list[StepRecord]], int | None] = field(default=lambda records: None)  # opens here (else
    # on its first note): the first step where the run's featured method wins


def _accepted(outcome: TreeOutcome) -> int:
    return outcome.accepted_length - 1  # head (or chain) tokens accepted below the root


def _quoted(outcome: TreeOutcome, nodes: list[int] | None = None) -> str:
    """The accepted tokens (or `nodes`) as the text they make, quoted; line breaks shown as ⏎."""
    nodes = outcome.accepted_nodes[1:] if nodes is None else nodes
    text = "".join(outcome.node_texts[n] for n in nodes if n < len(outcome.node_texts))
    return "“" + text.replace("\n", "⏎") + "”"


def _took(outcome: TreeOutcome) -> str:
    """"2 guesses, “ the sky”" or "no guess"."""
    accepted = _accepted(outcome)
    if not accepted:
        return "no guess"
    return f"{accepted} guess{'es' if accepted > 1 else ''}, {_quoted(outcome)}"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _wins(records: list[StepRecord], rival_of: Callable[[StepRecord], TreeOutcome | None], ours: str, theirs: str,
          why_ours: str, why_theirs: str) -> dict[int, str]:
    """A note on every step where one of two trees on the same heads and context accepted more: each says
    what both accepted, in words, and why the winner can."""
    notes = {}
    for r in records:
        other = rival_of(r)
        if other is None or other.accepted_length == r.outcome.accepted_length:
            continue
        if r.outcome.accepted_length > other.accepted_length:
            notes[r.index] = (f"{_capital(ours)} accepted {_took(r.outcome)}; {theirs} on the same context "
                              f"{_took(other)}. {why_ours}")
        else:
            notes[r.index] = (f"{_capital(theirs)} wins this step: {_took(other)}, against {_took(r.outcome)} for "
                              f"{ours}. {why_theirs}")
    return notes


def _dynamic_beats_fixed(records: list[StepRecord]) -> dict[int, str]:
    return _wins(records, lambda r: r.comparison, "the dynamic tree (top)", "the fixed tree (below)",
                 "Its nodes went to the heads' likeliest paths, however deep, not to a fixed shape.",
                 "Its wide, shallow shape held a guess the dynamic tree's budget left out.")


def _right_then_wrong(records: list[StepRecord]) -> dict[int, str]:
    notes = {}
    for r in records:
        if r.kind == StepKind.TREE and _accepted(r.outcome) == 2 and r.outcome.tree.max_depth >= 3:
            notes[r.index] = (f"Heads 1 and 2 were right, {_quoted(r.outcome)}, but no depth-3 guess was what the "
                              f"base model wanted: it gave “{r.outcome.bonus_text.replace(chr(10), '⏎')}” itself "
                              f"(the bonus token). The verification table shows each path's stop.")
    return notes


def _hydra_beats_medusa(records: list[StepRecord]) -> dict[int, str]:
    return _wins(records, lambda r: r.rival, "Medusa's tree (top)", "Hydra's tree (below)",
                 "Here the heads' independent guesses were enough.",
                 "Each Hydra head reads the guesses above it, so its second token follows its first.")


def _eagle_beats_medusa(records: list[StepRecord]) -> dict[int, str]:
    return _wins(records, lambda r: r.rival, "EAGLE's tree (top)", "the Medusa heads' tree (below)",
                 "EAGLE drafts token by token from the base model's features and its own last guess.",
                 "Medusa's heads guess every depth at once from one state: here that was enough.")


def _first_win(rival_of: Callable[[StepRecord], TreeOutcome | None], verified_wins: bool
               ) -> Callable[[list[StepRecord]], int | None]:
    """The first step where the verified tree (`verified_wins`) or the one beside it accepted more."""
    def first(records: list[StepRecord]) -> int | None:
        return next((r.index for r in records if rival_of(r) is not None
                     and (r.outcome.accepted_length > rival_of(r).accepted_length) == verified_wins
                     and r.outcome.accepted_length != rival_of(r).accepted_length), None)
    return first


def _chain_nodes(outcome: TreeOutcome, source: str) -> list[int]:
    return [n for n in outcome.accepted_nodes[1:] if outcome.node_source(n) == source]


def _most_from(source: str) -> Callable[[list[StepRecord]], int | None]:
    """The first step that accepted the most tokens from the `source` chain (None: none did)."""
    def most(records: list[StepRecord]) -> int | None:
        counts = [len(_chain_nodes(r.outcome, source)) for r in records]
        return counts.index(max(counts)) if counts and max(counts) else None
    return most


def _long_copies(records: list[StepRecord]) -> dict[int, str]:
    return {r.index: f"The prompt-lookup chain (◆) copied {len(_chain_nodes(r.outcome, 'lookup'))} tokens from the "
                     f"prompt in one verify: {_quoted(r.outcome, _chain_nodes(r.outcome, 'lookup'))}."
            for r in records if len(_chain_nodes(r.outcome, "lookup")) >= 3}


def _store_hits(records: list[StepRecord]) -> dict[int, str]:
    hits = {r.index: f"A datastore branch (n-grams of the model's own earlier answers) supplied "
                     f"{len(_chain_nodes(r.outcome, 'store'))} accepted token(s), "
                     f"{_quoted(r.outcome, _chain_nodes(r.outcome, 'store'))}"
                     f"{' (the heads skipped: the chains alone were verified)' if r.kind == StepKind.CHAINS else ''}."
            for r in records if _chain_nodes(r.outcome, "store")}
    return hits or {r.index: f"The datastore proposed {sum(1 for s in r.outcome.chain_sources if s == 'store')} "
                             f"branch(es) here; the heads' own guesses held the accepted {_quoted(r.outcome)}."
                    for r in records if "store" in r.outcome.chain_sources and _accepted(r.outcome) >= 2}


CONTROLLER_WHY = {
    "backing off": "the heads' trees had not paid for their verify lately, so steps are plain (or the lookup "
                   "chain alone) until evidence says otherwise",
    "probing": "a plain step, to measure what plain decoding costs now",
    "exploring": "a one-node tree, a cheap test of whether the heads guess again",
    "normal": "trees are back: the last ones paid for their verify",
}


def _fallbacks(records: list[StepRecord]) -> dict[int, str]:
    """A note where the controller changes state (not on every step of a state)."""
    notes, before = {}, "normal"
    for r in records:
        if r.controller and r.controller != before:
            notes[r.index] = (f"The controller turns to “{r.controller}”: {CONTROLLER_WHY.get(r.controller, '')}. "
                              f"This step verified {r.outcome.tree.num_nodes} node(s) and emitted "
                              f"{len(r.new_tokens)} token(s).")
            before = r.controller
    return dict(list(notes.items())[:12])


def _sampled(records: list[StepRecord], rule: str) -> dict[int, str]:
    """Steps that accepted two or more guesses and steps that rejected every one, in words."""
    notes = {}
    for r in records:
        if not r.outcome.tree.num_nodes:
            continue
        if _accepted(r.outcome) >= 2:
            notes[r.index] = f"{_accepted(r.outcome)} guesses passed {rule}: {_quoted(r.outcome)}."
        elif _accepted(r.outcome) == 0 and rule == "speculative sampling":
            notes[r.index] = (f"Every guess was rejected: each guess x passes with probability p(x) (q(x) = 1), "
                              f"and after a rejection x leaves p and the rest is renormalised; the bonus "
                              f"“{r.outcome.bonus_text.replace(chr(10), '⏎')}” was drawn from what remained.")
    return dict(sorted(notes.items())[:14])


def _accepting(records: list[StepRecord]) -> dict[int, str]:
    return _sampled(records, "typical acceptance at temperature 0.7")


def _rejections(records: list[StepRecord]) -> dict[int, str]:
    return _sampled(records, "speculative sampling")


def _backs_off(lab: labstate.LabState) -> bool:
    return any(r.controller == "backing off" for r in lab.run.session.records)


PROMPT_PHOTOSYNTHESIS = "Explain what photosynthesis is in two sentences."
BASE = dict(budget=63, top_m=32, depth=4, fixed_preset="mc_sim_7b_63", rule="greedy", temperature=0.0,
            precision="gguf-q8", max_new_tokens=64, compare_fixed=True, custom_tree="", compare_heads="")
RIGHT_ANSWERS = ("What are the benefits of regular exercise?", "List the steps to make a cup of tea.",
                 "What do bees make? Answer in one sentence.", "Give me a simple recipe for scrambled eggs.")
RECORDINGS = [
    Recording("dynamic_vs_fixed", "Dynamic tree vs Medusa's fixed tree",
              "Every step verifies the dynamic tree (top) and, for comparison, Medusa's fixed 63-node tree on the "
              "same heads and context (below). Where the heads are confident the dynamic tree spends its nodes "
              "deep on the likely path and accepts more; where they are not, the fixed tree's width can win.",
              PROMPT_PHOTOSYNTHESIS, dict(BASE, strategy="dynamic"),
              _dynamic_beats_fixed, point=_first_win(lambda r: r.comparison, verified_wins=True)),
    Recording("right_then_wrong", "Heads right at depth 1, wrong at depth 3",
              "Each head guesses one position further ahead from the same hidden state, so they get worse with "
              "depth: head 1 is often right, head 3 rarely. The verification table shows where each path stopped.",
              "List the steps to make a cup of tea.", dict(BASE, strategy="dynamic", compare_fixed=False),
              _right_then_wrong),
    Recording("hydra_beside_medusa", "Hydra's tree beside Medusa's, same context",
              "At every step the Medusa heads' dynamic tree (top) is verified, and the Hydra heads grow their own "
              "tree of the same size from the same context (bottom). Hydra's guesses read the path drafted before "
              "them, so the second token can follow the first: watch where that makes Hydra accept more.",
              PROMPT_PHOTOSYNTHESIS, dict(BASE, strategy="dynamic", compare_fixed=False, compare_heads="hydra"),
              _hydra_beats_medusa, point=_first_win(lambda r: r.rival, verified_wins=False)),
    Recording("eagle_beside_medusa", "EAGLE's tree beside Medusa's, same context",
              "Every step verifies the tree EAGLE's draft layer grows (top); the Medusa heads' dynamic tree of the "
              "same size is drawn from the same context (below). Medusa's heads each guess one position from the "
              "same hidden state; EAGLE's one layer drafts token by token from the base model's low, middle and "
              "last-layer features and its own previous guess, so deeper guesses follow the path above them.",
              PROMPT_PHOTOSYNTHESIS, dict(BASE, strategy="eagle", compare_fixed=False, compare_heads="dynamic"),
              _eagle_beats_medusa, point=_first_win(lambda r: r.rival, verified_wins=True)),
    Recording("prompt_lookup_copy", "Prompt lookup copies a long span",
              "When the answer repeats the prompt, the prompt-lookup chain (◆) proposes the text that followed "
              "the last words where they appeared before, and a whole span is accepted in one verify.",
              "Copy this list exactly, one item per line: red apples, green pears, yellow bananas, purple "
              "grapes, orange oranges.",
              dict(BASE, strategy="dynamic:auto+lookup", compare_fixed=False), _long_copies,
              point=_most_from("lookup")),
    Recording("datastore_phrase", "The datastore completes a stock phrase",
              "The datastore holds n-grams of the model's own earlier answers; a branch from it joins the tree, "
              "and stock phrases (list openings, polite formulas) are accepted from it.",
              "What are the benefits of regular exercise?",
              dict(BASE, strategy="dynamic:auto+lookup+store", compare_fixed=False), _store_hits,
              point=_most_from("store"),
              alternatives=("Write a polite email to a colleague thanking them for helping with a project.",
                            "Give me a simple recipe for scrambled eggs.", "List the steps to make a cup of tea."),
              shows=lambda lab: any(len(_chain_nodes(r.outcome, "store")) >= 3 for r in lab.run.session.records)),
    Recording("auto_falls_back", "The adaptive budget falls back to plain steps",
              "The adaptive budget prices every tree by this machine's measured verify cost and the heads' "
              "measured acceptance. Where trees do not pay (the heads guess badly, or, as on a 2-core CPU, a "
              "verify costs more than the tokens it wins) it backs off to plain steps (or the lookup chain "
              "alone), probing now and then and trying a one-node tree to see whether the heads guess again.",
              "Give three examples of mammals that live in the ocean.",
              dict(BASE, strategy="dynamic:auto", compare_fixed=False), _fallbacks,
              alternatives=RIGHT_ANSWERS, shows=_backs_off),
    Recording("typical_acceptance", "Typical acceptance at temperature 0.7",
              "With typical acceptance a guess passes when the base model gives it enough probability (not only "
              "when it is the top token): more tokens per step, and text that is sampled, not greedy. Compare "
              "with the first run's greedy answer to the same prompt.", PROMPT_PHOTOSYNTHESIS,
              dict(BASE, strategy="dynamic", rule="typical", temperature=0.7, compare_fixed=False), _accepting),
    Recording("bf16_near_tie", "Without the exact kernels: a near-tie flips a token",
              "Recorded on the lean forward (library kernels, what runs where the lab's own cannot be compiled): "
              "it sums a tree's rows in another order than a one-token step, so where plain decoding's two best "
              "tokens are (nearly) tied the verify can pick the other one and the text departs from plain greedy "
              "decoding in the same precision. The check card names the token and the logit gap. Every other run "
              "here, and the live page, use the exact kernels: each tree row is bitwise the one-token step, and "
              "the text is plain greedy's in every precision.",
              PROMPT_PHOTOSYNTHESIS,
              dict(BASE, strategy="dynamic", precision="bf16", compare_fixed=False, max_new_tokens=96),
              alternatives=RIGHT_ANSWERS + ("Describe the water cycle for a ten-year-old.",
                                            "Explain how a bicycle stays upright."),
              shows=lambda lab: labstate.greedy_check(lab, lab.run).state == "diff", engine="lean"),
    Recording("speculative_sampling", "Tree speculative sampling: reject and resample",
              "A guess is one proposal, not a draw from the heads' probabilities, so in min(1, p(x)/q(x)) the "
              "draft's q(x) = 1: each guess x is accepted with probability p(x), the base model's. On a rejection "
              "x is removed from p and the rest renormalised before the next sibling is tried, and the bonus "
              "token is drawn from what remains: the output follows the base model's distribution exactly.",
              PROMPT_PHOTOSYNTHESIS,
              dict(BASE, strategy="dynamic", rule="speculative", temperature=0.8, compare_fixed=False), _rejections),
]


def _divergence_notes(lab: labstate.LabState) -> dict[int, str]:
    """The step that emitted the first token differing from fp32 plain greedy, with its logit gap."""
    check = labstate.greedy_check(lab, lab.run)
    if check.position is None:
        return {}
    emitted = 1  # the prefill's token
    for record in lab.run.session.records:
        emitted += len(record.new_tokens)
        if emitted > check.position:
            gap = ("were exactly tied (gap 0)" if check.logit_gap == 0 else
                   f"were {check.logit_gap:.3g} apart")
            return {record.index: f"token {check.position + 1} differs from plain greedy decoding (lean forward, "
                                  f"bf16): the plain run's top two logits {gap}, and the tree verify, summing in "
                                  f"another order, ranked them the other way"}
    return {}


def record(recording: Recording) -> dict:
    """Run one recording through the lab and write its trace; returns its gallery index row."""
    run_settings = labstate.parse_settings(recording.settings)
    engine = {"engine": recording.engine} if recording.engine else {}  # read when its runtime loads
    with settings.overridden(**engine):
        for prompt in (recording.prompt, *recording.alternatives):
            lab = labstate.record_lab(prompt, run_settings)
            if recording.shows(lab):
                break
        records = list(lab.run.session.records)
        found = _divergence_notes(lab) if recording.name == "bf16_near_tie" else recording.notes(records)
    notes = {str(i + 1): text for i, text in sorted(found.items())}
    point = recording.point(records)
    meta = {"title": recording.title, "notice": recording.notice, "notes": notes,
            **({"point": point + 1} if point is not None else {}),
            "engine": lab.run.runtime.base.engine_name}
    (GALLERY / f"{recording.name}.json").write_text(labstate.run_trace(lab, meta), encoding="utf-8")
    print(f"{recording.name}: {len(records)} steps, {len(lab.run.session.output_ids)} tokens, {len(notes)} noted",
          file=sys.stderr)
    return {"name": recording.name, "title": recording.title, "notice": recording.notice,
            "file": f"{recording.name}.json"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="re-record these runs only")
    args = parser.parse_args()
    GALLERY.mkdir(parents=True, exist_ok=True)
    index_path = GALLERY / "index.json"
    old = {row["name"]: row for row in json.loads(index_path.read_text())["runs"]} if index_path.exists() else {}
    rows = [record(r) if args.only is None or r.name in args.only else old[r.name] for r in RECORDINGS]
    index_path.write_text(json.dumps({"runs": rows}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
