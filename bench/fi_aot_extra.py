"""The flashinfer GDN kernels the benchmark table calls, as FI_GDN_AOT_EXTRA for
../shared/gpu/flashinfer/make_fi_bundle.sh (its ahead-of-time bundle runs only the
specialisations built into it). Mirrors cli/bench/flashinfer_calls.py: one entry per
distinct call of a GDN row it does not refuse (K = V = 128; decode bf16 only).

    FI_GDN_AOT_EXTRA="$(python3 bench/fi_aot_extra.py)" bash /tmp/fipack/make_fi_bundle.sh
"""
import json
import sys

from linattn.cli.bench.workloads import load_rows


def entries(rows):
    out = []
    for r in rows:
        if r.op != "GDNFwd" or r.shape("q")[3] != 128 or r.shape("v")[3] != 128:
            continue
        B, T, H, _ = r.shape("q")
        HV = r.shape("v")[2]
        o = r.options
        if o.get("allow_neg_eigval") and o.get("use_beta_sigmoid_in_kernel"):
            continue
        l2 = bool(o.get("use_qk_l2norm_in_kernel"))
        if T == 1:
            if r.dtype != "bf16":
                continue
            kind = "pretranspose" if o.get("state_v_first") else "nontranspose"
            out.append(["decode", {"kind": kind, "B": B, "H": H, "HV": HV, "l2norm": l2}])
        else:
            nseq = len(o["seq_lens"]) if "seq_lens" in o else B
            # (the q / k normalisation is a kernel of its own, built by the bundle's default
            # list; the chunked kernels are those of the call without it, and a call with it
            # cannot be traced on the CPU)
            out.append(["prefill", {"T": B * T, "hq": H, "hk": H, "hv": HV, "nseq": nseq,
                                    "init": "initial_state" in r.tensors, "l2norm": False,
                                    "cu_dtype": "int32", "dtype": "bf16" if r.dtype == "bf16" else "fp16"}])
    uniq = []
    for e in out:
        if e not in uniq:
            uniq.append(e)
    return uniq


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else None
    json.dump(entries(load_rows(path)), sys.stdout)
