"""Sizes the lab accepts (a session's memory and a CPU's patience stay bounded)."""
from __future__ import annotations

from core.settings import SETTINGS
from core.strategy import MAX_BUDGET, MAX_DEPTH

MAX_TEMPERATURE = 2.0
# Prompts: refused above MAX_PROMPT_TOKENS (chat template included). 2048 keeps a session's KV cache
# (46 KB/token in fp32 for SmolLM2-135M) under ~150 MB even with 1024 new tokens and a 256-node tree,
# and a CPU prefill to a few seconds. Texts above MAX_PROMPT_CHARS are refused without tokenizing.
MAX_PROMPT_TOKENS = SETTINGS.max_prompt_tokens
MAX_PROMPT_CHARS = 100_000
MAX_CUSTOM_TREE_NODES = MAX_BUDGET
MAX_CUSTOM_TREE_CHARS = 20_000
MAX_REFERENCES = 8  # plain-greedy runs cached per session
STEP_LOCK_TIMEOUT_S = 120.0

__all__ = ["MAX_TEMPERATURE", "MAX_PROMPT_TOKENS", "MAX_PROMPT_CHARS",
           "MAX_CUSTOM_TREE_NODES", "MAX_CUSTOM_TREE_CHARS", "MAX_DEPTH", "MAX_REFERENCES", "STEP_LOCK_TIMEOUT_S"]
