"""The documents a user reads: the README stays a short guide whose fresh-machine commands are
what CI runs, every relative link in README.md, DESIGN.md, docs/ and the results pages points
at a file that exists, the
examples use only the public API, and the repository names results by date and topic, never
by the working session that produced them. Each check reads files; nothing is imported."""

from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200
MAIN_JOB = "pip install torch==2.13.0 && pip install -e . && aligndp train"
SESSION = re.compile(r"sessions?[ _-]?[0-9]", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def tracked_files() -> list[pathlib.Path]:
    """Every file git tracks here (a copy without .git: every file under the root)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        return [ROOT / name for name in out.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "__pycache__", ".pytest_cache", ".ruff_cache"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]


def fresh_machine_commands(readme: str) -> list[str]:
    """The commands of a README's "Fresh machine" section, one per ```bash block."""
    section = readme.split("## Fresh machine", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.DOTALL)]


def check_fresh_machine(readme: str, ci_run: str) -> None:
    """The section holds two commands: the main job, then the test command .ci/run runs."""
    commands = fresh_machine_commands(readme)
    assert len(commands) == 2, f"README's Fresh machine section holds {commands}"
    main_job, tests = commands
    assert main_job == MAIN_JOB
    ci = [line.strip() for line in ci_run.splitlines() if line.strip()]
    assert ci[-1] == tests, f".ci/run runs {ci[-1]!r}, the README says {tests!r}"


def test_readme_is_at_most_200_lines():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, the guide's limit is {MAX_README_LINES}: move detail to "
        "docs/ (performance.md, torch_conventions.md, gpus.md, troubleshooting.md)"
    )


def test_fresh_machine_commands_are_the_main_job_and_what_ci_runs():
    check_fresh_machine(README.read_text(), (ROOT / ".ci" / "run").read_text())


def test_fresh_machine_check_sees_a_changed_command():
    """The check reads the section it claims to: a test command other than .ci/run's, or a
    changed main job, fails it."""
    readme, ci_run = README.read_text(), (ROOT / ".ci" / "run").read_text()
    with pytest.raises(AssertionError, match="ci/run runs"):
        check_fresh_machine(readme.replace("pytest -q tests", "pytest tests"), ci_run)
    with pytest.raises(AssertionError):
        check_fresh_machine(readme.replace("&& aligndp train", "&& aligndp layout"), ci_run)


def test_relative_links_in_readme_docs_and_results_resolve():
    pages = [README, ROOT / "DESIGN.md", *sorted((ROOT / "docs").glob("*.md"))]
    pages += sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


@pytest.mark.parametrize("script", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_examples_use_only_the_public_api(script):
    """An example is what a user copies: ``import aligndp`` and its top-level names only."""
    private = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aligndp."):
            private.append(f"from {node.module} import ...")
        if isinstance(node, ast.Import):
            private += [a.name for a in node.names if a.name.startswith("aligndp.")]
    assert not private, f"{script.name} imports internals: {private}"


def test_no_file_names_a_working_session():
    """Results and notes are named by date and topic ("2026-12-02_readback_barrier"): a
    "session N" in a path or a text means nothing to a reader of the repository."""
    found = []
    for path in tracked_files():
        rel = path.relative_to(ROOT)
        if SESSION.search(str(rel)):
            found.append(f"{rel} (its name)")
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if SESSION.search(line):
                found.append(f"{rel}:{number}: {line.strip()[:80]}")
    assert not found, "name results by date and topic, not by session:\n" + "\n".join(found)


RESULT_PATH = re.compile(r"benchmarks/results/[A-Za-z0-9_./*-]+")


def test_every_results_path_named_in_the_repository_exists():
    """Source comments, DESIGN.md, benchmarks and docs cite results by path: a renamed or
    removed file must take its citations with it."""
    missing = []
    for path in tracked_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for cited in RESULT_PATH.findall(text):
            cited = cited.rstrip(".,;:")
            if "*" not in cited and not (ROOT / cited).exists():
                missing.append(f"{path.relative_to(ROOT)}: {cited}")
    assert not missing, "cited results that do not exist:\n" + "\n".join(missing)


def _code(text: str) -> str:
    """Python text without comments and whitespace, so a wrapped statement matches its
    one-line form."""
    return "".join(re.sub(r"#.*", "", line) for line in text.splitlines()).replace(" ", "")


def test_readme_own_loop_snippet_is_the_example_code():
    """Every line the README shows under "Your own training loop" is code of
    examples/train_own_model.py, so the snippet cannot drift from the tested script."""
    section = README.read_text().split("## Your own training loop", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert blocks, "the README's own-loop section shows no python block"
    script = _code((ROOT / "examples" / "train_own_model.py").read_text())
    lines = [_code(line) for block in blocks for line in block.splitlines()]
    missing = [line for line in lines if line and line not in script]
    assert not missing, f"README lines not in examples/train_own_model.py: {missing}"


def test_python_in_the_documents_is_ruff_formatted():
    """The code blocks users copy are formatted as our code is (ruff formats ```python
    blocks in Markdown, 100 columns)."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.importorskip("ruff", reason="ruff is in the test extras: pip install -e '.[test]'")
        command = [sys.executable, "-m", "ruff"]
    else:
        command = [ruff]
    command += ["format", "--check", "README.md", "DESIGN.md", "docs"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff format --check:\n{done.stdout[-3000:]}{done.stderr[-1000:]}"
