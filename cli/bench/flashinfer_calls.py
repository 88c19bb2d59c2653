"""flashinfer's Gated DeltaNet kernels as a benchmark implementation: loaded by worker.py
in a process whose package path holds flashinfer (its tvm_ffi differs from TileLang's),
never imported by linattn.

Native calls: the timed function is flashinfer's own entry point on tensors already in its
contract, prepared outside the timed call:
- prefill, ``flashinfer.gdn_prefill.chunk_gated_delta_rule``: q, k, v flattened to
  [tokens, heads, dim] (views), alpha = exp(g) and beta in fp32 (its precomputed-gate
  contract; raw gates and beta logits go in as they are with use_gate_in_kernel /
  beta_is_logit), cu_seqlens int32 (arange for equal lengths), the state value-major
  [N, HV, V, K] (transposed outside the timed call for a key-major row, and back);
- decode, ``gated_delta_rule_decode`` (key-major state) or
  ``gated_delta_rule_decode_pretranspose`` (value-major), which take the gate in its raw
  form (-exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)): a precomputed gate goes in
  as A_log = dt_bias = 0, a = log(expm1(-g)), b = logit(beta), in the row's dtype. The
  state is updated in place, so the check's call gets a copy of the initial state.
A call flashinfer does not serve (head dim 64, f16 decode, a shape its ahead-of-time
bundle lacks, beta in (0, 2) from logits) is refused.
"""
from __future__ import annotations

import os

os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fi_gdn_ws")
os.environ.setdefault("TVM_FFI_CACHE_DIR", "/tmp/fi_gdn_ws/tvm-ffi")
os.environ.setdefault("CUTE_DSL_CACHE_DIR", "/tmp/fi_gdn_ws/cute-dsl")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

if not (hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
        or hasattr(torch.Tensor, "__c_dlpack_exchange_api__")):
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

REFUSALS = ()


def describe() -> dict:
    import flashinfer
    return {"flashinfer": getattr(flashinfer, "__version__", "?")}


def _refusing(fn):
    """Missing ahead-of-time kernels and flashinfer's own argument asserts are refusals."""
    def call():
        try:
            return fn()
        except AssertionError as e:
            raise NotImplementedError(f"flashinfer asserts: {e}") from e
        except RuntimeError as e:
            if "no prebuilt" in str(e) or "AOT" in str(e):
                raise NotImplementedError(" ".join(str(e).split())[:300]) from e
            raise
    return call


def make(op: str, options: dict, decode: bool, x: dict):
    if op != "GDNFwd":
        raise NotImplementedError(f"flashinfer has no {op}")
    if x["q"].shape[-1] != 128 or x["v"].shape[-1] != 128:
        raise NotImplementedError("flashinfer's sm90 GDN kernels take K = V = 128")
    if options.get("allow_neg_eigval") and options.get("use_beta_sigmoid_in_kernel"):
        raise NotImplementedError("flashinfer's beta logits give sigmoid(b), not 2 sigmoid(b)")
    fn, convert = (_decode if decode else _prefill)(options, x)
    return _refusing(fn), convert


def _prefill(options: dict, x: dict):
    from flashinfer.gdn_prefill import chunk_gated_delta_rule
    B, T, H, K = x["q"].shape
    HV, V = x["v"].shape[2:]
    q, k, v = (x[n].reshape(B * T, *x[n].shape[2:]) for n in ("q", "k", "v"))
    raw_g, raw_b = bool(options.get("use_gate_in_kernel")), bool(options.get("use_beta_sigmoid_in_kernel"))
    g = x["g"].reshape(B * T, HV)
    g = g if raw_g else g.float().exp()
    beta = x["beta"].reshape(B * T, HV)
    beta = beta if raw_b else beta.float()
    cu = x.get("cu_seqlens")
    cu = (torch.arange(0, (B + 1) * T, T, device=q.device) if cu is None else cu).to(torch.int32)
    v_first = bool(options.get("state_v_first"))
    h0 = x.get("initial_state")
    if h0 is not None and not v_first:
        h0 = h0.transpose(-1, -2).contiguous()
    kw = dict(scale=options.get("scale"), initial_state=h0, output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm_in_kernel=bool(options.get("use_qk_l2norm_in_kernel")))
    if raw_g:
        kw.update(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    if raw_b:
        kw["beta_is_logit"] = True

    def convert(res):
        o, ht = res
        return {"o": o.view(B, T, HV, V), "final_state": ht if v_first else ht.transpose(-1, -2)}
    return (lambda: chunk_gated_delta_rule(q, k, v, g, beta, **kw)), convert


def _decode(options: dict, x: dict):
    from flashinfer import gdn_decode
    q = x["q"]
    if q.dtype != torch.bfloat16:
        raise NotImplementedError("flashinfer's GDN decode writes bf16 outputs (bf16 rows only)")
    B, _, HV, V = x["v"].shape
    K = q.shape[-1]
    v_first = bool(options.get("state_v_first"))
    raw_g, raw_b = bool(options.get("use_gate_in_kernel")), bool(options.get("use_beta_sigmoid_in_kernel"))
    if raw_g:
        a, A_log, dt_bias = x["g"], x["A_log"].float(), x["dt_bias"].float()
    else:   # softplus(a) = -g with A_log = dt_bias = 0
        a = torch.log(torch.expm1(-x["g"].double())).to(q.dtype)
        A_log = torch.zeros(HV, device=q.device)
        dt_bias = torch.zeros(HV, device=q.device)
    b = x["beta"] if raw_b else torch.logit(x["beta"].double()).to(q.dtype)
    h0 = x.get("initial_state")
    shape = (B, HV, V, K) if v_first else (B, HV, K, V)
    state = torch.zeros(shape, device=q.device) if h0 is None else h0.float().clone()
    out = torch.empty(B, 1, HV, V, device=q.device, dtype=torch.bfloat16)
    f = gdn_decode.gated_delta_rule_decode_pretranspose if v_first else gdn_decode.gated_delta_rule_decode
    l2 = bool(options.get("use_qk_l2norm_in_kernel"))

    def fn():
        return f(q, x["k"], x["v"], state, A_log, a, dt_bias, b, scale=options.get("scale"),
                 output=out, use_qk_l2norm=l2)
    return fn, (lambda res: {"o": res[0], "final_state": res[1]})
