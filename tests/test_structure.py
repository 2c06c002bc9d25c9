"""The shape of the code: layers point one way, no import cycles, DESIGN.md's module map is the
tree, no file is long, and ruff is clean. Each check reads the sources; nothing is imported."""

from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "aligndp"

# Which layers each layer may import (its own always). DESIGN.md "Modules" explains the order.
ALLOWED: dict[str, set[str]] = {
    "models": set(),
    "plan": set(),
    "lowp": {"plan"},
    "runtime": {"plan"},
    "state": {"plan", "runtime"},
    "optim": {"plan", "runtime", "state"},
    "api": {"plan", "lowp", "runtime", "state", "optim"},
    "app": {"plan", "lowp", "runtime", "state", "optim", "api", "models"},
    # no layer imports integrations: `import aligndp` never loads Lightning or transformers
    "integrations": {"plan", "lowp", "runtime", "state", "optim", "api"},
}
MAX_LINES = 400
LONG_FILE_ROOTS = ("src", "benchmarks", "tools")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    if module == "aligndp.__main__":
        return "app"  # ``python -m aligndp`` is the CLI
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return parts[1]
    return "api"  # aligndp/__init__.py, parallelize.py, user_input.py


def sources() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """aligndp modules ``path`` imports anywhere in its body (lazy imports count).

    String imports count too: a string constant that is exactly a module's name, or
    ``"module:attr"`` — ``importlib.import_module("aligndp.x")``, a registry's list of module
    names, a backend named by import path — is an import that ``import`` statements hide."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a submodule's name only: "aligndp" alone is the project's name in messages
            names = [node.value.partition(":")[0]] if "." in node.value else []
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def import_graph() -> dict[str, set[str]]:
    src = sources()
    return {m: imports_of(p, set(src)) - {m} for m, p in src.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        here = layer_of(mod)
        for dep in sorted(deps):
            there = layer_of(dep)
            if there != here and there not in ALLOWED[here]:
                bad.append(f"{mod} ({here}) imports {dep} ({there})")
    return bad


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_layers_point_one_way():
    bad = upward_imports(import_graph())
    assert not bad, "imports that point up a layer (see DESIGN.md, Modules):\n" + "\n".join(bad)


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_checks_catch_what_they_should():
    """The two checks above on hand-made graphs: they must be able to fail."""
    assert upward_imports({"aligndp.plan.layout": {"aligndp.runtime.ddp"}})
    assert not upward_imports({"aligndp.runtime.ddp": {"aligndp.plan.layout"}})
    assert upward_imports({"aligndp.models.gpt": {"aligndp.plan.layout"}})
    cyc = {"aligndp.app.a": {"aligndp.app.b"}, "aligndp.app.b": {"aligndp.app.a"}}
    assert find_cycle(cyc) == ["aligndp.app.a", "aligndp.app.b", "aligndp.app.a"]
    assert find_cycle({"aligndp.app.a": {"aligndp.app.b"}, "aligndp.app.b": set()}) is None


def test_string_imports_are_imports(tmp_path):
    """Regression (issue 25): ``importlib`` hid the cycle recipes -> recipe_fp8_tensor ->
    backends -> recipes from the checks above."""
    known = {"aligndp.lowp.backends", "aligndp.lowp.recipe_mxfp8", "aligndp.lowp.triton_backend"}
    source = tmp_path / "registry.py"
    source.write_text(
        "import importlib\n"
        "def load():\n"
        "    return importlib.import_module('aligndp.lowp.recipe_mxfp8')\n"
        "PATHS = ('aligndp.lowp.triton_backend:TritonBackend',)\n"
        "MESSAGE = 'see aligndp.lowp.backends for why'\n"  # prose naming a module is no import
    )
    assert imports_of(source, known) == {"aligndp.lowp.recipe_mxfp8", "aligndp.lowp.triton_backend"}


def design_module_map() -> set[str]:
    """Paths listed in DESIGN.md's module map (the ``src/aligndp/`` code block)."""
    text = (ROOT / "DESIGN.md").read_text()
    block = re.search(r"```\nsrc/aligndp/\n(.*?)```", text, re.S)
    assert block, "DESIGN.md has no ```src/aligndp/ module map block"
    listed, folder = set(), ""
    for line in block.group(1).splitlines():
        m = re.match(r"^  (\s*)(\S+)", line)
        if not m:
            continue
        name = m.group(2)
        if not m.group(1) and name.endswith("/"):
            folder = name
        elif name.endswith(".py"):
            listed.add((folder if m.group(1) else "") + name)
    return listed


def test_design_module_map_is_the_tree():
    on_disk = {
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    }
    listed = design_module_map()
    assert not on_disk - listed, f"modules missing from DESIGN.md's map: {sorted(on_disk - listed)}"
    assert not listed - on_disk, (
        f"DESIGN.md lists modules that do not exist: {sorted(listed - on_disk)}"
    )


def test_no_long_files():
    long = []
    for root in LONG_FILE_ROOTS:
        for p in sorted((ROOT / root).rglob("*.py")):
            n = len(p.read_text().splitlines())
            if n > MAX_LINES:
                long.append(f"{p.relative_to(ROOT)}: {n} lines")
    assert not long, f"files over {MAX_LINES} lines (split them by concern):\n" + "\n".join(long)


def _ruff() -> list[str]:
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.importorskip("ruff", reason="ruff is in the test extras: pip install -e '.[test]'")
    return [sys.executable, "-m", "ruff"]


@pytest.mark.parametrize("args", [("check",), ("format", "--check")], ids=["lint", "format"])
def test_ruff(args):
    """pyproject.toml's [tool.ruff] (100 columns) over everything we write."""
    paths = ["src", "tests", "benchmarks", "tools", "examples"]
    out = subprocess.run([*_ruff(), *args, *paths], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"ruff {' '.join(args)}:\n{out.stdout[-4000:]}{out.stderr[-2000:]}"


NOTE = re.compile(r"\[Note: ([^\]<>]+)\]")


def note_definitions() -> dict[str, list[str]]:
    """Where each [Note: X] is written out: a DESIGN.md heading ``## [Note: X]...`` or a source
    line that is the note's title alone (the first line of its text)."""
    found: dict[str, list[str]] = {}
    for i, line in enumerate((ROOT / "DESIGN.md").read_text().splitlines(), 1):
        if line.startswith("## ") and (m := NOTE.search(line)):
            found.setdefault(m.group(1), []).append(f"DESIGN.md:{i}")
    for p in sorted(PACKAGE.rglob("*.py")):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if (m := NOTE.fullmatch(line.strip().lstrip('"').strip())) is not None:
                found.setdefault(m.group(1), []).append(f"{p.relative_to(ROOT)}:{i}")
    return found


def test_each_note_is_written_once_and_every_reference_has_one():
    defined = note_definitions()
    twice = {k: v for k, v in defined.items() if len(v) > 1}
    assert not twice, f"notes written out in more than one place: {twice}"
    texts = [(ROOT / "DESIGN.md").read_text(), (ROOT / "README.md").read_text()]
    texts += [p.read_text() for p in PACKAGE.rglob("*.py")]
    referenced = {m.group(1) for t in texts for m in NOTE.finditer(t)}
    missing = sorted(r for r in referenced if r not in defined)
    assert not missing, f"notes referred to but written nowhere: {missing}"


WHERE = re.compile(
    r"\[Note: ([^\]<>]+)\]\s*(?:in\s+|\()(?:[\w/]*?aligndp/)?([\w/]+\.py|DESIGN\.md)"
)


def test_a_note_said_to_be_in_a_file_is_written_there():
    """``[Note: X] in ddp.py`` / ``[Note: X] (plan/request.py)`` must name where X is written."""
    defined = note_definitions()
    texts = {"DESIGN.md": (ROOT / "DESIGN.md").read_text()}
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in PACKAGE.rglob("*.py")}
    wrong = []
    for where, text in texts.items():
        for m in WHERE.finditer(text):
            title, path = m.group(1), m.group(2)
            places = [d.split(":")[0] for d in defined.get(title, [])]
            if places and not any(p.endswith(path) for p in places):
                wrong.append(f"{where}: [Note: {title}] said to be in {path}, written in {places}")
    assert not wrong, "\n".join(wrong)


# torch's private names the sources may use, each for a reason; anything else private (or
# deprecated: ShardedTensor, torch.distributed._shard) fails test_torch_private_apis_are_listed.
ALLOWED_PRIVATE_TORCH = {
    "torch.Tensor._make_wrapper_subclass": "ShardedGrad: a tensor that refuses every use",
    "torch._foreach_copy_": "one launch to cast many masters back",
    "torch._foreach_add_": "one launch to add many gradients into their views",
    "torch._foreach_norm": "one launch for many grad norms",
    "torch._scaled_mm": "the fp8-tensor recipe's GEMM (torch has no public one)",
    "torch.autograd.Variable._execution_engine": "the end-of-backward callback, as torch DDP",
    "torch.utils._pytree": "the tensors of any module output (namedtuples, registered classes)",
    "torch.testing._internal": "its distributed.fake_pg registers torch's fake process-group "
    "backend (no public module does, torch 2.9-2.13): the rehearsal (runtime/fake_world.py)",
    "torch.utils._python_dispatch": "TorchDispatchMode: the rehearsal's probe sees every c10d "
    "collective and tensor storage on any backend (app/rehearse_probe.py; CommDebugMode is one)",
    "torch.nn.parallel.DistributedDataParallel._active_ddp_module": "Dynamo's DDPOptimizer "
    "splits a compiled graph at bucket boundaries while it is set, as torch DDP sets it "
    "(runtime/compiled_overlap.py; checked for with hasattr, a warning where it is missing)",
    "torch._inductor": "the read-back barrier in Inductor's Triton code (no public hook; "
    "triton-lang/triton#10924, lowp/readback_barrier.py)",
}
DEPRECATED_TORCH = ("torch.distributed._shard", "ShardedTensor")


def torch_names(source: str) -> set[str]:
    """Dotted torch names a source uses: imports, and attribute chains through its aliases."""
    alias: dict[str, str] = {}
    used: set[str] = set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    used.add(a.name)
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                used.add(f"{node.module}.{a.name}")
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Del):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in alias:
                used.add(".".join([alias[base.id], *reversed(chain)]))
    return used


def private_or_deprecated(names: set[str]) -> set[str]:
    """The shortest private prefix of each name (``torch.x._y.z`` -> ``torch.x._y``), and any
    deprecated one."""
    found = set()
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.startswith("_") and not part.startswith("__"):
                found.add(".".join(parts[: i + 1]))
                break
        if any(d in name for d in DEPRECATED_TORCH):
            found.add(name)
    return found


def test_torch_private_apis_are_listed():
    bad = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        for name in private_or_deprecated(torch_names(p.read_text())):
            if name not in ALLOWED_PRIVATE_TORCH or any(d in name for d in DEPRECATED_TORCH):
                bad.setdefault(name, []).append(str(p.relative_to(ROOT)))
    assert not bad, (
        f"private or deprecated torch APIs not in ALLOWED_PRIVATE_TORCH: {bad}; use the public "
        "API, or list the name with the reason"
    )


def test_private_api_check_can_fail():
    old = (
        "import torch.distributed as dist\n"
        "from torch.distributed._shard.sharded_tensor import ShardedTensor\n"
        "x = dist._functional_collectives.all_reduce\n"
    )
    assert private_or_deprecated(torch_names(old)) == {
        "torch.distributed._shard",
        "torch.distributed._shard.sharded_tensor.ShardedTensor",
        "torch.distributed._functional_collectives",
    }
    assert not private_or_deprecated(torch_names("import torch\ntorch.distributed.all_reduce\n"))
