"""The bench scripts import each other as top-level modules (they run as `python bench/x.py`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
