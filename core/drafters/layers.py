"""Pieces the drafter families' modules share."""
from __future__ import annotations

import copy
import json
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, TypeVar

import safetensors.torch
import torch
from torch import nn
from torch.nn import functional as F

from core.engine.exact import KernelProduct

if TYPE_CHECKING:
    from core.model import BaseModel

T = TypeVar("T")


class RMSNorm(nn.Module):
    """x / RMS(x) * weight, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H]. One op, not six: drafting calls a norm a dozen times a step."""
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


def save_weights(folder: Path, file: str, tensors: dict[str, torch.Tensor], config: object,
                 family: str | None = None) -> None:
    """A family's on-disk format: `file` (safetensors) beside `config.json` (the config dataclass's
    fields, after `"family": family` when the family names itself)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({name: t.contiguous() for name, t in tensors.items()}, folder / file)
    fields = ({"family": family} if family else {}) | asdict(config)
    (folder / "config.json").write_text(json.dumps(fields, indent=2) + "\n")


def read_weights(folder: Path, file: str, family: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """`config.json`'s fields and the tensors of `file` saved by `save_weights`; ValueError when the
    config does not name `family`."""
    folder = Path(folder)
    fields = json.loads((folder / "config.json").read_text())
    if family and fields.pop("family", None) != family:
        raise ValueError(f"{folder} does not hold {family} weights (its config.json says no \"family\": \"{family}\")")
    return fields, safetensors.torch.load_file(folder / file)


def take_draft_vocab(state: dict[str, torch.Tensor], size: int, folder: Path) -> torch.Tensor:
    """The draft vocabulary popped from loaded tensors, checked against the config's size."""
    draft_vocab = state.pop("draft_vocab", torch.zeros(0, dtype=torch.long))
    if len(draft_vocab) != size:
        raise ValueError(f"{folder}: config says {size} draft tokens, weights hold {len(draft_vocab)}")
    return draft_vocab


class AppendStore:
    """Keys and values [heads, capacity, d] that `KVRows` views; positions [0, filled) are written once."""

    def __init__(self, rows: "KVRows", capacity: int) -> None:
        heads, length, dim = rows.keys.shape
        self.keys = rows.keys.new_empty(heads, capacity, dim)  # [heads, capacity, d]
        self.values = rows.values.new_empty(heads, capacity, rows.values.shape[-1])
        self.keys[:, :length], self.values[:, :length] = rows.keys, rows.values
        self.filled = length

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]


@dataclass(frozen=True)
class KVRows:
    """A drafter layer's keys and values [heads, n, d] over positions 0..n-1. `appended` returns a new
    one and never changes this one, so a forked session may keep sharing it; the rows live in a store
    that grows by doubling, so a step appends its few positions without copying the whole cache."""

    keys: torch.Tensor  # [heads, n, d]
    values: torch.Tensor  # [heads, n, d]
    store: AppendStore | None = field(default=None, compare=False, repr=False)

    @classmethod
    def empty(cls, heads: int, dim: int, dtype: torch.dtype = torch.float32) -> "KVRows":
        """No positions yet."""
        none = torch.empty(heads, 0, dim, dtype=dtype)  # [heads, 0, d]
        return cls(none, none)

    @property
    def length(self) -> int:
        """Positions held."""
        return self.keys.shape[1]

    def appended(self, keys: torch.Tensor, values: torch.Tensor) -> "KVRows":
        """These rows, then keys / values [heads, new, d]."""
        if torch.is_grad_enabled() and (keys.requires_grad or self.keys.requires_grad):  # training: no writes
            return KVRows(torch.cat([self.keys, keys], dim=1), torch.cat([self.values, values], dim=1))
        store = self.room_for(keys.shape[1])
        store.keys[:, self.length:self.length + keys.shape[1]] = keys
        store.values[:, self.length:self.length + keys.shape[1]] = values
        return self.written(store, keys.shape[1])

    def room_for(self, new: int) -> AppendStore:
        """A store whose rows [0, length) are these and whose rows [length, length + new) are free to
        write (then `written`): this one's, or a new one twice as large when another fork appended
        past this one or it is full."""
        store, total = self.store, self.length + new
        if store is None or store.filled != self.length or store.capacity < total:
            store = AppendStore(self, capacity=max(64, 2 * total))
        return store

    def written(self, store: AppendStore, new: int) -> "KVRows":
        """These rows and the `new` written after them in `store` (from `room_for`)."""
        total = self.length + new
        store.filled = total
        return KVRows(store.keys[:, :total], store.values[:, :total], store)


def appended(rows: KVRows | None, keys: torch.Tensor, values: torch.Tensor) -> KVRows:
    """`rows.appended(keys, values)`, or the first rows of a cache when `rows` is None."""
    return KVRows(keys, values) if rows is None else rows.appended(keys, values)


class KernelLinear(nn.Module):
    """A linear map through a kernel product (`ExactLlama.kernel_product`, bias included)."""

    def __init__(self, product: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


DRAFTER_EIGHT_BIT = True  # drafters' own layers on the exact engine as Q8_0 blocks (`drafter_product`)
NATIVE_DRAFTING = True  # on the exact engine, each drafter's proposal in a few native calls (`native_products`)
NATIVE_LANES = 16  # the native drafting calls' vector width: every width they read is whole vectors


def native_products(items: Iterable[object], widths: Iterable[int] = ()) -> list[KernelProduct] | None:
    """The exact kernels' products behind `items` (each a product, or a `KernelLinear` over one) for a
    drafter's native calls, or None when native drafting is off, any item is something else (another
    engine, a fallback, a missing row count) or any of `widths` is not whole NATIVE_LANES vectors."""
    products = [getattr(item, "product", item) for item in items]
    if not NATIVE_DRAFTING or not all(isinstance(p, KernelProduct) for p in products):
        return None
    return None if any(width % NATIVE_LANES for width in widths) else products


def drafter_product(base: "BaseModel", weight: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x @ weight.T (+ bias)` of a drafter's own layer through the exact engine's kernels: Q8_0 blocks
    times 8-bit inputs (`DRAFTER_EIGHT_BIT`), else bf16 weights. Why: a step's drafting reads every
    drafter weight cold (the verify before it streamed the base model through the caches), so bytes
    are time; a draft only proposes, the verify decides every token."""
    return base.engine.kernel_product(weight.bfloat16(), bias, eight_bit=DRAFTER_EIGHT_BIT)


class BuiltOnce:
    """What sessions build from a read-only module (a drafting copy, its products, a cast), built the
    first time per key (a precision, a base model) and shared after; the module is held weakly, so
    what was built from it goes with it."""

    def __init__(self) -> None:
        self._built: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()

    def get(self, module: nn.Module, key: Hashable, build: Callable[[], T]) -> T:
        """`build()`'s result for (`module`, `key`): built on the first call, the same object after."""
        built = self._built.setdefault(module, {})
        if key not in built:
            built[key] = build()
        return built[key]


_ON_KERNELS = BuiltOnce()  # each module's drafting copy per base model


def linears_on_kernels(module: nn.Module, base: "BaseModel") -> nn.Module:
    """`module` as a session drafts with it: on the exact engine a copy whose every nn.Linear runs
    through the kernels (`drafter_product`: Q8_0 blocks times 8-bit inputs); a draft only proposes,
    the verify decides every token. Elsewhere `module` itself."""
    if not base.exact:
        return module
    return _ON_KERNELS.get(module, id(base), lambda: _kernel_twin(module, base))


def _kernel_twin(module: nn.Module, base: "BaseModel") -> nn.Module:
    """A copy of `module` with every nn.Linear a `KernelLinear` over `drafter_product`."""
    twin = copy.deepcopy(module)
    for name, linear in list(twin.named_modules()):
        if isinstance(linear, nn.Linear):
            owner, _, attribute = name.rpartition(".")
            product = drafter_product(base, linear.weight.detach(), linear.bias)
            setattr(twin.get_submodule(owner), attribute, KernelLinear(product))
    return twin
