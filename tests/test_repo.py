"""The repository's own promises: CI runs the README's test command verbatim, the README stays a short page whose file
tree and links are true, seed documents are named by number only in dev/LOG.md, ruff is clean, files say how to run."""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import RUNNING_PYTHON

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


STAGES = ["pretrain", "midtrain", "sft", "rl", "core_eval", "chat_eval", "chat", "export", "report", "demo"]


def test_no_stage_imports_another_stage():
    """A stage reads top to bottom with the library beside it: what two stages share lives in a library file, so no
    stage script imports another, at module level or inside a function."""
    found = {}
    for stage in STAGES:
        tree = ast.parse((ROOT / f"{stage}.py").read_text())
        names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and node.module and not node.level}
        found[stage] = sorted(names & set(STAGES) - {stage})
    assert found == {stage: [] for stage in STAGES}


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


def documented_commands():
    """(page, script, words before the first flag, flags) of every `python X.py ...` line in README.md and docs/*.md,
    continuation lines joined."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in page.read_text().replace("\\\n", " ").splitlines():
            words = line.split("#")[0].split()
            if "python" not in words or words.index("python") + 1 >= len(words):
                continue
            words = words[words.index("python") + 1:]
            if not words[0].endswith(".py") or not (ROOT / words[0]).is_file():
                continue
            flags = [re.match(r"--[\w-]+", w).group() for w in words if re.match(r"--[\w-]+", w)]
            head = [w for w in words[1:] if not w.startswith("-")][:1]  # a subcommand (prepare.py tokenizer), if any
            found.append((page.name, words[0], head, flags))
    return found


def test_every_flag_the_docs_show_is_in_that_scripts_help(capsys):
    """A flag renamed or removed in a script, still shown in README.md or docs/, fails here: each documented command
    line's flags are looked up in that script's --help (its subcommand's, where it has one)."""
    import importlib
    helps, missing = {}, []
    for page, script, head, flags in documented_commands():
        module = importlib.import_module(Path(script).stem)  # dev/X.py: pytest.ini puts dev/ on the path
        for argv in ([*head, "--help"], ["--help"]):
            key = (script, tuple(argv))
            if key not in helps:
                try:
                    module.main(argv)
                except SystemExit:
                    pass
                helps[key] = capsys.readouterr().out
            if "usage:" in helps[key]:
                break
        text = helps[key]
        missing += [f"{page}: {script} {flag}" for flag in flags if flag not in text]
    assert len(helps) >= 10 and not missing, missing


def test_ruff_is_clean():
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "."], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_script_opens_with_a_docstring_saying_how_to_run_it():
    libraries = []
    for path in ROOT.glob("*.py"):
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring, path.name
        if '__name__ == "__main__"' in path.read_text():
            assert f"python {path.name}" in docstring, path.name
        else:  # a library with no command line says who runs it
            libraries.append(path.name)
            assert "not a stage" in docstring.lower(), path.name
    assert sorted(libraries) == ["dataset.py", "loader.py"]


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


@pytest.mark.parametrize("version", ["3.10", "3.11"])
def test_requirements_resolve_on_python(version, requirements_resolved):
    """pip resolves requirements.txt for that Python (a dry run: metadata only, nothing installed), every pin as
    written; on 3.10 the pins whose newest releases need 3.11 take their 3.10 markers. (pip started at the session's
    start, conftest's requirements_resolved: it waits on the network.) On the Python running the suite, whose .venv
    was installed from requirements.txt, the installed versions are checked against every pin instead: the same
    claim, without a second resolution."""
    if version == RUNNING_PYTHON:
        from importlib.metadata import version as installed

        from packaging.requirements import Requirement
        pins = [Requirement(line.split("#")[0]) for line in (ROOT / "requirements.txt").read_text().splitlines()
                if line.split("#")[0].strip()]
        pins = [pin for pin in pins if pin.marker is None or pin.marker.evaluate()]
        wrong = [(pin.name, installed(pin.name)) for pin in pins
                 if installed(pin.name).split("+")[0] not in pin.specifier]  # a local wheel: 2.13.0+cpu is 2.13.0
        assert len(pins) == 10 and not wrong, wrong  # every package of requirements.txt, once
        return
    skip_reason, result, report = requirements_resolved[version].result()
    if skip_reason:
        pytest.skip(skip_reason)
    assert result.returncode == 0, result.stderr[-3000:]
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    numpy, pyarrow, matplotlib = ("2.2.6", "25.0.1", "3.10.9") if version == "3.10" else ("2.4.6", "26.0.1", "3.11.2")
    torch = got["torch"].split("+")[0]  # a local wheel (2.13.0+cpu) satisfies ==2.13.0 too
    assert (torch, got["numpy"], got["pyarrow"], got["matplotlib"]) == ("2.13.0", numpy, pyarrow, matplotlib)
