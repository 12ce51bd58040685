"""Check what `make dist` built: the wheel and the sdist carry kvhit's packages and nothing else.

    python tests/dist/check_dist.py dist/kvhit-0.1.0-py3-none-any.whl dist/kvhit-0.1.0.tar.gz

The expected members come from pyproject.toml (``[tool.setuptools]`` packages and package-dir, the version,
the scripts and entry points) and the ``.py`` files in each package's folder: every one must be in the
wheel, and nothing else (no tests/, docs/, requirements/ or stray files). The sdist carries the same
sources under their folders, plus the metadata setuptools writes. Prints the members by folder and exits 1
naming every missing or unexpected member.
"""

from __future__ import annotations

import configparser
import email.parser
import os
import sys
import tarfile
import tomllib
import zipfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WHEEL_METADATA = ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt", "RECORD")
SDIST_METADATA = ("PKG-INFO", "README.md", "pyproject.toml", "setup.cfg", "MANIFEST.in")
EGG_INFO = ("PKG-INFO", "SOURCES.txt", "dependency_links.txt", "entry_points.txt", "requires.txt", "top_level.txt")


def project(root: str = ROOT) -> dict:
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def package_folder(package: str, package_dir: dict[str, str]) -> str:
    """The source folder of ``package`` as setuptools finds it: the longest mapped prefix, then the rest."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in package_dir:
            return os.path.join(package_dir[prefix], *parts[i:])
    return os.path.join(*parts)


def sources(pyproject: dict, root: str = ROOT) -> dict[str, str]:
    """Installed path -> source path (relative to ``root``) of every module the packages hold."""
    setup = pyproject["tool"]["setuptools"]
    out = {}
    for package in setup["packages"]:
        folder = package_folder(package, setup.get("package-dir", {}))
        for name in sorted(os.listdir(os.path.join(root, folder))):
            if name.endswith(".py"):
                out["/".join(package.split(".") + [name])] = os.path.join(folder, name).replace(os.sep, "/")
    return out


def expected_entry_points(pyproject: dict) -> dict[str, dict[str, str]]:
    meta = pyproject["project"]
    groups = {"console_scripts": dict(meta.get("scripts", {}))}
    groups.update({group: dict(points) for group, points in meta.get("entry-points", {}).items()})
    return groups


def differences(found: list[str], expected: list[str]) -> list[str]:
    """One line per member missing from ``found`` or not in ``expected`` (or there twice)."""
    counts = Counter(found)
    lines = [f"missing: {name}" for name in sorted(set(expected) - set(found))]
    lines += [f"unexpected: {name}" for name in sorted(set(found) - set(expected))]
    lines += [f"twice: {name}" for name, n in sorted(counts.items()) if n > 1]
    return lines


def check_wheel(path: str, pyproject: dict, root: str = ROOT) -> list[str]:
    """The problems of the wheel at ``path`` (empty when it is as expected)."""
    meta = pyproject["project"]
    dist_info = f"{meta['name']}-{meta['version']}.dist-info"
    expected = list(sources(pyproject, root)) + [f"{dist_info}/{name}" for name in WHEEL_METADATA]
    found = members(path)
    problems = differences(found, expected)
    with zipfile.ZipFile(path) as z:
        if f"{dist_info}/METADATA" in found:
            version = email.parser.Parser().parsestr(z.read(f"{dist_info}/METADATA").decode())["Version"]
            if version != meta["version"]:
                problems.append(f"METADATA version {version}, pyproject.toml says {meta['version']}")
        if f"{dist_info}/entry_points.txt" in found:
            parser = configparser.ConfigParser(delimiters=("=",))
            parser.optionxform = str
            parser.read_string(z.read(f"{dist_info}/entry_points.txt").decode())
            points = {group: dict(parser[group]) for group in parser.sections()}
            if points != expected_entry_points(pyproject):
                problems.append(f"entry points {points}, pyproject.toml: {expected_entry_points(pyproject)}")
    return problems


def check_sdist(path: str, pyproject: dict, root: str = ROOT) -> list[str]:
    """The problems of the sdist at ``path``: the wheel's sources under their own folders, and metadata."""
    meta = pyproject["project"]
    top = f"{meta['name']}-{meta['version']}"
    expected = ([f"{top}/{src}" for src in sources(pyproject, root).values()]
                + [f"{top}/{name}" for name in SDIST_METADATA]
                + [f"{top}/{meta['name']}.egg-info/{name}" for name in EGG_INFO])
    return differences(members(path), expected)


def members(path: str) -> list[str]:
    """The files of a wheel (``.whl``) or an sdist (``.tar.gz``)."""
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            return [name for name in z.namelist() if not name.endswith("/")]
    with tarfile.open(path) as t:
        return [m.name for m in t.getmembers() if m.isfile()]


def by_folder(names: list[str]) -> str:
    folders = Counter(name.rsplit("/", 1)[0] if "/" in name else "." for name in names)
    return ", ".join(f"{folder}/ ({n})" for folder, n in sorted(folders.items()))


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].endswith(".whl") or not argv[1].endswith(".tar.gz"):
        print("usage: python tests/dist/check_dist.py WHEEL.whl SDIST.tar.gz", file=sys.stderr)
        return 2
    pyproject = project()
    problems = []
    for path, check in zip(argv, (check_wheel, check_sdist)):
        found = members(path)
        print(f"{os.path.basename(path)}: {len(found)} files: {by_folder(found)}")
        problems += [f"{os.path.basename(path)}: {line}" for line in check(path, pyproject)]
    for line in problems:
        print(line, file=sys.stderr)
    print("dist: ok" if not problems else f"dist: {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
