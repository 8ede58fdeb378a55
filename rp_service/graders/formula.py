"""A safe arithmetic evaluator for `multi` graders' `calculate_output` (parsed with `ast`).

Allowed: numbers, the sub-graders' names, + - * / // % ** (unary and binary), parentheses,
and the functions in `_FUNCTIONS`. Anything else (attributes, subscripts, calls of other
names, comprehensions, strings) is refused when the grader is built, never evaluated.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Formula", "FormulaError"]

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "clip": lambda x, lo, hi: min(max(x, lo), hi),
}
# A power's exponent is bounded so `9**9**9` cannot hang the trainer.
_MAX_EXPONENT = 64.0
# Nesting is bounded so the recursive evaluation cannot overflow the stack.
_MAX_DEPTH = 64


class FormulaError(ValueError):
    """A formula that does not parse, or uses something other than arithmetic."""


@dataclass(frozen=True, slots=True)
class Formula:
    """A parsed `calculate_output`; `evaluate(scores)` gives its value."""

    text: str
    tree: ast.Expression

    @classmethod
    def parse(cls, text: str, names: frozenset[str]) -> Formula:
        """Parses and checks `text`; every variable must be one of `names`."""
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as exc:
            raise FormulaError(f"does not parse: {exc.msg}") from None
        except (RecursionError, MemoryError):
            raise FormulaError(f"nested more than {_MAX_DEPTH} deep") from None
        if _depth(tree) > _MAX_DEPTH:
            raise FormulaError(f"nested more than {_MAX_DEPTH} deep")
        for node in ast.walk(tree):
            _check_node(node, names)
        return cls(text=text, tree=tree)

    def evaluate(self, scores: Mapping[str, float]) -> float:
        """The formula's value with each name bound to its score."""
        return float(_eval(self.tree.body, scores))


def _depth(tree: ast.AST) -> int:
    """The tree's depth, walked without recursion."""
    deepest = 0
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _check_node(node: ast.AST, names: frozenset[str]) -> None:
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            allowed = ", ".join(sorted(_FUNCTIONS))
            raise FormulaError(f"only these functions can be called: {allowed}")
        if node.keywords:
            raise FormulaError("functions take positional arguments only")
    elif isinstance(node, ast.Name):
        if node.id not in names and node.id not in _FUNCTIONS:
            known = ", ".join(sorted(names)) or "none"
            raise FormulaError(f"unknown name {node.id!r}; the graders are: {known}")
    elif isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise FormulaError(f"only numbers can appear as constants, not {node.value!r}")
    elif isinstance(node, ast.BinOp | ast.UnaryOp):
        op = node.op
        if type(op) not in _BINARY and type(op) not in _UNARY:
            raise FormulaError(f"operator {type(op).__name__} is not allowed")
    elif not isinstance(node, ast.Expression | ast.Load | ast.operator | ast.unaryop):
        raise FormulaError(f"{type(node).__name__} is not allowed: use arithmetic only")


def _eval(node: ast.AST, scores: Mapping[str, float]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return scores[node.id]
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_eval(node.operand, scores))
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, scores), _eval(node.right, scores)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise FormulaError(f"exponent {right} is over {_MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)  # checked at parse
        return _FUNCTIONS[node.func.id](*(_eval(arg, scores) for arg in node.args))
    raise FormulaError(f"{type(node).__name__} is not allowed")
