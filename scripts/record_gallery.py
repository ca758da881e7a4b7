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
from core.records import StepKind, StepRecord

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
    shows: Callable[[labstate.GreedyCheck], bool] = field(default=lambda check: True)
    engine: str = ""  # the forward it is recorded on ("": the lab's default, the exact kernels where they build)


def _accepted(record: StepRecord) -> int:
    return record.outcome.accepted_length - 1  # head (or chain) tokens accepted below the root


def _dynamic_beats_fixed(records: list[StepRecord]) -> dict[int, str]:
    return {r.index: f"the dynamic tree accepted {_accepted(r)} guessed token(s) here, the fixed tree on the same "
                     f"heads and context only {r.comparison.accepted_length - 1}: compare the two trees"
            for r in records if r.comparison is not None and r.outcome.accepted_length > r.comparison.accepted_length}


def _right_then_wrong(records: list[StepRecord]) -> dict[int, str]:
    return {r.index: "head 1's and head 2's guesses were right (accepted, depth 1-2) but no depth-3 guess matched "
                     "what the base model wanted: see the verification table" for r in records
            if r.kind == StepKind.TREE and _accepted(r) == 2 and r.outcome.tree.max_depth >= 3}


def _hydra_beats_medusa(records: list[StepRecord]) -> dict[int, str]:
    return {r.index: f"Hydra's tree (below) would accept {r.rival.accepted_length - 1} token(s) here, Medusa's "
                     f"{_accepted(r)}: its deeper guesses follow the path above them"
            for r in records if r.rival is not None and r.rival.accepted_length > r.outcome.accepted_length}


def _eagle_beats_medusa(records: list[StepRecord]) -> dict[int, str]:
    return {r.index: f"EAGLE's tree (top) accepted {_accepted(r)} token(s) here, the Medusa heads' tree of the same "
                     f"size (below) would accept {r.rival.accepted_length - 1}: each EAGLE guess reads the guess "
                     f"before it and the base model's features, so its second and third tokens follow the first"
            for r in records if r.rival is not None and r.outcome.accepted_length > r.rival.accepted_length}


def _long_copies(records: list[StepRecord]) -> dict[int, str]:
    return {r.index: f"the prompt-lookup chain (◆) copied {sum(1 for n in r.outcome.accepted_nodes[1:] if r.outcome.node_source(n) == 'lookup')} "
                     f"tokens from the prompt in one step" for r in records
            if sum(1 for n in r.outcome.accepted_nodes[1:] if r.outcome.node_source(n) == "lookup") >= 3}


def _store_hits(records: list[StepRecord]) -> dict[int, str]:
    hits = {r.index: "a datastore branch (the model's own earlier answers) supplied accepted tokens: a stock phrase"
            for r in records if any(r.outcome.node_source(n) == "store" for n in r.outcome.accepted_nodes[1:])}
    return hits or {r.index: f"the datastore proposed {sum(1 for s in r.outcome.chain_sources if s == 'store')} "
                             f"branch(es) here; the heads' own guesses already held the accepted tokens"
                    for r in records if "store" in r.outcome.chain_sources and _accepted(r) >= 2}


def _fallbacks(records: list[StepRecord]) -> dict[int, str]:
    notes = {}
    for r in records:
        if r.controller and r.controller != "normal" and r.index not in notes:
            notes[r.index] = (f"the controller is {r.controller}: the heads' trees had not paid for their verify "
                              f"cost on this prompt, so the step verifies {r.outcome.tree.num_nodes} node(s)")
    return dict(list(notes.items())[:12])


def _rejections(records: list[StepRecord]) -> dict[int, str]:
    return {r.index: "every guess here was rejected: each was accepted with probability p(x) (a guess is one "
                     "proposal, q(x) = 1), and after each rejection x was removed from p and the rest renormalised; "
                     "the bonus token was drawn from what remained, so the output follows the base model exactly"
            for r in records if r.outcome.tree.num_nodes and _accepted(r) == 0}


def _accepting(records: list[StepRecord]) -> dict[int, str]:
    return {r.index: f"{_accepted(r)} guessed token(s) accepted at temperature 0.7"
            for r in records if _accepted(r) >= 2}


PROMPT_SKY = "Explain in three sentences why the sky is blue."
BASE = dict(budget=63, top_m=32, depth=4, fixed_preset="mc_sim_7b_63", rule="greedy", temperature=0.0,
            precision="fp32", max_new_tokens=64, compare_fixed=True, custom_tree="", compare_heads="")
RECORDINGS = [
    Recording("dynamic_vs_fixed", "Dynamic tree vs Medusa's fixed tree",
              "Every step verifies the dynamic tree (top) and, for comparison, Medusa's fixed 63-node tree on the "
              "same heads and context (below). Where the heads are confident the dynamic tree spends its nodes "
              "deep on the likely path and accepts more.", PROMPT_SKY, dict(BASE, strategy="dynamic"),
              _dynamic_beats_fixed),
    Recording("right_then_wrong", "Heads right at depth 1, wrong at depth 3",
              "Each head guesses one position further ahead from the same hidden state, so they get worse with "
              "depth: head 1 is often right, head 3 rarely. The verification table shows where each path stopped.",
              "Give me a recipe for pancakes.", dict(BASE, strategy="dynamic", compare_fixed=False),
              _right_then_wrong),
    Recording("hydra_beside_medusa", "Hydra's tree beside Medusa's, same context",
              "At every step the Medusa heads' dynamic tree (top) is verified, and the Hydra heads grow their own "
              "tree of the same size from the same context (bottom). Hydra's guesses read the path drafted before "
              "them, so the second token can follow the first: watch where that makes Hydra accept more.",
              PROMPT_SKY, dict(BASE, strategy="dynamic", compare_fixed=False, compare_heads="hydra"),
              _hydra_beats_medusa),
    Recording("eagle_beside_medusa", "EAGLE's tree beside Medusa's, same context",
              "Every step verifies the tree EAGLE's draft layer grows (top); the Medusa heads' dynamic tree of the "
              "same size is drawn from the same context (below). Medusa's heads each guess one position from the "
              "same hidden state; EAGLE's one layer drafts token by token from the base model's low, middle and "
              "last-layer features and its own previous guess, so deeper guesses follow the path above them.",
              PROMPT_SKY, dict(BASE, strategy="eagle", compare_fixed=False, compare_heads="dynamic"),
              _eagle_beats_medusa),
    Recording("prompt_lookup_copy", "Prompt lookup copies a long span",
              "When the answer repeats the prompt, the prompt-lookup chain (◆) proposes the text that followed "
              "the last words where they appeared before, and a whole span is accepted in one verify.",
              "Fix the typo in this Python function and show the whole corrected function:\n\n"
              "def total_price(item_prices, discount_rate):\n    subtotal = sum(item_prices)\n"
              "    discount = subtotal * discont_rate\n    return subtotal - discount\n",
              dict(BASE, strategy="dynamic:auto+lookup", compare_fixed=False), _long_copies),
    Recording("datastore_phrase", "The datastore completes a stock phrase",
              "The datastore holds n-grams of the model's own earlier answers; a branch from it joins the tree, "
              "and stock phrases (list openings, polite formulas) are accepted from it.",
              "Write a short, polite email thanking a colleague for their help with a project.",
              dict(BASE, strategy="dynamic:auto+lookup+store", compare_fixed=False), _store_hits),
    Recording("auto_falls_back", "The adaptive budget falls back to plain steps",
              "On a prompt where the heads guess badly, the controller measures that trees do not pay for their "
              "verify cost and backs off to plain steps (or the lookup chain alone), probing now and then.",
              "Write a list of ten random, unrelated nouns, separated by commas.",
              dict(BASE, strategy="dynamic:auto", compare_fixed=False), _fallbacks),
    Recording("typical_acceptance", "Typical acceptance at temperature 0.7",
              "With typical acceptance a guess passes when the base model gives it enough probability (not only "
              "when it is the top token): more tokens per step, and text that is sampled, not greedy. Compare "
              "with the first run's greedy answer to the same prompt.", PROMPT_SKY,
              dict(BASE, strategy="dynamic", rule="typical", temperature=0.7, compare_fixed=False), _accepting),
    Recording("bf16_near_tie", "Without the exact kernels: a near-tie flips a token",
              "Recorded on the lean forward (library kernels, what runs where the lab's own cannot be compiled): "
              "it sums a tree's rows in another order than a one-token step, so where plain decoding's two best "
              "tokens are (nearly) tied the verify can pick the other one and the text departs from plain greedy "
              "decoding in the same precision. The check card names the token and the logit gap. Every other run "
              "here, and the live page, use the exact kernels: each tree row is bitwise the one-token step, and "
              "the text is plain greedy's in every precision.",
              "Write a short story about a robot who learns to paint.",
              dict(BASE, strategy="dynamic", precision="bf16", compare_fixed=False, max_new_tokens=96),
              alternatives=("Describe the water cycle for a ten-year-old.", "What are the benefits of regular exercise?",
                            "Explain how a bicycle stays upright.", "Give me three tips for learning a new language."),
              shows=lambda check: check.state == "diff", engine="lean"),
    Recording("speculative_sampling", "Tree speculative sampling: reject and resample",
              "A guess is one proposal, not a draw from the heads' probabilities, so in min(1, p(x)/q(x)) the "
              "draft's q(x) = 1: each guess x is accepted with probability p(x), the base model's. On a rejection "
              "x is removed from p and the rest renormalised before the next sibling is tried, and the bonus "
              "token is drawn from what remains: the output follows the base model's distribution exactly.",
              PROMPT_SKY,
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
            if recording.shows(labstate.greedy_check(lab, lab.run)):
                break
        records = list(lab.run.session.records)
        found = _divergence_notes(lab) if recording.name == "bf16_near_tie" else recording.notes(records)
    notes = {str(i + 1): text for i, text in sorted(found.items())}
    meta = {"title": recording.title, "notice": recording.notice, "notes": notes,
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
