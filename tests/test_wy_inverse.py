"""The warpgroup WY inverse (codegen/templates/cuda/wy_inverse64.cuh, la_wy_inverse64):
X = (I + L)^-1 of a 64 x 64 strictly lower L by four warps, one exchange.

CPU: its block formula (D = (I + Ld)^-1, N = D Lo, X = (I - N + N^2 - N^3) D written block
by block as the helper forms it) equals the fp64 inverse; the helper compiles for sm_90a
with no spills (compile). GPU: the helper itself, in a kernel of its own, against the fp64
inverse on L as the walk forms it (beta_i k_i . k_j e^(g_i - g_j), l2-normalised k; strong,
weak and no gates; beta up to 2), every element of X written (poisoned input above the
diagonal), tf32 tolerance.

    python3 -m pytest -q tests/test_wy_inverse.py          (GPU cases skip without a GPU)
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _blocks_formula(L):
    """X as the helper forms it, in fp64."""
    B = lambda M, i, j: M[16 * i:16 * i + 16, 16 * j:16 * j + 16]  # noqa: E731
    D = [np.linalg.inv(np.eye(16) + B(L, w, w)) for w in range(4)]
    N = {(w, j): D[w] @ B(L, w, j) for w in range(4) for j in range(w)}
    X = np.zeros((64, 64))
    for w in range(4):
        X[16 * w:16 * w + 16, 16 * w:16 * w + 16] = D[w]
    Y = N[3, 2] @ N[2, 1] - N[3, 1]
    for (i, j), blk in {(1, 0): -N[1, 0] @ D[0], (2, 1): -N[2, 1] @ D[1],
                        (2, 0): (N[2, 1] @ N[1, 0] - N[2, 0]) @ D[0],
                        (3, 2): -N[3, 2] @ D[2], (3, 1): Y @ D[1],
                        (3, 0): (N[3, 2] @ N[2, 0] - Y @ N[1, 0] - N[3, 0]) @ D[0]}.items():
        X[16 * i:16 * i + 16, 16 * j:16 * j + 16] = blk
    return X


def _walk_l(rng, n, gate_scale, beta_max):
    """n matrices L as the walk forms them (fp64)."""
    k = rng.standard_normal((n, 64, 128))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0, beta_max, (n, 64, 1))
    g = np.cumsum(-gate_scale * rng.uniform(0.2, 2.0, (n, 64)), axis=-1)
    decay = np.exp(np.minimum(g[:, :, None] - g[:, None, :], 0))
    return np.tril(beta * (k @ k.transpose(0, 2, 1)) * decay, -1)


@pytest.mark.parametrize("gate_scale, beta_max", [(0.8, 1.0), (1e-3, 1.0), (0.0, 2.0)])
def test_block_formula(gate_scale, beta_max):
    """The helper's block formula is the inverse (fp64, the walk's L)."""
    for L in _walk_l(np.random.default_rng(1), 4, gate_scale, beta_max):
        ref = np.linalg.inv(np.eye(64) + L)
        assert np.abs(_blocks_formula(L) - ref).max() < 1e-9 * max(1.0, np.abs(ref).max())


def _kernel(n):
    """n CTAs, each inverting x[b] by la_wy_inverse64 in its second warpgroup."""
    import tilelang
    import tilelang.language as T
    from linattn.codegen.arch import get_arch
    from linattn.codegen.render import TEMPLATE_DIR
    src = (TEMPLATE_DIR / "cuda" / "wy_inverse64.cuh").read_text()

    @T.prim_func
    def wy_inverse_check(x: T.Tensor((n, 64, 64), "float32"),
                         y: T.Tensor((n, 64, 64), "float32")):
        with T.Kernel(n, threads=256, prelude=src) as (b,):
            a = T.alloc_shared((64, 64), "float32")
            scratch = T.alloc_shared((1024,), "float32")
            tx = T.get_thread_binding()
            if tx >= 128:               # (a group that is not the CTA's first, as in the walk)
                for i, j in T.Parallel(64, 64):
                    a[i, j] = x[b, i, j]
                T.sync_threads(8, 128)
                T.call_extern("handle", "la_wy_inverse64", T.address_of(a[0, 0]),
                              T.address_of(scratch[0]), tx - 128, 8)
                T.sync_threads(8, 128)
                for i, j in T.Parallel(64, 64):
                    y[b, i, j] = a[i, j]
    return tilelang.compile(wy_inverse_check, out_idx=[], target=get_arch("sm90").TARGET)


@pytest.mark.compile
def test_helper_compiles_without_spills():
    from linattn.codegen.compile import ptxas_usage
    use = ptxas_usage(_kernel(2).get_kernel_source(), "sm90")
    assert use["spill_store_bytes"] == 0 and use["spill_load_bytes"] == 0, use


@pytest.mark.gpu
@pytest.mark.parametrize("gate_scale, beta_max", [(0.8, 1.0), (1e-3, 1.0), (0.0, 2.0),
                                                  (0.05, 2.0)])
def test_helper_against_fp64(gate_scale, beta_max):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    n = 64
    L = _walk_l(np.random.default_rng(7), n, gate_scale, beta_max)
    x = torch.tensor(L, dtype=torch.float32)
    x += torch.triu(torch.full((64, 64), float("nan")))     # ignored: poisoned
    x = x.cuda()
    y = torch.full_like(x, float("nan"))
    _kernel(n)(x, y)
    ref = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + torch.tensor(L))
    got = y.double().cpu()
    assert torch.isfinite(got).all()
    assert torch.equal(torch.triu(got, 1), torch.zeros_like(got))
    err = ((got - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max().item()
    assert err < 3e-3, err
