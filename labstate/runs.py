"""A run: one prompt decoded with fixed settings, started (checked, tokenized, prefilled) and stepped."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from core.accept import AcceptConfig
from core.decoder import DecodeConfig, DecodeSession, PageViews, strategy_config
from core.sampling import SamplingConfig
from core.families import family
from core.strategy import MAX_BUDGET, MAX_NEW_TOKENS
from core.tree import load_named_trees
from labstate.errors import LabInputError
from labstate.limits import MAX_PROMPT_TOKENS
from labstate.modes import READY, RUNNING, STOPPED
from labstate.shared import Runtime, runtime
from labstate.settings import CUSTOM_TREE, CUSTOM_TREE_EXAMPLE, Settings



@dataclass
class Run:
    """One prompt being decoded with fixed settings."""

    prompt: str
    settings: Settings
    runtime: Runtime
    session: DecodeSession
    note: str = ""
    mode: str = READY  # READY after Start, PAUSED after a Step, RUNNING inside Run to end, STOPPED after Stop
    page_seconds: list[float] = field(default_factory=list)  # the page's time on this run, not decoding's
    draws_awaited: list[bool] = field(default_factory=list)  # each redraw a Run waited for: drawn in time?
    stepping: bool = False  # a step of this run is in flight (Stop waits for it to end)

    @property
    def reference_key(self) -> tuple[str, str, int]:
        return self.prompt, self.settings.precision, self.settings.max_new_tokens

    @property
    def state(self) -> str:
        """The run's state in words: finished (why), running, stopping, stopped, paused after step N, or ready."""
        session = self.session
        if session.finished:
            return f"finished: {session.stop_reason}"
        steps = len(session.records)
        if self.mode == RUNNING:
            return "running"
        if self.mode == STOPPED and self.stepping:  # Stop came while a step ran: it ends first
            return f"stopping: step {steps + 1} is ending"
        if self.mode == STOPPED:
            return f"stopped after step {steps}" if steps else "stopped"
        if steps:
            return f"paused after step {steps}: press Step"
        return "ready: press Step"


@dataclass(frozen=True)
class Prepared:
    """A checked prompt and settings, tokenized, ready to prefill (nothing touched a session yet)."""

    prompt: str
    settings: Settings
    runtime: Runtime
    prompt_ids: list[int]
    config: DecodeConfig
    note: str


def prepare(prompt: object, settings: Settings) -> Prepared:
    """Check the prompt (sanitized first: see `sanitize_prompt`) against the token limit and build the config."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise LabInputError("Type a prompt (or pick an MT-Bench example) first.")
    rt = runtime(settings.precision)
    config, note = decode_config(settings, rt.max_depth(settings.strategy), rt.fixed_depth)
    try:
        prompt_ids = rt.base.chat_ids(prompt)
    except (TypeError, ValueError, UnicodeError) as error:  # sanitize_prompt should have made this impossible
        raise LabInputError(f"the prompt could not be tokenized ({error})") from error
    limit = min(MAX_PROMPT_TOKENS, rt.base.max_positions - MAX_NEW_TOKENS - MAX_BUDGET - 2)
    if len(prompt_ids) > limit:
        raise LabInputError(f"The prompt is {len(prompt_ids):,} tokens ({len(prompt):,} characters); the lab "
                            f"accepts prompts of up to {limit:,} tokens (the model's context is "
                            f"{rt.base.max_positions:,} tokens). Shorten it.")
    return Prepared(prompt=prompt, settings=settings, runtime=rt, prompt_ids=prompt_ids, config=config, note=note)


def fixed_choice(preset: str, depth: int, custom: tuple[tuple[int, ...], ...] = ()) -> tuple[str | tuple, str]:
    """The fixed tree for `depth` heads: the named preset (or the custom paths), cut at `depth` with a note."""
    paths = custom if preset == CUSTOM_TREE else load_named_trees()[preset]
    if max(len(p) for p in paths) <= depth:
        return (tuple(paths) if preset == CUSTOM_TREE else preset), ""
    kept = tuple(tuple(p) for p in paths if len(p) <= depth)
    return kept, f"fixed tree {preset} cut to depth {depth} ({len(kept)} of {len(paths)} nodes)"


def _check_custom_depth(settings: Settings, num_heads: int) -> None:
    if not settings.custom_tree:
        raise LabInputError(f"custom tree is empty: give at least one rank path, {CUSTOM_TREE_EXAMPLE}")
    deepest = max(settings.custom_tree, key=len)
    if len(deepest) > num_heads:
        raise LabInputError(f"custom tree: path {list(deepest)} is {len(deepest)} deep but only {num_heads} "
                            f"heads are loaded")


def decode_config(settings: Settings, max_depth: int, fixed_depth: int | None = None) -> tuple[DecodeConfig, str]:
    """The core DecodeConfig for these settings, plus a note on any adjustment made. `max_depth`: the
    deepest tree the strategy's drafter guesses; `fixed_depth`: the deepest fixed tree (the Medusa
    heads' count; default `max_depth`)."""
    if settings.depth > max_depth:
        drafts = "heads loaded" if family(settings.strategy).depth_label == "head" else "depths its drafter grows"
        raise LabInputError(f"depth {settings.depth} exceeds the {max_depth} {drafts}")
    accept = AcceptConfig(rule=settings.rule, sampling=SamplingConfig(temperature=settings.temperature))
    base = DecodeConfig(top_m=settings.top_m, depth=settings.depth, accept=accept, max_new_tokens=settings.max_new_tokens)
    config = strategy_config(settings.spec.with_budget(settings.budget), base)
    if not settings.uses_fixed_tree:  # the preset (or custom box) is read by nothing in this run
        return config, ""
    if settings.fixed_preset == CUSTOM_TREE:
        _check_custom_depth(settings, max_depth if fixed_depth is None else fixed_depth)
    tree, note = fixed_choice(settings.fixed_preset, settings.depth, settings.custom_tree)
    if note and not family(settings.strategy).decodes_fixed_tree:
        note = f"the comparison's {note}"  # the run's own tree is dynamic: only the side-by-side tree is cut
    return replace(config, fixed_tree=tree), note


def page_views(settings: Settings, rt: Runtime) -> PageViews:
    """What the session records beside its steps for the page: the fixed tree (the comparison box),
    the rival family's tree (the compare-heads box, for families sized by a budget), every text."""
    wanted = settings.compare_heads and settings.spec.grown
    rival = rt.rival_for(settings.strategy, settings.compare_heads) if wanted else None
    return PageViews(fixed=settings.compare_fixed and family(settings.strategy).fixed_beside, rival=rival)
