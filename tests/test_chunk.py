"""CPU tests of the chunked forward: templates render, stages compile for sm_90a, and the
host-side chunk tables match a direct NumPy walk over the sequences."""
import types

import numpy as np
import pytest

from linattn.dsl import Gate, Options, SpecError, all_rule_gate_specs
from linattn.ops import chunk
from linattn.ops.registry import get_spec

SIX = {s.name: s for s in all_rule_gate_specs()}
SUPPORTED = [n for n, s in SIX.items() if s.gate in chunk.SUPPORTED_GATES]
UNSUPPORTED = [n for n, s in SIX.items() if s.gate not in chunk.SUPPORTED_GATES]


def _spec(name):
    return SIX[name] if name in SIX else get_spec(name)


# -- rendering ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage", chunk.STAGES)
@pytest.mark.parametrize("name", ["deltanet", "gdn"] + SUPPORTED)
def test_stage_renders(name, stage):
    spec = _spec(name)
    mod = chunk.stage_module(spec, stage)
    assert isinstance(mod, types.ModuleType)
    assert mod.STAGE == stage and mod.SPEC_HASH == spec.hash and mod.SPEC_KEY == spec.key
    assert mod.out_idx(**mod.EXAMPLES[0]) == []
    # the spec's structure reaches the text: no gate, no cumsum; additive, no inverse
    src = chunk.stage_module.__globals__["_MODULES"]  # noqa: F841  (module cache exists)
    text = _rendered_text(spec, stage)
    assert ("T.cumsum" in text) == (stage == "chunk_prepare" and spec.has_gate)
    assert ("forward substitution" in text) == (stage == "chunk_prepare" and spec.has_beta)


def _rendered_text(spec, stage):
    from linattn.codegen.plan import Stage
    from linattn.codegen.render import render_stage
    return render_stage(spec, Stage(stage, f"{stage}.py.jinja", "fwd"), "sm90")


@pytest.mark.parametrize("name", UNSUPPORTED + ["kda", "gla"])
def test_key_gate_not_supported(name):
    with pytest.raises(SpecError, match="not 'key'"):
        chunk.stage_module(_spec(name), "chunk_state")


def test_rendering_is_deterministic():
    spec = get_spec("gdn")
    assert all(_rendered_text(spec, s) == _rendered_text(spec, s) for s in chunk.STAGES)


# -- compiling (sm_90a, no GPU needed) ----------------------------------------------------

COMPILE_CASES = [
    ("gdn", 0), ("gdn", 1), ("deltanet", 1), ("delta_none", 0), ("additive_scalar", 1),
]


@pytest.mark.compile
@pytest.mark.parametrize("stage", chunk.STAGES)
@pytest.mark.parametrize("name,example", COMPILE_CASES,
                         ids=[f"{n}-ex{e}" for n, e in COMPILE_CASES])
def test_stage_compiles(name, example, stage):
    spec = _spec(name)
    mod = chunk.stage_module(spec, stage)
    params = dict(mod.EXAMPLES[example])
    kern = chunk.compiled_stage(spec, stage, **params)
    src = kern.get_kernel_source()
    assert "__global__" in src
    uses_gemm = stage != "chunk_prepare" or spec.has_beta
    assert ("wgmma" in src) == uses_gemm


# -- host chunk tables --------------------------------------------------------------------

def _tables_by_walking(lens, C):
    bos, length, offsets = [], [], [0]
    start = 0
    for L in lens:
        t = 0
        while t < L:
            bos.append(start + t)
            length.append(min(C, L - t))
            t += C
        offsets.append(len(bos))
        start += L
    return np.array(bos), np.array(length), np.array(offsets)


@pytest.mark.parametrize("C", [16, 64])
def test_chunk_tables_match_walk(rng, C):
    for _ in range(20):
        n = int(rng.integers(1, 33))
        lens = rng.integers(0, 300, n)
        lens[rng.integers(0, n)] = 1
        cu = np.concatenate([[0], np.cumsum(lens)])
        bos, length, offsets = chunk.build_chunk_tables(cu, C)
        want = _tables_by_walking(lens, C)
        for got, ref in zip((bos, length, offsets), want):
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, ref)
        assert np.all((length >= 1) & (length <= C))


def test_chunk_tables_fixed_length():
    bos, length, offsets = chunk.build_chunk_tables([0, 65, 130], 64)
    assert bos.tolist() == [0, 64, 65, 129]
    assert length.tolist() == [64, 1, 64, 1]
    assert offsets.tolist() == [0, 2, 4]


@pytest.mark.parametrize("cu", [[1, 4], [0, 5, 3], [0]])
def test_chunk_tables_reject_bad_cu(cu):
    with pytest.raises(SpecError):
        chunk.build_chunk_tables(cu, 64)


def test_state_block_fills_gpu():
    assert chunk.state_block_v(128, 512) == 64       # 1024 CTAs at 64
    assert chunk.state_block_v(128, 64) == 32        # 256 CTAs at 32
    assert chunk.state_block_v(128, 16) == 16        # too few either way: smallest
    assert chunk.state_block_v(48, 1) == 16
    with pytest.raises(SpecError):
        chunk.state_block_v(40, 1)
    with pytest.raises(SpecError):
        chunk.output_block_v(40)


def test_options_checked_before_launch():
    with pytest.raises(SpecError):
        chunk.chunk_forward(get_spec("deltanet"), None, None, None,
                            options=Options(gate_in_kernel=True))
