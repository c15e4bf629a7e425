"""The layout's rules (docs/design.md, "Layout"), read from the sources: a rule that only lives
in a document is broken by the next change."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specchat"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text(), str(path))


def _imports(tree) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_a_request_is_built_in_one_module():
    builders = {str(path) for path, tree in _modules() for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "GenerateConfig"}
    assert builders == {"specchat/core/settings.py"}


def test_core_imports_only_core_and_no_model_library():
    for path, tree in _modules():
        if path.parts[1] != "core":
            continue
        for name in _imports(tree):
            assert not name.startswith(("transformers", "gradio", "bitsandbytes")), (path, name)
            if name.startswith("specchat."):
                assert name.startswith("specchat.core"), (path, name)


def test_the_engine_reads_the_runner_by_its_declared_capabilities():
    _, tree = next((p, t) for p, t in _modules() if str(p) == "specchat/core/engine.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
            assert "runner" not in ast.unparse(node.args[0]), ast.unparse(node)


def test_no_module_of_specchat_imports_one_that_imports_it_back():
    graph = {}
    for path, tree in _modules():
        name = ".".join(path.with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m in _imports(tree) if m.startswith("specchat")}
    for a, deps in graph.items():
        for b in deps:
            if b != a and b in graph:
                assert a not in graph[b] or b.startswith(a + ".") or a.startswith(b + "."), \
                    f"{a} <-> {b}"
