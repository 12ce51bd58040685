"""tests/dist/check_dist.py on small fake projects: it passes a wheel of exactly the packages' modules and
names every missing or stray member; and the real pyproject.toml's version is kvhit's."""

import io
import tarfile
import zipfile

import kvhit
from tests.dist import check_dist

PYPROJECT = """
[project]
name = "demo"
version = "1.2.3"
[project.scripts]
demo = "demo.cli:main"
[project.entry-points."vllm.general_plugins"]
demo = "demo.plugin:register"
[tool.setuptools]
package-dir = { "demo" = "demo", "demo.core" = "core" }
packages = ["demo", "demo.core", "demo.core.sub"]
"""

# The project's modules: source path -> installed path.
MODULES = {"demo/__init__.py": "demo/__init__.py", "demo/cli.py": "demo/cli.py",
           "core/__init__.py": "demo/core/__init__.py", "core/sub/__init__.py": "demo/core/sub/__init__.py"}
ENTRY_POINTS = "[console_scripts]\ndemo = demo.cli:main\n\n[vllm.general_plugins]\ndemo = demo.plugin:register\n"


def _project(tmp_path):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    for src in MODULES:
        (tmp_path / src).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / src).write_text("")
    (tmp_path / "core" / "notes.txt").write_text("not a module")
    return check_dist.project(str(tmp_path))


def _wheel(tmp_path, names, version="1.2.3", entry_points=ENTRY_POINTS):
    path = tmp_path / "demo-1.2.3-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name in names:
            z.writestr(name, "")
        info = "demo-1.2.3.dist-info/"
        z.writestr(info + "METADATA", f"Metadata-Version: 2.1\nName: demo\nVersion: {version}\n")
        z.writestr(info + "entry_points.txt", entry_points)
        for name in ("WHEEL", "top_level.txt", "RECORD"):
            z.writestr(info + name, "")
    return str(path)


def test_a_wheel_of_exactly_the_packages_modules_passes(tmp_path):
    pyproject = _project(tmp_path)
    assert check_dist.check_wheel(_wheel(tmp_path, MODULES.values()), pyproject, str(tmp_path)) == []


def test_stray_and_missing_wheel_members_are_each_named(tmp_path):
    pyproject = _project(tmp_path)
    names = [n for n in MODULES.values() if n != "demo/cli.py"] + ["tests/test_demo.py", "docs/demo.md"]
    assert check_dist.check_wheel(_wheel(tmp_path, names), pyproject, str(tmp_path)) == [
        "missing: demo/cli.py", "unexpected: docs/demo.md", "unexpected: tests/test_demo.py"]


def test_a_wheel_with_another_version_or_entry_point_fails(tmp_path):
    pyproject = _project(tmp_path)
    wrong = _wheel(tmp_path, MODULES.values(), version="1.2.4",
                   entry_points="[console_scripts]\ndemo = demo.cli:main\n")
    problems = check_dist.check_wheel(wrong, pyproject, str(tmp_path))
    assert len(problems) == 2
    assert problems[0] == "METADATA version 1.2.4, pyproject.toml says 1.2.3"
    assert problems[1].startswith("entry points {'console_scripts': {'demo': 'demo.cli:main'}}")


def test_the_sdist_carries_the_sources_under_their_own_folders(tmp_path):
    pyproject = _project(tmp_path)
    top = "demo-1.2.3/"
    names = ([top + src for src in MODULES] + [top + n for n in check_dist.SDIST_METADATA]
             + [top + "demo.egg-info/" + n for n in check_dist.EGG_INFO])
    path = tmp_path / "demo-1.2.3.tar.gz"

    def write(extra):
        with tarfile.open(path, "w:gz") as t:
            for name in names + extra:
                info = tarfile.TarInfo(name)
                t.addfile(info, io.BytesIO(b""))
        return check_dist.check_sdist(str(path), pyproject, str(tmp_path))

    assert write([]) == []
    assert write([top + "tests/test_make_prove.py"]) == ["unexpected: demo-1.2.3/tests/test_make_prove.py"]


def test_kvhit_version_is_the_pyproject_version():
    assert kvhit.__version__ == check_dist.project()["project"]["version"]
