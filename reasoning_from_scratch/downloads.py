"""The package's one HTTP call (`fetch_url`) and the book's download helpers built on it.

``fetch_url`` streams a URL into a file with ``requests.get(url, stream=True, timeout=...)``,
writing a temp file beside the target and renaming it (an interrupted download leaves no half
file). Everything this package downloads goes through it: the datasets (``datasets.py``), the
book's Qwen3-0.6B files and checkpoints (``qwen3.download_qwen3_*``, which call
``download_file``), and files of the book's repository (``download_from_github``). Because the
call is ``requests.get`` looked up at call time, a stub put in its place
(``monkeypatch.setattr(requests, "get", fake)``, as the book's readers write it) catches every
download of the package.

``download_file(url, out_dir=".", backup_url=None)`` and ``download_from_github(rel_path,
out=None)`` have the signatures and file names of the book's ``utils.download_file`` and
``ch07.download_from_github`` (rasbt/reasoning-from-scratch). A file that is already there is
kept when the server reports the same size, downloaded again when the size differs, and used as
it is when the server cannot be reached (offline work goes on).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import requests

__all__ = [
    "fetch_url",
    "download_file",
    "download_error_message",
    "download_from_github",
]

GITHUB_RAW = "https://raw.githubusercontent.com/rasbt/reasoning-from-scratch/refs/heads/main/"
TROUBLESHOOTING_URL = (
    "https://github.com/rasbt/reasoning-from-scratch/blob/main/troubleshooting.md")
# words in an error that mean a certificate or proxy problem, not a missing file
_CERT_OR_PROXY_WORDS = ("certificate", "ssl", "tls", "proxy")
CHUNK_BYTES = 1 << 20  # 1 MiB per read: memory stays flat for a 1.5 GB checkpoint


def fetch_url(url, dest, sha256=None, expected_size=None, timeout=60, keep_same_size=False,
              progress=False) -> Path:
    """Download `url` to `dest` atomically (a temp file beside it, then os.replace).

    `sha256` / `expected_size`: checked before the rename (ValueError on a mismatch, and `dest`
    is left as it was). `keep_same_size`: an existing `dest` whose size equals the server's
    Content-Length is kept and the body is not read. `progress` prints a percentage line.
    Network and HTTP errors are `requests.RequestException`s (OSErrors).
    """
    dest = Path(dest)
    with requests.get(url, stream=True, timeout=timeout) as response:
        response.raise_for_status()
        total = int(response.headers.get("Content-Length") or 0)
        if keep_same_size and total and dest.is_file() and dest.stat().st_size == total:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
        try:
            digest, size = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as f:
                for chunk in response.iter_content(chunk_size=CHUNK_BYTES):
                    f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    if progress and total:
                        print(f"\r{dest.name}: {100 * size // total:3d}% "
                              f"({size >> 20} MiB / {total >> 20} MiB)", end="", flush=True)
            if progress and total:
                print()
            if expected_size is not None and size != expected_size:
                raise ValueError(f"{url}: got {size} bytes, expected {expected_size}")
            if sha256 is not None and digest.hexdigest() != sha256:
                raise ValueError(f"{url}: sha256 {digest.hexdigest()} != expected {sha256}")
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return dest


def download_error_message(dest, failures) -> str:
    """What went wrong and what to do: each (url, error) of `failures`, the certificate/proxy
    hint when an error looks like one, the book's troubleshooting guide, and the manual fix."""
    dest = Path(dest)
    lines = [f"could not download {dest.name}:"]
    for i, (url, err) in enumerate(failures):
        label = "Primary URL failed" if i == 0 else "Backup URL failed"
        lines.append(f"  {label} ({url}): {type(err).__name__}: {err}")
    errors = [err for _, err in failures]
    if any(isinstance(err, (requests.exceptions.SSLError, requests.exceptions.ProxyError))
           or any(word in str(err).lower() for word in _CERT_OR_PROXY_WORDS) for err in errors):
        lines.append("A certificate or proxy error: this happens on work or school machines where "
                     "a VPN, proxy, or antivirus tool intercepts HTTPS certificates.")
    lines.append(f"See {TROUBLESHOOTING_URL} (section 'File Download Issues').")
    if failures:
        lines.append(f"Or download it by hand (e.g. curl -L -o {dest} {failures[0][0]}) and run "
                     "again: a file that is there is used when the server cannot be reached.")
    return "\n".join(lines)


def download_file(url: str, out_dir=".", backup_url: str | None = None) -> Path:
    """Download `url` into `out_dir` (file name from the URL), trying `backup_url` if it fails.

    Returns the file's path. A file already there is kept when the server reports its size,
    fetched again when the size differs, and used as it is when the download fails (offline).
    With neither a download nor a file: RuntimeError naming both URLs, their errors and the fixes.
    """
    dest = Path(out_dir) / Path(urlparse(url).path).name
    failures = []
    for u in [url] + ([backup_url] if backup_url else []):
        try:
            return fetch_url(u, dest, timeout=30, keep_same_size=True, progress=True)
        except (OSError, ValueError) as err:  # requests' errors are OSErrors
            failures.append((u, err))
    if dest.is_file() and dest.stat().st_size > 0:
        print(f"{dest}: the download failed ({failures[-1][1]}); using the file that is there")
        return dest
    raise RuntimeError(download_error_message(dest, failures)) from failures[-1][1]


def download_from_github(rel_path, out=None) -> Path:
    """A file of the book's repository by its path there (e.g. 'ch07/README.md').

    Saved as `out` (default: the file's name in the current directory); a file already there
    is used as it is, without a request.
    """
    rel_path = Path(rel_path)
    out = Path(out) if out is not None else Path(rel_path.name)
    if not out.is_file():
        fetch_url(GITHUB_RAW + rel_path.as_posix(), out, timeout=30)
    print(f"{out}: {out.stat().st_size / 1e3:.1f} KB")
    return out
