"""Writes model-shaped forward calls outside the seed table, in linattn-bench's row format
(no seed figures: linattn vs fla):
  bench/workloads/outside.json          GDN / DeltaNet (issue 12: head dims 64 / 128 / 256,
                                        4 - 64 heads, lengths not a multiple of 64,
                                        1 - 64 sequences)
  bench/workloads/outside_keygate.json  KDA / GLA (issue 13: Kimi-Linear-like KDA, 32 heads,
                                        K = V = 128 at 4k - 32k tokens; GLA-1.3B's 4 heads,
                                        K = 256, V = 512; varlen packs, initial states)

    python3 bench/workloads/make_outside.py && linattn-bench --workloads-json \
        bench/workloads/outside.json --impl linattn,fla
"""
import json
import os

# (op, label, B, T, H, HV, K, V, seq_lens or None, initial state, options)
SHAPES = [
    ("GDNFwd", "k64-h32-b4x1000", 4, 1000, 32, 32, 64, 64, None, False, {}),
    ("GDNFwd", "k256-h8-4096", 1, 4096, 8, 8, 256, 256, None, False, {}),
    ("GDNFwd", "k256-v128-h16-2k+h0", 2, 2047, 16, 16, 256, 128, None, True, {}),
    ("GDNFwd", "gva-h16-hv32-8k", 1, 8190, 16, 32, 128, 128, None, False,
     {"use_qk_l2norm_in_kernel": True}),
    ("GDNFwd", "h64-b2-3001", 2, 3001, 64, 64, 128, 128, None, False, {}),
    ("GDNFwd", "h4-32k", 1, 32768, 4, 4, 128, 128, None, False, {}),
    ("GDNFwd", "varlen-64seq", 1, None, 16, 16, 128, 128,
     [37 + 61 * i for i in range(64)], False, {}),
    ("GDNFwd", "varlen-mixed-h0", 1, None, 8, 16, 128, 128,
     [5, 4100, 777, 63, 1500, 2], True, {}),
    ("GDNFwd", "b64-x-257", 64, 257, 16, 16, 128, 128, None, True, {}),
    ("DeltaNetFwd", "k64-h4-5000", 1, 5000, 4, 4, 64, 64, None, False, {}),
    ("DeltaNetFwd", "k128-h16-b8x1023", 8, 1023, 16, 16, 128, 128, None, False,
     {"use_qk_l2norm_in_kernel": True}),
    ("DeltaNetFwd", "k256-h8-4k", 1, 4096, 8, 8, 256, 256, None, False, {}),
    ("DeltaNetFwd", "k128-h32-16k", 1, 16384, 32, 32, 128, 128, None, False, {}),
    ("DeltaNetFwd", "varlen-16seq", 1, None, 12, 12, 64, 64,
     [100 * i + 3 for i in range(1, 17)], True, {}),
]
L2 = {"use_qk_l2norm_in_kernel": True}
KEY_SHAPES = [
    ("KDAFwd", "kimi-h32-8k", 1, 8192, 32, 32, 128, 128, None, False, L2),
    ("KDAFwd", "kimi-h32-32k", 1, 32768, 32, 32, 128, 128, None, False, L2),
    ("KDAFwd", "kimi-h32-b2x4k+h0", 2, 4096, 32, 32, 128, 128, None, True, L2),
    ("KDAFwd", "kimi-h32-8x2k+h0", 1, None, 32, 32, 128, 128, [2048] * 8, True, L2),
    ("KDAFwd", "kimi-h32-16k-gik", 1, 16384, 32, 32, 128, 128, None, False,
     dict(L2, use_gate_in_kernel=True)),
    ("KDAFwd", "kda-h16-varlen-ragged", 1, None, 16, 16, 128, 128,
     [3000, 17, 900, 4100, 1], False, L2),
    ("GLAFwd", "gla1.3b-h4-4k", 2, 4096, 4, 4, 256, 512, None, False, {}),
    ("GLAFwd", "gla1.3b-h4-16k+h0", 1, 16384, 4, 4, 256, 512, None, True, {}),
    ("GLAFwd", "gla-h16-8k", 2, 8192, 16, 16, 128, 128, None, False, {}),
    ("GLAFwd", "gla-h8-varlen-8seq", 1, None, 8, 8, 128, 128,
     [513 * i + 7 for i in range(1, 9)], True, {}),
]


def row(op, label, B, T, H, HV, K, V, lens, h0, options):
    if lens:
        B, T = 1, sum(lens)
        options = dict(options, seq_lens=lens)
    t = lambda *s, dtype=None: {"shape": list(s), "dtype": dtype}  # noqa: E731
    tensors = dict(q=t(B, T, H, K), k=t(B, T, H, K), v=t(B, T, HV, V))
    if op != "GLAFwd":
        tensors["beta"] = t(B, T, HV)
    if op == "GDNFwd":
        tensors["g"] = t(B, T, HV)
    if op in ("KDAFwd", "GLAFwd"):
        tensors["g"] = t(B, T, HV, K)
    if options.get("use_gate_in_kernel"):
        tensors["A_log"] = t(HV, dtype="f32")
        tensors["dt_bias"] = t(HV * K if op == "KDAFwd" else HV, dtype="f32")
    if lens:
        tensors["cu_seqlens"] = t(len(lens) + 1, dtype="i64")
        tensors["cu_seqlens_cpu"] = t(len(lens) + 1, dtype="i64")
    if h0:
        tensors["initial_state"] = t(len(lens) if lens else B, HV, K, V, dtype="f32")
    return dict(op=op, workload=label, dtype="bf16", tensors=tensors, options=options)


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    for name, shapes in (("outside.json", SHAPES), ("outside_keygate.json", KEY_SHAPES)):
        with open(os.path.join(here, name), "w") as f:
            json.dump([row(*s) for s in shapes], f, indent=1)
        print(f"{len(shapes)} rows -> {os.path.join(here, name)}")
