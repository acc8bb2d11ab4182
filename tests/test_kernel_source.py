"""Rules for the Triton source in kernels/ that no interpreter run can check."""

import ast
from pathlib import Path

import pytest

KERNEL_FILES = sorted((Path(__file__).parent.parent / "kernels").glob("*.py"))


def _jit_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    def is_jit(dec: ast.expr) -> bool:
        target = dec.func if isinstance(dec, ast.Call) else dec
        return isinstance(target, ast.Attribute) and target.attr == "jit"

    functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
    return [fn for fn in functions if any(map(is_jit, fn.decorator_list))]


def unary_minus_on_values(source: str) -> list[str]:
    """``-expr`` inside @triton.jit functions where expr is not a literal: Triton 3.6 compiles it as ``0 - expr``,
    which turns torch's ``-(+0) = -0`` into +0 (the interpreter, running numpy, cannot show it)."""
    found = []
    for fn in _jit_functions(ast.parse(source)):
        for node in ast.walk(fn):
            negated_value = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
            if negated_value and not isinstance(node.operand, ast.Constant):
                found.append(f"{fn.name}, line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_rule_finds_unary_minus():
    src = "import triton\n@triton.jit\ndef k(x, y):\n    a = -x * y\n    b = x ^ -2147483648\n    return a + b\n"
    assert unary_minus_on_values(src) == ["k, line 4: -x"]


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_kernels_negate_with_the_sign_bit(path):
    """Negation goes through ``rounding.negate`` (or ``exp(-x)``-like uses where the sign of zero cannot matter are
    listed here with why)."""
    allowed = {"swiglu_quantize.py": {"-gate"}}  # exp(-0) == exp(+0): the sign of a zero gate cannot reach the output
    found = [f for f in unary_minus_on_values(path.read_text())
             if f.rsplit(": ", 1)[1] not in allowed.get(path.name, set())]
    assert not found, f"{path.name}: unary minus on values (use rounding.negate): {found}"
