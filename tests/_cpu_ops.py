"""The ``cpu_ops`` fixture: public linattn calls on CPU tensors, end to end but for the
kernels. The device check is switched off and the torch.library ops' CPU kernel is the
fp64 torch reference (dsl/torch_reference.py; the pool one for state pools), so all the
Python around the kernels (argument forms, conversions, path choice, the ops' plumbing)
runs without a GPU. Outside the fixture the CPU kernel is the real implementation
(which refuses CPU tensors)."""
import pytest
import torch

from linattn.dsl import torch_reference as tr
from linattn.ops import library, validate
from linattn.ops.registry import specs

_CPU = {"on": False}
_REGISTERED = []


def _reference(spec, path, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
               scale, output_final_state, options, slots=None, accepted=None,
               rule_inputs=None):
    opts = library.options_from_key(options)
    for name, t in dict(q=q, k=k, v=v, g=g, beta=beta, h0=initial_state, slots=slots).items():
        assert t is None or t.is_contiguous(), name
    common = dict(options=opts, scale=scale, cu_seqlens=cu_seqlens, A_log=A_log,
                  dt_bias=dt_bias, **library.rule_dict(spec, rule_inputs))
    if slots is None:
        o, ht = tr.recurrent_forward(spec, q, k, v, g, beta, initial_state=initial_state,
                                     **common)
        if path == "inplace":
            initial_state.copy_(ht)
    else:
        o, new_pool, ht = tr.pool_recurrent_forward(
            spec, q, k, v, g, beta, pool=initial_state, ssm_state_indices=slots,
            num_accepted_tokens=accepted, inplace=path == "inplace", **common)
        if path == "inplace":
            initial_state.copy_(new_pool)
    if path == "inplace":
        return o.to(q.dtype)
    return o.to(q.dtype), (ht.float() if output_final_state else q.new_empty(0, dtype=torch.float32))


def _cpu_kernel(spec, path):
    real = library._impl(spec, path)

    def kernel(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu,
               scale, output_final_state, options, *pool):
        if not _CPU["on"]:
            return real(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                        cu_seqlens_cpu, scale, output_final_state, options, *pool)
        if path == "chunk" and pool:        # (the chunk op's one optional: rule_inputs)
            pool = (None, None) + tuple(pool)
        return _reference(spec, path, q, k, v, g, beta, A_log, dt_bias, initial_state,
                          cu_seqlens, scale, output_final_state, options, *pool)
    return kernel


@pytest.fixture
def cpu_ops(monkeypatch):
    """Yields the list of (op, path) the public calls ran."""
    if not _REGISTERED:
        for spec in specs().values():
            for path in library.SCHEMAS:
                name = f"{library.NAMESPACE}::{library.op_name(spec, path)}"
                torch.library.register_kernel(name, "cpu", _cpu_kernel(spec, path))
        _REGISTERED.append(True)
    ran = []
    real_run = library.run

    def run(spec, path, *args, **kw):
        ran.append((spec.name, "inplace" if kw.get("inplace") else path))
        return real_run(spec, path, *args, **kw)
    monkeypatch.setattr(library, "run", run)
    monkeypatch.setattr(validate, "check_devices", lambda q, **t: None)
    _CPU["on"] = True
    yield ran
    _CPU["on"] = False
