"""The run-directory files several scripts read: logs/stages.tsv (launch.py's row per stage: name, wall seconds, exit
status) and its JSON files. The standard library only: launch.py imports it before .venv exists. Not a stage; one
command line, the stages a run has run:

    python run_files.py runs/<run>      # logs/stages.tsv: each stage's wall seconds and exit status, oldest first
"""
import argparse
import json
from pathlib import Path


def read_json(path):
    """A JSON file's value, or None where the stage left none."""
    return json.loads(Path(path).read_text()) if Path(path).is_file() else None


def stage_rows(run):
    """logs/stages.tsv's rows [name, seconds, exit status] (strings, as launch.py wrote them), oldest first."""
    path = Path(run, "logs", "stages.tsv")
    return [line.split("\t") for line in path.read_text().splitlines()] if path.is_file() else []


def stage_seconds(run):
    """{stage: wall seconds}: the last successful run of each stage."""
    return {name: float(seconds) for name, seconds, rc in stage_rows(run) if rc == "0"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a run's stages (logs/stages.tsv), oldest first")
    parser.add_argument("run", metavar="RUN", help="a run directory (runs/<run>/)")
    for name, seconds, rc in stage_rows(parser.parse_args().run):
        print(f"{name:<16} {float(seconds):>10.1f} s  exit {rc}")
