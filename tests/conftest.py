import os
import sys

# Tests import the independent reference as `reference`.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("MPLBACKEND", "Agg")
