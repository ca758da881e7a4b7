"""llama.cpp's plain greedy decoding of the shipped GGUF, timed beside ours (`llamacpp:greedy`).

Optional: it needs llama-cpp-python (`pip install llama-cpp-python`, which compiles llama.cpp for
this CPU in a few minutes); the tests and the lab never do. The peer reads the very file the exact
engine's gguf mode reads (the same Q4_1 / Q8_0 blocks), runs on as many threads as torch does, and
decodes the same prompt token ids (the chat template applied by our tokenizer), so its tokens/s is
comparable with `ar`'s in the same run. Its arithmetic is its own (activations quantised to 8 bits
for the 4-bit products), so its text may part from ours at a near-tie; the benchmark reports where.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONTEXT_TOKENS = 2048  # the model's own context; a prompt and 1,024 new tokens fit


@dataclass(frozen=True)
class PeerRun:
    """One prompt decoded by the peer."""

    output_ids: list[int]
    seconds: float  # prompt in to the last token out (what `ar`'s seconds count too)
    prefill_seconds: float  # prompt in to the first new token out


@dataclass
class LlamaCppPeer:
    """A loaded llama.cpp model (one per benchmark run; not shared across threads)."""

    model: Any  # llama_cpp.Llama
    threads: int
    gguf: Path

    @classmethod
    def load(cls, gguf: Path, threads: int | None = None) -> "LlamaCppPeer":
        """The GGUF at `gguf` in llama.cpp on `threads` (default: torch's); ImportError saying how to
        install llama-cpp-python where it is missing."""
        try:
            import llama_cpp
        except ImportError as error:
            raise ImportError("llamacpp:greedy needs llama-cpp-python (pip install llama-cpp-python; it builds "
                              "llama.cpp from source in a few minutes)") from error
        threads = threads or torch.get_num_threads()
        model = llama_cpp.Llama(model_path=str(gguf), n_ctx=CONTEXT_TOKENS, n_threads=threads,
                                n_threads_batch=threads, verbose=False)
        return cls(model=model, threads=threads, gguf=gguf)

    @property
    def version(self) -> str:
        """llama-cpp-python's version (it pins the llama.cpp it was built from)."""
        import llama_cpp
        return llama_cpp.__version__

    def decode(self, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: frozenset[int]) -> PeerRun:
        """Greedy decoding of `prompt_ids` (argmax at every step, no penalty) until an end token
        (kept, as our decoder keeps it) or `max_new_tokens`."""
        output: list[int] = []
        # llama-cpp-python keeps the cache of the last prompt and skips its common prefix: ours
        # starts every prompt from an empty cache, and so must the peer
        self.model.reset()
        started = time.perf_counter()
        first = started
        tokens = self.model.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                                     repeat_penalty=1.0, reset=True)
        for token in tokens:
            if not output:
                first = time.perf_counter()
            output.append(int(token))
            if token in eos_token_ids or len(output) >= max_new_tokens:
                break
        return PeerRun(output_ids=output, seconds=time.perf_counter() - started, prefill_seconds=first - started)
