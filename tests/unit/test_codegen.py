"""refimpl/ is generated from the spec: fresh, self-contained, and a hand edit is caught."""

import subprocess
import sys

from kvhit.spec import codegen


def test_refimpl_is_what_the_spec_generates():
    for name, text in codegen.generate().items():
        on_disk = (codegen.SPEC_DIR.parent / "refimpl" / name).read_text()
        assert on_disk == text, f"refimpl/{name} is stale or hand-edited: run `make gen`"


def test_a_hand_edit_is_detected(tmp_path):
    for name, text in codegen.generate().items():
        (tmp_path / name).write_text(text)
    policy = tmp_path / "policy.py"
    policy.write_text(policy.read_text().replace("return n_tokens - 1", "return n_tokens - 2"))
    assert codegen.main(["--check", "--out", str(tmp_path)]) == 1
    assert codegen.main(["--check"]) == 0


def test_refimpl_imports_neither_z3_nor_the_spec():
    code = ("import sys, kvhit.refimpl as r; "
            "r.hit(r.Layout((r.Group('full', 16),)), r.Speculation(), 100, [100]); "
            "bad = [m for m in sys.modules if m == 'z3' or m.startswith('kvhit.spec') or m.startswith('kvhit.proofs')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_refimpl_header_names_its_sources_and_hashes():
    text = (codegen.SPEC_DIR.parent / "refimpl" / "policy.py").read_text()
    assert "DO NOT EDIT" in text.splitlines()[0]
    assert f"spec-sha256: {codegen.spec_digest()}" in text
