"""The one strategy grammar: a spec type, its parser, its printer and its label.

    ar | autoregressive                         plain decoding (the yardstick)
    fixed[:<tree name or JSON file>]            Medusa's fixed tree
    dynamic[:<budget>|auto][+lookup][+store]    the dynamic tree from the heads' joint probabilities
    hydra[:<budget>|auto][+lookup][+store]      the tree Hydra heads grow node by node
    eagle[:<budget>|auto][+lookup][+store]      the tree the EAGLE draft layer grows from the base's features
    hf:greedy | hf:prompt_lookup                transformers' own generate, as peers (benchmark only)
    any of them + @exact | @lean | @hf          on the exact kernels, the lean forward or transformers' (benchmark only)

`auto` sizes the tree every step (the budget is then the cap); `+lookup` adds a prompt-lookup
chain, `+store` datastore branches. The UI, labstate, the benchmark, the simulator, the training
reports and the scripts all read and write strategies through `parse_strategy` and
`StrategySpec.text`. This module imports nothing heavy (no torch): replay draws with it too.
The limits every caller checks against live here as well, checked once in `StrategySpec`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# the family names are re-exported: callers spell strategies with them
from core.families import AUTOREGRESSIVE, DYNAMIC, EAGLE, FAMILIES, FIXED, HYDRA  # noqa: F401
from core.limits import (MAX_BUDGET, MAX_CHAIN_TOKENS, MAX_CHAINS, MAX_DEPTH, MAX_NEW_TOKENS,  # noqa: F401
                         MAX_TOP_M, MAX_TREE_ROWS)  # the sizes, said where the grammar is read too

# decoding families (the values StepRecord.family and DecodeConfig.strategy take): core.families
HF = "hf"  # transformers' generate as a peer (benchmark only)
LLAMACPP = "llamacpp"  # llama.cpp's plain decoding of the same GGUF as a peer (benchmark only, optional)
HF_PEERS = ("greedy", "prompt_lookup")
PEERS = {HF: HF_PEERS, LLAMACPP: ("greedy",)}  # peer family -> its runs: other programs' decoding, timed beside ours
ENGINES = ("exact", "lean", "hf")
ADDITIONS = ("lookup", "store")

# defaults and limits, said once
ACCEPT_RULES = ("greedy", "typical", "speculative")  # core.accept: how a tree's path is accepted
DEFAULT_BUDGET = 63
DEFAULT_FIXED_TREE = "mc_sim_7b_63"
DEFAULT_TOP_M = 32  # candidates kept per head
DEFAULT_DEPTH = 4  # heads used
DEFAULT_BEAM = 8  # nodes expanded per depth when a drafter grows its tree (Hydra, EAGLE)
DEFAULT_NEW_TOKENS = 128
LOOKUP_TOKENS = 10  # the chain `+lookup` adds (transformers' prompt_lookup_num_tokens is 10 too)
STORE_TOKENS = 8  # the length of each branch `+store` adds



def strategy_families() -> tuple[str, ...]:
    """The families of the table (core.families), read when asked: a family registered later is one too."""
    return tuple(FAMILIES)


def sized_families() -> tuple[str, ...]:
    """The families sized by a node budget: they take auto, +lookup and +store."""
    return tuple(name for name, entry in FAMILIES.items() if entry.sized)


def grammar() -> str:
    """Every strategy text the grammar reads, in one line (for its error messages)."""
    return ("ar, fixed[:<tree>], " + ", ".join(f"{name}[:<n>|auto][+lookup][+store]" for name in sized_families())
            + ", hf:greedy, hf:prompt_lookup, llamacpp:greedy, each optionally @exact, @lean or @hf")


def check_int(name: str, value: object, low: int, high: int) -> None:
    """ValueError unless `value` is an integer (not a bool) from `low` to `high`: the one range check
    of every setting (the page's parser coerces what a browser sends first)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")


class StrategyError(ValueError):
    """A strategy text that is not in the grammar (the message says what is)."""


@dataclass(frozen=True)
class StrategySpec:
    """One decoding strategy. `budget` None means the default (the cap when `auto`)."""

    family: str = DYNAMIC
    budget: int | None = None
    auto: bool = False
    lookup: bool = False
    store: bool = False
    tree: str = ""  # fixed: a tree name or a JSON file of rank paths ("" = the default tree)
    peer: str = ""  # a peer family's run (PEERS): hf:greedy, hf:prompt_lookup, llamacpp:greedy
    engine: str | None = None  # exact, lean or hf (None: the run's default forward)

    def __post_init__(self) -> None:
        if self.family not in strategy_families() + tuple(PEERS):
            raise StrategyError(f"unknown strategy family {self.family!r}: use {grammar()}")
        grown = self.family in sized_families()
        if (self.auto or self.lookup or self.store or self.budget is not None) and not grown:
            raise StrategyError(f"{self.family} takes no budget, auto, +lookup or +store (only "
                                 f"{', '.join(sized_families())} do)")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or not 1 <= self.budget <= MAX_BUDGET):
            raise StrategyError(f"the node budget must be a whole number from 1 to {MAX_BUDGET}, got {self.budget!r}")
        if self.tree and self.family != FIXED:
            raise StrategyError("only the fixed strategy names a tree")
        if (self.family in PEERS) != bool(self.peer) or (self.peer and self.peer not in PEERS[self.family]):
            raise StrategyError("the peers are " + ", ".join(f"{family}:{run}" for family, runs in PEERS.items()
                                                            for run in runs))
        if self.family == LLAMACPP and self.engine is not None:
            raise StrategyError("llamacpp:greedy runs llama.cpp's own forward: it takes no @forward")
        if self.engine is not None and self.engine not in ENGINES:
            raise StrategyError(f"unknown forward @{self.engine}: use @exact, @lean or @hf")

    @property
    def text(self) -> str:
        """The canonical spelling (`parse_strategy(spec.text) == spec`)."""
        if self.family == AUTOREGRESSIVE:
            body = "ar"
        elif self.family in PEERS:
            body = f"{self.family}:{self.peer}"
        elif self.family == FIXED:
            body = f"fixed:{self.tree}" if self.tree else FIXED
        else:
            size = "auto" if self.auto else "" if self.budget is None else str(self.budget)
            body = self.family + (f":{size}" if size else "")
            body += "+lookup" * self.lookup + "+store" * self.store
        return body + (f"@{self.engine}" if self.engine else "")

    def __str__(self) -> str:
        return self.text

    @property
    def label(self) -> str:
        """What a reader sees: `dynamic (auto budget) + prompt lookup`, `Hydra tree`, ..."""
        if self.family == AUTOREGRESSIVE:
            name = "autoregressive"
        elif self.family == HF:
            name = f"transformers' generate ({self.peer.replace('_', ' ')})"
        elif self.family == LLAMACPP:
            name = "llama.cpp's greedy decoding of the same GGUF"
        elif self.family == FIXED:
            name = f"fixed ({self.tree})" if self.tree else "fixed"
        else:
            name = FAMILIES[self.family].label
            cap = f" ≤ {self.budget}" if self.budget is not None else ""
            name += f" (auto budget{cap})" if self.auto else f" ({self.budget} nodes)" if self.budget else ""
            name += " + prompt lookup" * self.lookup + " + datastore" * self.store
        forward = {"exact": "the exact kernels", "lean": "the lean forward", "hf": "transformers' forward"}.get(self.engine or "")
        return f"{name} on {forward}" if forward else name

    @property
    def drafts(self) -> bool:
        """Whether it drafts a tree (plain decoding and transformers' peers do not)."""
        return self.family in FAMILIES and FAMILIES[self.family].drafts

    @property
    def grown(self) -> bool:
        """Dynamic or Hydra: the families that take the adaptive budget and chains."""
        return self.family in sized_families()

    @property
    def node_budget(self) -> int:
        return DEFAULT_BUDGET if self.budget is None else self.budget

    def with_budget(self, budget: int | None) -> StrategySpec:
        """The same strategy with another node budget (ignored by families that take none)."""
        return replace(self, budget=budget) if self.grown else self


def _size(text: str, spec_text: str) -> tuple[int | None, bool]:
    if text in ("", "auto"):
        return None, text == "auto"
    if not text.isdigit():
        raise StrategyError(f"{spec_text!r}: the node budget must be a whole number or auto, got {text!r}")
    return int(text), False


def parse_strategy(text: object) -> StrategySpec:
    """The spec a strategy text names; StrategyError (a ValueError) with the grammar otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise StrategyError(f"a strategy must be a non-empty text: {grammar()}")
    spec_text = text.strip()
    body, at, engine = spec_text.rpartition("@")
    if not at:
        body, engine = spec_text, None
    elif engine not in ENGINES:
        raise StrategyError(f"unknown forward {engine!r} in {spec_text!r}: use @exact, @lean or @hf")
    family = body.split(":", 1)[0].split("+", 1)[0]  # `dynamic+lookup` is `dynamic:` + `+lookup`
    rest = body[len(family):]
    arg = rest[1:] if rest.startswith(":") else rest
    if rest.startswith("+") and family not in sized_families():
        raise StrategyError(f"{spec_text!r}: only {', '.join(sized_families())} take +lookup or +store")
    if family in ("ar", AUTOREGRESSIVE) and not arg:
        return StrategySpec(family=AUTOREGRESSIVE, engine=engine)
    if family in PEERS:
        return StrategySpec(family=family, peer=arg, engine=engine)
    if family == FIXED:
        return StrategySpec(family=FIXED, tree=arg, engine=engine)
    if family in sized_families():
        size, *extras = arg.split("+") if arg else ("",)
        unknown = [e for e in extras if e not in ADDITIONS]
        if unknown or len(set(extras)) != len(extras):
            raise StrategyError(f"unknown or repeated addition {unknown or extras} in {spec_text!r}: only +lookup "
                                "and +store, once each")
        budget, auto = _size(size, spec_text)
        return StrategySpec(family=family, budget=budget, auto=auto, lookup="lookup" in extras,
                            store="store" in extras, engine=engine)
    raise StrategyError(f"unknown strategy {spec_text!r}: use {grammar()}")
