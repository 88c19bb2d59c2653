"""linattn under other projects' model code: the top layer, beside ``cli`` (it may import
``ops``; nothing below imports it). transformers, kernels and fla are imported only when
one of these is called, so ``import linattn`` never needs them.

* transformers (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi Linear; integrations/transformers.py):
  ``kernelize(model)``, or ``kernel_mapping()`` for the ``kernels`` package's own
  ``use_kernel_mapping`` / ``kernelize``.
* fla's layers and models (integrations/fla.py): ``apply_linattn_to_fla()``.
* ``precompile(fn)``: compile the linattn kernels a model step needs, in parallel, first.

A missing dependency raises ImportError with one line naming the package to install.
"""
from linattn.integrations.fla import FLA_FUNCTIONS, Patch, apply_linattn_to_fla  # noqa: F401
from linattn.integrations.transformers import (LAYERS, LinattnRepository,  # noqa: F401
                                               kernel_mapping, kernelize, routed)
from linattn.integrations.warm import precompile  # noqa: F401
