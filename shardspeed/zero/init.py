"""``zero.Init``: build a model directly sharded, so it never exists whole on one rank.

Every parameter registered on any ``nn.Module`` while the context is active (whatever its class, wherever
the class was defined or imported) is sharded the moment it is registered, through torch's global
parameter-registration hook: this rank keeps its 1/N slice (flat, padded) and the parameter's ``.data``
becomes a *placeholder*, a zero-stride view of one element with the parameter's full shape (so shape
queries such as ``fan_in`` computations still work) that holds no memory.

Everything done to a placeholder afterwards is intercepted by a ``TorchFunctionMode`` active inside the
context, whatever path the call took (``torch.nn.init`` functions, saved references to them such as
transformers' ``TORCH_INIT_FUNCTIONS`` or ``from torch.nn.init import xavier_uniform_``, or tensor methods
like ``weight.data.normal_()``): the call runs on a whole temporary copy of that one parameter, on the
device and in the dtype the normal build would use, so the random stream is consumed exactly as in a
normal build and the weights are bit for bit the same. The copy is written back into the shard when the
next parameter is touched or the context exits: peak memory is about one parameter. The copy starts
empty for calls that overwrite every element (``normal_``, ``uniform_``, ``fill_``, ``zero_``, ``copy_``
...); otherwise it is gathered from every rank's shard (a collective: every rank runs the same code, as
with any data-parallel initialisation, and must use the same seed).

On exit each placeholder becomes an empty tensor, so stray use fails loudly. Stage 3's builder assembles
its units from these per-parameter shards one parameter at a time; ``GatheredParameters`` gathers them.

Inside the context ``PreTrainedModel.from_pretrained`` (transformers) builds the model sharded from its
config, without running its weight initialisation, and each rank reads only its own slice of every
tensor from the safetensors checkpoint (see :mod:`shardspeed.zero.hf`).
"""
from __future__ import annotations

import sys
import warnings
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..comm.collectives import Collectives
from ..errors import CheckpointError, ShardspeedError
from ..mesh.current import CURRENT
from ..mesh.init import init_distributed
from ..mesh.topology import Topology
from .tags import in_stage3_unit, init_shard_of, is_sharded, tag_init_shard  # init_shard_of: also imported from here


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

    @property
    def range(self):
        """(first, end) flat element indices of the parameter this rank holds."""
        lo = min(self.rank * self.chunk, self.numel)
        return lo, min(lo + self.chunk, self.numel)

    def write_full(self, full: torch.Tensor) -> None:
        flat = full.detach().reshape(-1)
        lo, hi = self.range
        self.shard.zero_()
        if hi > lo:
            self.shard[: hi - lo].copy_(flat[lo:hi])

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


def _shard_parameter(p: nn.Parameter, world: int, rank: int, dtype: Optional[torch.dtype], device,
                     collectives: Optional[Collectives] = None) -> Optional[InitShard]:
    """Keep this rank's slice of ``p`` and leave an empty placeholder in ``p.data``; the new record, or
    None when ``p`` was sharded already."""
    if is_sharded(p):
        return None
    if p.is_meta:
        raise ShardspeedError(
            "zero.Init cannot shard a parameter on the meta device (it has no values): build the model without "
            "torch.device('meta') inside zero.Init, or load it with from_pretrained inside zero.Init")
    chunk = -(-p.numel() // world) if p.numel() else 0
    target_dtype = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
    shard = torch.zeros(chunk, dtype=target_dtype, device=device)
    info = InitShard(p.shape, p.numel(), world, rank, shard, collectives)
    info.write_full(p.data)
    tag_init_shard(p, info)
    p.data = torch.empty(0, dtype=target_dtype, device=device)
    return info


# ---- placeholders and the mode that intercepts every use of them -----------------------------------------

def _fn(owner, name):
    return getattr(owner, name, None)


def _prop(name, which):
    d = getattr(torch.Tensor, name, None) or torch._C.TensorBase.__dict__.get(name)
    return getattr(d, which, None)


#: calls that read only a tensor's metadata (or return an alias with the same shape): run on the placeholder
_METADATA = frozenset({f for f in (
    *(_fn(torch.Tensor, n) for n in (
        "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
        "is_contiguous", "ndimension", "type", "get_device", "data_ptr", "untyped_storage", "storage_offset",
        "requires_grad_", "detach", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
        "__len__", "__hash__", "__format__", "__repr__", "_is_view", "is_shared", "is_pinned", "__reduce_ex__",
        "register_hook", "retain_grad", "is_signed", "has_names", "is_inference", "__setstate__", "__deepcopy__")),
    *(_prop(n, w) for n in ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "data", "ndim",
                            "layout", "is_cuda", "is_meta", "is_sparse", "is_quantized", "names", "_base",
                            "grad_fn", "is_mps", "is_xpu", "itemsize", "nbytes", "_grad", "_grad_fn",
                            "is_nested", "output_nr", "_version")
      for w in ("__get__", "__set__")),
    torch.numel, torch.is_floating_point, torch.is_complex,
) if f is not None})

#: in-place calls that overwrite every element of their first argument: the whole copy need not be gathered
_OVERWRITE = frozenset({f for f in (_fn(torch.Tensor, n) for n in (
    "normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "exponential_", "log_normal_", "cauchy_",
    "geometric_", "bernoulli_", "set_")) if f is not None})


class _Record:
    __slots__ = ("param", "info", "placeholder", "dtype", "device", "full")

    def __init__(self, param: nn.Parameter, info: InitShard, placeholder: torch.Tensor, dtype, device):
        self.param = weakref.ref(param)
        self.info, self.placeholder, self.dtype, self.device = info, placeholder, dtype, device
        self.full: Optional[torch.Tensor] = None


class _PlaceholderMode(TorchFunctionMode):
    """Runs every call that touches a placeholder on a whole temporary copy of that parameter."""

    def __init__(self, ctx: Init):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ctx = self.ctx
        if not ctx._records or func in _METADATA:
            return func(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        hit = False
        for i, a in enumerate(flat):
            rec = ctx._record_of(a) if isinstance(a, torch.Tensor) else None
            if rec is not None:
                overwrite = i == 0 and func in _OVERWRITE
                flat[i] = ctx._materialize(rec, overwrite)
                hit = True
        if not hit:
            return func(*args, **kwargs)
        args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **kwargs)


def active_init() -> Optional[Init]:
    """The innermost Init context open (kept by :data:`shardspeed.mesh.current.CURRENT`), or None."""
    return CURRENT.inits[-1] if CURRENT.inits else None


class Init:
    """Context manager: every parameter created inside holds only this rank's shard (see module doc).

    Accepts DeepSpeed's arguments; ``config``/``config_dict_or_path`` and ``remote_device`` are accepted for
    compatibility (parameter offload is decided by the engine's config). ``dtype`` is the dtype the shards
    are kept in (initialisation itself runs in the dtype the model creates its parameters in).
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory: bool = False, config_dict_or_path=None, config=None,
                 enabled: bool = True, dtype: Optional[torch.dtype] = None, mpu=None, **_ignored):
        self.enabled = enabled
        self.group = data_parallel_group
        self.dtype = dtype
        self._records: Dict[int, _Record] = {}  # placeholder data_ptr -> record
        self._current: Optional[_Record] = None  # the parameter whose whole copy is live
        self._handles: List[Any] = []
        self._mode: Optional[_PlaceholderMode] = None
        self._nested = False
        self._hooked_modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        if module is not None and enabled:  # DeepSpeed also lets you shard an already-built module
            self._setup()
            for m in module.modules():
                self._shard_module(m)

    def _setup(self):
        init_distributed()
        topo = Topology.data_parallel(self.group)
        self.world, self.rank, self.device = topo.shard_size, topo.shard_rank, topo.device
        self.collectives = Collectives(topo)  # the shard gathers of the units built from these parameters

    def _shard_module(self, module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            _shard_parameter(p, self.world, self.rank, self.dtype, self.device, self.collectives)
        self._guard_state_dict(module)

    def _guard_state_dict(self, module: nn.Module) -> None:
        if module not in self._hooked_modules:
            self._hooked_modules.add(module)
            module.register_state_dict_post_hook(_check_sharded_state_dict)

    # ---- inside the context ----------------------------------------------------------------------------
    def _on_register(self, module: nn.Module, name: str, param: Optional[nn.Parameter]):
        if param is None or is_sharded(param):
            return None
        self._flush()
        dtype, device = param.dtype, param.device
        info = _shard_parameter(param, self.world, self.rank, self.dtype, self.device, self.collectives)
        if info is None:
            return None
        placeholder = torch.zeros((), dtype=dtype, device=device).expand(info.shape)
        self._records[placeholder.data_ptr()] = _Record(param, info, placeholder, dtype, device)
        param.data = placeholder
        self._guard_state_dict(module)
        return None

    def _record_of(self, t: torch.Tensor) -> Optional[_Record]:
        try:
            rec = self._records.get(t.data_ptr())
        except (RuntimeError, NotImplementedError):
            return None
        if rec is None or t.device != rec.device or t.dtype != rec.dtype:
            return None
        if t.shape != rec.info.shape or t.stride() != rec.placeholder.stride():
            raise ShardspeedError(f"zero.Init: a view of a sharded parameter of shape {tuple(rec.info.shape)} "
                                  f"escaped (shape {tuple(t.shape)}); please report this")
        return rec

    def _materialize(self, rec: _Record, overwrite: bool) -> torch.Tensor:
        if self._current is rec and rec.full is not None:
            return rec.full
        self._flush()
        if overwrite:
            full = torch.empty(rec.info.shape, dtype=rec.dtype, device=rec.device)
        else:  # the current values are spread over the ranks
            full = rec.info.gather_full().to(device=rec.device, dtype=rec.dtype, copy=True)
        rec.full, self._current = full, rec
        return full

    def _flush(self) -> None:
        """Write the live whole copy (if any) back into its shard."""
        rec, self._current = self._current, None
        if rec is not None and rec.full is not None:
            rec.info.write_full(rec.full)
            rec.full = None

    def __enter__(self):
        if not self.enabled:
            return self
        if CURRENT.inits:  # nested: the outer context already shards everything
            self._nested = True
            return self
        self._setup()
        self._handles.append(nn.modules.module.register_module_parameter_registration_hook(self._on_register))
        self._handles.extend(_patch_from_pretrained())
        self._mode = _PlaceholderMode(self)
        self._mode.__enter__()
        CURRENT.inits.append(self)
        return self

    def __exit__(self, *exc):
        if not self.enabled or self._nested:
            return False
        CURRENT.inits.remove(self)
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
                self._mode = None
            self._flush()
        finally:
            for h in reversed(self._handles):
                h.remove()
            self._handles.clear()
            for rec in self._records.values():
                p = rec.param()
                if p is not None and p.data.data_ptr() == rec.placeholder.data_ptr():
                    p.data = torch.empty(0, dtype=rec.info.shard.dtype, device=rec.info.shard.device)
            self._records.clear()
        return False

    # ---- for GatheredParameters inside the context ---------------------------------------------------------
    def placeholder_of(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        rec = self._records.get(p.data.data_ptr()) if p.data.numel() else None
        return rec.placeholder if rec is not None else None


class _Removable:
    def __init__(self, fn):
        self.remove = fn


def _patch_from_pretrained() -> List[Any]:
    """Route transformers' ``from_pretrained`` through our sharded loader while the context is active."""
    mu = sys.modules.get("transformers.modeling_utils")
    if mu is None:
        return []
    cls = mu.PreTrainedModel
    orig = cls.__dict__["from_pretrained"]

    def from_pretrained(klass, pretrained_model_name_or_path, *args, **kwargs):
        from .hf import sharded_from_pretrained

        return sharded_from_pretrained(klass, pretrained_model_name_or_path, *args, **kwargs)

    cls.from_pretrained = classmethod(from_pretrained)

    def restore():
        cls.from_pretrained = orig

    return [_Removable(restore)]


def _in_save_pretrained() -> bool:
    f: Optional[FrameType] = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "save_pretrained" and not str(f.f_globals.get("__name__", "")).startswith("shardspeed"):
            return True
        f = f.f_back
    return False


SAVE_PRETRAINED_MESSAGE = (
    "save_pretrained() on a model whose parameters are sharded (ZeRO stage 3 or zero.Init) would write empty "
    "placeholders. Use shardspeed.integrations.transformers.save_pretrained(engine, save_directory) (it "
    "gathers the parameters; rank 0 writes config and safetensors), or engine.save_16bit_model(...).")


def _check_sharded_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """A state_dict of a module with sharded parameters holds empty placeholders: refuse it inside
    ``save_pretrained``, warn otherwise."""
    for name, p in module.named_parameters(recurse=False):
        t = state_dict.get(prefix + name)
        info = init_shard_of(p)
        sharded = info is not None or in_stage3_unit(p)
        if t is not None and sharded and t.numel() == 0 and (info is None or info.numel):
            if _in_save_pretrained():
                raise CheckpointError(SAVE_PRETRAINED_MESSAGE)
            if not in_stage3_unit(p):  # stage 3's own hook warns for its modules
                warnings.warn(
                    "model.state_dict() holds empty tensors: the model was built under shardspeed.zero.Init "
                    "and its parameters are sharded across ranks. Read them inside "
                    "shardspeed.zero.GatheredParameters(...) on every rank, or train it with a stage-3 engine.",
                    stacklevel=3)
            return


def warn_sharded_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """``model.state_dict()`` at stage 3 holds empty placeholders: say so instead of saving nothing."""
    for name, p in module.named_parameters():
        t = state_dict.get(prefix + name)
        if t is not None and t.numel() == 0 and in_stage3_unit(p):
            if _in_save_pretrained():  # transformers would write the placeholders: refuse
                raise CheckpointError(SAVE_PRETRAINED_MESSAGE)
            warnings.warn(
                "model.state_dict() at ZeRO stage 3 contains empty tensors: parameters are sharded across "
                "ranks. Use engine.save_checkpoint(...) and `shardspeed consolidate`, "
                "engine.save_16bit_model(...), or read parameters inside "
                "shardspeed.zero.GatheredParameters(...) on every rank.",
                stacklevel=3,
            )
            return


def refuse_deepspeed_partitioned(module: nn.Module) -> None:
    """Refuse a model whose parameters the real DeepSpeed's ``zero.Init`` partitioned (they carry ``ds_tensor``
    and hold empty placeholders that shardspeed cannot gather), naming the first such parameter."""
    for name, p in module.named_parameters():
        if hasattr(p, "ds_tensor") and init_shard_of(p) is None and not in_stage3_unit(p):
            raise ShardspeedError(
                f"parameter '{name}' was partitioned by DeepSpeed's own zero.Init (it has ds_id/ds_tensor and holds an "
                "empty placeholder), which shardspeed cannot gather: build the model under shardspeed.zero.Init, or "
                "put shardspeed's deepspeed package first on the path (export PYTHONPATH=\"$(shardspeed "
                "deepspeed-path):$PYTHONPATH\") so that transformers' HfDeepSpeedConfig calls shardspeed's")
