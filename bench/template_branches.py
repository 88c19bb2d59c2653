"""How the templates specialise by rule and gate: their branches, before and after the
members (codegen/members.py).

    python3 bench/template_branches.py [TEMPLATE_DIR ...]     # default: this tree's

Per stage template (codegen/templates/*.jinja) and in all: the `{% if %}` / `{% elif %}`
tags; those testing a rule or gate by identity (the old flags is_delta, has_gate,
gate_scalar, gate_key, gate_value, and `additive` = not is_delta), as tags and as inline
`{{ x if flag else y }}`; those testing a member's fact (`gate.per_key`,
`gate.rescales_values`, `diagonal` = not rule.reads_state, ...); and the member pieces
the template composes ({% put gate.x() %}, {{ rule.y() }}). The member files
(templates/gates/, templates/rules/) are counted apart: their branches test a macro's
arguments (a stage flag, or a piece passed in), never a member.
"""
import re
import sys
from pathlib import Path

IDENTITY = re.compile(r"\b(is_delta|has_gate|gate_scalar|gate_key|gate_value|additive)\b")
FACT = re.compile(r"\b(gate|rule|this)\.\w+|\bdiagonal\b")
TAG = re.compile(r"{%-?\s*(?:el)?if\b([^%]*)%}")
INLINE = re.compile(r"{{([^}]*\bif\b[^}]*)}}")
PIECE = re.compile(r"{%-?\s*put\s+(?:gate|rule)\.|{{\s*(?:gate|rule)\.\w+\(")


def count(path: Path) -> dict:
    text = path.read_text()
    tags = [m.group(1) for m in TAG.finditer(text)]
    inline = [m.group(1) for m in INLINE.finditer(text)]
    return dict(tags=len(tags), identity=sum(bool(IDENTITY.search(c)) for c in tags),
                identity_inline=sum(bool(IDENTITY.search(c)) for c in inline),
                facts=sum(bool(FACT.search(c)) and not IDENTITY.search(c) for c in tags + inline),
                pieces=len(PIECE.findall(text)), lines=text.count("\n"))


def report(root: Path) -> dict:
    stages = {p.name: count(p) for p in sorted(root.glob("*.jinja"))}
    members = {f"{p.parent.name}/{p.name}": count(p)
               for p in sorted(root.glob("*/*.jinja"))}
    print(f"{root}")
    print(f"  {'template':34s} {'if':>4s} {'ident':>6s} {'inline':>6s} {'facts':>6s} {'pieces':>6s}")
    for name, c in stages.items():
        if c["tags"] or c["pieces"]:
            print(f"  {name:34s} {c['tags']:4d} {c['identity']:6d} {c['identity_inline']:6d} "
                  f"{c['facts']:6d} {c['pieces']:6d}")
    total = {k: sum(c[k] for c in stages.values()) for k in next(iter(stages.values()))}
    print(f"  {'stage templates':34s} {total['tags']:4d} {total['identity']:6d} "
          f"{total['identity_inline']:6d} {total['facts']:6d} {total['pieces']:6d}")
    if members:
        m = {k: sum(c[k] for c in members.values()) for k in total}
        print(f"  {'member files (' + str(len(members)) + ')':34s} {m['tags']:4d} "
              f"{m['identity']:6d} {m['identity_inline']:6d} {m['facts']:6d}   "
              f"{m['lines']} lines")
    return total


if __name__ == "__main__":
    roots = sys.argv[1:] or [str(Path(__file__).resolve().parent.parent / "codegen" / "templates")]
    for r in roots:
        report(Path(r))
