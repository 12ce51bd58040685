"""Fetch vLLM 0.33.0's source distribution through pip's configured index and unpack the tests we run.

``pip download vllm==0.33.0 --no-binary :all:`` would build the sdist, so the file itself is fetched: the
project's page of each simple index pip is configured with (its ``index-url``, else pip's default, then its
``extra-index-url``\\ s) is read, the first link named ``vllm-0.33.0.tar.gz`` is taken, and the download must
match the ``#sha256=`` of that link. The archive is cached in ``KVHIT_WHEEL_CACHE`` (default
``~/.cache/kvhit/wheels``, as ``tests/e2e/setup.sh`` caches its wheel) and only the members of
:data:`TESTS_NEEDED` are unpacked into :data:`UNPACKED` (git-ignored ``build/``). vLLM's root
``tests/conftest.py`` is not among them: the suite runs without it (``vllm_suite_plugin`` supplies the
fixtures the selected files use).

Idempotent: a stamp in :data:`UNPACKED` records the archive's hash and the members; a second run with the
same :data:`TESTS_NEEDED` reads no index and unpacks nothing.

Usage: ``python -m tests.vllm_suite.fetch`` prints the folder.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import shutil
import ssl
import sys
import tarfile
import tempfile
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

VLLM_VERSION = "0.33.0"
SDIST = f"vllm-{VLLM_VERSION}.tar.gz"
TOP = f"vllm-{VLLM_VERSION}/"
"""The archive's top folder."""

REPO = Path(__file__).resolve().parents[2]
UNPACKED = REPO / "build" / f"vllm-{VLLM_VERSION}-tests"
"""Where the tests are unpacked: ``UNPACKED / "tests" / "v1" / "core" / ...``; pytest runs from here."""

STAMP = UNPACKED / ".unpacked.json"
PYTEST_INI = UNPACKED / "pytest.ini"
"""The markers of vLLM's own ``[tool.pytest.ini_options]`` (read from the archive's pyproject.toml)."""

TESTS_NEEDED = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/core/",                      # every file: `make vllm-tests-long` runs the whole folder
    "tests/v1/spec_decode/__init__.py",
    "tests/v1/spec_decode/test_dflash_lookahead.py",
    "tests/v1/spec_decode/test_dynamic_sd.py",
    # Helpers the files above import: tests.v1.core.utils imports MockKVConfig, test_scheduler.py
    # create_model_runner_output and create_vllm_config, test_async_scheduler.py and
    # test_mamba_align_chunk_split.py the attention test utilities.
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
    "tests/v1/attention/utils.py",
)
"""Members of the archive's ``tests/`` we unpack: a path ending in ``/`` is a folder with everything under it."""


def cache_dir() -> Path:
    """``KVHIT_WHEEL_CACHE``, else ``$XDG_CACHE_HOME/kvhit/wheels`` (default ``~/.cache/kvhit/wheels``)."""
    configured = os.environ.get("KVHIT_WHEEL_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvhit" / "wheels"


def _pip_config() -> dict[str, str]:
    """pip's configuration as ``pip config list`` shows it (files and ``PIP_*`` variables), by option name.

    A later source overrides an earlier one, as in pip; ``global.``, ``install.``, ``download.`` and ``:env:.``
    are the sections that apply to fetching.
    """
    from pip._internal.configuration import Configuration

    config = Configuration(isolated=False)
    config.load()
    options: dict[str, str] = {}
    for key, value in config.items():
        section, _, name = key.partition(".")
        if section in ("global", "install", "download", ":env:"):
            options[name] = value
    return options


def index_urls() -> list[str]:
    """The simple indexes pip would read, in its order: ``index-url`` (or pip's default), then the extras."""
    from pip._internal.models.index import PyPI

    options = _pip_config()
    urls = [options.get("index-url") or PyPI.simple_url]
    urls += options.get("extra-index-url", "").split()
    return urls


def _ssl_context() -> ssl.SSLContext:
    cert = _pip_config().get("cert")
    return ssl.create_default_context(cafile=cert) if cert else ssl.create_default_context()


def _timeout() -> float:
    return float(_pip_config().get("default-timeout") or 60)


class _Links(html.parser.HTMLParser):
    """The ``href`` of every ``<a>`` of a simple-index page (PEP 503)."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


def _read(url: str) -> bytes:
    if url.startswith("file:") and os.path.isdir(urllib.request.url2pathname(urllib.parse.urlparse(url).path)):
        url = url.rstrip("/") + "/index.html"     # a local index keeps each page as a folder's index.html
    request = urllib.request.Request(url, headers={"Accept": "text/html"})
    with urllib.request.urlopen(request, timeout=_timeout(), context=_ssl_context()) as response:
        return response.read()


def find_sdist(project: str = "vllm", filename: str = SDIST) -> tuple[str, str]:
    """The download URL of ``filename`` and its sha256, from the first of :func:`index_urls` that lists it.

    Raises:
        LookupError: no index lists the file with a ``#sha256=`` fragment (every index tried is named).
    """
    tried = []
    for index in index_urls():
        page = index.rstrip("/") + f"/{project}/"
        try:
            text = _read(page).decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as e:
            tried.append(f"{page}: {e}")
            continue
        links = _Links()
        links.feed(text)
        for href in links.hrefs:
            url, _, fragment = urllib.parse.urljoin(page, href).partition("#")
            if url.rsplit("/", 1)[-1] != filename:
                continue
            algorithm, _, digest = fragment.partition("=")
            if algorithm != "sha256" or not digest:
                tried.append(f"{page}: {filename} has no sha256 fragment")
                break
            return url, digest
        else:
            tried.append(f"{page}: no {filename}")
    raise LookupError(f"{filename} not found on pip's indexes:\n  " + "\n  ".join(tried))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sdist() -> Path:
    """The cached ``vllm-0.33.0.tar.gz``, downloaded (and its sha256 checked) if it is not there yet."""
    target = cache_dir() / SDIST
    if target.exists():
        return target
    url, expected = find_sdist()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"[vllm-tests] downloading {SDIST} into {target.parent}", file=sys.stderr)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=SDIST, delete=False) as tmp:
        request = urllib.request.Request(url)
        with urllib.request.urlopen(request, timeout=_timeout(), context=_ssl_context()) as response:
            shutil.copyfileobj(response, tmp)
    os.chmod(tmp.name, 0o644)
    got = _sha256(Path(tmp.name))
    if got != expected:
        os.unlink(tmp.name)
        raise ValueError(f"{SDIST}: sha256 {got} does not match the index's {expected}")
    os.replace(tmp.name, target)
    return target


def _needed(name: str) -> bool:
    """Whether the archive member ``name`` (below :data:`TOP`) is one of :data:`TESTS_NEEDED`."""
    return any(name == path or (path.endswith("/") and name.startswith(path)) for path in TESTS_NEEDED)


def _pytest_ini(archive: tarfile.TarFile) -> str:
    """vLLM's pytest markers, from the ``[tool.pytest.ini_options]`` of the archive's pyproject.toml."""
    pyproject = tomllib.load(archive.extractfile(TOP + "pyproject.toml"))
    markers = pyproject["tool"]["pytest"]["ini_options"]["markers"]
    lines = ["# Written by tests/vllm_suite/fetch.py: vLLM 0.33.0's pytest markers.", "[pytest]", "markers ="]
    return "\n".join(lines + [f"    {marker}" for marker in markers]) + "\n"


def unpack() -> Path:
    """:data:`UNPACKED` with the tests of :data:`TESTS_NEEDED` and a ``pytest.ini``; a no-op when done."""
    wanted = {"sdist": SDIST, "members": list(TESTS_NEEDED)}
    if STAMP.exists() and {k: v for k, v in json.loads(STAMP.read_text()).items() if k in wanted} == wanted:
        return UNPACKED
    archive_path = sdist()
    UNPACKED.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=UNPACKED.parent, prefix=UNPACKED.name + "."))
    with tarfile.open(archive_path) as archive:
        members = []
        for member in archive.getmembers():
            name = member.name.removeprefix(TOP)
            if member.isfile() and _needed(name):
                member.name = name
                members.append(member)
        archive.extractall(staging, members=members, filter="data")
        (staging / "pytest.ini").write_text(_pytest_ini(archive))
    (staging / STAMP.name).write_text(json.dumps({**wanted, "sha256": _sha256(archive_path),
                                                  "files": len(members)}, indent=1) + "\n")
    if UNPACKED.exists():
        shutil.rmtree(UNPACKED)
    os.replace(staging, UNPACKED)
    print(f"[vllm-tests] unpacked {len(members)} files of {SDIST} into {UNPACKED}", file=sys.stderr)
    return UNPACKED


if __name__ == "__main__":
    print(unpack())
