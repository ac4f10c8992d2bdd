"""The import floors of docs/design.md ('Import floors'), checked in fresh interpreters.

`cutbce_common` imports neither framework (torch_cutbce loads it without jax, jax_kernels
without torch); `jax_kernels` never imports torch; the oracles import no engine; the engine registry
names exactly the engines the framework-neutral impl rule accepts.
Documents stay out of the packages (they would ship in the wheel), and docs/design.md's module
tables and engine map name what the code holds.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch_cutbce", "jax_kernels", "cutbce_common")


def _modules(package: str) -> list[str]:
    """Every module of `package` (a folder of this checkout or of the installed package), sub-packages included."""
    module = __import__(package, fromlist=["__path__"])
    return [package] + [info.name for info in pkgutil.walk_packages(module.__path__, package + ".")]


def _imported_after(modules: list[str]) -> set[str]:
    """The top-level package names in sys.modules after importing `modules` in a fresh interpreter."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_neutral_imports_no_framework():
    loaded = _imported_after(_modules("cutbce_common"))
    assert not loaded & {"torch", "jax", "jaxlib", "torch_xla"}, sorted(loaded)


def test_jax_kernels_never_imports_torch():
    pytest.importorskip("jax")
    loaded = _imported_after(_modules("jax_kernels"))
    assert "torch" not in loaded and "torch_xla" not in loaded


def _source(name: str) -> Path | None:
    """The file of module `name` of this project where it is installed or checked out (None for
    another package's module, or a name that is an attribute, not a module)."""
    if not name.startswith(("jax_kernels", "torch_cutbce")):
        return None
    try:
        spec = importlib.util.find_spec(name)
    except ImportError:
        return None
    return Path(spec.origin) if spec is not None and str(spec.origin).endswith(".py") else None


def _own_imports(module: str) -> set[str]:
    """The modules of this repository that `module` imports, transitively, read from the source (a
    runtime check would count the package `__init__`s, which load the entries)."""
    import ast

    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        path = _source(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
    return seen - {module}


@pytest.mark.parametrize("oracle", ["jax_kernels.reference", "torch_cutbce.reference"])
def test_oracles_import_no_engine(oracle):
    engines = ("jax_kernels.blocked", "jax_kernels.pallas", "jax_kernels.engines", "jax_kernels.core",
               "jax_kernels.positives", "jax_kernels.branch_math", "torch_cutbce.native", "torch_cutbce.engines",
               "torch_cutbce.positives", "torch_cutbce.branch_math", "torch_cutbce.jax_bridge")
    imported = _own_imports(oracle)
    assert imported, oracle  # the walk found the module
    assert not [m for m in imported if m.startswith(engines)], sorted(imported)


def test_registry_matches_the_impl_rule():
    pytest.importorskip("jax")
    from jax_kernels.engines import ENGINES
    from cutbce_common.shapes import IMPL_CHOICES

    assert IMPL_CHOICES == ("auto", *ENGINES)


def test_the_packages_hold_no_documents():
    """Documents live in docs/ (the JAX side: docs/jax.md); a Markdown file inside a package would ship
    in the wheel, and its relative links would break there."""
    found = [p.relative_to(ROOT).as_posix() for package in PACKAGES
             for p in (ROOT / package).rglob("*.md")]
    assert not found, found


def _design_module_tables() -> dict[str, set[str]]:
    """docs/design.md, 'What each module holds': package -> the modules its table names."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("### What each module holds", 1)[1].split("\n### ", 1)[0]
    tables: dict[str, set[str]] = {}
    package = None
    for line in section.splitlines():
        heading = re.match(r"`(\w+)/`", line)
        if heading:
            package = heading.group(1)
            tables[package] = set()
        elif line.startswith("| `") and package:
            first_cell = line.split("|")[1]
            tables[package].update(re.findall(r"`([\w/]+\.(?:py|c|cc))`", first_cell))
    return tables


def test_the_design_module_tables_name_every_library_file():
    """Each package's table in docs/design.md names exactly the source files the package holds."""
    tables = _design_module_tables()
    assert set(tables) == set(PACKAGES), sorted(tables)
    for package, named in tables.items():
        if not (ROOT / package).is_dir():
            pytest.skip(f"no {package}/ beside the tests (ci/core_only.sh removes the sources to test the install)")
        held = {p.relative_to(ROOT / package).as_posix() for p in (ROOT / package).rglob("*")
                if p.suffix in (".py", ".c", ".cc") and "__pycache__" not in p.parts}
        assert named == held, (package, "missing from the table:", sorted(held - named),
                               "named but absent:", sorted(named - held))


# Heads in the engine map that are no library module: the engine and place protocols' variables,
# and TorchTPU's `torch.tpu.pallas.jax_op`.
NOT_MODULES = {"engine", "place", "torch", "pallas"}


def _defined_names(path: Path) -> set[str]:
    """The top-level names a module defines or imports, and the string keys of its top-level dicts
    (a package's lazy public names, PEP 562: `jax_kernels._PUBLIC`)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if isinstance(node.value, ast.Dict):
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_the_engine_map_names_what_the_code_holds():
    """docs/design.md, 'Which entry picks which engine': every `file.py` it names exists and every
    `module.name` is defined in a library module of that name (a package's `__init__` or submodule)."""
    if not all((ROOT / package).is_dir() for package in PACKAGES):
        pytest.skip("the library's sources are not beside the tests (ci/core_only.sh removes them)")
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("### Which entry picks which engine", 1)[1].split("```")[1]
    sources = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    # module or package name -> what `name.x` may be: its defined names (a package: also its submodules),
    # read once per file; a name two packages share (`engines`) holds the union.
    names_of: dict[str, set[str]] = {}
    for path in sources:
        is_package = path.stem == "__init__"
        names = names_of.setdefault(path.parent.name if is_package else path.stem, set())
        names |= _defined_names(path)
        if is_package:
            names |= {p.stem for p in path.parent.glob("*.py")}
    wrong = [name for name in re.findall(r"\b([\w/]+)\.py\b", block)
             if not any(p.as_posix().endswith(f"/{name}.py") for p in sources)]
    wrong += [f"{head}.{name}" for head, name in re.findall(r"\b([a-z_]+)\.([A-Za-z_]\w*)\b", block)
              if name != "py" and head not in NOT_MODULES and name not in names_of.get(head, set())]
    assert not wrong, f"the engine map names what the code does not hold: {wrong}"


# The floors of docs/design.md ('Import floors'), top to bottom: a module may import its own layer
# and the layers below it, never one above. Each library module belongs to the layer of its longest
# prefix here, so a new module must be placed before this test passes.
LAYERS = (
    # torch_cutbce: the package's face, and the tools and integrations that run the entry
    ("torch_cutbce", "torch_cutbce.tune_tiles", "torch_cutbce.integrations"),
    ("torch_cutbce.functional", "torch_cutbce.module", "torch_cutbce.topk"),  # the entries
    ("torch_cutbce.special_rows",),  # what the entries take
    ("torch_cutbce.engines",),  # the registry
    ("torch_cutbce.native", "torch_cutbce.triton", "torch_cutbce.chunked", "torch_cutbce.jax_bridge",
     "torch_cutbce.reference", "torch_cutbce.vocab_parallel", "torch_cutbce.distributed"),  # engines, the oracle, layouts
    ("torch_cutbce.arguments", "torch_cutbce.route", "torch_cutbce.positives", "torch_cutbce.branch_math",
     "torch_cutbce.reduction", "torch_cutbce.metrics", "torch_cutbce.targets",
     "torch_cutbce.chunked_ops"),  # what they share
    # jax_kernels, below all of torch_cutbce
    ("jax_kernels",),
    ("jax_kernels.api", "jax_kernels.bridge"),  # the entries (the bridge's for torch)
    ("jax_kernels.sharded",),  # the mesh layout
    ("jax_kernels.core",),
    ("jax_kernels.engines",),  # the registry
    ("jax_kernels.blocked", "jax_kernels.pallas", "jax_kernels.reference"),  # engines, the oracle
    ("jax_kernels.arguments", "jax_kernels.positives", "jax_kernels.reduction", "jax_kernels.branch_math",
     "jax_kernels.compensated"),  # what they share
    ("cutbce_common",),  # neither framework, below both
)


def _module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the library modules it imports anywhere in its source (a function's lazy import too:
    an arrow up or a circle through one breaks the floor all the same)."""
    graph = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in files else base)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _layer(module: str) -> int | None:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (rank, prefix)
    return None if best is None else best[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _library_graph():
    if not all((ROOT / package).is_dir() for package in PACKAGES):
        pytest.skip("the library's sources are not beside the tests (ci/core_only.sh removes them)")
    return _import_graph(_module_files())


def test_no_import_circle_among_the_library_modules():
    graph = _library_graph()
    assert "torch_cutbce.engines" in graph["torch_cutbce.functional"]  # the walk read the imports
    assert _cycles(graph) == []


def test_no_import_points_up_a_floor():
    graph = _library_graph()
    unplaced = sorted(module for module in graph if _layer(module) is None)
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                    if _layer(target) < _layer(module))
    assert not upward, upward
