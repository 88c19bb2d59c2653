"""The rule and the gate as the stage templates see them: each the dsl object (its maths,
dsl/family.py: inputs, channels, g's shape) with its macros, the pieces of code where
the stages' algorithms differ by member (templates/rules/<name>.py.jinja,
templates/gates/<name>.py.jinja).

A stage template composes the pieces instead of testing flags::

    {% put gate.chunk_decay(KT, diagonal, summary) %}   (the chunk's decay of the state tile)
    w: T.Tensor(({{ rule.w_rows() }}, HV, K), dtype),   (an inline piece)
    {% if gate.per_key %}                               (a fact: a form of the algorithm)

``{% put X %}`` writes X's lines indented as the tag stands, nothing when X is empty
(:class:`Put`). A member's file defines what differs from the member it extends (its
``{% set extends = "gates/....py.jinja" %}``); a macro it lacks comes from there, and so
on up to its kind's root, the none gate or the additive rule, whose files list every
hook (most of a none gate's are empty: no gate adds nothing there). So a new gate or
rule is its dsl object and one file of macros (and the lines that name it outside the
templates: docs/design.md).
"""
from __future__ import annotations

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension


class Member:
    """A rule or gate for the templates: ``member.hook(...)`` is its macro (or the root's),
    ``member.fact`` its dsl object's attribute; ``{{ member }}`` its name."""

    def __init__(self, maths, modules: tuple):
        self._maths = maths
        self._modules = modules

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        for module in self._modules:
            if hasattr(module, name):
                return getattr(module, name)
        return getattr(self._maths, name)

    def __str__(self) -> str:
        return self._maths.name


def member(env: jinja2.Environment, kind: str, maths) -> Member:
    """The member ``maths`` (a dsl RuleMaths / GateMaths) of ``kind`` ("rules" or
    "gates") with its macros and, behind them, those of the files it extends. A file's
    macros see the member as ``this``: a piece shared in an extended file may call a
    hook the member's own file fills (``{% put this.hook() %}``)."""
    key = (id(env), kind, maths.name)
    if key not in _MEMBERS:
        m = Member(maths, ())
        modules, path = [], f"{kind}/{maths.name}.py.jinja"
        while path:
            modules.append(env.get_template(path).make_module({"this": m}))
            path = getattr(modules[-1], "extends", "")
        m._modules = tuple(modules)
        _MEMBERS[key] = m
    return _MEMBERS[key]


_MEMBERS: dict = {}


class Put(Extension):
    """``{% put EXPR %}``: EXPR's text (a member's macro) with each line indented as the
    tag is in its template; nothing at all when the text is empty (a block tag: its own
    line leaves no trace)."""
    tags = {"put"}

    def parse(self, parser):
        token = next(parser.stream)
        expr = parser.parse_expression()
        source = self.environment.loader.get_source(self.environment, parser.name)[0]
        line = source.splitlines()[token.lineno - 1]
        indent = nodes.Const(len(line) - len(line.lstrip()))
        return nodes.Output([self.call_method("_indented", [expr, indent])],
                            lineno=token.lineno)

    @staticmethod
    def _indented(text, indent: int) -> str:
        lines = str(text).split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return "".join((" " * indent + ln if ln.strip() else "") + "\n" for ln in lines)
