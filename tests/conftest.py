"""Test session setup: tests import their helpers (oracle_mlx, helpers_tvm) from this folder."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)
os.chdir(ROOT)  # tests name models/k3-nano and ../shared relative to the repo root
