"""`linattn-bench`: the benchmark over the seed's workload table.

    python3 -m linattn.cli.bench --impl linattn,fla,torch,torch-compile --out x.json \
        [--op GDNFwd,KDAFwd] [--workload 'prefill-*'] [--dtype bf16] [--limit N] \
        [--budget-s 500] [--merge bench/results/h200.json] [--plot x.png] [--verify-timer]
    python3 -m linattn.cli.bench --op train --impl linattn,fla --out train.json   (training)

Modules: workloads (table + filters), inputs (realistic tensors), reference (fp64 torch
references + check), impls (linattn / fla / torch / torch-compile / flashinfer calls),
timer (CUPTI device time), roofline (FLOPs, bytes, SOL), report (table, JSON, merge), plot (the picture),
run (the loop), train (the training rows' step, reference gradients and peak memory).
"""
from .cli import main  # noqa: F401
