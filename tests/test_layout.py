"""The layout is the architecture: imports go one way, the CLI and the daemon sit on top of the
library, and the commands that promise to start without torch do.

Every import counts, also one inside a function (a cycle hidden that way is still a cycle)
and one under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt

PACKAGE = Path(ckpt.__file__).resolve().parent
LONGEST = 450  # lines: a module past this holds more than one concept


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The ckpt modules `name` imports (a name imported from a package that is a module counts
    as that module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
        elif isinstance(node, ast.Call) and _dynamic_import(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.add(first.value)  # importlib.import_module("ckpt.x"), __import__, runpy
    return {m for m in found if m in known and m != name}


def _dynamic_import(func: ast.expr) -> bool:
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return called in {"import_module", "__import__", "run_module"}


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_cycle_finder_finds_a_cycle_through_three_modules_and_none_in_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_imports_another_that_imports_it_back_even_inside_a_function():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between ckpt's subpackages (a top-level module counts as its own)."""
    def room(name: str) -> str:
        return ".".join(name.split(".")[:2])

    rooms: dict[str, set[str]] = {}
    for name, targets in graph.items():
        rooms.setdefault(room(name), set()).update(room(t) for t in targets if room(t) != room(name))
    return rooms


def test_no_package_imports_another_that_imports_it_back():
    """One level up from modules: the rooms of the house are in an order too (format below
    storage below save, schedule below the checkpointer, ...). (Importing any ckpt module
    still runs `ckpt/__init__.py` first, the public API, which loads a few names eagerly:
    the errors, `Manifest`, the policies, `Lease`.)"""
    graph = package_graph(import_graph())
    graph.pop("ckpt", None)  # the facade on top imports everything, and nothing imports it (below)
    found = cycles(graph)
    assert not found, "package cycles: " + "; ".join(" <-> ".join(c) for c in found)


# The README's picture of the layout, top to bottom: a package (or a top-level module) imports
# only those after it. The checkpointer's room is its module with the three it is split into;
# the helpers of one concern share a row. Every room of ckpt is in it: a new one must be placed.
ORDER = [
    ("ckpt.integrations",),
    ("ckpt.cli",),
    ("ckpt.agent",),
    ("ckpt.admin",),
    ("ckpt.checkpointer", "ckpt.lifecycle", "ckpt.background", "ckpt.options", "ckpt.early"),
    ("ckpt.schedule",),
    ("ckpt.restore",),
    ("ckpt.save",),
    ("ckpt.capture",),
    ("ckpt.node",),
    ("ckpt.events", "ckpt.metrics"),
    ("ckpt.storage",),
    ("ckpt.format",),
    ("ckpt.collectives", "ckpt.data", "ckpt.preempt", "ckpt.console", "ckpt.errors", "ckpt.redact", "ckpt._faults", "ckpt._gc", "ckpt._version"),
]


def _shown(name: str) -> str:
    """How the README's picture names a room: `  save/`, `  checkpointer.py`."""
    short = name.removeprefix("ckpt.")
    return f"  {short}/" if (PACKAGE / short).is_dir() else f"  {short}.py"


def test_a_package_imports_only_those_below_it_in_the_readmes_picture():
    level = {name: i for i, names in enumerate(ORDER) for name in names}
    graph = package_graph(import_graph())
    assert set(graph) - {"ckpt"} == set(level), "every package and top-level module has its row in ORDER (and the README)"
    upward = [
        f"{room} imports {target}"
        for room, targets in graph.items()
        if room in level
        for target in targets
        if target in level and level[target] <= level[room] and target not in ORDER[level[room]]
    ]
    assert not upward, "imports up the picture: " + "; ".join(upward)
    readme = (PACKAGE.parent / "README.md").read_text()
    picture = readme[readme.index("## Layout") :]
    places = [picture.index(_shown(names[0])) for names in ORDER]
    assert places == sorted(places), "the README's layout picture lists the packages in this order"


@pytest.mark.parametrize(
    ("top", "allowed_in"),
    [("ckpt.cli", ["ckpt.cli"]), ("ckpt.agent", ["ckpt.agent", "ckpt.cli"])],
    ids=["cli", "agent"],
)
def test_the_library_never_imports_the_cli_or_the_daemon(top, allowed_in):
    offenders = [
        f"{name} imports {target}"
        for name, targets in import_graph().items()
        if not any(_within(name, p) for p in allowed_in)
        for target in targets
        if _within(target, top)
    ]
    assert not offenders


def test_nothing_in_the_library_imports_the_package_facade():
    """`ckpt/__init__.py` is the public API on top; a module importing it closes a cycle
    through whatever the facade loads."""
    assert [name for name, targets in import_graph().items() if "ckpt" in targets] == []


def test_every_module_is_shorter_than_the_limit_and_every_package_says_what_it_owns():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > LONGEST}
    assert not long, f"modules over {LONGEST} lines: {long}"
    for name, path in _modules().items():
        assert ast.get_docstring(ast.parse(path.read_text())), f"{name} has no docstring saying what it owns"


# torch blocked: `import torch` raises ImportError in the child, as on a machine without it.
_NO_TORCH = """
import sys
sys.modules["torch"] = None
from ckpt.cli.main import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules or sys.modules["torch"] is None
sys.exit(code)
"""


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("root")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=ckpt.Every(steps=1), keep=ckpt.Keep(last=10)) as cp:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
    return root


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["ls"], "committed"),
        (["verify"], "ok"),
        (["rm", "--step", "1"], ""),
        (["gc", "--keep-last", "1"], ""),
    ],
    ids=["ls", "verify", "rm", "gc"],
)
def test_the_admin_commands_that_promise_no_torch_run_where_importing_it_fails(saved_root, argv, says):
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, argv[0], str(saved_root), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert says in out.stdout


def test_the_node_agent_starts_where_importing_torch_fails(tmp_path):
    code = "import sys; sys.modules['torch'] = None; import ckpt.agent.daemon, ckpt.agent.config; from ckpt.cli.main import main; sys.exit(main(['agent', '--help']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "spool" in out.stdout
