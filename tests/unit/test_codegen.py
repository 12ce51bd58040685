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


def test_the_generated_staging_stages_what_the_spec_stages():
    """``kvhit.refimpl.staging`` (what the adapter stages with) and ``kvhit.spec.stage`` write the same
    function for every catalogue layout, speculative setting and policy, or refuse it with the same error."""
    from kvhit import refimpl
    from kvhit.convert import to_refimpl, to_spec
    from kvhit.refimpl import staging
    from kvhit.spec import stage
    from kvhit.spec.catalogue import CATALOGUE

    def staged(module, layout, speculation, policy):
        try:
            return module.stage_hit_tokens(layout, speculation, policy)[0]
        except Exception as e:  # noqa: BLE001 - the refusal is compared, by its class name and message
            return f"{type(e).__name__}: {e}"

    settings = [refimpl.Speculation("none"), refimpl.Speculation("drop", 1), refimpl.Speculation("drop", 2, True),
                refimpl.Speculation("lookahead", 1), refimpl.Speculation("lookahead", 2)]
    outcomes = set()
    for layout in CATALOGUE.values():
        for speculation in settings:
            for policy in sorted(refimpl.ALL_POLICIES):
                want = staged(stage, layout, to_spec(speculation), policy)
                got = staged(staging, to_refimpl(layout), speculation, policy)
                assert got == want, (layout.name, speculation, policy)
                outcomes.add(want.startswith("def hit_tokens"))
    assert outcomes == {True, False}  # both functions and refusals were compared


def test_the_staging_module_imports_neither_z3_nor_the_spec():
    code = ("import sys, kvhit.refimpl as r, kvhit.refimpl.staging as s; "
            "_, f = s.stage_hit_tokens(r.Layout((r.Group('full', 16), r.Group('mamba', 16))), r.Speculation('drop', 1)); "
            "assert f(100, r.CacheState.from_sets([{16, 32, 48}, {48}])) == r.hit_tokens("
            "r.CacheState.from_sets([{16, 32, 48}, {48}]), r.derive_sizes(r.Layout((r.Group('full', 16), "
            "r.Group('mamba', 16))), r.Speculation('drop', 1)), 100, r.REFERENCE); "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'z3' or m.startswith(('kvhit.spec', 'kvhit.proofs'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_staging_refuses_what_it_could_not_copy_faithfully(tmp_path, monkeypatch):
    """A class or constant naming a function that must run as the spec writes it (it would come from
    refimpl/policy.py, its operators replaced), and an import of kvhit in a spec module (the serving process
    would import the spec again), stop the generator."""
    import shutil

    import pytest

    def spec_with(module, extra):
        spec = tmp_path / f"spec{len(list(tmp_path.iterdir()))}"
        shutil.copytree(codegen.SPEC_DIR, spec)
        (spec / f"{module}.py").write_text((spec / f"{module}.py").read_text() + extra)
        monkeypatch.setattr(codegen, "SPEC_DIR", spec)

    spec_with("policy", "\nLOOKUPS = {'full': full_attention_lookup}\n\n\ndef uses_table(x):\n"
                        "    return LOOKUPS\n")
    codegen.generate_staging()  # unreached from the staged hit: nothing changes
    spec_with("policy", "\nLOOKUPS = {'full': full_attention_lookup}\n")
    src = (codegen.SPEC_DIR / "api.py").read_text()
    (codegen.SPEC_DIR / "api.py").write_text(src.replace("def policy_rules(policy):",
                                                         "def policy_rules(policy, _table=None):\n    _table = LOOKUPS"))
    (codegen.SPEC_DIR / "api.py").write_text((codegen.SPEC_DIR / "api.py").read_text().replace(
        "from .policy import ALL_POLICIES", "from .policy import LOOKUPS, ALL_POLICIES"))
    with pytest.raises(ValueError, match="LOOKUPS .a class or constant. names .'full_attention_lookup'."):
        codegen.generate_staging()
    spec_with("sizes", "\nfrom kvhit.convert import to_spec\n")
    with pytest.raises(ValueError, match="spec/sizes.py imports kvhit.convert"):
        codegen.generate_staging()


def test_staging_takes_only_its_own_modules_domain_types():
    from kvhit import refimpl
    from kvhit.convert import to_spec
    from kvhit.refimpl import staging
    from kvhit.spec import stage

    import pytest

    layout, speculation = refimpl.Layout((refimpl.Group("full", 16),)), refimpl.Speculation()
    with pytest.raises(TypeError, match="needs kvhit.spec.domain.Layout, got kvhit.refimpl.policy.Layout"):
        stage.stage_hit_tokens(layout, to_spec(speculation))
    with pytest.raises(TypeError, match="needs kvhit.refimpl.policy.Speculation, got kvhit.spec.domain.Speculation"):
        staging.stage_hit_tokens(layout, to_spec(speculation))
