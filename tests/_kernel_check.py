"""Test helpers: a stand-in for compiled stages that checks every launch's arguments
against the traced prim_func, and the patch that routes ops.runtime's compiles to it."""


class SignatureCheckingKernel:
    """Stands in for a compiled stage: checks each call's arguments against the traced
    prim_func (count, dtypes, static dims, one value per dynamic size, contiguity)."""

    def __init__(self, func):
        self.func = func
        self.calls = 0

    def __call__(self, *args):
        params = list(self.func.params)
        assert len(args) == len(params), (len(args), [p.name for p in params])
        binds, exprs = {}, []
        for p, a in zip(params, args):
            buf = self.func.buffer_map.get(p)
            if buf is None:
                assert isinstance(a, float), (p.name, type(a))
                continue
            name = buf.name
            assert str(a.dtype).replace("torch.", "") == str(buf.dtype), (name, a.dtype, buf.dtype)
            assert a.dim() == len(buf.shape), (name, tuple(a.shape), list(buf.shape))
            assert a.is_contiguous(), name
            for s, d in zip(buf.shape, a.shape):
                text = str(s)
                if text.isdigit():
                    assert int(text) == d, (name, list(buf.shape), tuple(a.shape))
                elif text.isidentifier():
                    assert binds.setdefault(text, d) == d, (name, text, binds[text], d)
                else:
                    exprs.append((name, text, d))
        for name, text, d in exprs:
            for op, solve in ((" + ", lambda d, c: d - c), (" * ", lambda d, c: d // c)):
                var, hit, const = text.partition(op)   # TileLang solves "N + 1", "NT * 64"
                if hit and var.isidentifier() and const.isdigit() and var not in binds:
                    binds[var] = solve(d, int(const))
            assert eval(text, {}, dict(binds)) == d, (name, text, binds, d)
        self.calls += 1


def fake_compiles(monkeypatch, body=None, calls=None):
    """Route ops.runtime's compiles to SignatureCheckingKernel (one per distinct params);
    body(spec, stage, params) -> callable(*args) (or None) runs the stage's formula after
    the check; calls (a list) collects (stage, params) of every compile. Returns the dict of
    fakes, keyed (spec name, stage, params)."""
    from linattn.ops import runtime
    fakes = {}

    def fake(spec, stage, arch, params, target=None):
        key = (spec.name, stage, tuple(sorted(params.items())))
        if key not in fakes:
            func = runtime.stage_module(spec, stage, arch).build(**params)
            checker = SignatureCheckingKernel(func)
            run = body(spec, stage, params) if body else None

            def call(*args, checker=checker, run=run):
                checker(*args)
                if run is not None:
                    run(*args)
            call.checker = checker
            fakes[key] = (call, runtime.arg_names(func))
            if calls is not None:
                calls.append((stage, dict(params)))
        return fakes[key]
    monkeypatch.setattr(runtime, "_compiled", fake)
    return fakes
