"""The book's utils index: its download helper (imports only; home: downloads.py)."""

from .downloads import download_file

__all__ = ["download_file"]
