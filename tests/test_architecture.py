"""The package's folders are its design (docs/architecture.md): every import, at module level or inside a function,
goes down the layers below, and no two modules import each other, directly or through others."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trl_costaware"

# Each unit's layer; a module may import its own unit and the units of lower layers only. The face is the package's
# ``__init__`` with the trainer and config a TRL user imports; the testbeds and the scripts use the face, as a user's
# script does.
LAYERS = {
    "_version": 0,
    "_compat": 0,
    "rewards": 0,
    "tracking": 1,
    "rows": 2,
    "config": 3,
    "trainer": 4,
    "__init__": 5,
    "embedded": 6,
    "scripts": 7,
}


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    name = ".".join(rel.parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _exists(root: Path, dotted: str) -> bool:
    base = root.parent / Path(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the package modules it imports (every ``import``/``from`` statement, nested ones included)."""
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        module = _module_name(path, root)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    target = ".".join(parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith(root.name):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    targets.add(sub if _exists(root, sub) else target)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith(root.name))
        targets.discard(module)
        graph[module] = targets
    return graph


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        for target in targets:
            a, b = unit(module), unit(target)
            if a != b and LAYERS[b] >= LAYERS[a]:
                bad.append(f"{module} -> {target} ({a}: layer {LAYERS[a]}, {b}: layer {LAYERS[b]})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles (each as a path that returns to its start), by depth-first search."""
    found, state = [], {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            # a package's __init__ is imported on the way to its modules; only module-to-module arrows count
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_every_unit_has_a_layer():
    assert sorted({unit(m) for m in import_graph()} - set(LAYERS)) == []


def test_no_import_goes_up_or_sideways():
    assert upward_imports(import_graph()) == []


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_the_checks_catch_a_circle_and_an_upward_import(tmp_path):
    """Control: a tree with a layer-0 module importing the row stage, and two row modules importing each other."""
    root = tmp_path / "trl_costaware"
    (root / "rows").mkdir(parents=True)
    (root / "rows" / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "rewards.py").write_text("def f():\n    from .rows.plan import g\n")
    (root / "rows" / "plan.py").write_text("from .layout import h\n")
    (root / "rows" / "layout.py").write_text("from trl_costaware.rows import plan\n")
    graph = import_graph(root)
    assert upward_imports(graph) == [
        "trl_costaware.rewards -> trl_costaware.rows.plan (rewards: layer 0, rows: layer 2)"
    ]
    assert any(set(c) >= {"trl_costaware.rows.plan", "trl_costaware.rows.layout"} for c in cycles(graph))


@pytest.mark.parametrize("name", ["CostAwareGRPOTrainer", "CostAwareGRPOConfig"])
def test_the_face_is_where_a_trl_user_looks(name):
    import trl_costaware

    assert name in trl_costaware.__all__
    assert (PACKAGE / ("trainer.py" if "Trainer" in name else "config.py")).exists()


def test_docs_state_what_the_code_does():
    """Cheap checks of statements issue 54 found stale: the proxy's γ, a removed metric, the ESS's module, the token
    budget's rule."""
    from pathlib import Path

    from trl_costaware.rows.proxy import DEFAULT_GAMMA

    docs = Path(__file__).resolve().parents[1] / "docs"
    assert DEFAULT_GAMMA == 0.5 and "γ is a constant of the package, ½" in (docs / "budget_and_proxy.md").read_text()
    assert "grad_clipped" not in (docs / "trainer.md").read_text()
    assert "ESS, kept" not in (docs / "architecture.md").read_text()
    for name in ("budget_and_proxy.md", "trainer.md", "distributed.md"):
        assert "budget / E_p[c]" not in (docs / name).read_text(), name


# ---------------------------------------------------------------------------------------------------- TRL surface
OWN_STATE = "_cost_aware"  # the trainer's one attribute of its own (CostAwareState)


def trl_surface(source: str) -> set[str]:
    """What `CostAwareGRPOTrainer` relies on of TRL, read off its source: the names it defines that `GRPOTrainer`
    already has (overrides, class attributes), every ``self.X`` it uses that it does not define (TRL's attributes),
    and the names it imports from ``trl`` modules other than `GRPOTrainer` itself."""
    from trl import GRPOTrainer

    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CostAwareGRPOTrainer")
    defined = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    defined |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    used = {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }
    imported = {
        a.name
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "trl"
        for a in n.names
        if a.name != "GRPOTrainer"
    }
    return {n for n in defined if hasattr(GRPOTrainer, n)} | (used - defined - {OWN_STATE}) | imported


def documented_surface(text: str) -> list[str]:
    """The first column of docs/architecture.md's table under "## The TRL surface"."""
    section = text.split("## The TRL surface", 1)[1].split("\n## ", 1)[0]
    return [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")]


def test_the_trl_surface_table_lists_what_the_trainer_relies_on():
    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    listed = documented_surface(docs)
    assert len(listed) == len(set(listed)), "a name listed twice"
    code = trl_surface((PACKAGE / "trainer.py").read_text())
    assert sorted(set(listed) - code) == [], "listed but not used by trainer.py"
    assert sorted(code - set(listed)) == [], "used by trainer.py but not listed"


def test_the_surface_check_sees_a_new_override_and_a_new_attribute():
    """Control: an override and a TRL attribute added to the source are found (and the trainer's own state is not)."""
    source = (PACKAGE / "trainer.py").read_text()
    before = trl_surface(source)
    assert {"_prepare_inputs", "_buffered_inputs", "use_adapter"} <= before and OWN_STATE not in before
    added = source.replace(
        "    def log(self, logs",
        "    def training_step(self, *a):\n        return self.temperature\n\n    def log(self, logs",
    )
    assert trl_surface(added) - before == {"training_step", "temperature"}
