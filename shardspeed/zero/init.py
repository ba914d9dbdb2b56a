"""``zero.Init``: build a model directly sharded, so it never exists whole on one rank.

Inside the context every ``nn.Module`` subclass's ``__init__`` is wrapped: when a module's outermost
``__init__`` returns, each of its parameters not yet sharded keeps only this rank's 1/N slice (flat,
padded) and its ``.data`` becomes an empty placeholder. Peak memory while building is therefore about one
module's own parameters. ``torch.nn.init`` functions called later on a sharded parameter (e.g. a parent's
``self.apply(self._init_weights)``) are redirected: the full tensor is initialised in a temporary buffer
with the same random stream on every rank and this rank keeps its slice. Every rank must use the same
seed, as with any data-parallel initialisation.

Stage 3's builder then assembles its units from these per-parameter shards one parameter at a time.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn

from ..dist.comms import Collectives
from ..dist.init import init_distributed
from ..dist.topology import Topology

_state = threading.local()

#: torch.nn.init functions that fill a tensor in place; redirected for sharded parameters
_INIT_FUNCTIONS = [
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
]


@dataclass
class InitShard:
    """This rank's slice of a parameter created under ``zero.Init``."""

    shape: torch.Size
    numel: int
    world: int
    rank: int
    shard: torch.Tensor  # ceil(numel / world) elements, zero padded
    collectives: Optional[Collectives] = None  # of the group the parameter was sharded over (world > 1)

    @property
    def chunk(self) -> int:
        return self.shard.numel()

    def write_full(self, full: torch.Tensor) -> None:
        flat = full.detach().reshape(-1)
        lo = self.rank * self.chunk
        n = max(0, min(self.chunk, self.numel - lo))
        self.shard.zero_()
        if n:
            self.shard[:n].copy_(flat[lo : lo + n])

    def gather_full(self, group=None) -> torch.Tensor:
        """The whole parameter, gathered from every rank's slice (a collective: every rank must call it).

        Gathers over the group the parameter was sharded over, through its :class:`Collectives` (logged,
        errors named); ``group`` is accepted for the callers' convenience and must be that group."""
        out = torch.empty(self.chunk * self.world, dtype=self.shard.dtype, device=self.shard.device)
        if self.world == 1 or self.collectives is None:
            out.copy_(self.shard)
        else:
            self.collectives.all_gather(out, self.shard)
        return out[: self.numel].view(self.shape)


def init_shard_of(p: torch.Tensor) -> Optional[InitShard]:
    return getattr(p, "_shardspeed_init", None)


def _shard_parameter(p: nn.Parameter, world: int, rank: int, dtype: Optional[torch.dtype], device,
                     collectives: Optional[Collectives] = None) -> None:
    if init_shard_of(p) is not None or getattr(p, "_shardspeed_unit", None) is not None:
        return
    chunk = -(-p.numel() // world) if p.numel() else 0
    target_dtype = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
    shard = torch.zeros(chunk, dtype=target_dtype, device=device)
    info = InitShard(p.shape, p.numel(), world, rank, shard, collectives)
    info.write_full(p.data)
    p._shardspeed_init = info  # type: ignore[attr-defined]  # a tag read back by init_shard_of
    p.data = torch.empty(0, dtype=target_dtype, device=device)


def _all_subclasses(cls):
    out, stack = [], [cls]
    while stack:
        c = stack.pop()
        for s in c.__subclasses__():
            out.append(s)
            stack.append(s)
    return out


class Init:
    """Context manager: modules constructed inside hold only this rank's shard of their parameters.

    Accepts DeepSpeed's arguments; ``config``/``config_dict_or_path`` and ``remote_device`` are accepted for
    compatibility (parameter offload is decided by the engine's config).
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory: bool = False, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype: Optional[torch.dtype] = None, mpu=None, **_ignored):
        self.enabled = enabled
        self.group = data_parallel_group
        self.dtype = dtype
        self._patched: List[Tuple[Any, str, Any]] = []  # (owner, attribute, original)
        if module is not None and enabled:  # DeepSpeed also lets you shard an already-built module
            self._setup()
            for m in module.modules():
                self._shard_module(m)

    def _setup(self):
        init_distributed()
        topo = Topology.data_parallel(self.group)
        self.world, self.rank, self.device = topo.dp_size, topo.dp_rank, topo.device
        self.collectives = Collectives(topo)  # the shard gathers of the units built from these parameters

    def _shard_module(self, module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            _shard_parameter(p, self.world, self.rank, self.dtype, self.device, self.collectives)

    def __enter__(self):
        if not self.enabled:
            return self
        self._setup()
        depth = {}

        def wrap_init(cls):
            orig = cls.__dict__["__init__"]

            @functools.wraps(orig)
            def init(module_self, *args, **kwargs):
                key = id(module_self)
                depth[key] = depth.get(key, 0) + 1
                try:
                    orig(module_self, *args, **kwargs)
                finally:
                    depth[key] -= 1
                if depth[key] == 0:
                    del depth[key]
                    self._shard_module(module_self)

            cls.__init__ = init
            self._patched.append((cls, "__init__", orig))

        for cls in [nn.Module] + _all_subclasses(nn.Module):
            if "__init__" in cls.__dict__:
                wrap_init(cls)

        def wrap_fn(name):
            orig = getattr(torch.nn.init, name)

            @functools.wraps(orig)
            def fn(tensor, *args, **kwargs):
                info = init_shard_of(tensor)
                if info is None:
                    return orig(tensor, *args, **kwargs)
                full = torch.empty(info.shape, dtype=info.shard.dtype, device=info.shard.device)
                orig(full, *args, **kwargs)  # same RNG stream on every rank: every rank draws the whole tensor
                info.write_full(full)
                return tensor

            setattr(torch.nn.init, name, fn)
            self._patched.append((torch.nn.init, name, orig))

        for name in _INIT_FUNCTIONS:
            if hasattr(torch.nn.init, name):
                wrap_fn(name)
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._patched):
            setattr(owner, name, orig)
        self._patched.clear()
        return False
