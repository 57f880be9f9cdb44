"""The repository's own promises: CI runs the README's test command verbatim, ruff is clean, files say how to run."""
import ast
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

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
    lines = [line.split("#")[0].split(";")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    pinned = {line.split("==")[0].lower().replace("_", "-") for line in lines if line}
    missing = [m for m in third_party if not {d.lower().replace("_", "-") for d in dists.get(m, [m])} & pinned]
    assert third_party and not missing, missing


def pyenv_python(version):
    """The interpreter of a pyenv-installed Python `version` (e.g. "3.10"), or None."""
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return None
    for installed in subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True, check=False).stdout.split():
        if installed == version or installed.startswith(version + "."):
            path = subprocess.run([pyenv, "which", "python"], capture_output=True, text=True, check=False,
                                  env={**os.environ, "PYENV_VERSION": installed}).stdout.strip()
            return path or None
    return None


def registry_reachable(python):
    """The index pip would use (PIP_INDEX_URL, pip config, else PyPI) answers for torch within 20 s."""
    config = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False).stdout
    index = os.environ.get("PIP_INDEX_URL") or next(
        (line.split("=", 1)[1].strip("'\"") for line in config.splitlines() if line.split("=")[0].endswith(
            ".index-url") and "extra" not in line.split("=")[0]), "https://pypi.org/simple")
    try:
        urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=20).close()
        return True, index
    except OSError as e:
        return False, f"{index}: {e}"


@pytest.mark.parametrize("version", ["3.10", "3.11"])
def test_requirements_resolve_on_python(version, tmp_path):
    """pip resolves requirements.txt for that Python (a dry run: metadata only, nothing installed), every pin as
    written; on 3.10 the pins whose newest releases need 3.11 take their 3.10 markers."""
    python = pyenv_python(version)
    if python is None:
        pytest.skip(f"no Python {version} installed with pyenv here to resolve requirements.txt with")
    reachable, why = registry_reachable(python)
    if not reachable:
        pytest.skip(f"the package registry is unreachable ({why}): cannot resolve requirements.txt")
    report = tmp_path / "report.json"
    result = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                             "--report", str(report), "-r", str(ROOT / "requirements.txt")],
                            capture_output=True, text=True, check=False, timeout=900,
                            env={**os.environ, "PIP_NO_INPUT": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    numpy, pyarrow, matplotlib = ("2.2.6", "25.0.1", "3.10.9") if version == "3.10" else ("2.4.6", "26.0.1", "3.11.2")
    torch = got["torch"].split("+")[0]  # a local wheel (2.13.0+cpu) satisfies ==2.13.0 too
    assert (torch, got["numpy"], got["pyarrow"], got["matplotlib"]) == ("2.13.0", numpy, pyarrow, matplotlib)
