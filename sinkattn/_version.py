"""The package version: its one owner. setup.py reads this file as text (importing the package would import torch)."""
__version__ = "0.1.0"
