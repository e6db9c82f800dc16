"""The book's utils index: its download helper (imports only; home: downloads.py)."""

import requests  # noqa: F401  (the book's module has it; its readers stub requests.get here)

from .downloads import download_file

__all__ = ["download_file"]
