"""Every default is written once: on its typed config (`name: T = setting(DEFAULT, ...)`), never again below the CLI.

A function parameter named like a setting whose default equals that setting's default restates it: change the
setting and the function quietly keeps the old value. Such a parameter takes the config (or the value, required)
instead. Read with ast: a setting's default is a literal or a module-level constant (`DSPARK_LAYOUT`), and so is a
restated one; None and booleans are not counted (they mean "not given" and "off" far more often than they restate).
`python tests/test_defaults.py` prints what it finds.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = object()  # a default that is neither a literal nor a constant of dspark's


def sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "dspark").rglob("*.py"))}


def constants(texts: dict[str, str]) -> dict[str, object]:
    """Module-level `NAME = LITERAL` (or `A, B = LIT, LIT`) of every module; a name two modules give different
    values is left out (a default naming it is then not resolved)."""
    seen: dict[str, set] = {}
    for where, text in texts.items():
        for node in ast.parse(text, where).body:
            if isinstance(node, ast.AnnAssign) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            else:
                continue
            for target, value in pairs:
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and \
                        len(target.elts) == len(value.elts):
                    pairs += list(zip(target.elts, value.elts))
                elif isinstance(target, ast.Name):
                    v = literal(value, {})
                    if v is not UNKNOWN:
                        seen.setdefault(target.id, set()).add((type(v), v))
    return {name: next(iter(vs))[1] for name, vs in seen.items() if len(vs) == 1}


def literal(node: ast.AST, consts: dict[str, object]) -> object:
    """The value of a literal default, or of a Name/Attribute naming a known constant; else UNKNOWN."""
    if isinstance(node, ast.Name):
        return consts.get(node.id, UNKNOWN)
    if isinstance(node, ast.Attribute):
        return consts.get(node.attr, UNKNOWN)
    try:
        value = ast.literal_eval(node)
        hash(value)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return UNKNOWN
    return value


def setting_defaults(texts: dict[str, str], consts: dict[str, object]) -> dict[str, list]:
    """Setting name -> the defaults of the class-level `NAME: T = setting(DEFAULT, ...)` fields of that name."""
    out: dict[str, list] = {}
    for where, text in texts.items():
        for cls in ast.walk(ast.parse(text, where)):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in cls.body:
                if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and
                        isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) and
                        node.value.func.id == "setting"):
                    continue
                call = node.value
                given = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "default"),
                                                            None)
                value = UNKNOWN if given is None else literal(given, consts)
                if value is not UNKNOWN:
                    out.setdefault(node.target.id, []).append(value)
    return out


def same(a, b) -> bool:
    """Equal and of one kind: 0.0 restates 0.0 and 0, never False."""
    return not isinstance(a, bool) and not isinstance(b, bool) and a == b


def restated_defaults(texts: dict[str, str]) -> list[str]:
    """`file:line function(param=value)` for each parameter whose default restates a setting's of the same name."""
    consts = constants(texts)
    defaults = setting_defaults(texts, consts)
    found = []
    for where, text in texts.items():
        for fn in ast.walk(ast.parse(text, where)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            a = fn.args
            positional = [*a.posonlyargs, *a.args]
            pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults),
                     *((p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)]
            for param, node in pairs:
                value = literal(node, consts)
                if value is UNKNOWN or value is None or isinstance(value, bool):
                    continue
                if any(same(value, d) for d in defaults.get(param.arg, ())):
                    name = getattr(fn, "name", "<lambda>")
                    found.append((where, node.lineno, node.col_offset, f"{name}({param.arg}={value!r})"))
    return [f"{where}:{line} {what}" for where, line, _, what in sorted(found)]


def test_the_rule_catches_a_restated_default_and_passes_what_is_not_one():
    source = '''
LAYOUT = "dspark"
class SamplingConfig:
    temperature: float = setting(0.0, "0: greedy.")
    layout: str = setting(LAYOUT)
    seed: int = setting(0)
    dtype: str = setting("float32")
    items: list = setting(factory=list)
def speculative(max_new, temperature=0.0, *, layout=LAYOUT, seed=None, dtype="bfloat16", items=()):
    pass
def greedy(temperature=0, seed=False):
    pass
def sample(*, temperature, seed, layout):
    pass
'''
    assert restated_defaults({"m.py": source}) == [
        "m.py:9 speculative(temperature=0.0)", "m.py:9 speculative(layout='dspark')", "m.py:11 greedy(temperature=0)"]


def test_no_function_below_the_cli_restates_a_settings_default():
    found = restated_defaults(sources())
    assert not found, ("these parameters restate a setting's default; take the config (or the value, "
                       "required) instead:\n  " + "\n  ".join(found))


if __name__ == "__main__":
    print("\n".join(restated_defaults(sources())) or "none", file=sys.stderr)
