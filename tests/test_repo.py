"""The repository's own promises: CI runs the README's test command verbatim, the README stays a short page whose file
tree and links are true, seed documents are named by number only in dev/LOG.md, ruff is clean, files say how to run."""
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



def readme_files_block():
    """The lines of the README's file tree: the code block under its "## Files" heading."""
    section = (ROOT / "README.md").read_text().split("\n## Files\n", 1)[1]
    return section.split("```\n", 2)[1].splitlines()


def test_the_readme_stays_a_page_of_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference to docs/ and records to dev/LOG.md"


def test_the_readme_file_tree_names_every_script_and_only_files_that_exist():
    named = [line.split()[0] for line in readme_files_block() if line.strip()]
    scripts = sorted(path.name for path in ROOT.glob("*.py"))
    unnamed = [s for s in scripts if s not in named]
    assert unnamed == [], f"add a line for each of {unnamed} to the README's file tree (## Files)"
    missing = [name for name in named if not (ROOT / name).exists()]
    assert missing == [], f"the README's file tree names {missing}, which do not exist: remove or rename them"


def test_every_docs_page_the_readme_links_to_exists():
    import re
    links = re.findall(r"\]\((docs/[^)#]*)", (ROOT / "README.md").read_text())
    pages = {link for link in links if link.endswith(".md")}
    assert len(pages) >= 8, pages  # one page per concern: speedrun, model, data, training, distributed, eval, chat, export
    missing = sorted(page for page in pages if not (ROOT / page).is_file())
    assert missing == [], f"the README links to {missing}, which do not exist"


def help_texts(path):
    """The strings a script's --help can print: help=, description=, epilog= and usage= of any call, and the module
    docstring where a parser takes description=__doc__."""
    tree = ast.parse(path.read_text())
    texts = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for keyword in node.keywords:
            if keyword.arg not in ("help", "description", "epilog", "usage"):
                continue
            if isinstance(keyword.value, ast.Name) and keyword.value.id == "__doc__":
                texts.append(ast.get_docstring(tree) or "")
            texts += [n.value for n in ast.walk(keyword.value) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return texts


def test_the_seed_documents_are_named_by_number_only_in_the_development_log():
    where = {path.relative_to(ROOT).as_posix(): path.read_text() for path in
             [ROOT / "README.md", ROOT / "speedrun.sh", *sorted((ROOT / "docs").glob("*.md"))]}
    where |= {f"{path.name} --help": "\n".join(help_texts(path)) for path in sorted(ROOT.glob("*.py"))}
    assert len(where) > 20
    naming = [name for name, text in where.items() if "seed 00" in " ".join(text.lower().split())]  # across line ends
    assert naming == [], f"{naming} name a seed document by number: say what it showed instead (dev/LOG.md only)"


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
