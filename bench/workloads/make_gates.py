"""bench/workloads/gates.json: the issue-45 rows of the seed table with the gates trained
models have and with no gate, for the question "does our speed depend on the gates?".

Per base row (bf16): <name>-trained (a trained model's decays, -exp(A_log) softplus(a +
dt_bias), computed outside the kernel: -1e-3 .. -1e-1 a token), <name>-trained-raw (the
same gate formed in the kernel: use_gate_in_kernel with A_log and dt_bias) and
<name>-nogate (g = 0: no decay at all). The base rows themselves (the table's synthetic
logsigmoid(N(2, 1)) gates) are in the main table.

    python3 bench/workloads/make_gates.py > bench/workloads/gates.json
    linattn-bench --workloads-json bench/workloads/gates.json ...
"""
import copy
import json
import sys

from linattn.cli.bench.workloads import load_rows

BASE = {"GDNFwd": ("prefill-4k", "q35-2b-16384", "q35-397b-tp1-65536", "q35-397b-tp8-8192",
                   "q35-2b-8x8192", "q35-397b-tp4-8x1024"),
        "KDAFwd": ("kda-tp1-4096", "kda-tp8-16384")}


def variants(row: dict) -> list:
    out = []
    HV = row["tensors"]["v"]["shape"][2]
    per = row["tensors"]["g"]["shape"][3] if row["op"] == "KDAFwd" else 1
    for suffix, opts, extra in (
            ("trained", {"gates": "trained"}, {}),
            ("trained-raw", {"use_gate_in_kernel": True},
             {"A_log": {"shape": [HV], "dtype": "f32"}, "dt_bias": {"shape": [HV * per], "dtype": "f32"}}),
            ("nogate", {"gates": "none"}, {})):
        r = copy.deepcopy(row)
        r["workload"] = f"{row['workload']}-{suffix}"
        r["options"].update(opts)
        r["tensors"].update(extra)
        r["seed"] = {}
        out.append(r)
    return out


def main():
    rows = []
    for r in load_rows():
        if r.dtype == "bf16" and r.workload in BASE.get(r.op, ()):
            rows += variants({"op": r.op, "workload": r.workload, "dtype": r.dtype,
                              "tensors": r.tensors, "options": dict(r.options)})
    json.dump(rows, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
