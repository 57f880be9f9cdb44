"""With this directory on PYTHONPATH (helpers.faults_env), every Python process a test starts takes the faults that
NANOCHAT_FAULTS names (tests/faults.py) as its interpreter starts."""
import importlib.util
import os
from pathlib import Path

if os.environ.get("NANOCHAT_FAULTS"):
    spec = importlib.util.spec_from_file_location("faults", Path(__file__).resolve().parent.parent / "faults.py")
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)
    faults.from_environment()
