"""``linattn-gen``: regenerate, check, list and compile the generated TileLang kernels.

    linattn-gen --op gdn --arch sm90            regenerate generated/sm90/gdn/
    linattn-gen --op all --check                exit 1 listing stale/missing/extra files
    linattn-gen --list                          ops, variants, stages
    linattn-gen --op all --compile --report bench/compile_sm90.json
    linattn-gen --op gdn --plan B=1,T=4096,H=16,K=128    the chunked forward's plan for a call

A spec of your own (an OpSpec in a file or module outside the package) goes through the
same commands with ``--spec`` instead of ``--op``; its files land under
``<out>/<arch>/<name>/``, where ``<out>`` is ``--out`` or else the per-user folder the
runtime renders into (``$LINATTN_GEN_DIR``, default ``~/.cache/linattn/generated``),
never the package's generated/ unless ``--out`` names it:

    linattn-gen --spec my_variants.py:SIMPLE_GLA --arch sm90          generate
    linattn-gen --spec my_variants.py:SIMPLE_GLA --check              exit 1 if stale
    linattn-gen --spec my_pkg.variants:SIMPLE_GLA --out DIR --compile (module:NAME too)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..codegen.plan import VARIANTS, plan
from ..codegen.arch import ARCHES, DEFAULT_ARCH
from ..codegen.render import DEFAULT_OUT, check, render_tree, write
from ..dsl import SpecError
from ..ops.runtime import gen_dir
from ..ops.registry import is_registered, load_spec, specs


def _resolve_ops(names: tuple[str, ...]) -> list:
    table = specs()
    if not names or "all" in names:
        return [table[n] for n in sorted(table)]
    bad = [n for n in names if n not in table]
    if bad:
        raise click.BadParameter(f"unknown op {bad[0]!r}; valid ops: all, "
                                 f"{', '.join(sorted(table))} (a spec of your own: "
                                 "--spec FILE.py:NAME)", param_hint="'--op'")
    return [table[n] for n in dict.fromkeys(names)]


def _resolve_specs(refs: tuple[str, ...]) -> list:
    """--spec FILE.py:NAME / module:NAME -> OpSpecs (one-line errors, distinct names)."""
    out = {}
    for ref in dict.fromkeys(refs):
        try:
            spec = load_spec(ref)
        except SpecError as e:
            raise click.BadParameter(str(e), param_hint="'--spec'")
        if spec.name in out and out[spec.name].hash != spec.hash:
            raise click.BadParameter(f"two different specs are named {spec.name!r}",
                                     param_hint="'--spec'")
        out[spec.name] = spec
    return list(out.values())


def _rerun_hint(op_names, spec_refs, arch, out_dir) -> str:
    sel = [f"--op {n}" for n in op_names or ("all",)] if not spec_refs else [
        f"--spec {r}" for r in spec_refs]
    return " ".join(["linattn-gen", *sel, "--arch", arch] + (["--out", out_dir] if out_dir else []))


def _list(ops, arch) -> None:
    click.echo(f"arches: {', '.join(ARCHES)}")
    click.echo(f"variants: {', '.join(VARIANTS)}")
    for spec in ops:
        click.echo(f"{spec.name}  ({spec.key}, hash {spec.hash})")
        for variant in VARIANTS:
            stages = plan(spec, variant, arch)
            click.echo(f"  {variant:6s} {', '.join(s.name for s in stages) or '-'}")


class _OneLineErrors(click.Command):
    """click's command, a user error printed as one line ``Error: ...`` (the argument and
    what is accepted, no usage block, no traceback), exit status 2."""

    def main(self, args=None, prog_name=None, **kwargs):
        kwargs.pop("standalone_mode", None)
        try:
            return super().main(args, prog_name, standalone_mode=False, **kwargs)
        except click.ClickException as e:
            click.echo(f"Error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)


@click.command(name="linattn-gen", cls=_OneLineErrors,
               context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--op", "op_names", multiple=True, metavar="NAME",
              help="op to generate (repeatable), or 'all' (default: all)")
@click.option("--spec", "spec_refs", multiple=True, metavar="FILE.py:NAME|module:NAME",
              help="an OpSpec of your own instead of --op (repeatable); default --out: "
                   "the runtime's per-user folder ($LINATTN_GEN_DIR or "
                   "~/.cache/linattn/generated)")
@click.option("--arch", default=DEFAULT_ARCH, show_default=True, type=click.Choice(ARCHES),
              help="target architecture")
@click.option("--variant", default=None, type=click.Choice(VARIANTS),
              help="only this variant's stages (default: all variants)")
@click.option("--check", "check_only", is_flag=True,
              help="write nothing; exit 1 listing stale, missing or extra files")
@click.option("--list", "list_only", is_flag=True, help="list ops, variants and stages")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="output folder (default: the package's generated/ for --op, the "
                   "per-user folder for --spec)")
@click.option("--compile", "compile_all", is_flag=True,
              help="compile every generated stage for its representative configurations "
                   "and print registers / shared memory / spills")
@click.option("--report", default=None, type=click.Path(dir_okay=False),
              help="with --compile: write the results as JSON to this file")
@click.option("--plan", "plan_sizes", default=None, metavar="B=1,T=4096,H=16,K=128",
              help="print the chunked forward's plan for a call: B, T (or lens=1024:7168), "
                   "H, HV (default H), K, V (default K), dtype (bf16 / f16), option flags "
                   "(l2norm_qk, gate_in_kernel, state_v_first, ...), h0 / ht (initial / "
                   "final state), and plan config keys (block_v, segments, fused, block_k)")
def cli(op_names, spec_refs, arch, variant, check_only, list_only, out_dir, compile_all,
        report, plan_sizes):
    """Generate TileLang kernels from the linattn op specs (or your own: --spec)."""
    if op_names and spec_refs:
        raise click.UsageError("give --op (the package's families) or --spec (your own), "
                               "not both")
    ops = _resolve_specs(spec_refs) if spec_refs else _resolve_ops(op_names)
    if plan_sizes is not None:
        for spec in ops:
            click.echo(f"{spec.name}: {_plan(spec, arch, plan_sizes)}")
        return
    if list_only:
        _list(ops, arch)
        return
    out = Path(out_dir) if out_dir else gen_dir() if spec_refs else DEFAULT_OUT
    try:
        files = render_tree(ops, arch, variant, shipped=is_registered)
    except SpecError as e:
        raise click.UsageError(str(e))
    if check_only:
        extra_dirs = () if variant else tuple(f"{arch}/{s.name}" for s in ops)
        res = check(files, out, extra_dirs)
        if not res.ok:
            for line in res.lines():
                click.echo(line)
            click.echo(f"{out} is not current: run "
                       f"{_rerun_hint(op_names, spec_refs, arch, out_dir)}", err=True)
            sys.exit(1)
        click.echo(f"ok: {len(files)} files current under {out}")
        return
    written = write(files, out)
    for rel in written:
        click.echo(f"wrote {rel}")
    if not variant:   # stages no plan produces any more: generated/ is the generator's alone
        for rel in check(files, out, tuple(f"{arch}/{s.name}" for s in ops)).extra:
            (out / rel).unlink()
            click.echo(f"removed {rel}")
    click.echo(f"{len(written)} of {len(files)} files changed under {out}")
    if compile_all:
        from ..codegen.compile import compile_tree
        results = compile_tree(ops, arch, variant, out, echo=click.echo)
        if report:
            Path(report).parent.mkdir(parents=True, exist_ok=True)
            Path(report).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
            click.echo(f"report: {report}")
        if any(r.get("error") for r in results):
            sys.exit(1)


_PLAN_INTS = ("B", "T", "H", "HV", "K", "V")
_PLAN_DTYPES = {"bf16": "bfloat16", "f16": "float16"}
_PLAN_STATES = ("h0", "ht")


def _plan_error(text: str, why: str):
    return click.BadParameter(f"{text!r}: {why}", param_hint="'--plan'")


def _parse_plan(text: str, arch: str) -> tuple:
    """--plan's text -> (sizes, lens, dtype, config, flags); one-line errors naming the
    token that is wrong or the sizes that are missing, and what is accepted."""
    from ..codegen.arch import get_arch
    from ..dsl import OPTION_NAMES
    config_keys = get_arch(arch).CONFIG_KEYS
    kv, flags = {}, set()
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        if eq:
            kv[key] = value
        else:
            flags.add(key)
    keys = (*_PLAN_INTS, "lens", "dtype", *config_keys)
    bad = [k for k in kv if k not in keys] + sorted(flags - set(OPTION_NAMES) - set(_PLAN_STATES))
    if bad:
        raise _plan_error(text, f"unknown {bad[0]!r}; accepted: {', '.join(keys)} as key=value, "
                          f"flags {', '.join((*OPTION_NAMES, *_PLAN_STATES))} "
                          "(a dtype is dtype=bf16 or dtype=f16)")
    missing = [k for k in ("T", "H", "K") if k not in kv and not (k == "T" and "lens" in kv)]
    if missing:
        raise _plan_error(text, f"missing {', '.join(missing)} (a plan needs T or lens, H, K)")
    if kv.get("dtype", "bf16") not in _PLAN_DTYPES:
        raise _plan_error(text, f"dtype {kv['dtype']!r}; accepted: {', '.join(_PLAN_DTYPES)}")
    try:
        n = {k: int(kv[k]) for k in _PLAN_INTS if k in kv}
        lens = [int(x) for x in kv["lens"].split(":")] if "lens" in kv else None
        config = {k: (kv[k] == "true" if k == "fused" else int(kv[k]))
                  for k in config_keys if k in kv}
    except ValueError as e:
        raise _plan_error(text, f"{e} (sizes are integers, lens=1024:7168, fused=true)")
    return n, lens, _PLAN_DTYPES[kv.get("dtype", "bf16")], config, flags


def _plan(spec, arch: str, text: str):
    """The arch's forward plan for the sizes in ``text`` (--plan)."""
    from ..dsl import Options
    from ..ops import chunk
    n, lens, dtype, config, flags = _parse_plan(text, arch)
    B, C = n.get("B", 1), spec.chunk_size
    lens = lens or [n["T"]] * B
    try:
        options = Options(**{f: True for f in flags - set(_PLAN_STATES)})
        return chunk.forward_plan(
            spec, options, arch, config,
            H=n["H"], HV=n.get("HV", n["H"]), K=n["K"], V=n.get("V", n["K"]), dtype=dtype,
            seq_chunks=tuple(-(-t // C) for t in lens), Ttot=sum(lens), beta_dtype=dtype,
            has_initial_state="h0" in flags, output_final_state="ht" in flags)
    except (SpecError, ValueError) as e:
        raise click.UsageError(f"--plan {text!r}: {e}")


def main(argv=None):
    """Entry point of the ``linattn-gen`` script."""
    return cli.main(args=argv, prog_name="linattn-gen")


if __name__ == "__main__":
    main()
