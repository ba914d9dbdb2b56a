"""DeepSpeed's pipeline model API: `LayerSpec`, `TiedLayerSpec`, `PipelineModule`.

A `PipelineModule` is a sequence of layers cut into stages. Each rank builds only the layers of the
stages it runs (a spec is built under ``torch.device("meta")`` to count its parameters for the
``parameters`` partition, never allocated whole). Layers are registered under their global index
(``"3.weight"``), tied layers once per rank under ``tied_modules.<key>``, so a parameter's name is the
same whatever the pipeline layout: checkpoints are keyed by it.

``forward(*inputs, chunk=i)`` runs the layers of this rank's ``i``-th stage (a rank runs several with
interleaved or V schedules); a pipeline engine drives it through ``torch.distributed.pipelining``.
"""
from __future__ import annotations

import logging
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ..errors import ConfigError
from .partition import partition_layers

logger = logging.getLogger("shardspeed")


class LayerSpec:
    """Defers building a layer: ``LayerSpec(cls, *args, **kwargs)`` builds ``cls(*args, **kwargs)`` only on
    the ranks that run it."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ConfigError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        if log:
            logger.info("building %r", self)
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` parameters are shared by every use of ``key`` (an embedding and
    the LM head): each rank holding a use builds the module once; the copies on different stages start
    from the same values (broadcast) and their gradients are summed before each step. ``forward_fn(module,
    x)`` replaces the module's forward for this use."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Optional[Callable] = None,
                 tied_weight_attr: Union[str, Sequence[str]] = ("weight",), **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = str(key)
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _count_params(layer: Any) -> Tuple[int, str]:
    """(trainable parameters, class name) of a layer, a spec (built on the meta device) or a function."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            built = layer.build()
        layer = built
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad), type(layer).__name__
    return 0, getattr(layer, "__name__", type(layer).__name__)


def _pipe_rank(num_stages: int) -> int:
    """This rank's pipe coordinate (pipe is the mesh's outermost dim, as in DeepSpeed's topology)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    world = dist.get_world_size()
    if world % num_stages:
        raise ConfigError(f"num_stages {num_stages} does not divide the world of {world} ranks; use a divisor of "
                          f"{world}")
    return dist.get_rank() // (world // num_stages)


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule`` signature (``activation_checkpoint_func`` defaults to torch's
    non-reentrant ``torch.utils.checkpoint``)."""

    def __init__(self, layers: Sequence[Any], num_stages: Optional[int] = None, topology: Any = None,
                 loss_fn: Optional[Callable] = None, seed_layers: bool = False, seed_fn: Optional[Callable] = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Optional[Callable] = None,
                 checkpointable_layers: Optional[List[str]] = None, dynamic_shape: bool = False):
        super().__init__()
        if num_stages is None and topology is not None:
            num_stages = int(topology.get_dim("pipe"))
        if num_stages is None:
            raise ConfigError("PipelineModule needs num_stages= (or topology=)")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ConfigError(f"num_stages must be a positive integer, got {num_stages!r}")
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise ConfigError("PipelineModule(layers=[]) has no layers")
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        counts = [_count_params(layer) for layer in self._layer_specs]
        self._param_counts = [c for c, _ in counts]
        self._class_names = [n for _, n in counts]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: Dict[str, List[str]] = {}
        self.parts: List[int] = []
        self.stage_ids: List[int] = []
        self._chunks: List[List[Tuple[int, Callable]]] = []
        self.assign_stages(num_stages, [_pipe_rank(num_stages)])

    # ---- building ------------------------------------------------------------------------------
    def assign_stages(self, total_stages: int, stage_ids: Sequence[int]) -> None:
        """(Re)build this rank's layers for a pipeline of ``total_stages`` stages of which it runs
        ``stage_ids`` (several with interleaved or V schedules). Called at construction with one stage per
        pipe rank, and by the builder when the schedule asks for virtual stages."""
        self.parts = partition_layers(self.partition_method, self._param_counts, self._class_names, total_stages)
        for s in range(total_stages):  # every rank checks every stage: the same error everywhere, no hang
            if not any(self._param_counts[self.parts[s] : self.parts[s + 1]]):
                raise ConfigError(
                    f"pipeline stage {s} of {total_stages} (layers {self.parts[s]}..{self.parts[s + 1] - 1}: "
                    f"{self._class_names[self.parts[s]:self.parts[s + 1]]}) holds no trainable parameters; use "
                    f"partition_method=\"uniform\" or \"type:<regex>\", fewer stages, or fold parameter-free "
                    f"layers into their neighbours")
        self.stage_ids = list(stage_ids)
        for name in [n for n in self._modules if n.isdigit()]:  # the layers (an nn.Module loss_fn stays)
            del self._modules[name]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs = {}
        self._chunks = []
        for s in self.stage_ids:
            self._chunks.append([(i, self._build(i)) for i in range(self.parts[s], self.parts[s + 1])])

    def _build(self, index: int) -> Callable:
        spec = self._layer_specs[index]
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                self._seed(index)
                self.tied_modules[spec.key] = spec.build()
                self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
            module = self.tied_modules[spec.key]
            return module if spec.forward_fn is None else _TiedUse(module, spec.forward_fn)
        if isinstance(spec, LayerSpec):
            self._seed(index)
            layer: Any = spec.build()
        else:
            layer = spec
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
        elif not callable(layer):
            raise ConfigError(f"layer {index} of the PipelineModule is {type(layer).__name__}, not a module, "
                              f"LayerSpec or callable")
        return layer

    def _seed(self, index: int) -> None:
        if self.seed_layers:
            (self.seed_fn or torch.manual_seed)(self.base_seed + index)

    # ---- what the engine asks ----------------------------------------------------------------------
    @property
    def stage_id(self) -> int:
        """The first stage this rank runs (DeepSpeed's attribute)."""
        return self.stage_ids[0]

    def num_chunks(self) -> int:
        return len(self._chunks)

    def chunk_layers(self, chunk: int) -> List[int]:
        """Global indices of the layers of this rank's ``chunk``-th stage."""
        return [i for i, _ in self._chunks[chunk]]

    def chunk_modules(self, chunk: int) -> List[nn.Module]:
        """The modules (each once) that this rank's ``chunk``-th stage runs: its parameters."""
        out: List[nn.Module] = []
        for _, f in self._chunks[chunk]:
            m = f.module if isinstance(f, _TiedUse) else f
            if isinstance(m, nn.Module) and not any(m is x for x in out):
                out.append(m)
        return out

    def layer_classes(self) -> List[str]:
        """The class name of every layer of the whole pipeline (all stages), in order."""
        return list(self._class_names)

    def tied_keys_by_stage(self) -> Dict[str, List[int]]:
        """For each tie key, the stages (of the whole pipeline) that use it."""
        out: Dict[str, List[int]] = {}
        for s in range(len(self.parts) - 1):
            for i in range(self.parts[s], self.parts[s + 1]):
                spec = self._layer_specs[i]
                if isinstance(spec, TiedLayerSpec) and s not in out.setdefault(spec.key, []):
                    out[spec.key].append(s)
        return out

    def tied_parameters(self, key: str) -> List[nn.Parameter]:
        """This rank's copies of the parameters tied under ``key`` (empty when it holds no use)."""
        if key not in self.tied_modules:
            return []
        module = self.tied_modules[key]
        return [module.get_parameter(attr) for attr in self.tied_weight_attrs[key]]  # dotted names too

    # ---- forward ----------------------------------------------------------------------------------------
    def forward(self, *inputs: Any, chunk: int = 0) -> Any:
        """Run the layers of this rank's ``chunk``-th stage on ``inputs`` (one tensor, or a tuple that the
        first layer receives whole, as DeepSpeed passes it)."""
        layers = self._chunks[chunk]
        x: Any = inputs[0] if len(inputs) == 1 else inputs
        k = self.activation_checkpoint_interval
        if k <= 0 or not torch.is_grad_enabled():
            return _run(layers, x)
        for start in range(0, len(layers), k):
            segment = layers[start : start + k]
            if not self._checkpointable(segment):
                x = _run(segment, x)
                continue
            args = x if isinstance(x, tuple) else (x,)
            fn = self.activation_checkpoint_func
            if fn is None:
                x = torch_checkpoint(_SegmentRunner(segment), *args, use_reentrant=False)
            else:
                x = fn(_SegmentRunner(segment), *args)
        return x

    def _checkpointable(self, segment: List[Tuple[int, Callable]]) -> bool:
        """DeepSpeed's rule: listed class names when ``checkpointable_layers`` is given, else any layer with
        parameters."""
        if self.checkpointable_layers is not None:
            return any(type(f).__name__ in self.checkpointable_layers for _, f in segment)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for _, f in segment)


class _SegmentRunner:
    """A picklable callable running a few layers (what activation checkpointing recomputes)."""

    def __init__(self, layers: List[Tuple[int, Callable]]):
        self.layers = layers

    def __call__(self, *args: Any) -> Any:
        return _run(self.layers, args[0] if len(args) == 1 else args)


def _run(layers: List[Tuple[int, Callable]], x: Any) -> Any:
    for _, layer in layers:
        x = layer(x)
    return x


class _TiedUse:
    """A use of a tied module through ``forward_fn(module, x)``, called as the module itself so that its
    forward hooks (stage-3 gathers) fire."""

    def __init__(self, module: nn.Module, forward_fn: Callable):
        self.module = module
        self.forward_fn = forward_fn

    def __call__(self, x: Any) -> Any:
        fn = self.forward_fn
        module = self.module
        module.forward = types.MethodType(lambda self, inp: fn(self, inp), module)
        try:
            return module(x)
        finally:
            del module.forward
