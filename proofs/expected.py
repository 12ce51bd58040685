"""Expected verdicts other than PROVED for the modelled policies (and REFUTED for known-bad variants).

Each entry is a finding: a property the policy does not have, with the reason. A verdict that differs from
this table fails ``make prove``. The counterexamples are in ``tests/vectors/hit_tokens/`` and each one is
pinned by a regression test.
"""

EXPECTED = {
}
