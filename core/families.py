"""The drafter families, one entry each: what the grammar calls them, what a reader sees, how their
weights load and how their drafter is built.

Adding a family is one entry here plus its own module under `core/drafters/` (a drafter class with
`for_session`, a loader of the shipped weights). Nothing else compares family names: the grammar
(`core.strategy`), the decoder, labstate, the views and the benchmark read this table. Loaders
and drafters are named by import path and resolved on use, so this module imports no torch (replay
reads it without a model).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

AUTOREGRESSIVE = "autoregressive"
FIXED = "fixed"
DYNAMIC = "dynamic"
HYDRA = "hydra"
EAGLE = "eagle"
MEDUSA = "medusa"  # the weights key of the Medusa heads (fixed and dynamic trees)


@dataclass(frozen=True)
class Family:
    """One decoding family."""

    name: str  # the grammar's word (`StrategySpec.family`, `DecodeConfig.strategy`, `CandidateTree.kind`)
    label: str  # what a reader sees
    sized: bool = False  # sized by a node budget: takes auto, +lookup and +store
    grows_tree: bool = False  # its drafter grows the tree node by node (a column is a node, not a head rank)
    decodes_fixed_tree: bool = False  # it decodes Medusa's fixed tree (a preset or custom rank paths)
    fixed_beside: bool = False  # the page may verify the fixed tree beside it, over the same heads' guesses
    weights_key: str = ""  # which weights it drafts with (families sharing weights share the key)
    weights: str = ""  # "module:function" of (base) -> (the shipped weights or None, a line for the header)
    drafter: str = ""  # "module:Class" whose `for_session(weights, base, config, fixed)` builds the session's drafter
    weights_name: str = ""  # what its weights are called in messages
    weights_folder: str = ""  # where they ship
    tree_phrase: str = ""  # the tree panel's phrase for its tree
    rival: str = ""  # the family drawn beside it when the page compares drafters ("": none)
    guesses: str = ""  # how its drafter guesses, in a few words (the rival tree's title)
    node_phrase: str = "head"  # a grown tree's node, before its depth ("Hydra head 2, child 0")
    depth_label: str = "head"  # what guesses depth d in the tree's axis and the table's rows ("head 2", "depth 2")
    guesser: str = "head"  # who made a guess, in a tree's subtitle ("2 head guesses accepted")
    table_caption: str = ""  # the heads table's caption for a grown tree
    # the settings panel: its strategy's help, and for a sized family the auto, +lookup and (where offered)
    # +store variants' ("" for auto / +lookup: the sentences every sized family shares)
    help: str = ""
    auto_help: str = ""
    lookup_help: str = ""
    store_help: str = ""  # "": the panel offers no +store variant
    rival_choice: str = ""  # how the page offers it as the tree drawn beside another's ("": it does not)

    def panel_variants(self) -> tuple[tuple[str, str], ...]:
        """(variant, help) the settings panel offers for this family: "" (the family alone), then for a
        sized family "auto", "auto+lookup" and, where it has a store help, "auto+lookup+store"."""
        variants = [("", self.help)]
        if self.sized:
            variants += [("auto", self.auto_help or f"The {self.label}, sized every step by the same "
                                                     "expected-tokens/s rule as dynamic (auto)."),
                         ("auto+lookup", self.lookup_help or f"The auto-sized {self.label} plus the prompt-lookup "
                                                             "chain (◆).")]
            if self.store_help:
                variants.append(("auto+lookup+store", self.store_help))
        return tuple(variants)

    @property
    def drafts(self) -> bool:
        """Whether it drafts at all (plain decoding does not)."""
        return bool(self.drafter)

    def load_weights(self, base: Any) -> tuple[Any, str]:
        """The shipped weights for `base` (its dtype and device; None when this copy ships none) and
        a line describing them."""
        return _resolve(self.weights)(base)

    def build_drafter(self, weights: Any, base: Any, config: Any, fixed: Any = None) -> Any:
        """The drafter of one session (`fixed`: the fixed tree the session decodes or draws beside, if
        any); ValueError when `weights` are not this family's."""
        return _resolve(self.drafter).for_session(weights, base, config, fixed)


FAMILIES: dict[str, Family] = {family.name: family for family in (
    Family(AUTOREGRESSIVE, "autoregressive", tree_phrase="Autoregressive: the root only",
           help="Plain decoding: one base-model forward per token, no heads, no tree (the yardstick)."),
    Family(FIXED, "fixed", decodes_fixed_tree=True, weights_key=MEDUSA, weights="core.drafters.medusa:shipped_heads",
           drafter="core.drafters.medusa:HeadsDrafter", weights_name="Medusa heads", weights_folder="assets/heads",
           tree_phrase="Fixed tree", guesses="one guess per depth",
           help="Medusa's fixed tree: the same rank paths (the preset below) every step."),
    Family(DYNAMIC, "dynamic", sized=True, fixed_beside=True, weights_key=MEDUSA, weights="core.drafters.medusa:shipped_heads",
           drafter="core.drafters.medusa:HeadsDrafter", weights_name="Medusa heads", weights_folder="assets/heads",
           tree_phrase="Dynamic tree", rival=HYDRA, guesses="one guess per depth",
           help="The paper's dynamic tree: every step keeps the `budget` rank paths with the highest joint head "
                "probability.",
           auto_help="Dynamic tree whose size is chosen every step: the node count (≤ budget) with the best "
                     "expected tokens/s, from a verify-cost profile measured once per precision (5-10 s).",
           lookup_help="Auto-sized dynamic tree plus prompt lookup: the tokens that followed the text's last words "
                       "where they appeared before join the tree as one more branch (◆).",
           store_help="Auto-sized dynamic tree, prompt lookup, and a datastore of the model's own earlier answers: "
                      "what most often followed the text's last words there joins the tree as up to 3 more branches.",
           rival_choice="Medusa heads (dynamic tree)"),
    Family(HYDRA, "Hydra tree", sized=True, grows_tree=True, weights_key="hydra",
           weights="core.drafters.hydra:shipped_hydra_heads",
           drafter="core.drafters.hydra:HydraDrafter", weights_name="Hydra heads", weights_folder="assets/hydra",
           tree_phrase="Hydra tree grown node by node", rival=DYNAMIC,
           guesses="each guess reads its path", node_phrase="Hydra head",
           table_caption="Hydra heads read the path: row d is head d's guesses after the best guesses of the rows "
                         "above (other branches of the tree got their own)",
           help="Hydra heads grow the tree node by node: each guess reads the tokens on the path before it, so a "
                "node's children depend on the node (`budget` nodes, `top-m` children per expanded node).",
           rival_choice="Hydra heads"),
    Family(EAGLE, "EAGLE tree", sized=True, grows_tree=True, weights_key="eagle",
           weights="core.drafters.eagle:shipped_eagle",
           drafter="core.drafters.eagle:EagleDrafter", weights_name="the EAGLE draft layer",
           weights_folder="assets/eagle", tree_phrase="EAGLE tree grown from the draft layer's features", rival=HYDRA,
           guesses="each guess reads the base model's features and its path", node_phrase="EAGLE draft step",
           depth_label="depth", guesser="draft",
           table_caption="The EAGLE draft layer reads the base model's features, then its own output: row d is its "
                         "guesses at depth d after the best guesses of the rows above (other branches got their own)",
           help="The EAGLE draft layer grows the tree: one decoder layer reads the base model's own features "
                "(an early, the middle and the last layer) and drafts on its own outputs (`budget` nodes).",
           rival_choice="EAGLE draft layer"),
)}


def family(name: str) -> Family:
    """The family called `name`; KeyError naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown family {name!r}: one of {', '.join(FAMILIES)}") from None


def grows_tree(kind: str) -> bool:
    """Whether a tree of this kind (a family's name, or a step kind) was grown node by node."""
    entry = FAMILIES.get(kind)
    return entry is not None and entry.grows_tree


def depth_label(kind: str) -> str:
    """What guessed depth d of a tree of this kind, for its axis, hover and table ("head", EAGLE's "depth");
    a step kind that is no family (a lookup-only step) reads as heads."""
    entry = FAMILIES.get(kind)
    return entry.depth_label if entry is not None else "head"


def guesser(kind: str) -> str:
    """Who made a tree's guesses, for its subtitle ("head", EAGLE's "draft"); heads for a step kind."""
    entry = FAMILIES.get(kind)
    return entry.guesser if entry is not None else "head"


def _resolve(path: str) -> Callable[..., Any]:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
