"""linattn as a ``kernels`` mapping for transformers' linear-attention models.

transformers 5.x declares each linear-attention function of Qwen3-Next, Qwen3.5,
OLMo-hybrid and Kimi Linear with ``use_kernel_func_from_hub_with_fallback(NAME, "fla")``:
a hub-kernel slot named NAME (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``,
``chunk_kda``, ``fused_recurrent_kda``) whose default is fla if importable, else a torch
loop. The ``kernels`` package fills such slots from a mapping {NAME: {device: {mode:
repository}}} when ``kernelize`` runs; a repository is anything with ``load()`` returning
the layer class whose ``forward`` replaces the slot's. :class:`LinattnRepository` is that
for linattn's installed functions (nothing downloaded or built), so::

    from kernels import use_kernel_mapping, kernelize, Mode
    with use_kernel_mapping(linattn.integrations.kernel_mapping()):
        kernelize(model, mode=Mode.TRAINING, device="cuda")

or in one call, refusing clearly when nothing was routed: ``kernelize(model)`` below.
The mapping covers Hopper (compute capability 9.x); on other devices ``kernels`` keeps the
original function, as it does for any kernel without a build for the device.
"""
from __future__ import annotations

import functools
import inspect

import torch

from linattn.integrations.deps import require

#: transformers' slot name -> linattn's function (the same name: fla's, whose arguments
#: transformers passes)
FUNCTIONS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
             "fused_recurrent_kda")
#: Compute capabilities linattn has kernels for (major * 10 + minor): Hopper
CAPABILITIES = (90, 99)


@functools.lru_cache(maxsize=None)
def _keywords(fn) -> frozenset:
    """The keyword names ``fn`` declares (through functools.wraps too)."""
    return frozenset(inspect.signature(fn).parameters)


def _call(name, query, key, value, g, beta, **kwargs):
    """linattn's ``name`` with transformers' arguments. As transformers' own wrapper does
    for fla, keywords the function does not declare (the model's attention kwargs:
    position_ids, cu_seq_lens_k, ...) are dropped; ``chunk_size`` is fla's keyword,
    checked by linattn. g and beta go by name, as the models pass them: in
    fused_recurrent_gated_delta_rule the fifth parameter is fla's ``gk``."""
    import linattn
    fn = getattr(linattn, name)
    known = _keywords(fn) | {"chunk_size"}
    kwargs = {k: v for k, v in kwargs.items() if k in known}
    return fn(query, key, value, g=g, beta=beta, **kwargs)


def _chunk_layer(name):
    """A ``kernels`` layer for a chunk_* slot: ``forward`` has the signature of
    transformers' torch function (``kernels`` checks the parameters' count and kinds)."""
    def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None,
                output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        return _call(name, query, key, value, g, beta, chunk_size=chunk_size,
                     initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    return _layer(name, forward)


def _recurrent_layer(name):
    """As :func:`_chunk_layer` for a fused_recurrent_* slot (no chunk_size)."""
    def forward(self, query, key, value, g, beta, initial_state=None,
                output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        return _call(name, query, key, value, g, beta, initial_state=initial_state,
                     output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    return _layer(name, forward)


def _layer(name, forward):
    """A stateless nn.Module class (``kernels``' rules: no constructor, no members but
    these two flags): linattn's functions train and compile (torch.library ops)."""
    forward.__doc__ = f"linattn.{name} with transformers' arguments."
    return type(name, (torch.nn.Module,), {
        "forward": forward, "can_torch_compile": True, "has_backward": True,
        "__module__": __name__, "__doc__": f"linattn.{name} as a kernels layer."})


#: slot name -> the layer class :class:`LinattnRepository` loads
LAYERS = {name: (_chunk_layer if name.startswith("chunk") else _recurrent_layer)(name)
          for name in FUNCTIONS}


class LinattnRepository:
    """A ``kernels`` repository (the ``load()`` of LayerRepository / LocalLayerRepository)
    holding linattn's installed functions: ``load()`` returns the layer for
    ``layer_name`` (one of :data:`FUNCTIONS`)."""

    def __init__(self, layer_name: str):
        if layer_name not in LAYERS:
            raise ValueError(f"layer_name={layer_name!r}: linattn maps "
                             f"{', '.join(FUNCTIONS)}")
        self.layer_name = layer_name

    def load(self):
        return LAYERS[self.layer_name]

    def __eq__(self, other):
        return isinstance(other, LinattnRepository) and other.layer_name == self.layer_name

    def __hash__(self):
        return hash(("linattn", self.layer_name))

    def __str__(self):
        return f"linattn (installed), layer `{self.layer_name}`"

    __repr__ = __str__


def kernel_mapping() -> dict:
    """{slot: {Device(cuda, Hopper): {mode: LinattnRepository}}} for every slot of
    :data:`FUNCTIONS`, in training and inference modes, with and without torch.compile;
    for ``kernels.use_kernel_mapping`` / ``register_kernel_mapping``."""
    kernels = require("kernels", "kernels>=0.19", "linattn.integrations.kernel_mapping")
    hopper = kernels.Device(type="cuda", properties=kernels.CUDAProperties(
        min_capability=CAPABILITIES[0], max_capability=CAPABILITIES[1]))
    Mode = kernels.Mode
    modes = (Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE,
             Mode.INFERENCE | Mode.TORCH_COMPILE)
    return {name: {hopper: dict.fromkeys(modes, LinattnRepository(name))}
            for name in FUNCTIONS}


def routed(model) -> dict:
    """{module path.slot: True if linattn serves it} for every linear-attention slot of
    ``model`` (transformers' ``use_kernelized_func`` attaches them to each layer)."""
    out = {}
    for path, module in model.named_modules():
        for fn in getattr(module, "_kernel_funcs", {}).values():
            name = getattr(type(fn), "kernel_layer_name", None)
            if name in LAYERS:      # kernelize binds the layer's forward to the slot
                bound = getattr(fn.__dict__.get("forward"), "__func__", None)
                out[f"{path}.{name}"] = bound is LAYERS[name].forward
    return out


def kernelize(model, mode=None, device: str = "cuda"):
    """Route ``model``'s linear-attention functions (:data:`FUNCTIONS`) to linattn:
    ``kernels.kernelize`` under :func:`kernel_mapping` (added to any mapping in use).
    mode: a ``kernels.Mode`` (default TRAINING if model.training else INFERENCE); linattn
    serves both. Raises ValueError when the model has no such function or none was routed
    (a GPU other than Hopper: ``kernels`` would keep the original). Returns the model."""
    kernels = require("kernels", "kernels>=0.19", "linattn.integrations.kernelize")
    if mode is None:
        mode = kernels.Mode.TRAINING if model.training else kernels.Mode.INFERENCE
    with kernels.use_kernel_mapping(kernel_mapping()), _quiet_unmapped():
        kernels.kernelize(model, mode=mode, device=device)
    slots = routed(model)
    if not slots:
        raise ValueError(f"model ({type(model).__name__}) has no linear-attention function "
                         f"linattn maps ({', '.join(FUNCTIONS)}); transformers >= 5 declares "
                         "them in Qwen3-Next, Qwen3.5, OLMo-hybrid and Kimi Linear")
    if not all(slots.values()):
        cap = torch.cuda.get_device_capability() if device == "cuda" else device
        raise ValueError(f"device={device!r} (capability {cap}): linattn's kernels run on "
                         "Hopper (compute capability 9.x); kernelize kept the originals")
    return model


class _quiet_unmapped:
    """Silence ``kernels``' warning for every slot the mapping leaves alone (conv, norms)."""

    def __enter__(self):
        import logging
        self.logger = logging.getLogger("kernels._internals.layer.layer")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
