"""The repository's own promises: CI runs the README's test command verbatim, ruff is clean, files say how to run."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command_verbatim():
    ci_lines = (ROOT / ".ci/run").read_text().splitlines()
    command = next(line for line in ci_lines if "pytest" in line and not line.startswith("#"))
    readme = (ROOT / "README.md").read_text()
    assert f"\n{command}\n" in readme


def test_ruff_is_clean():
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "."], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_script_opens_with_a_docstring_saying_how_to_run_it():
    for path in ROOT.glob("*.py"):
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring and f"python {path.name}" in docstring, path.name


def test_every_third_party_import_is_pinned_in_requirements():
    """A package that happens to be installed (PyYAML comes with huggingface_hub) must still be listed."""
    from importlib.metadata import packages_distributions
    local = {p.stem for p in ROOT.glob("*.py")}
    imported = set()
    for path in ROOT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = sorted(imported - set(sys.stdlib_module_names) - local - {"wandb", "bitsandbytes"})  # optional
    dists = packages_distributions()
    pinned = {line.split("==")[0].lower().replace("_", "-") for line in (ROOT / "requirements.txt").read_text().split()}
    missing = [m for m in third_party if not {d.lower().replace("_", "-") for d in dists.get(m, [m])} & pinned]
    assert third_party and not missing, missing
